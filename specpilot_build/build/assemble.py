"""Assemble an engine tree from resolved inputs: the runtime base (wheel members or an in-repo directory), the
overlays, the kernels, the effective config and the launch spec. Pruning refines the SGLang base (prune.py)."""
from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath

from specpilot_build.build.inputs import BuildInputs
from specpilot_build.build.launch import launch_spec
from specpilot_build.build.overlay import apply_overlays
from specpilot_build.build.prune import select_members
from specpilot_build.build.runtime_base import copy_files, copy_source_dir, local_runtime_dir, wheel_file
from specpilot_build.errors import SpecPilotError
from specpilot_build.hub.lockfile import WheelPin
from specpilot_build.store.engines import put_object
from specpilot_build.store.manifest import canonical_json


def assemble_tree(tree: Path, inputs: BuildInputs, store: Path) -> dict:
    """Write the engine's files into `tree` (wheel members as hardlinks of `store`'s objects); return the base
    record for the manifest."""
    cfg, pin = inputs.config, inputs.runtime
    if isinstance(pin, WheelPin):
        record = _unpack_wheel(wheel_file(pin), tree / "python", cfg, store)
    else:
        copy_source_dir(local_runtime_dir(pin), tree / "runtime")
        record = {"kind": "directory", "dir": pin.dir}
    record["overlays"] = apply_overlays(tree, list(inputs.overlays), cfg)
    for kernel in inputs.kernels:
        copy_files(list(kernel.files), tree / "kernels" / kernel.name)
    (tree / "config.json").write_bytes(canonical_json(cfg) + b"\n")
    (tree / "launch.json").write_bytes(canonical_json(launch_spec(cfg)) + b"\n")
    for name in ("config.json", "launch.json"):
        os.chmod(tree / name, 0o644)
    return record


def _unpack_wheel(wheel: Path, dest: Path, cfg: dict, store: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        members = [info for info in zf.infolist() if not info.is_dir()]
        for info in members:
            _check_member(wheel, info)
        kept, prune_record = select_members(zf, members, cfg)
        made: set[str] = set()
        for info in kept:  # straight into the object store, then a hardlink into the tree
            obj = put_object(store, zf.read(info), bool((info.external_attr >> 16) & 0o111))
            target = os.path.join(dest, info.filename)
            parent = os.path.dirname(target)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            os.link(obj, target)
    return {"kind": "wheel", "wheel": wheel.name, **prune_record}


def _check_member(wheel: Path, info: zipfile.ZipInfo) -> None:
    path = PurePosixPath(info.filename)
    mode = info.external_attr >> 16
    if path.is_absolute() or ".." in path.parts or "\\" in info.filename or (mode & 0o170000) == 0o120000:
        raise SpecPilotError(f"{wheel.name}: member {info.filename!r} escapes the engine tree; refusing the wheel")
