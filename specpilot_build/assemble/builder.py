"""The builder: compose → resolve pins → assemble a tree → hash → manifest → engines/<id>/.

A build whose inputs (effective config, pins, base, overlays, kernels, builder source) were built before is a
no-op found through engines/.index/, without reading the runtime base. The index is a cache, never an
authority: an entry is used only when it names an engine whose manifest records exactly the head being built."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from specpilot_build import __version__
from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.tree import assemble_tree
from specpilot_build.cache.pull import PullResult, pull_key
from specpilot_build.cache.remote import BinaryCache
from specpilot_build.cache.settings import cache_settings
from specpilot_build.config.compose import Composed, compose_setting
from specpilot_build.errors import SpecPilotError
from specpilot_build.pins.lockfile import Lock, load_lock
from specpilot_build.store.engines import (
    INDEX,
    Engine,
    commit,
    index_put,
    is_engine_id,
    manifest_head,
    new_build_dir,
    remove_tree,
    store_lock,
    store_root,
)
from specpilot_build.store.manifest import (
    MANIFEST_NAME,
    SCHEMA,
    canonical_json,
    digest_bytes,
    read_regular,
)


@dataclass(frozen=True)
class BuildResult:
    engine: Engine
    created: bool
    seconds: float
    pulled_from: str | None = None  # the substituter it came from, when it was not built here
    notes: tuple[str, ...] = ()  # what each substituter answered (a miss, a refusal, an unreachable cache)

    @property
    def files(self) -> int:
        return len(self.engine.manifest["files"])

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.engine.manifest["files"])


def build_engine(
    setting: str, arm: str = "final", overrides: Sequence[str] = (), lock: Lock | None = None
) -> BuildResult:
    return build_composed(compose_setting(setting, arm, list(overrides)), lock=lock)


def build_head(composed: Composed, lock: Lock | None = None):
    """(resolved inputs, the manifest head: everything but the files and the base record)."""
    inputs = resolve_inputs(composed, lock or load_lock())
    head = {
        "schema": SCHEMA,
        "builder": {"name": "specpilot", "version": __version__},
        "setting": composed.setting,
        "arm": composed.arm,
        "choices": composed.choices,
        "config": inputs.config,
        "inputs": inputs.record(),
    }
    return inputs, head


def build_key(head: dict) -> str:
    """What a build is known by before it runs: its manifest head (effective config, choices and input digests:
    runtime base, overlays, kernels, checkpoint pins) and the builder's own source. The store's index and every
    cache map it to the engine id it builds."""
    return digest_bytes(canonical_json({"head": head, "builder_source": _builder_source_digest()})).split(":")[1]


def build_composed(composed: Composed, lock: Lock | None = None) -> BuildResult:
    started = time.perf_counter()
    inputs, head = build_head(composed, lock)
    root = store_root()
    key = build_key(head)
    known = _index_lookup(root, key, head)
    if known:
        return BuildResult(known, created=False, seconds=time.perf_counter() - started)
    pulled, notes = _substitute(composed, key, head, root)
    if pulled is not None:
        return BuildResult(
            pulled[0].engine, pulled[0].created, time.perf_counter() - started, pulled_from=pulled[1], notes=notes
        )
    with store_lock(root):
        tree = new_build_dir(root)
        try:
            base_record, checked = assemble_tree(tree, inputs, root)
            head = dict(head, base=base_record)
            engine, created = commit(tree, head, root, known=checked)
        except BaseException:
            remove_tree(tree)
            raise
        index_put(root, key, engine.id)
    return BuildResult(engine, created=created, seconds=time.perf_counter() - started, notes=notes)


def _substitute(
    composed: Composed, key: str, head: dict, root: Path
) -> tuple[tuple[PullResult, str] | None, tuple[str, ...]]:
    """Ask each configured substituter for `key` in order; the first verified hit is pulled into the store. A
    miss, an unreachable cache or a refused entry is a note, and the next substituter (or the build) follows."""
    settings = cache_settings(composed.config)
    notes: list[str] = []
    for url in settings.substituters:
        try:
            pulled = pull_key(BinaryCache(url), key, head, settings.trusted, root)
        except SpecPilotError as exc:
            notes.append(f"substituter {url}: {exc}")
            continue
        if pulled is not None:
            return (pulled, url), tuple(notes)
        notes.append(f"substituter {url}: miss (no entry for build key {key[:12]})")
    return None, tuple(notes)


# The stages whose code shapes an engine tree; serving, measuring, bundling, caching and the command line do not,
# so editing them moves no build key.
BUILDING_STAGES = ("assemble", "config", "pins", "models", "hosts", "store")


def _builder_source_digest() -> str:
    package = Path(__file__).resolve().parent.parent
    sources = [p for p in package.glob("*.py")] + [p for s in BUILDING_STAGES for p in (package / s).rglob("*.py")]
    parts = [(p.relative_to(package).as_posix(), p.read_bytes()) for p in sorted(sources)]
    return digest_bytes(b"".join(name.encode() + b"\0" + data for name, data in parts))


def _index_lookup(root: Path, key: str, head: dict) -> Engine | None:
    """The engine an index entry names, if the entry is a plain engine id whose directory is whole and whose
    manifest records exactly `head`; anything else is ignored (the build runs and rewrites the entry). Reads
    one manifest, hashes no object."""
    try:
        eid = read_regular(root / INDEX / key)[0].decode("ascii").strip()
        if not is_engine_id(eid):
            return None
        path = root / eid
        raw = read_regular(path / MANIFEST_NAME)[0] if os.path.isdir(path) and not os.path.islink(path) else b""
        if blake3.blake3(raw).hexdigest() != eid:
            return None
        manifest = json.loads(raw)
        recorded = manifest_head(manifest)
    except (SpecPilotError, OSError, ValueError, AttributeError):
        return None
    if canonical_json(recorded) != canonical_json(head):
        return None
    engine = Engine(eid, path)
    engine.__dict__["manifest"] = manifest  # parsed once
    return engine


def describe(result: BuildResult) -> str:
    what = "built" if result.created else "exists"
    if result.pulled_from:
        what = f"pulled from {result.pulled_from}" if result.created else f"exists; entry in {result.pulled_from}"
    return f"{result.engine.id}  {result.engine.path}  ({what}, {result.seconds:.2f} s)"
