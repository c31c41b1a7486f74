"""The layout holds: stage packages import one way, no import cycles, no `sys.path` edits, benchmarks import no
tests, every sub-package says what it owns. Static (ast over the source files), so it sees imports inside
functions too, and runs in well under a second."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = "specpilot_build"
# Modules every stage may use: the package root (its version), typed errors, paths, defaults.
BASE = {"(root)", "errors", "locations", "defaults"}
# What each stage may import besides itself and BASE (cli may import everything; nothing imports cli).
# The one-way rule: cli -> measure -> serve -> store / models -> pins; cli -> assemble -> hosts -> pins;
# cli / assemble / bundle -> cache -> store, config; nothing goes back.
ALLOWED = {
    "measure": {"serve", "store", "models", "pins"},
    "draft": {"config", "measure", "models", "pins", "store"},
    "tune": {"config", "assemble", "serve", "measure", "store", "models", "pins"},
    "serve": {"store", "models", "pins"},
    "assemble": {"store", "config", "models", "pins", "hosts", "cache"},
    "cache": {"store", "config", "pins"},
    "bundle": {"store", "models", "pins", "cache"},
    "hosts": {"store", "config", "pins"},
    "models": {"pins", "store"},
    "store": set(),
    "config": set(),
    "pins": {"store"},
}
# serve/ and measure/ read engines only through the store: never the assembler or the config composer.
NEVER = {"serve": {"assemble", "config"}, "measure": {"assemble", "config"}}
# Where `sys.path` may not be edited, and the benchmarks that may not import tests.
NO_SYS_PATH = ("specpilot_build", "kernels", "runtimes", "lab", "benchmarks", "tests")


@functools.cache
def modules(repo: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its __init__.py)."""
    found = {}
    for path in sorted((repo / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """(module, line) for each package module `name` imports anywhere in its file, relative imports resolved;
    `from a import b` counts as importing a.b when a.b is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add((sub if sub in known else module, node.lineno))
    return {(m, line) for m, line in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


@functools.cache
def graph(repo: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, package modules only."""
    mods = modules(repo)
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges[name] = {}
        for target, line in sorted(imports(name, path, set(mods)), key=lambda t: t[1]):
            edges[name].setdefault(target, line)
    return edges


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan; the graph has ~50 nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layering_violations(repo: Path) -> list[str]:
    bad, mods = [], modules(repo)
    for source, targets in graph(repo).items():
        here = stage(source)
        if here == "cli":
            continue
        for target, line in targets.items():
            there = stage(target)
            where = f"{mods[source].relative_to(repo)}:{line} imports {target}"
            if there == "cli":
                bad.append(f"{where} (nothing imports cli)")
            elif here in BASE and there not in BASE:
                bad.append(f"{where} ({here} is a base module: it imports no stage)")
            elif there in NEVER.get(here, ()):
                bad.append(f"{where} ({here}/ reads engines only through the store)")
            elif here in ALLOWED and there != here and there not in BASE | ALLOWED[here]:
                allowed = ", ".join(sorted(ALLOWED[here])) or "no other stage"
                bad.append(f"{where} ({here}/ may import {allowed})")
    return sorted(bad)


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def sys_path_edits(path: Path) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend/..., sys.path = / += / [i] =, del sys.path[i]."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            if node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear", "__setitem__"):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value)):
                    lines.append(node.lineno)
    return sorted(lines)


def python_files(repo: Path, top: str) -> list[Path]:
    return sorted(p for p in (repo / top).rglob("*.py") if ".venv" not in p.parts and "__pycache__" not in p.parts)


def test_the_package_has_modules_in_every_stage(repo):
    stages = {stage(m) for m in modules(repo)}
    assert set(ALLOWED) | {"cli"} <= stages, sorted(stages)


def test_serve_and_measure_import_neither_the_assembler_nor_the_config(repo):
    bad = [
        f"{modules(repo)[s].relative_to(repo)}:{line} imports {t}"
        for s, targets in graph(repo).items()
        for t, line in targets.items()
        if stage(t) in NEVER.get(stage(s), ())
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_among_package_modules(repo):
    found = cycles(graph(repo))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_stage_imports_flow_one_way(repo):
    bad = layering_violations(repo)
    assert not bad, "\n".join(bad)


def test_no_sys_path_edits(repo):
    bad = [
        f"{path.relative_to(repo)}:{line}"
        for top in NO_SYS_PATH
        for path in python_files(repo, top)
        for line in sys_path_edits(path)
    ]
    assert not bad, "sys.path edited (install the package in pyproject.toml instead): " + ", ".join(bad)


def test_benchmarks_import_no_tests(repo):
    test_modules = {p.stem for p in (repo / "tests").rglob("*.py")} | {"tests", "conftest"}
    bad = []
    for path in python_files(repo, "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [
                f"{path.relative_to(repo)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in test_modules
            ]
    assert not bad, "\n".join(bad)


def test_every_sub_package_opens_with_a_docstring(repo):
    missing = [
        str(p.relative_to(repo))
        for p in sorted((repo / PACKAGE).rglob("__init__.py"))
        if ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert not missing, "no docstring: " + ", ".join(missing)


# --- the checks can fail: each one run on a small made-up package -----------------------------------------


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"specpilot_build/__init__.py": '"""x"""\n', **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for sub in {Path(rel).parent for rel in files}:
        if (
            sub != Path("specpilot_build")
            and sub.parts[0] == "specpilot_build"
            and not (root / sub / "__init__.py").exists()
        ):
            (root / sub / "__init__.py").write_text('"""x"""\n')
    return root


def test_the_checks_catch_what_they_are_for(tmp_path):
    repo = _package(
        tmp_path,
        {
            "specpilot_build/errors.py": "",
            "specpilot_build/store/engines.py": "from specpilot_build.errors import X\n",
            "specpilot_build/serve/process.py": "def f():\n    from ..config import compose\n",
            "specpilot_build/config/compose.py": "from specpilot_build.store import engines\n",
            "specpilot_build/pins/a.py": "from . import b\n",
            "specpilot_build/pins/b.py": "import specpilot_build.pins.a\n",
            "specpilot_build/cli/main.py": "import sys\nsys.path.insert(0, 'x')\n",
            "specpilot_build/measure/__init__.py": "import specpilot_build.cli.main\n",
            "benchmarks/bench.py": "from sglang_builds import ARMS\n",
            "tests/sglang_builds.py": "",
        },
    )
    assert graph(repo)["specpilot_build.serve.process"] == {"specpilot_build.config.compose": 2}
    assert cycles(graph(repo)) == [["specpilot_build.pins.a", "specpilot_build.pins.b"]]
    assert layering_violations(repo) == [
        "specpilot_build/config/compose.py:1 imports specpilot_build.store.engines (config/ may import no other stage)",
        "specpilot_build/measure/__init__.py:1 imports specpilot_build.cli.main (nothing imports cli)",
        "specpilot_build/serve/process.py:2 imports specpilot_build.config.compose (serve/ reads engines only through the store)",
    ]
    assert sys_path_edits(repo / "specpilot_build/cli/main.py") == [2]
    for code in ["sys.path.append(p)", "sys.path = []", "sys.path[0:0] = [p]", "sys.path += [p]"]:
        (repo / "x.py").write_text(f"import sys\n{code}\n")
        assert sys_path_edits(repo / "x.py") == [2], code
    with pytest.raises(AssertionError):
        test_benchmarks_import_no_tests(repo)
    (repo / "specpilot_build/store/__init__.py").write_text("import os\n")
    with pytest.raises(AssertionError):
        test_every_sub_package_opens_with_a_docstring(repo)
