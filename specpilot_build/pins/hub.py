"""The Hugging Face hub, through huggingface_hub's own client: resolve a ref to a commit, list a revision's
files with their sizes and sha256, and turn the hub's and the network's failures into one-line errors."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import hf_cache_dir
from specpilot_build.pins.lockfile import REVISION, PinnedFile


def hub_endpoint() -> str | None:
    """HF_ENDPOINT read now (huggingface_hub reads it once, at import); None: the library's default."""
    return os.environ.get("HF_ENDPOINT") or None


def hub_is_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now (huggingface_hub reads them once, at import)."""
    from huggingface_hub import constants

    truthy = {"1", "on", "yes", "true"}
    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().lower()
    return env in truthy or constants.HF_HUB_OFFLINE


class hub_errors:
    """Turn huggingface_hub's and the network's failures into one line naming the repo and file."""

    def __init__(self, repo: str, revision: str, what: str = ""):
        self.where = f"{repo}@{revision[:12] if len(revision) == 40 else revision}" + (f": {what}" if what else "")

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (SpecPilotError, KeyboardInterrupt)):
            return False
        from huggingface_hub import errors as hub

        if isinstance(exc, (hub.RepositoryNotFoundError, hub.GatedRepoError)):
            reason = "repository not found or not accessible (private or gated: set HF_TOKEN)"
        elif isinstance(exc, hub.RevisionNotFoundError):
            reason = "revision not found on the hub"
        elif isinstance(exc, (hub.OfflineModeIsEnabled, hub.LocalEntryNotFoundError)):
            reason = "not cached and the hub is offline or unreachable"
        elif isinstance(exc, hub.EntryNotFoundError):
            reason = "file not found at this revision"
        elif isinstance(exc, (hub.HfHubHTTPError, OSError)) or _is_network_error(exc):
            reason = f"cannot reach the Hugging Face hub ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        else:
            return False
        raise SpecPilotError(f"{self.where}: {reason}") from None


def _is_network_error(exc: BaseException) -> bool:
    """httpx / httpx2 / httpcore transport errors (huggingface_hub's HTTP stack varies by version)."""
    return any(
        cls.__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2") for cls in type(exc).__mro__
    )


def resolve_revision(repo: str, ref: str) -> str:
    """Branch, tag or commit → the 40-hex commit the hub serves for it now."""
    if hub_is_offline():
        raise SpecPilotError(
            f"{repo}@{ref}: cannot resolve a revision, the hub is offline (HF_HUB_OFFLINE=1); "
            "run `make lock` where huggingface.co is reachable"
        )
    from huggingface_hub import HfApi

    with hub_errors(repo, ref):
        sha = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=ref).sha
    if not sha or not REVISION.match(sha):
        raise SpecPilotError(f"{repo}@{ref}: the hub returned no commit for this revision")
    return sha


def hub_files(repo: str, revision: str, paths: Sequence[str] = ()) -> list[PinnedFile]:
    """Size and sha256 of `paths` (empty: all files) at `revision`, from the hub's file metadata."""
    if hub_is_offline():
        raise SpecPilotError(
            f"{repo}@{revision[:12]}: cannot list its files, the hub is offline (HF_HUB_OFFLINE=1); "
            "run `make lock` where huggingface.co is reachable"
        )
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

    with hub_errors(repo, revision, sibling.rfilename):
        path = Path(
            hf_hub_download(
                repo, sibling.rfilename, revision=revision, cache_dir=str(hf_cache_dir()), endpoint=hub_endpoint()
            )
        )
    data = path.read_bytes()
    blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if sibling.blob_id and blob_id != sibling.blob_id:
        raise SpecPilotError(
            f"{repo}@{revision[:12]}: downloaded {sibling.rfilename} has git blob id {blob_id}, "
            f"the hub lists {sibling.blob_id}"
        )
    return PinnedFile(path=sibling.rfilename, size=len(data), sha256=hashlib.sha256(data).hexdigest())
