"""Canonical bytes and digests: the manifest of an engine tree and the engine id that names it.

Only content and the executable bit enter a digest: entries are sorted by their UTF-8 bytes, JSON has sorted
keys and fixed separators, and no mtime, owner or umask is read."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, TypedDict

import blake3

from specpilot_build.errors import SpecPilotError
from specpilot_build.store.names import plain_name, plain_relpath

MANIFEST_NAME = "manifest.json"
SCHEMA = "specpilot.manifest/1"

JsonObject = dict[str, Any]  # a JSON object as json.loads returns it: a manifest, its head, a config


class FileEntry(TypedDict):
    """One file of an engine tree as its manifest records it."""

    path: str
    size: int
    exec: bool
    blake3: str


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest_bytes(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def digest_file(path: Path) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            hasher.update(chunk)
    return "blake3:" + hasher.hexdigest()


def engine_id(manifest: JsonObject) -> str:
    return blake3.blake3(canonical_json(manifest)).hexdigest()


def file_entry(root: Path, rel: str) -> FileEntry:
    path = root / rel
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{rel}: not a regular file")
    return {"path": rel, "size": st.st_size, "exec": bool(st.st_mode & 0o111), "blake3": digest_file(path)}


DIGEST = re.compile(r"blake3:[0-9a-f]{64}")
_ENTRY_KEYS = {"path": str, "size": int, "exec": bool, "blake3": str}


def manifest_problem(data: object) -> str | None:
    """What keeps parsed JSON from being an engine manifest this builder reads (one phrase), or None: a JSON
    object with this SCHEMA, `setting` and `arm` strings and a file list whose entries are exactly path,
    size, exec and blake3, each path a plain relative path, listed once, in UTF-8 byte order."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema") != SCHEMA:
        return f"schema {data.get('schema')!r}, not {SCHEMA!r}"
    for key in ("setting", "arm"):
        if not isinstance(data.get(key), str):
            return f"no {key}"
    files = data.get("files")
    if not isinstance(files, list):
        return "no file list"
    previous = b""
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or set(entry) != set(_ENTRY_KEYS):
            return f"files[{i}] is not an entry of {', '.join(_ENTRY_KEYS)}"
        for key, kind in _ENTRY_KEYS.items():
            if not isinstance(entry[key], kind) or (kind is int and isinstance(entry[key], bool)):
                return f"files[{i}].{key} is {entry[key]!r}"
        if entry["size"] < 0:
            return f"files[{i}].size is {entry['size']!r}"
        if not DIGEST.fullmatch(entry["blake3"]):
            return f"files[{i}].blake3 is {entry['blake3']!r}, not blake3:<64 hex digits>"
        try:
            plain_relpath(entry["path"], f"files[{i}].path", error=ValueError)
        except ValueError as exc:
            return str(exc).split(";")[0]
        key = entry["path"].encode("utf-8", "surrogateescape")
        if i and key <= previous:
            return f"files[{i}].path {entry['path']!r} is out of order or listed twice"
        previous = key
    return None


def entry_kind(mode: int) -> str:
    """What an lstat mode is, in words: 'file', 'directory', or the kind that is refused."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def walk_tree(root: Path) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Everything under root, seen with lstat (no link is followed, nothing is opened): (regular files,
    directories, [(path, kind)] of links, FIFOs, sockets and devices), POSIX relative paths sorted by UTF-8
    bytes; the manifest itself is left out of the files."""
    files: list[str] = []
    dirs: list[str] = []
    others: list[tuple[str, str]] = []
    stack = [("", str(root))]
    while stack:
        prefix, directory = stack.pop()
        with os.scandir(directory) as it:
            for entry in it:
                rel = prefix + entry.name
                kind = entry_kind(entry.stat(follow_symlinks=False).st_mode)
                if kind == "directory":
                    dirs.append(rel)
                    stack.append((rel + "/", entry.path))
                elif kind == "file":
                    if rel != MANIFEST_NAME:
                        files.append(rel)
                else:
                    others.append((rel, kind))

    def key(p: str) -> bytes:
        return p.encode("utf-8", "surrogateescape")

    return sorted(files, key=key), sorted(dirs, key=key), sorted(others, key=lambda o: key(o[0]))


def walk_files(root: Path) -> list[str]:
    """Every file under root as a POSIX relative path, sorted by UTF-8 bytes (the manifest itself excluded);
    a link, FIFO, socket or device anywhere is refused with its path."""
    files, _, others = walk_tree(root)
    if others:
        rel, kind = others[0]
        raise SpecPilotError(f"{root / rel}: a {kind} in an engine tree; refused (only files and directories)")
    return files


