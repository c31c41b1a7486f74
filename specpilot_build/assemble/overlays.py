"""Overlays: overlays/<name>/ = overlay.toml (what it is for, the runtime and version range it applies to),
files/ copied on top of the engine tree at the same relative path (or, with `files_from = "<overlay>"`, another
overlay's files/: two cuts of one overlay ship one copy), and patches/*.patch unified diffs applied strictly:
every context and removed line must match exactly at the line the hunk names (no fuzz, no offset).

Paths are confined to the tree: absolute paths, `..` and paths through links are refused before anything is
written. The manifest records each overlay's digest and, per touched file, its digest before and after."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import OVERLAYS_DIR
from specpilot_build.store.manifest import (
    OVERLAY_DESCRIPTOR as DESCRIPTOR,
)
from specpilot_build.store.manifest import (
    digest_bytes,
    overlay_digest,
    overlay_files_dir,
    plain_directory,
    read_regular,
    source_files,
)
from specpilot_build.store.names import plain_name, plain_relpath

DESCRIPTOR_KEYS = ("description", "runtime", "versions", "files_from")


def overlay_inputs(names: list[str], cfg: dict) -> list[dict]:
    """Each overlay's name and content digest (an input of the engine id); its descriptor is validated."""
    out = []
    for name in names:
        directory = overlay_dir(name)
        descriptor = read_descriptor(directory)
        _check_runtime(name, descriptor, cfg["runtime"]["name"], None)
        out.append({"name": name, "digest": overlay_digest(directory, f"overlay '{name}'")})
    return out


def apply_overlays(tree: Path, overlays: list[dict], cfg: dict) -> list[dict]:
    """Copy each overlay's files and apply its patches onto `tree`, in order (`overlays`: overlay_inputs' records).
    Returns the manifest records."""
    records = []
    for overlay in overlays:
        name = overlay["name"]
        directory = overlay_dir(name)
        descriptor = read_descriptor(directory)
        _check_runtime(name, descriptor, cfg["runtime"]["name"], installed_version(tree, cfg["runtime"]["name"]))
        touched: dict[str, dict] = {}
        for rel, src in _overlay_files(directory):
            target = confined(tree, rel, f"overlay {name}: files/{rel}")
            data, executable = read_regular(src, f"overlay {name}")
            _note_before(touched, tree, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(target):
                target.unlink()  # never write through a hardlink shared with another tree or the store
            target.write_bytes(data)
            os.chmod(target, 0o755 if executable else 0o644)
        for patch_path in _patch_files(directory, name):
            where = f"overlay {name}: patches/{patch_path.name}"
            patches = parse_patch(read_regular(patch_path, f"overlay {name}")[0].decode("utf-8"), where)
            for fp in patches:  # every path is checked before any file is written
                confined(tree, fp.path, where)
            for fp in patches:
                _note_before(touched, tree, fp.path)
                apply_file_patch(tree, fp, where)
        files = []
        for rel in sorted(touched, key=lambda p: p.encode()):
            after = tree / rel
            files.append(
                {
                    "path": rel,
                    "before": touched[rel]["before"],
                    "after": digest_bytes(after.read_bytes()) if after.exists() else None,
                }
            )
        records.append({"name": name, "digest": overlay["digest"], "files": files})
    return records


def overlay_dir(name: str) -> Path:
    """overlays/<name>/: a plain name, a real directory (not a link to one) holding its descriptor."""
    directory = OVERLAYS_DIR / plain_name(name, "overlay name")
    if not os.path.lexists(directory / DESCRIPTOR) and not os.path.islink(directory):
        raise SpecPilotError(f"overlay '{name}': {directory / DESCRIPTOR} does not exist")
    plain_directory(directory, f"overlay '{name}'")
    return directory


def read_descriptor(directory: Path) -> dict:
    path = directory / DESCRIPTOR
    try:
        data = tomllib.loads(read_regular(path, f"overlay '{directory.name}'")[0].decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecPilotError(f"{path}: not valid TOML: {exc}") from None
    for key in ("description", "runtime", "versions"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise SpecPilotError(f"{path}: key '{key}' (a non-empty string) is required")
    unknown = sorted(set(data) - set(DESCRIPTOR_KEYS))
    if unknown:
        raise SpecPilotError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(DESCRIPTOR_KEYS)})")
    return data


def installed_version(tree: Path, runtime: str) -> str | None:
    """The runtime version the tree's base carries (its dist-info directory), None for a directory base. A runtime
    is named after its distribution, optionally with a version (`sglang`, `sglang-0.5.17`)."""
    base = tree / "python"
    if not base.is_dir():
        return None
    prefix = runtime.split("-", 1)[0] + "-"
    for entry in os.listdir(base):
        if entry.endswith(".dist-info") and entry.startswith(prefix):
            return entry[len(prefix) : -len(".dist-info")]
    return None


def version_in_range(version: str, spec: str) -> bool:
    """`spec` is comma-separated clauses `<op><version>` with op in == != >= <= > < (or `*` for any)."""
    if spec.strip() == "*":
        return True
    have = _version_key(version)
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(==|!=|>=|<=|>|<)\s*([0-9][0-9.]*)\s*", clause)
        if not m:
            raise SpecPilotError(f"version range clause {clause.strip()!r} is not <op><version> (ops: == != >= <= > <)")
        op, want = m.group(1), _version_key(m.group(2))
        ok = {
            "==": have == want,
            "!=": have != want,
            ">=": have >= want,
            "<=": have <= want,
            ">": have > want,
            "<": have < want,
        }[op]
        if not ok:
            return False
    return True


def _version_key(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:4]]
    return tuple(parts + [0] * (4 - len(parts)))


