"""The builder: compose → resolve pins → assemble a tree → hash → manifest → engines/<id>/.

A build whose inputs (effective config, pins, base, overlays, kernels, builder source) were built before is a
no-op found through engines/.index/, without reading the runtime base."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .assemble import assemble_tree, base_inputs
from .compose import Composed, compose_setting
from .effective import effective_config
from .errors import SpecPilotError
from .lockfile import CheckpointPin, Lock, load_lock
from .manifest import SCHEMA, canonical_json, digest_bytes
from .store import INDEX, Engine, commit, new_build_dir, store_root


@dataclass(frozen=True)
class BuildResult:
    engine: Engine
    created: bool
    seconds: float

    @property
    def files(self) -> int:
        return len(self.engine.manifest["files"])

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.engine.manifest["files"])


def build_engine(setting: str, arm: str = "final", overrides: list[str] = (), lock: Lock | None = None
                 ) -> BuildResult:
    return build_composed(compose_setting(setting, arm, list(overrides)), lock=lock)


def build_composed(composed: Composed, lock: Lock | None = None) -> BuildResult:
    started = time.perf_counter()
    cfg = effective_config(composed.config)
    lock = lock or load_lock()
    checkpoints = resolve_checkpoints(composed.setting, cfg, lock)
    inputs = {"checkpoints": {k: (p.as_record() if p else None) for k, p in checkpoints.items()},
              **base_inputs(cfg, lock)}
    head = {"schema": SCHEMA, "builder": {"name": "specpilot", "version": __version__},
            "setting": composed.setting, "arm": composed.arm, "choices": composed.choices,
            "config": cfg, "inputs": inputs}
    root = store_root()
    key = digest_bytes(canonical_json({"head": head, "builder_source": _builder_source_digest()})).split(":")[1]
    known = _index_lookup(root, key)
    if known:
        return BuildResult(known, created=False, seconds=time.perf_counter() - started)
    tree = new_build_dir(root)
    try:
        base_record = assemble_tree(tree, cfg, lock, root)
        head = dict(head, base=base_record)
        engine, created = commit(tree, head, root)
    except BaseException:
        shutil.rmtree(tree, ignore_errors=True)
        raise
    _index_store(root, key, engine.id)
    return BuildResult(engine, created=created, seconds=time.perf_counter() - started)


def resolve_checkpoints(setting: str, cfg: dict, lock: Lock) -> dict[str, CheckpointPin | None]:
    """The model's pin and, when the arm runs a drafter checkpoint, the drafter's. Unpinned → one-line error."""
    wanted = {"model": cfg["model"]["repo"], "drafter": cfg["drafter"].get("repo")}
    pins: dict[str, CheckpointPin | None] = {}
    for role, repo in wanted.items():
        if repo is None:
            pins[role] = None
            continue
        if repo not in lock.checkpoints:
            raise SpecPilotError(
                f"checkpoint {repo} ({role} of {setting}) is not pinned in {lock.directory / 'checkpoints.toml'}; "
                f"run `make lock SETTING={setting}` where the Hugging Face hub is reachable")
        pins[role] = lock.checkpoints[repo]
    return pins


def _builder_source_digest() -> str:
    package = Path(__file__).parent
    parts = [(p.name, p.read_bytes()) for p in sorted(package.glob("*.py"))]
    return digest_bytes(b"".join(name.encode() + b"\0" + data for name, data in parts))


def _index_lookup(root: Path, key: str) -> Engine | None:
    try:
        eid = (root / INDEX / key).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / eid
    return Engine(eid, path) if (path / "manifest.json").is_file() else None


def _index_store(root: Path, key: str, eid: str) -> None:
    index = root / INDEX
    index.mkdir(parents=True, exist_ok=True)
    tmp = index / f".{key}.{os.getpid()}"
    tmp.write_text(eid + "\n")
    os.replace(tmp, index / key)


def describe(result: BuildResult) -> str:
    what = "built" if result.created else "exists"
    return f"{result.engine.id}  {result.engine.path}  ({what}, {result.seconds:.2f} s)"

