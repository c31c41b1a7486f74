"""Import audit: which source files a served engine's processes really import, against what its tree kept.

Opt-in: with SPECPILOT_IMPORT_AUDIT=<log file> in serve's environment, the server is launched with a directory
holding only a `sitecustomize.py` first on its PYTHONPATH. Python imports it at start-up in every process of the
engine — the server and the subprocesses it spawns (SGLang's scheduler and detokenizer start fresh interpreters
with the same environment) — and it puts a finder at the head of sys.meta_path that appends `pid<TAB>module<TAB>file`
to the log for every module found on disk. Lines are written with O_APPEND, one write each, as they happen, so a
process killed by `stop` has already logged what it imported.

`compare_imports` then sets the logged files of one package (e.g. `sglang/...`) against an engine manifest's files
and, optionally, a full file list (the unpruned wheel): imported and kept, imported but pruned (must be none),
kept but never imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir

AUDIT_ENV = "SPECPILOT_IMPORT_AUDIT"

SITECUSTOMIZE = """\
# Written by SpecPilot (specpilot_build/serve/audit.py): logs every module this process imports from disk.
import os
import sys


def _install(log):
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    class SpecPilotImportAudit:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is cls or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    if spec.has_location and spec.origin:
                        os.write(fd, f"{pid}\\t{name}\\t{os.path.abspath(spec.origin)}\\n".encode("utf-8", "replace"))
                    return spec
            return None

    for name, module in list(sys.modules.items()):  # what start-up imported before this file ran
        origin = getattr(module, "__file__", None)
        if origin:
            os.write(fd, f"{pid}\\t{name}\\t{os.path.abspath(origin)}\\n".encode("utf-8", "replace"))
    sys.meta_path.insert(0, SpecPilotImportAudit)


if os.environ.get("SPECPILOT_IMPORT_AUDIT"):
    _install(os.environ["SPECPILOT_IMPORT_AUDIT"])
"""


def audit_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (a launch environment) with the audit's sitecustomize first on PYTHONPATH when SPECPILOT_IMPORT_AUDIT
    is set in this process's environment; unchanged otherwise."""
    log = os.environ.get(AUDIT_ENV)
    if not log:
        return env
    log_path = Path(log).resolve()
    if not log_path.parent.is_dir():
        raise SpecPilotError(f"{AUDIT_ENV}={log}: its directory does not exist")
    hook_dir = data_dir() / "cache" / "import-audit"
    hook_dir.mkdir(parents=True, exist_ok=True)
    hook = hook_dir / "sitecustomize.py"
    if not hook.is_file() or hook.read_text() != SITECUSTOMIZE:
        tmp = hook_dir / f".sitecustomize.{os.getpid()}"
        tmp.write_text(SITECUSTOMIZE)
        os.replace(tmp, hook)
    path = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, AUDIT_ENV: str(log_path)}


@dataclass(frozen=True)
class ImportAudit:
    package: str
    processes: int  # distinct pids in the log
    imported: tuple[str, ...]  # package files the processes imported (paths from the package root: sglang/...)
    kept: tuple[str, ...]  # package files the engine's manifest kept
    imported_kept: tuple[str, ...]
    imported_pruned: tuple[str, ...]  # must be empty
    kept_never_imported: tuple[str, ...]
    outside_universe: tuple[str, ...]  # imported, yet not in the full file list (when one is given)

    def table(self) -> str:
        rows = [
            ("processes logged", self.processes),
            (f"{self.package} files imported", len(self.imported)),
            ("imported and kept", len(self.imported_kept)),
            ("imported and pruned (must be 0)", len(self.imported_pruned)),
            ("kept but never imported", len(self.kept_never_imported)),
        ]
        if self.outside_universe:
            rows.append(("imported, not in the full file list", len(self.outside_universe)))
        width = max(len(label) for label, _ in rows)
        lines = [f"{label:<{width}}  {value:>7}" for label, value in rows]
        lines += [f"  pruned but imported: {path}" for path in self.imported_pruned]
        return "\n".join(lines)


def compare_imports(
    log: Path, manifest_files: list[str], package: str, universe: list[str] | None = None
) -> ImportAudit:
    """Set the log's files of `package` against the manifest's (`python/sglang/...` or `runtime/specpilot_runtime/...`
    paths) and the full file list `universe` (package-root paths, e.g. a wheel's members)."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise SpecPilotError(f"import log {log}: {exc.strerror}") from None
    if not lines:
        raise SpecPilotError(f"import log {log} is empty: was the engine served with {AUDIT_ENV}={log}?")
    pids, imported = set(), set()
    for number, line in enumerate(lines, start=1):
        parts = line.split("\t")
        if len(parts) != 3:
            raise SpecPilotError(f"import log {log}: line {number} is not pid<TAB>module<TAB>file")
        pids.add(parts[0])
        module = parts[1]
        # by module name: another distribution's `<dist>/sglang/...` subpackage is not SGLang's file
        rel = package_path(parts[2], package) if module == package or module.startswith(package + ".") else None
        if rel is not None:
            imported.add(rel)
    kept = {rel for rel in (package_path(p, package) for p in manifest_files) if rel is not None}
    full = set(universe or ())
    return ImportAudit(
        package=package,
        processes=len(pids),
        imported=_sorted(imported),
        kept=_sorted(kept),
        imported_kept=_sorted(imported & kept),
        imported_pruned=_sorted(imported - kept),
        kept_never_imported=_sorted(kept - imported),
        outside_universe=_sorted(imported - full) if universe is not None else (),
    )


def package_path(path: str, package: str) -> str | None:
    """`.../<package>/x/y.py` → `<package>/x/y.py` (the last `<package>` directory on the path), else None."""
    parts = path.replace(os.sep, "/").split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == package:
            return "/".join(parts[i:])
    return None


def _sorted(items) -> tuple[str, ...]:
    return tuple(sorted(items, key=str.encode))


def module_name(path: str) -> str:
    """`sglang/srt/models/llama.py` → `sglang.srt.models.llama`; a package's `__init__.py` → the package."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def static_importers(root: Path, files: list[str], modules: set[str]) -> dict[str, list[str]]:
    """For each of `modules`, the `.py` files among `files` (paths under `root`) with an import statement naming it,
    at any depth (a lazy import inside a function counts): `import a.b`, `from a import b` and relative imports,
    which name `a` and `a.b`, and a string that spells the whole name (`importlib.import_module("a.b")`). A
    module named by no kept file is reached only by enumeration (pkgutil, computed names) or through other pruned
    modules."""
    import ast

    found: dict[str, list[str]] = {module: [] for module in modules}
    for path in sorted(p for p in files if p.endswith(".py")):
        try:
            tree = ast.parse((root / path).read_bytes(), filename=path)
        except (OSError, SyntaxError, ValueError) as exc:  # an unread file could hide an importer: no verdict
            raise SpecPilotError(f"import audit: cannot read the imports of {root / path}: {exc}") from None
        package = module_name(path).split(".") if path.endswith("__init__.py") else module_name(path).split(".")[:-1]
        named: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                named.add(source)
                named.update(f"{source}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # importlib.import_module("a.b")
                named.add(node.value)
        for module in named & found.keys():
            found[module].append(path)
    return found
