"""Overlays: overlays/<name>/ descriptors, files copied on top, strict patches (placeholder until #3)."""
from __future__ import annotations

from pathlib import Path

from .errors import SpecPilotError


def overlay_inputs(names: list[str], cfg: dict) -> list[dict]:
    if names:
        raise SpecPilotError(f"overlays are not supported yet: {', '.join(names)}")
    return []


def apply_overlays(tree: Path, names: list[str], cfg: dict) -> list[dict]:
    return []