def _check_runtime(name: str, descriptor: dict, runtime: str, version: str | None) -> None:
    where = f"overlays/{name}/{DESCRIPTOR}"
    if descriptor["runtime"] != runtime:
        raise SpecPilotError(
            f"{where}: applies to runtime '{descriptor['runtime']}', but this setting runs '{runtime}'"
        )
    if version is not None and not version_in_range(version, descriptor["versions"]):
        raise SpecPilotError(
            f"{where}: applies to {runtime} {descriptor['versions']}, but the pinned "
            f"{runtime} is {version}; update the overlay for this version"
        )


def _overlay_files(directory: Path) -> list[tuple[str, Path]]:
    files_dir = overlay_files_dir(directory)
    if not os.path.lexists(files_dir):
        return []
    return source_files(files_dir, f"overlay '{directory.name}'")


def _patch_files(directory: Path, name: str) -> list[Path]:
    """patches/*.patch, sorted; the folder and each patch seen with lstat (links and special files refused)."""
    patches = directory / "patches"
    if not os.path.lexists(patches):
        return []
    return [
        path for rel, path in source_files(patches, f"overlay '{name}'") if rel.endswith(".patch") and "/" not in rel
    ]


def _note_before(touched: dict, tree: Path, rel: str) -> None:
    if rel not in touched:
        path = tree / rel
        touched[rel] = {"before": digest_bytes(read_regular(path)[0]) if os.path.lexists(path) else None}


