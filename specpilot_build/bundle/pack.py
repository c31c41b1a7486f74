"""`make bundle`: engines, their models, their environment and SpecPilot itself as one content-addressed
archive, split into parts that fit the host's transfer limit, with an index of every digest.

The archive is deterministic (members in a fixed order — the same file of several engines side by side —, files
only, mtime/uid/gid/owner names fixed, mode 0644 or 0755 from the executable bit, tar + xz at a fixed preset), so two bundles of the same
engines are byte-identical. Its id is the BLAKE3 of the archive bytes; the index also records the archive's
and every part's sha256, which is what the installer checks on a host without blake3."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from specpilot_build.bundle.contents import INSTALLER, Member, bundle_members
from specpilot_build.cache.progress import Meter
from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.store.engines import Engine

FORMAT = "specpilot.bundle/1"
INDEX_NAME = "index.json"
MTIME = 946684800  # 2000-01-01T00:00:00Z: a fixed, ordinary timestamp (0 makes some tools warn)
XZ_PRESET = 6
CHUNK = 1 << 20


@dataclass(frozen=True)
class Bundle:
    path: Path  # the folder holding index.json, the parts and install.py
    index: dict


def make_bundle(
    engines: list[Engine],
    *,
    part_bytes: int,
    env_dir: Path | None = None,
    env_files: dict[str, str] | None = None,
    host: str | None = None,
    out: Path | None = None,
    meter: Meter | None = None,
) -> Bundle:
    """Pack `engines` (with `env_dir` as their environment for `host`, holding exactly `env_files` when given:
    path → blake3) into <data>/bundles/<archive id>/ or `out`."""
    if part_bytes < 1:
        raise SpecPilotError(f"part size {part_bytes} bytes: must be at least 1 byte (--part-mb)")
    if not engines:
        raise SpecPilotError("bundle: name at least one engine")
    members = bundle_members(engines, env_dir, env_files)
    base = Path(out) if out else data_dir() / "bundles"
    base.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bundle-", dir=base.parent if out else _made(base)))
    try:
        archive = scratch / "archive.tar.xz"
        write_archive(members, archive, meter or Meter())
        meta = {
            "engines": [
                {"id": e.id, "setting": e.manifest.get("setting"), "arm": e.manifest.get("arm")} for e in engines
            ],
            "host": host,
            "environment": env_dir is not None,
        }
        folder = scratch / "bundle"
        index = split_archive(archive, folder, part_bytes, meta)
        final = Path(out) if out else base / index["archive"]["id"].split(":", 1)[1]
        return Bundle(_place(folder, final), index)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_archive(members: list[Member], path: Path, meter: Meter | None = None) -> None:
    """Write `members` as a deterministic tar.xz at `path`, checking each file's bytes against its digest
    as they are packed (a file that differs is refused naming it; the partial archive is the caller's to drop).
    `meter` hears of each member's bytes as it is packed."""
    meter = meter or Meter()
    with (
        meter,
        lzma.open(path, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET) as xz,
        tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar,
    ):
        meter.start(f"bundle {len(members)} files", sum(_size(m.source) for m in members))
        for member in members:
            meter.advance(member.name, _add_member(tar, member))


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0  # _add_member names it


def _add_member(tar: tarfile.TarFile, member: Member) -> int:
    """Add one member; returns its size."""
    try:
        fd = os.open(member.source, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SpecPilotError(
            f"{member.source}: cannot read it for bundle member {member.name} ({exc.strerror})"
        ) from None
    with os.fdopen(fd, "rb") as fh:
        info = tarfile.TarInfo(member.name)
        info.size = os.fstat(fd).st_size
        info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "", ""
        info.mode = 0o755 if member.executable else 0o644
        reader = _HashingReader(fh)
        tar.addfile(info, reader)
    if reader.read_bytes != info.size:
        raise IntegrityError(f"{member.source}: changed size while it was packed as {member.name}")
    if member.blake3 and "blake3:" + reader.blake3.hexdigest() != member.blake3:
        raise IntegrityError(
            f"{member.source}: its bytes differ from the digest recorded for {member.name} "
            f"({member.blake3[:19]}…); refusing to bundle it"
        )
    if member.sha256 and reader.sha256.hexdigest() != member.sha256:
        raise IntegrityError(
            f"{member.source}: sha256 differs from the pin of {member.name} "
            f"({member.sha256[:16]}…); refusing to bundle it"
        )
    return info.size


class _HashingReader:
    """A file object for tarfile that hashes what it hands over."""

    def __init__(self, fh):
        self.fh, self.read_bytes = fh, 0
        self.blake3, self.sha256 = blake3.blake3(), hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.read_bytes += len(data)
        self.blake3.update(data)
        self.sha256.update(data)
        return data


def split_archive(archive: Path, folder: Path, part_bytes: int, meta: dict) -> dict:
    """Cut `archive` into parts of at most `part_bytes` in `folder`, beside index.json (archive id, sizes,
    every part's sha256 and blake3, `meta`) and the installer; returns the index."""
    folder.mkdir(parents=True)
    whole_b3, whole_sha = blake3.blake3(), hashlib.sha256()
    parts: list[dict[str, Any]] = []
    size = archive.stat().st_size
    with open(archive, "rb") as src:
        for number in range(max(1, -(-size // part_bytes))):
            name = f"part-{number:03d}"
            part_b3, part_sha, written = blake3.blake3(), hashlib.sha256(), 0
            with open(folder / name, "wb") as dst:
                while written < part_bytes and (chunk := src.read(min(CHUNK, part_bytes - written))):
                    for hasher in (part_b3, part_sha, whole_b3, whole_sha):
                        hasher.update(chunk)
                    dst.write(chunk)
                    written += len(chunk)
            parts.append({"name": name, "size": written, "sha256": part_sha.hexdigest(), "blake3": part_b3.hexdigest()})
    if sum(p["size"] for p in parts) != size:
        raise IntegrityError(f"{archive}: changed size while it was split")
    index = {
        "format": FORMAT,
        **meta,
        "archive": {
            "id": "blake3:" + whole_b3.hexdigest(),
            "sha256": whole_sha.hexdigest(),
            "size": size,
            "compression": "xz",
            "part_bytes": part_bytes,
        },
        "parts": parts,
        "installer": INSTALLER.name,
    }
    (folder / INDEX_NAME).write_bytes(json.dumps(index, indent=1, sort_keys=True).encode() + b"\n")
    shutil.copyfile(INSTALLER, folder / INSTALLER.name)
    os.chmod(folder / INSTALLER.name, 0o755)
    return index


def _place(folder: Path, final: Path) -> Path:
    """Rename the finished folder to `final`, replacing what was there (never trusted: it may be an old or
    damaged copy; the fresh one was just checked)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        if not (final / INDEX_NAME).is_file():
            raise SpecPilotError(f"{final}: exists and is not a bundle; remove it or choose another --out")
        old = folder.with_name("replaced")
        os.replace(final, old)
    os.replace(folder, final)
    return final


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