def read_regular(path: Path, where: str | None = None) -> tuple[bytes, bool]:
    """(content, executable bit) of a regular file, opened without following a link or blocking on a FIFO;
    anything else is refused naming `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        kind = _kind_of(path)
        if kind not in (None, "file"):
            raise SpecPilotError(f"{path}: a {kind}, not a file{_in(where)}; refused") from None
        raise SpecPilotError(f"{path}: cannot read it ({exc.strerror}){_in(where)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecPilotError(f"{path}: a {entry_kind(st.st_mode)}, not a file{_in(where)}; refused")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read()
    finally:
        os.close(fd)
    return data, bool(st.st_mode & 0o111)


def _kind_of(path: Path) -> str | None:
    try:
        return entry_kind(os.lstat(path).st_mode)
    except OSError:
        return None


def _in(where: str | None) -> str:
    return f" in {where}" if where else ""


def plain_directory(path: Path, where: str) -> Path:
    """`path` if it is a real directory (not a link to one); a one-line refusal otherwise."""
    kind = _kind_of(path)
    if kind != "directory":
        raise SpecPilotError(
            f"{path}: {'does not exist' if kind is None else 'a ' + kind + ', not a directory'} ({where}); refused"
        )
    return path


IGNORED_NAMES = {"__pycache__", ".pytest_cache", ".DS_Store"}
IGNORED_SUFFIXES = (".pyc", ".pyo")


def source_files(src: Path, where: str | None = None) -> list[tuple[str, Path]]:
    """An in-repo directory's files as (relative POSIX path, path), sorted by bytes; caches and bytecode left
    out. Seen with lstat: the directory itself or anything in it that is a link (to a file or a directory), a
    FIFO, a socket or a device is refused with its path, never followed or opened."""
    where = where or "a runtime, overlay or kernel directory"
    plain_directory(src, where)
    found = []
    stack = [src]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name in IGNORED_NAMES:
                    continue
                kind = entry_kind(entry.stat(follow_symlinks=False).st_mode)
                path = Path(entry.path)
                if kind == "directory":
                    stack.append(path)
                elif kind != "file":
                    raise SpecPilotError(
                        f"{path}: a {kind} in {where}; refused (only files and directories: "
                        f"symbolic links are not allowed, nor FIFOs, sockets or devices)"
                    )
                elif not entry.name.endswith(IGNORED_SUFFIXES):
                    found.append((path.relative_to(src).as_posix(), path))
    return sorted(found, key=lambda item: item[0].encode())


def files_digest(files: list[tuple[str, Path]]) -> str:
    """One digest over (path, exec bit, content) of each file: pins an in-repo directory or a kernel's files."""
    entries = []
    for rel, path in files:
        data, executable = read_regular(path)
        entries.append({"path": rel, "exec": executable, "blake3": digest_bytes(data)})
    return digest_bytes(canonical_json(entries))


def source_dir_digest(src: Path, where: str | None = None) -> str:
    return files_digest(source_files(src, where))


OVERLAY_DESCRIPTOR = "overlay.toml"


def overlay_files_dir(directory: Path) -> Path:
    """An overlay's files/: its own, or — `files_from = "<overlay>"` in its overlay.toml — that sibling overlay's
    (one copy of a file that two cuts of an overlay ship; the sibling must have files/ and no files_from itself)."""
    source = _files_from(directory)
    return directory / "files" if source is None else source


def overlay_digest(directory: Path, where: str | None = None) -> str:
    """An overlay's content digest: its folder's; for one with files_from, also the digest of the files it takes."""
    own = source_dir_digest(directory, where)
    source = _files_from(directory)
    if source is None:
        return own
    taken = source_dir_digest(source, f"overlay '{source.parent.name}': files/")
    return digest_bytes(canonical_json({"overlay": own, "files_from": source.parent.name, "files": taken}))


def _files_from(directory: Path) -> Path | None:
    import tomllib

    descriptor = directory / OVERLAY_DESCRIPTOR
    try:
        value = tomllib.loads(read_regular(descriptor)[0].decode("utf-8")).get("files_from")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecPilotError(f"{descriptor}: not valid TOML: {exc}") from None
    if value is None:
        return None
    where = f"{descriptor}: files_from"
    name = plain_name(value, where, error=SpecPilotError)
    source = directory.parent / name
    if name == directory.name or os.path.lexists(directory / "files"):
        raise SpecPilotError(
            f"{where} = {name!r}: an overlay takes files from another overlay or has its own files/, not both"
        )
    if not (source / OVERLAY_DESCRIPTOR).is_file():
        raise SpecPilotError(f"{where} = {name!r}: overlays/{name}/ with an overlay.toml and files/ does not exist")
    if _files_from(source) is not None:
        raise SpecPilotError(
            f"{where} = {name!r}: that overlay takes its files from another; name the one that holds them"
        )
    if not os.path.lexists(source / "files"):
        raise SpecPilotError(f"{where} = {name!r}: overlays/{name}/ with an overlay.toml and files/ does not exist")
    return source / "files"
