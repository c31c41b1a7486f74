"""Where things live: the repository, the data directory, the offline mirror, the engine store."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# $SPECPILOT_OVERLAYS / $SPECPILOT_KERNELS (read once, at import) point a test at scratch copies.
OVERLAYS_DIR = Path(os.environ.get("SPECPILOT_OVERLAYS") or REPO_ROOT / "overlays").expanduser().absolute()
KERNELS_DIR = Path(os.environ.get("SPECPILOT_KERNELS") or REPO_ROOT / "kernels").expanduser().absolute()


def data_dir() -> Path:
    """Caches, run records and results: $SPECPILOT_DATA, default ~/specpilot_data."""
    return Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data").expanduser().resolve()


def mirror_dir() -> Path | None:
    """Offline mirror of pinned files: $SPECPILOT_MIRROR, default ../shared beside the checkout if it exists.

    SPECPILOT_MIRROR set to the empty string disables the mirror."""
    value = os.environ.get("SPECPILOT_MIRROR")
    if value is not None:
        return Path(value).expanduser().resolve() if value else None
    default = REPO_ROOT.parent / "shared"
    return default.resolve() if default.is_dir() else None


def engines_dir() -> Path:
    """The content-addressed engine store: $SPECPILOT_ENGINES, default <repo>/engines."""
    return Path(os.environ.get("SPECPILOT_ENGINES") or REPO_ROOT / "engines").expanduser().resolve()


def environment_dir() -> Path | None:
    """An installed bundle's environment ($SPECPILOT_ENV, set by the prefix's bin/specpilot): serve puts it on
    the engine's PYTHONPATH after the engine tree's own entries. Unset or empty: none."""
    value = os.environ.get("SPECPILOT_ENV")
    return Path(value).expanduser().resolve() if value else None


def lockfiles_dir() -> Path:
    """Pins: $SPECPILOT_LOCKFILES (e.g. a test lock), default <repo>/lockfiles."""
    return Path(os.environ.get("SPECPILOT_LOCKFILES") or REPO_ROOT / "lockfiles").expanduser().resolve()


def conf_dir() -> Path:
    """The Hydra config root: $SPECPILOT_CONF, default <repo>/conf."""
    return Path(os.environ.get("SPECPILOT_CONF") or REPO_ROOT / "conf").expanduser().resolve()


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: HF_HUB_CACHE, else $HF_HOME/hub, else <data>/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser().resolve()
    if os.environ.get("HF_HOME"):
        return (Path(os.environ["HF_HOME"]).expanduser() / "hub").resolve()
    return data_dir() / "huggingface" / "hub"
