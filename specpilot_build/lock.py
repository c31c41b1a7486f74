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
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from specpilot_build.checkpoints import (
    converted_files, hub_endpoint, hub_errors, hub_is_offline, llama2c_pair, materialize, sha256_of,
)
from specpilot_build.errors import SpecPilotError
from specpilot_build.lockfile import REVISION, CheckpointPin, PinnedFile, load_checkpoint_pins

HEADER = ("# Checkpoint pins: repo -> exact 40-hex revision; per-file size and sha256 once locked "
          "(`make lock SETTING=...`).\n"
          "# `converted`: the output of specpilot_build/llama2c.py for llama2.c checkpoints, hashed like any pinned file.\n")


def lock_repos(repos: Mapping[str, Sequence[str]], lockfile: Path, *, refs: Mapping[str, str] | None = None,
               source_formats: Mapping[str, str] | None = None, update: bool = False,
               mirror: Path | None = None) -> dict[str, CheckpointPin]:
    """Lock `repos` (repo → files to pin; empty: every file at the revision) into `lockfile`.

    A repo already pinned keeps its revision (confirmed, files added) unless `update`; otherwise
    `refs[repo]` (default "main") is resolved to a commit. llama2c repos (`source_formats`) also get
    their conversion's hashes. Other repos in the file are kept as they are. Returns the new pins."""
    refs, source_formats = refs or {}, source_formats or {}
    existing = load_checkpoint_pins(lockfile)
    locked = {}
    for repo in sorted(repos):
        old = existing.get(repo)
        revision = old.revision if old and not update else resolve_revision(repo, refs.get(repo, "main"))
        files = tuple(sorted(hub_files(repo, revision, list(repos[repo])), key=lambda f: f.path.encode()))
        if old and old.revision == revision:
            _confirm(repo, old.files, files)
        pin = CheckpointPin(repo=repo, revision=revision, files=files)
        if source_formats.get(repo, "hf") == "llama2c":
            pin = CheckpointPin(repo=repo, revision=revision, files=files,
                                converted=conversion_hashes(pin, mirror=mirror))
        locked[repo] = pin
    write_lockfile({**existing, **locked}, lockfile)
    return locked


def lock_main(argv: Sequence[str]) -> int:
    """`specpilot lock --setting NAME [--update]` (make lock): pin the setting's model and drafter repos."""
    import argparse

    from specpilot_build.checkpoints import checkpoint_requests
    from specpilot_build.compose import compose_setting
    from specpilot_build.locations import lockfiles_dir

    parser = argparse.ArgumentParser(prog="specpilot lock", description=lock_main.__doc__)
    parser.add_argument("--setting", required=True)
    parser.add_argument("--update", action="store_true", help="re-resolve `main` even for repos already pinned")
    args = parser.parse_args(list(argv))
    requests = checkpoint_requests(compose_setting(args.setting).config)
    lockfile = lockfiles_dir() / "checkpoints.toml"
    locked = lock_repos({r.repo: list(r.files) for r in requests}, lockfile, update=args.update,
                        source_formats={r.repo: r.source_format for r in requests})
    for repo, pin in locked.items():
        print(f"{repo}@{pin.revision}  {len(pin.files)} files" + (f", {len(pin.converted)} converted" if pin.converted else ""))
    print(f"wrote {lockfile}")
    return 0


def conversion_hashes(pin: CheckpointPin, *, mirror: Path | None = None) -> tuple[PinnedFile, ...]:
    """Fetch (verified) and convert a llama2c pin afresh, in a temp dir: what this converter writes now."""
    from specpilot_build.llama2c import convert

    snapshot = materialize(pin.repo, pin, source_format="hf", mirror=mirror)
    model_path, tokenizer_path = llama2c_pair(pin.repo, [f.path for f in pin.files])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        convert(snapshot / model_path, snapshot / tokenizer_path, out)
        return tuple(converted_files(out))


