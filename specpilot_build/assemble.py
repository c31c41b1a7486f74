"""Assemble an engine tree: the runtime base (wheel members or an in-repo directory), kernels, the effective
config and the launch spec. Overlays and pruning refine the SGLang base (overlay.py, prune.py)."""
from __future__ import annotations

import fnmatch
import os
import zipfile
from pathlib import Path, PurePosixPath

from .effective import overlays_of
from .errors import SpecPilotError
from .launch import launch_spec
from .locations import REPO_ROOT
from .lockfile import LocalRuntimePin, Lock, WheelPin
from .manifest import canonical_json
from .runtime_base import (copy_files, copy_source_dir, files_digest, local_runtime_dir, source_dir_digest,
                           source_files, wheel_file)
from .store import put_object

KERNELS_DIR = REPO_ROOT / "kernels"
SHIP_LIST = "engine_files.txt"


def runtime_pin(cfg: dict, lock: Lock) -> WheelPin | LocalRuntimePin:
    name = cfg["runtime"]["name"]
    if name not in lock.runtimes:
        raise SpecPilotError(f"runtime '{name}' is not pinned in {lock.directory / 'runtimes.toml'}")
    return lock.runtimes[name]


def kernels_of(cfg: dict) -> list[str]:
    """Kernels the engine ships: those its mechanisms name, and W12 when the model runs quantized with it."""
    names = list(cfg.get("kernels", []))
    if cfg["model"].get("quantization") == "w12" and "w12" not in names:
        names.append("w12")
    return names


def kernel_files(name: str) -> list[tuple[str, Path]]:
    """The files of kernels/<name>/ that an engine ships: those its engine_files.txt names (glob patterns, one
    per line, `#` comments), or all of them when it has no such list. Benchmarks and their results stay out,
    so an engine's id does not move when only they change."""
    src = KERNELS_DIR / name
    if not src.is_dir():
        raise SpecPilotError(f"kernel '{name}': kernels/{name}/ does not exist")
    files = source_files(src)
    listing = src / SHIP_LIST
    if not listing.is_file():
        return files
    patterns = [line.split("#", 1)[0].strip() for line in listing.read_text().splitlines()]
    chosen = set()
    for pattern in filter(None, patterns):
        matched = {rel for rel, _ in files if fnmatch.fnmatchcase(rel, pattern)}
        if not matched:
            raise SpecPilotError(f"kernels/{name}/{SHIP_LIST}: '{pattern}' matches no file in kernels/{name}/")
        chosen |= matched
    return [(rel, path) for rel, path in files if rel in chosen]


def base_inputs(cfg: dict, lock: Lock) -> dict:
    """Everything the assembly reads besides the config, each with its digest (cheap: no wheel is read)."""
    pin = runtime_pin(cfg, lock)
    if isinstance(pin, WheelPin):
        runtime = {"name": pin.name, "kind": "wheel", "version": pin.version, "filename": pin.filename,
                   "sha256": pin.sha256}
    else:
        runtime = {"name": pin.name, "kind": "directory", "dir": pin.dir,
                   "digest": source_dir_digest(local_runtime_dir(pin))}
    from .overlay import overlay_inputs
    return {"runtime": runtime,
            "overlays": overlay_inputs(overlays_of(cfg), cfg),
            "kernels": [{"name": k, "digest": files_digest(kernel_files(k))} for k in kernels_of(cfg)]}


def assemble_tree(tree: Path, cfg: dict, lock: Lock, store: Path) -> dict:
    """Write the engine's files into `tree` (wheel members as hardlinks of `store`'s objects); return the base
    record for the manifest."""
    pin = runtime_pin(cfg, lock)
    if isinstance(pin, WheelPin):
        record = _unpack_wheel(wheel_file(pin), tree / "python", cfg, store)
    else:
        copy_source_dir(local_runtime_dir(pin), tree / "runtime")
        record = {"kind": "directory", "dir": pin.dir}
    from .overlay import apply_overlays
    record["overlays"] = apply_overlays(tree, overlays_of(cfg), cfg)
    for kernel in kernels_of(cfg):
        copy_files(kernel_files(kernel), tree / "kernels" / kernel)
    (tree / "config.json").write_bytes(canonical_json(cfg) + b"\n")
    (tree / "launch.json").write_bytes(canonical_json(launch_spec(cfg)) + b"\n")
    for name in ("config.json", "launch.json"):
        os.chmod(tree / name, 0o644)
    return record


def _unpack_wheel(wheel: Path, dest: Path, cfg: dict, store: Path) -> dict:
    from .prune import select_members
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
