"""The reference runtime's base: an in-repo directory, checked and copied into a new engine tree (an SGLang
base is its pinned wheel: pins/wheels.py)."""

from __future__ import annotations

import os
from pathlib import Path

from specpilot_build.errors import PinError, SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import LocalRuntimePin
from specpilot_build.store.manifest import plain_directory, read_regular, source_files
from specpilot_build.store.names import plain_relpath


def local_runtime_dir(pin: LocalRuntimePin) -> Path:
    plain_relpath(pin.dir, f"runtime '{pin.name}': directory (lockfiles/runtimes.toml)", error=PinError)
    path = REPO_ROOT / pin.dir
    if not os.path.lexists(path):
        raise SpecPilotError(f"runtime '{pin.name}': directory {pin.dir} (lockfiles/runtimes.toml) does not exist")
    return plain_directory(path, f"runtime '{pin.name}'")


def copy_files(files: list[tuple[str, Path]], dest: Path) -> None:
    """Copy checked source files (regular files, read without following links) into a new tree."""
    for rel, path in files:
        target = dest / plain_relpath(rel, f"{path}: path")
        data, executable = read_regular(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, 0o755 if executable else 0o644)


def copy_source_dir(src: Path, dest: Path) -> None:
    copy_files(source_files(src), dest)