def resolve_revision(repo: str, ref: str) -> str:
    """Branch, tag or commit → the 40-hex commit the hub serves for it now."""
    if hub_is_offline():
        raise SpecPilotError(f"{repo}@{ref}: cannot resolve a revision, the hub is offline (HF_HUB_OFFLINE=1); "
                             "run `make lock` where huggingface.co is reachable")
    from huggingface_hub import HfApi

    with hub_errors(repo, ref):
        sha = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=ref).sha
    if not sha or not REVISION.match(sha):
        raise SpecPilotError(f"{repo}@{ref}: the hub returned no commit for this revision")
    return sha


def hub_files(repo: str, revision: str, paths: Sequence[str] = ()) -> list[PinnedFile]:
    """Size and sha256 of `paths` (empty: all files) at `revision`, from the hub's file metadata."""
    if hub_is_offline():
        raise SpecPilotError(f"{repo}@{revision[:12]}: cannot list its files, the hub is offline (HF_HUB_OFFLINE=1); "
                             "run `make lock` where huggingface.co is reachable")
    from huggingface_hub import HfApi

    with hub_errors(repo, revision):
        info = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=revision, files_metadata=True)
    if REVISION.match(revision) and info.sha and info.sha != revision:
        raise SpecPilotError(f"{repo}@{revision[:12]}: the hub answered for commit {info.sha} instead")
    siblings = {s.rfilename: s for s in info.siblings or ()}
    missing = [p for p in paths if p not in siblings]
    if missing:
        raise SpecPilotError(f"{repo}@{revision[:12]}: {missing[0]} is not a file at this revision")
    return [_pinned(repo, revision, siblings[path]) for path in (paths or sorted(siblings))]


def _pinned(repo: str, revision: str, sibling) -> PinnedFile:
    if sibling.lfs is not None:
        return PinnedFile(path=sibling.rfilename, size=int(sibling.lfs.size), sha256=sibling.lfs.sha256)
    # A plain git file: the hub gives its git blob id, not a sha256. Fetch it, prove it by the blob id.
    from huggingface_hub import hf_hub_download

    from specpilot_build.locations import hf_cache_dir

    with hub_errors(repo, revision, sibling.rfilename):
        path = Path(hf_hub_download(repo, sibling.rfilename, revision=revision, cache_dir=str(hf_cache_dir()),
                                        endpoint=hub_endpoint()))
    data = path.read_bytes()
    blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if sibling.blob_id and blob_id != sibling.blob_id:
        raise SpecPilotError(f"{repo}@{revision[:12]}: downloaded {sibling.rfilename} has git blob id {blob_id}, "
                             f"the hub lists {sibling.blob_id}")
    return PinnedFile(path=sibling.rfilename, size=len(data), sha256=sha256_of(path))


def _confirm(repo: str, old: Sequence[PinnedFile], new: Sequence[PinnedFile]) -> None:
    """Same revision, so the same bytes: a file whose hash changed means the lock or the hub is wrong."""
    now = {f.path: f for f in new}
    for f in old:
        if f.path in now and (now[f.path].size, now[f.path].sha256) != (f.size, f.sha256):
            raise SpecPilotError(f"{repo}: {f.path} is locked as sha256 {f.sha256[:16]}… but the hub reports "
                                 f"{now[f.path].sha256[:16]}… at the same revision; not rewriting the lock")


# --- the lockfile -----------------------------------------------------------------------------------

def write_lockfile(pins: Mapping[str, CheckpointPin], lockfile: Path) -> None:
    """Write `pins` sorted by repo, files sorted by path, atomically (temp file + rename)."""
    text = render_lockfile(pins)
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


def render_lockfile(pins: Mapping[str, CheckpointPin]) -> str:
    blocks = [HEADER]
    for repo in sorted(pins, key=str.encode):
        pin = pins[repo]
        lines = [f"[{_string(repo)}]", f"revision = {_string(pin.revision)}"]
        for key, files in (("files", pin.files), ("converted", pin.converted)):
            if files:
                lines.append(f"{key} = [")
                lines.extend(f"  {{ path = {_string(f.path)}, size = {int(f.size)}, sha256 = {_string(f.sha256)} }},"
                             for f in sorted(files, key=lambda f: f.path.encode()))
                lines.append("]")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _string(value: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML escapes)."""
    return json.dumps(value, ensure_ascii=False)
