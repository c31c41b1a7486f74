"""Assemble an engine tree from resolved inputs: the runtime base (wheel members or an in-repo directory), the
overlays, the kernels, the effective config and the launch spec. Pruning refines the SGLang base (prune.py)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath

from specpilot_build.assemble.base import copy_files, copy_source_dir, local_runtime_dir
from specpilot_build.assemble.corpus import write_external_corpus
from specpilot_build.assemble.inputs import BuildInputs
from specpilot_build.assemble.launch import flag_origins, launch_spec, sglang_flags
from specpilot_build.assemble.overlays import apply_overlays
from specpilot_build.assemble.prune import select_members
from specpilot_build.assemble.sglang_flags import check_launch_args, flag_table
from specpilot_build.assemble.w12_plan import PLAN_FILE, plan_for
from specpilot_build.errors import SpecPilotError
from specpilot_build.pins.lockfile import WheelPin
from specpilot_build.pins.wheels import wheel_file
from specpilot_build.store.engines import put_object
from specpilot_build.store.manifest import canonical_json, digest_bytes, entry_kind
from specpilot_build.store.names import plain_relpath


def assemble_tree(tree: Path, inputs: BuildInputs, store: Path) -> tuple[dict, dict]:
    """Write the engine's files into `tree` (wheel members as hardlinks of `store`'s objects, each re-checked
    against the bytes read from the sha256-pinned wheel); return the base record for the manifest and the
    entries of those members ({tree path: (entry, (device, inode))}, see store.engines.commit)."""
    cfg, pin = inputs.config, inputs.runtime
    checked: dict = {}
    if isinstance(pin, WheelPin):
        record = _unpack_wheel(wheel_file(pin), tree / "python", cfg, store, checked)
    else:
        copy_source_dir(local_runtime_dir(pin), tree / "runtime")
        record = {"kind": "directory", "dir": pin.dir}
    record["overlays"] = apply_overlays(tree, list(inputs.overlays), cfg)
    if inputs.corpus is not None:  # SGLang NGRAM's external corpus, decoded from the pinned corpus drafter
        drafter = inputs.checkpoints["drafter"]
        assert drafter is not None
        record["external_corpus"] = write_external_corpus(tree, cfg, drafter)
    if isinstance(pin, WheelPin):  # every launch flag and value against this SGLang's own parser
        flag_check = cfg["runtime"].get("flag_check")
        table, stand_ins = flag_table(tree / "python", pin.sha256, list(inputs.overlays), pin.version, flag_check)
        if flag_check is not None:  # the table was read in that environment: say so in the manifest
            record["flag_check"] = {"stand_ins_used": stand_ins}
        check_launch_args(sglang_flags(cfg), table, flag_origins(cfg, inputs.composed.config.get("final")), pin.version)
    for kernel in inputs.kernels:
        copy_files(list(kernel.files), tree / "kernels" / kernel.name)
        if kernel.name == "w12":
            plan = tree / "kernels" / "w12" / PLAN_FILE
            plan.write_bytes(canonical_json(plan_for(cfg, plan.parent)) + b"\n")
            os.chmod(plan, 0o644)
    (tree / "config.json").write_bytes(canonical_json(cfg) + b"\n")
    (tree / "launch.json").write_bytes(canonical_json(launch_spec(cfg)) + b"\n")
    for name in ("config.json", "launch.json"):
        os.chmod(tree / name, 0o644)
    return record, checked


def _unpack_wheel(wheel: Path, dest: Path, cfg: dict, store: Path, checked: dict | None = None) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        members = [info for info in zf.infolist() if not info.is_dir()]
        for info in members:
            _check_member(wheel, info)
        kept, prune_record = select_members(zf, members, cfg)
        made: set[str] = set()
        for info in kept:  # straight into the object store, then a hardlink into the tree
            data = zf.read(info)  # checked against the member's CRC by zipfile; the wheel against its sha256
            executable = bool((info.external_attr >> 16) & 0o111)
            digest = digest_bytes(data)
            obj = put_object(store, data, executable, digest)
            target = os.path.join(dest, info.filename)
            parent = os.path.dirname(target)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            os.link(obj, target)
            if checked is not None:
                st = os.lstat(target)
                rel = f"{dest.name}/{info.filename}"
                checked[rel] = (
                    {"path": rel, "size": len(data), "exec": executable, "blake3": digest},
                    (st.st_dev, st.st_ino),
                )
    return {"kind": "wheel", "wheel": wheel.name, **prune_record}


def _check_member(wheel: Path, info: zipfile.ZipInfo) -> None:
    path = PurePosixPath(info.filename)
    mode = info.external_attr >> 16
    if path.is_absolute() or ".." in path.parts or "\\" in info.filename or (mode & 0o170000) == 0o120000:
        raise SpecPilotError(f"{wheel}: member {info.filename!r} escapes the engine tree; refusing the wheel")
    if mode & 0o170000 not in (0, 0o100000):
        raise SpecPilotError(
            f"{wheel}: member {info.filename!r} is a {entry_kind(mode)}, not a file; refusing the wheel"
        )
    try:
        plain_relpath(info.filename, f"{wheel.name}: member")
    except SpecPilotError as exc:
        raise SpecPilotError(f"{wheel}: {exc}; refusing the wheel") from None
