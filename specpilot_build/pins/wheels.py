"""Pinned wheels in <data>/wheels: the SGLang runtime base and an engine environment's locked wheels, fetched
once (from $SPECPILOT_MIRROR/wheels or with pip), checked against their sha256 before anything reads them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from specpilot_build.errors import PinError, SpecPilotError
from specpilot_build.locations import data_dir, mirror_dir
from specpilot_build.pins.lockfile import WheelPin
from specpilot_build.store.manifest import entry_kind, read_regular
from specpilot_build.store.names import plain_name


def wheel_file(pin: WheelPin) -> Path:
    """The pinned wheel in <data>/wheels, fetched with pip (or taken from the mirror) and sha256-verified."""
    return cached_wheel(
        pin.filename,
        f"runtime '{pin.name}': wheel filename (lockfiles/runtimes.toml)",
        check=lambda path, hint: _check_sha256(path, pin, hint),
        download=lambda into: _pip_download(pin, into),
        fresh_hint="the download is not what lockfiles/runtimes.toml pins; nothing was kept",
    )


def cached_wheel(
    filename: str, what: str, *, check: Callable[[Path, str], None], download: Callable[[Path], Path], fresh_hint: str
) -> Path:
    """<data>/wheels/<filename>: `check`ed where it already is; else taken from $SPECPILOT_MIRROR/wheels or
    `download(into a temp folder)`, `check`ed, then renamed into place (a failed check keeps nothing). Shared by
    the runtime's wheel and an engine environment's locked wheels."""
    cache = data_dir() / "wheels"
    target = cache / plain_name(filename, what, error=PinError)
    kind = _kind(target)
    if kind is not None and kind != "file":
        raise PinError(f"{target}: a {kind}, not a wheel file; refused (remove it to fetch the wheel again)")
    if kind == "file":
        check(target, f"remove {target} to fetch it again")
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        fetched = _from_mirror(filename, Path(tmp)) or download(Path(tmp))
        check(fetched, fresh_hint)
        os.replace(fetched, target)
    return target


def _kind(path: Path) -> str | None:
    try:
        return entry_kind(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def _from_mirror(filename: str, into: Path) -> Path | None:
    mirror = mirror_dir()
    candidate = mirror / "wheels" / filename if mirror else None
    if candidate is None or _kind(candidate) is None:
        return None
    (into / filename).write_bytes(read_regular(candidate, "the mirror")[0])
    return into / filename


def _pip_download(pin: WheelPin, into: Path) -> Path:
    python_tag = pin.filename.split("-")[2]  # cp311
    platform = pin.filename.rsplit("-", 1)[1].removesuffix(".whl")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--python-version",
        python_tag.removeprefix("cp"),
        "--implementation",
        "cp",
        "--platform",
        platform,
        "-d",
        str(into),
        f"{pin.distribution}=={pin.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    got = into / pin.filename
    if proc.returncode != 0 or not got.exists():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecPilotError(
            f"could not fetch {pin.filename} with pip ({last}); "
            f"put it in {data_dir() / 'wheels'} or $SPECPILOT_MIRROR/wheels"
        )
    return got


def wheel_sha256(path: Path) -> tuple[str, int]:
    """(sha256 hex, size) of a fetched or cached wheel, read without following a link (OSError if `path` is one)."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _check_sha256(path: Path, pin: WheelPin, hint: str) -> None:
    sha256, _ = wheel_sha256(path)
    if sha256 != pin.sha256:
        raise SpecPilotError(
            f"wheel {path.name}: sha256 {sha256[:16]}… does not match the pin "
            f"{pin.sha256[:16]}… in lockfiles/runtimes.toml; {hint}"
        )