def confined(tree: Path, rel: str, where: str) -> Path:
    """tree/rel, refusing absolute paths, `..`, backslashes and any existing link on the way."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or "\\" in rel or rel.startswith("~"):
        raise SpecPilotError(f"{where}: path {rel!r} leaves the engine tree; refused (nothing was written)")
    plain_relpath(rel, f"{where}: path", error=SpecPilotError)
    current = tree
    for part in path.parts:
        current = current / part
        if current.is_symlink():
            raise SpecPilotError(
                f"{where}: path {rel!r} goes through a link ({current.relative_to(tree)}); "
                f"refused (nothing was written)"
            )
    return tree / rel


# --- strict unified diffs ------------------------------------------------------------------------------------

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    header: str
    old_start: int
    old_lines: list[str] = field(default_factory=list)  # context + removed, with line endings
    new_lines: list[str] = field(default_factory=list)  # context + added


@dataclass
class FilePatch:
    path: str  # relative to the tree (the a/ b/ prefix stripped)
    create: bool
    delete: bool
    hunks: list[Hunk]


def parse_patch(text: str, where: str) -> list[FilePatch]:
    lines = text.splitlines(keepends=True)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise SpecPilotError(f"{where}: line {i + 1}: '---' without a following '+++'")
        old, new = _diff_path(lines[i][4:]), _diff_path(lines[i + 1][4:])
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i, where)
            hunks.append(hunk)
        if not hunks:
            raise SpecPilotError(f"{where}: {new or old}: no hunks")
        path = new if new is not None else old
        if path is None:
            raise SpecPilotError(f"{where}: line {i - len(hunks)}: both sides of a file section are /dev/null")
        patches.append(FilePatch(path=path, create=old is None, delete=new is None, hunks=hunks))
    if not patches:
        raise SpecPilotError(f"{where}: no file sections (---/+++) found")
    return patches


def _diff_path(field_text: str) -> str | None:
    name = field_text.rstrip("\n").split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        return name[2:]
    return name  # kept as is, so an absolute or ../ path is refused by confined()


def _parse_hunk(lines: list[str], i: int, where: str) -> tuple[Hunk, int]:
    header = lines[i].rstrip("\n")
    m = _HUNK.match(header)
    if not m:
        raise SpecPilotError(f"{where}: line {i + 1}: malformed hunk header {header!r}")
    old_count = int(m.group(2)) if m.group(2) is not None else 1
    new_count = int(m.group(4)) if m.group(4) is not None else 1
    hunk = Hunk(header=header, old_start=int(m.group(1)))
    i += 1
    last: list[str] | None = None
    while i < len(lines) and (len(hunk.old_lines) < old_count or len(hunk.new_lines) < new_count):
        line = lines[i]
        tag, body = line[:1], line[1:]
        if tag == " " or line == "\n":
            body = body if tag == " " else "\n"
            hunk.old_lines.append(body)
            hunk.new_lines.append(body)
            last = None
        elif tag == "-":
            hunk.old_lines.append(body)
            last = hunk.old_lines
        elif tag == "+":
            hunk.new_lines.append(body)
            last = hunk.new_lines
        else:
            raise SpecPilotError(f"{where}: line {i + 1}: unexpected {line[:20]!r} inside hunk {header}")
        i += 1
        if i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
            targets = [hunk.old_lines, hunk.new_lines] if last is None else [last]
            for t in targets:
                t[-1] = t[-1].rstrip("\n")
            i += 1
    if len(hunk.old_lines) != old_count or len(hunk.new_lines) != new_count:
        raise SpecPilotError(f"{where}: hunk {header}: the body does not have the line counts its header says")
    return hunk, i


def apply_file_patch(tree: Path, fp: FilePatch, where: str) -> None:
    target = confined(tree, fp.path, where)
    if fp.create:
        if target.exists():
            raise SpecPilotError(f"{where}: {fp.path}: the patch creates it, but it already exists")
        original: list[str] = []
    else:
        if not target.is_file():
            raise SpecPilotError(f"{where}: {fp.path}: the patch changes it, but it is not in the tree")
        original = target.read_bytes().decode("utf-8").splitlines(keepends=True)
    out: list[str] = []
    cursor = 0  # index into original of the first line not yet copied
    for number, hunk in enumerate(fp.hunks, start=1):
        start = hunk.old_start - 1 if hunk.old_lines else hunk.old_start  # an empty old side inserts after
        if start < cursor:
            raise SpecPilotError(f"{where}: {fp.path}: hunk #{number} ({hunk.header}) overlaps the hunk before it")
        actual = original[start : start + len(hunk.old_lines)]
        if actual != hunk.old_lines:
            bad = next((k for k, (a, b) in enumerate(zip(actual, hunk.old_lines)) if a != b), len(actual))
            found = actual[bad].rstrip("\n") if bad < len(actual) else "<end of file>"
            expected = hunk.old_lines[bad].rstrip("\n")
            raise SpecPilotError(
                f"{where}: {fp.path}: hunk #{number} ({hunk.header}) does not apply: "
                f"line {start + bad + 1} is {found!r}, the patch expects {expected!r}"
            )
        out += original[cursor:start] + hunk.new_lines
        cursor = start + len(hunk.old_lines)
    out += original[cursor:]
    if fp.delete:
        if out:
            raise SpecPilotError(f"{where}: {fp.path}: the patch deletes it, but lines would remain")
        target.unlink()
        return
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.unlink()  # never write through a hardlink shared with another tree
    target.write_bytes("".join(out).encode("utf-8"))
    os.chmod(target, mode)
