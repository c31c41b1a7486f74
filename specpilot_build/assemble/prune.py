"""Prune the SGLang wheel to what a setting can execute.

Kept: the static import closure (imports inside functions too, relative imports, `from x import y` where y is
a submodule; not those under `if TYPE_CHECKING:`) of the launcher plus the modules the setting's rules name,
and the files the rules keep by glob (what is loaded by path or by a computed name: licences, metadata, JIT
sources, tuning JSON). The rules are data in conf/runtime/sglang.yaml (`prune`); a rule applies when all its
`when` keys equal the setting's config (a list: any of its values; the native rules use the same test).

The wheel's import graph is derived data: it is computed once per wheel sha256 and cached under
<data>/cache/import-graph/, so a build only walks a graph and matches globs."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import zipfile
from pathlib import Path

from specpilot_build.config.effective import rule_applies
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir

GRAPH_FORMAT = 1


def select_members(
    zf: zipfile.ZipFile, members: list[zipfile.ZipInfo], cfg: dict
) -> tuple[list[zipfile.ZipInfo], dict]:
    rules = cfg["runtime"].get("prune")
    total_bytes = sum(m.file_size for m in members)
    if not rules:
        return members, _record(members, members, total_bytes, [])
    graph = import_graph(zf, members)
    applied = [r for r in rules.get("rules", []) if rule_applies(r, cfg)]
    roots = [rules["launcher"]]
    for rule in applied:
        roots += _expand_modules(rule.get("modules", []), graph, rule)
    keep = {graph["modules"][m] for m in reach(graph, roots)}
    by_glob = _glob_matcher([g for r in applied for g in r.get("files", [])])
    dropped_by_rule = _glob_matcher([g for r in applied for g in r.get("drop", [])])
    for info in members:
        name = info.filename
        if name not in keep and by_glob(name) and not dropped_by_rule(name):
            keep.add(name)
    kept = [m for m in members if m.filename in keep]
    return kept, _record(kept, members, total_bytes, applied)


def reach(graph: dict, roots: list[str]) -> set[str]:
    """Modules reachable from `roots`; importing a module also imports every package above it."""
    modules, edges = graph["modules"], graph["edges"]
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        parent = name.rpartition(".")[0]
        if parent:
            stack.append(parent)
        stack.extend(edges.get(name, ()))
    return seen


def _record(kept: list, members: list, total_bytes: int, applied: list[dict]) -> dict:
    kept_bytes = sum(m.file_size for m in kept)
    return {
        "total_files": len(members),
        "total_bytes": total_bytes,
        "kept_files": len(kept),
        "kept_bytes": kept_bytes,
        "dropped_files": len(members) - len(kept),
        "dropped_bytes": total_bytes - kept_bytes,
        "rules": [r.get("why", "") for r in applied],
    }


def _expand_modules(patterns: list[str], graph: dict, rule: dict) -> list[str]:
    """Module names or patterns where `*` stands for one name component; a pattern that names nothing in the
    wheel is an error (a rule gone stale with a new wheel must not silently keep less)."""
    out = []
    for pattern in patterns:
        if "*" not in pattern:
            found = [pattern] if pattern in graph["modules"] else []
        else:
            rx = re.compile(re.escape(pattern).replace(r"\*", r"[^.]*") + r"\Z")
            found = [m for m in graph["modules"] if rx.match(m)]
        if not found:
            raise SpecPilotError(
                f"conf/runtime/sglang.yaml prune rule '{rule.get('why', '?')}': module "
                f"{pattern} is not in the wheel; fix the rule for this SGLang version"
            )
        out += found
    return out


def _glob_matcher(globs: list[str]):
    """One regex for all globs; `*` matches across `/` (so `dir/*` is everything below dir)."""
    if not globs:
        return lambda name: False
    rx = re.compile("|".join(fnmatch.translate(g) for g in globs))
    return lambda name: rx.match(name) is not None


# --- the wheel's import graph ------------------------------------------------------------------------------

_FROM = re.compile(rb"^[ \t]*from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|(?:[^\n\\#]|\\\n)*)", re.M)
_IMPORT = re.compile(rb"^[ \t]*import[ \t]+((?:[^\n\\#;]|\\\n)*)", re.M)
_TYPE_CHECKING_IF = re.compile(rb"if (?:typing\.)?TYPE_CHECKING:[ \t]*\n")
_EXTENSION = re.compile(r"^(.*/)?([A-Za-z_]\w*)(\.[\w-]+)?\.(so|pyd)$")


def import_graph(zf: zipfile.ZipFile, members: list[zipfile.ZipInfo]) -> dict:
    """{"modules": {module: member path}, "edges": {module: [modules it may import]}}, cached per wheel."""
    cache_dir = data_dir() / "cache" / "import-graph"
    if zf.filename is None:
        raise SpecPilotError("import graph: the wheel has no file name to cache by")
    sha256 = _wheel_sha256(Path(zf.filename), cache_dir)
    cache = cache_dir / f"{sha256}.json"
    try:
        graph = json.loads(cache.read_bytes())
        if graph.get("format") == GRAPH_FORMAT:
            return graph
    except (FileNotFoundError, ValueError):
        pass
    graph = scan_imports(zf, members)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_text(json.dumps(graph, sort_keys=True))
    os.replace(tmp, cache)
    return graph


def scan_imports(zf: zipfile.ZipFile, members: list[zipfile.ZipInfo]) -> dict:
    """A regex scan (not an AST parse: ~10× faster) that over-approximates: an import in a docstring or a string
    counts too, which only keeps more. Imports under `if TYPE_CHECKING:` never run and are not edges; modules
    loaded by a name computed or held in a string are dynamic and kept by rule."""
    modules: dict[str, str] = {}
    sources: dict[str, tuple[zipfile.ZipInfo, bool]] = {}
    for info in members:
        name = info.filename
        if name.endswith(".py"):
            module = name[:-3].replace("/", ".")
            is_package = module.endswith(".__init__")
            module = module.removesuffix(".__init__")
            modules[module] = name
            sources[module] = (info, is_package)
        elif (m := _EXTENSION.match(name)) and ".dist-info/" not in name:
            modules[(m.group(1) or "").replace("/", ".") + m.group(2)] = name
    tops = {m.split(".")[0] for m in modules}
    edges: dict[str, list[str]] = {}
    for module, (info, is_package) in sources.items():
        package = module if is_package else module.rpartition(".")[0]
        named = _imported_names(zf.read(info), package)
        found = {p for n in named if n.split(".")[0] in tops and (p := _known_prefix(n, modules)) is not None}
        found.discard(module)
        edges[module] = sorted(found)
    return {"format": GRAPH_FORMAT, "modules": modules, "edges": edges}


def _statement_starts(src: bytes):
    """Offsets of lines that begin (after indentation) with `from ` or `import `. Every such statement holds
    the word `import`, and bytes.find is much faster than an anchored multi-line regex over the file."""
    last = -1
    pos = src.find(b"import")
    while pos >= 0:
        start = src.rfind(b"\n", 0, pos) + 1
        if start != last:
            last = start
            head = src[start : start + 200].lstrip(b" \t")
            if head.startswith((b"from ", b"import ", b"from\t", b"import\t")):
                yield start
        pos = src.find(b"import", pos + 6)


def _without_type_checking_blocks(src: bytes) -> bytes:
    """`src` with the bodies of `if TYPE_CHECKING:` blocks (lines indented deeper than the `if`) removed."""
    cuts = []
    for m in _TYPE_CHECKING_IF.finditer(src):
        start = src.rfind(b"\n", 0, m.start()) + 1
        indent = src[start : m.start()]
        if indent.strip(b" \t"):
            continue
        end = m.end()
        while end < len(src):
            nl = src.find(b"\n", end)
            line = src[end : nl if nl >= 0 else len(src)]
            if line.strip() and not (line.startswith(indent) and line[len(indent) : len(indent) + 1] in (b" ", b"\t")):
                break
            end = nl + 1 if nl >= 0 else len(src)
        cuts.append((m.end(), end))
    if not cuts:
        return src
    parts, pos = [], 0
    for a, b in cuts:
        parts.append(src[pos:a])
        pos = b
    parts.append(src[pos:])
    return b"".join(parts)


def _imported_names(src: bytes, package: str) -> set[str]:
    names: set[str] = set()
    if b"TYPE_CHECKING:" in src:
        src = _without_type_checking_blocks(src)
    froms, imports = [], []
    for start in _statement_starts(src):
        m = _FROM.match(src, start)
        if m:
            froms.append(m)
        elif m := _IMPORT.match(src, start):
            imports.append(m)
    for m in froms:
        base = m.group(1).decode()
        if base.startswith("."):
            level = len(base) - len(base.lstrip("."))
            parts = package.split(".")
            parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
            rest = base.lstrip(".")
            base = ".".join(parts + ([rest] if rest else []))
        names.add(base)
        listed = m.group(2)
        if b"#" in listed:
            listed = re.sub(rb"#[^\n]*", b"", listed)
        listed = listed.replace(b"\\\n", b" ").strip(b"() \t\n")
        for item in listed.split(b","):
            word = item.split()[0].decode() if item.split() else ""
            if word.isidentifier():
                names.add(f"{base}.{word}")
    for m in imports:
        for item in m.group(1).replace(b"\\\n", b" ").split(b","):
            words = item.split()
            if words:
                names.add(words[0].decode(errors="replace"))
    return names


def _known_prefix(name: str, modules: dict) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _wheel_sha256(path: Path, cache_dir: Path) -> str:
    """The wheel's sha256, remembered per (path, inode, size, mtime) so a build does not re-read 39 MB."""
    st = path.stat()
    stamp = hashlib.sha256(f"{path.resolve()}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir / "sha256-by-stat" / stamp
    try:
        value = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", value):
            return value
    except FileNotFoundError:
        pass
    value = _file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{stamp}.{os.getpid()}")
    tmp.write_text(value + "\n")
    os.replace(tmp, memo)
    return value


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
