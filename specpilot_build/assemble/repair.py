"""Repair sources: where the bytes of a damaged engine file may be found again, each candidate hashed before
use. The store mends engines (store/maintain.py) but holds only objects; the build knows the pinned base wheel,
the checkout's runtime, overlay and kernel files, the config and launch spec a manifest records, and how to
rebuild a setting's arm."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from specpilot_build.assemble import inputs as _inputs
from specpilot_build.assemble import overlays as _overlay
from specpilot_build.assemble.builder import build_head
from specpilot_build.assemble.launch import launch_spec
from specpilot_build.assemble.tree import assemble_tree
from specpilot_build.config.compose import compose_setting
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import WheelPin
from specpilot_build.pins.wheels import wheel_file
from specpilot_build.store import maintain
from specpilot_build.store.engines import (
    Engine,
    manifest_head,
    new_build_dir,
    remove_tree,
)
from specpilot_build.store.manifest import (
    canonical_json,
    digest_bytes,
    overlay_files_dir,
    read_regular,
    walk_files,
)
from specpilot_build.store.names import plain_name, plain_relpath


def repair_engine(engine: Engine, root: Path | None = None) -> maintain.RepairReport:
    return maintain.repair_engine(engine, root, EngineSources)


def fsck(root: Path | None = None, repair: bool = False) -> maintain.FsckReport:
    return maintain.fsck(root, repair, EngineSources)


class EngineSources:
    """Places that may hold the bytes of a manifest entry; every candidate is hashed before it is used."""

    def __init__(self, engine: Engine, manifest: dict, root: Path):
        self.engine, self.manifest, self.root = engine, manifest, root
        self.origin: dict[str, str] = {}
        self._why_not: dict[str, str] = {}
        self._zip: zipfile.ZipFile | None = None
        self._rebuilt: dict[str, bytes] | None = None

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def find(self, rel: str, entry: dict) -> bytes | None:
        for origin, reader in (
            ("the pinned base wheel", self._from_wheel),
            ("the checkout", self._from_checkout),
            ("the manifest's config", self._from_config),
            ("a rebuild of its setting", self._from_rebuild),
        ):
            try:
                data = reader(rel)
            except (OSError, SpecPilotError, KeyError, ValueError, zipfile.BadZipFile):
                data = None
            if data is not None and len(data) == entry["size"] and digest_bytes(data) == entry["blake3"]:
                self.origin[rel] = origin
                return data
        self._why_not[rel] = self._rebuild_note or (
            "no good object, and neither the pinned base, the checkout nor the recorded config holds these bytes"
        )
        return None

    _rebuild_note: str | None = None

    def why_not(self, rel: str) -> str:
        return self._why_not.get(rel, "could not be re-linked")

    def _from_wheel(self, rel: str) -> bytes | None:
        runtime = self.manifest["inputs"]["runtime"]
        if runtime.get("kind") != "wheel" or not rel.startswith("python/"):
            return None
        if self._zip is None:
            pin = WheelPin(
                name=runtime["name"], version=runtime["version"], filename=runtime["filename"], sha256=runtime["sha256"]
            )
            self._zip = zipfile.ZipFile(wheel_file(pin))  # sha256-checked against the manifest's pin
        return self._zip.read(rel[len("python/") :])

    def _from_checkout(self, rel: str) -> bytes | None:
        inputs = self.manifest["inputs"]
        plain_relpath(rel, "manifest path")
        candidates: list[tuple[Path, str]] = []  # (source directory, path inside it)
        runtime = inputs["runtime"]
        if runtime.get("kind") == "directory" and rel.startswith("runtime/"):
            plain_relpath(runtime["dir"], "runtime directory")
            candidates.append((REPO_ROOT / runtime["dir"], rel[len("runtime/") :]))
        if rel.startswith("kernels/"):
            name, _, inner = rel[len("kernels/") :].partition("/")
            candidates.append((_inputs.KERNELS_DIR / plain_name(name, "kernel name"), inner))
        for overlay in inputs.get("overlays", []):
            directory = _overlay.OVERLAYS_DIR / plain_name(overlay["name"], "overlay name")
            candidates.append((overlay_files_dir(directory), rel))
        for base, inner in candidates:
            if _plain_path(base, inner):
                return read_regular(base / inner)[0]
        return None

    def _from_config(self, rel: str) -> bytes | None:
        cfg = self.manifest["config"]
        if rel == "config.json":
            return canonical_json(cfg) + b"\n"
        if rel == "launch.json":
            return canonical_json(launch_spec(cfg)) + b"\n"
        return None

    def _from_rebuild(self, rel: str) -> bytes | None:
        if self._rebuilt is None:
            self._rebuilt = self._rebuild()
        return self._rebuilt.get(rel)

    def _rebuild(self) -> dict[str, bytes]:
        """Assemble the engine's setting and arm again in a scratch tree, if that build has this manifest's head."""
        m = self.manifest
        try:
            inputs, head = build_head(compose_setting(m["setting"], m["arm"]))
        except SpecPilotError as exc:
            self._rebuild_note = f"rebuilding {m['setting']} / {m['arm']} fails: {exc}"
            return {}
        if canonical_json(head) != canonical_json(manifest_head(m)):
            self._rebuild_note = (
                f"rebuilding {m['setting']} / {m['arm']} from this checkout gives another engine "
                f"(its config, pins, overlays or overrides differ)"
            )
            return {}
        tree = new_build_dir(self.root)
        try:
            assemble_tree(tree, inputs, self.root)
            return {rel: read_regular(tree / rel)[0] for rel in walk_files(tree)}
        finally:
            remove_tree(tree)


def _plain_path(base: Path, inner: str) -> bool:
    """base/inner exists and neither base nor any directory on the way is a link (the file itself is opened
    without following one)."""
    current = base
    for part in ["", *inner.split("/")[:-1]]:
        current = current / part if part else current
        if not os.path.isdir(current) or os.path.islink(current):
            return False
    return os.path.lexists(base / inner)
