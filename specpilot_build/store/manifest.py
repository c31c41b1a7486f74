"""Canonical bytes and digests: the manifest of an engine tree and the engine id that names it.

Only content and the executable bit enter a digest: entries are sorted by their UTF-8 bytes, JSON has sorted
keys and fixed separators, and no mtime, owner or umask is read."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import blake3

from specpilot_build.errors import SpecPilotError

MANIFEST_NAME = "manifest.json"
SCHEMA = "specpilot.manifest/1"


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest_bytes(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def digest_file(path: Path) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            hasher.update(chunk)
    return "blake3:" + hasher.hexdigest()


def engine_id(manifest: dict) -> str:
    return blake3.blake3(canonical_json(manifest)).hexdigest()


def file_entry(root: Path, rel: str) -> dict:
    path = root / rel
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{rel}: not a regular file")
    return {"path": rel, "size": st.st_size, "exec": bool(st.st_mode & 0o111), "blake3": digest_file(path)}


def walk_files(root: Path) -> list[str]:
    """Every file under root as a POSIX relative path, sorted by UTF-8 bytes (the manifest itself excluded)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rel != MANIFEST_NAME:
                found.append(rel.replace(os.sep, "/"))
    return sorted(found, key=lambda p: p.encode("utf-8"))


IGNORED_NAMES = {"__pycache__", ".pytest_cache", ".DS_Store"}
IGNORED_SUFFIXES = (".pyc", ".pyo")


def source_files(src: Path) -> list[tuple[str, Path]]:
    """An in-repo directory's files as (relative POSIX path, path), sorted by bytes; caches and bytecode left
    out, links refused."""
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d not in IGNORED_NAMES]
        for name in filenames:
            if name in IGNORED_NAMES or name.endswith(IGNORED_SUFFIXES):
                continue
            path = Path(dirpath) / name
            if path.is_symlink():
                raise SpecPilotError(f"{path}: symbolic links are not allowed in a runtime or overlay directory")
            found.append((path.relative_to(src).as_posix(), path))
    return sorted(found, key=lambda item: item[0].encode())


def files_digest(files: list[tuple[str, Path]]) -> str:
    """One digest over (path, exec bit, content) of each file: pins an in-repo directory or a kernel's files."""
    entries = [{"path": rel, "exec": os.access(path, os.X_OK), "blake3": digest_file(path)} for rel, path in files]
    return digest_bytes(canonical_json(entries))


def source_dir_digest(src: Path) -> str:
    return files_digest(source_files(src))
