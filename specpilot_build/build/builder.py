"""The builder: compose → resolve pins → assemble a tree → hash → manifest → engines/<id>/.

A build whose inputs (effective config, pins, base, overlays, kernels, builder source) were built before is a
no-op found through engines/.index/, without reading the runtime base."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specpilot_build import __version__
from specpilot_build.build.assemble import assemble_tree
from specpilot_build.build.inputs import resolve_inputs
from specpilot_build.config.compose import Composed, compose_setting
from specpilot_build.hub.lockfile import Lock, load_lock
from specpilot_build.store.manifest import SCHEMA, canonical_json, digest_bytes
from specpilot_build.store.engines import INDEX, Engine, commit, new_build_dir, store_root


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
    inputs = resolve_inputs(composed, lock or load_lock())
    head = {"schema": SCHEMA, "builder": {"name": "specpilot", "version": __version__},
            "setting": composed.setting, "arm": composed.arm, "choices": composed.choices,
            "config": inputs.config, "inputs": inputs.record()}
    root = store_root()
    key = digest_bytes(canonical_json({"head": head, "builder_source": _builder_source_digest()})).split(":")[1]
    known = _index_lookup(root, key)
    if known:
        return BuildResult(known, created=False, seconds=time.perf_counter() - started)
    tree = new_build_dir(root)
    try:
        base_record = assemble_tree(tree, inputs, root)
        head = dict(head, base=base_record)
        engine, created = commit(tree, head, root)
    except BaseException:
        shutil.rmtree(tree, ignore_errors=True)
        raise
    _index_store(root, key, engine.id)
    return BuildResult(engine, created=created, seconds=time.perf_counter() - started)


def _builder_source_digest() -> str:
    package = Path(__file__).resolve().parent.parent
    parts = [(p.relative_to(package).as_posix(), p.read_bytes()) for p in sorted(package.rglob("*.py"))]
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

