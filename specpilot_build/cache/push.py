"""Push an engine from the store to a cache: objects, then the manifest, then one signed entry per build key.

A push that dies half-way leaves objects (whole, named by their content) and perhaps a manifest, but no entry, so
no pull or substitution ever sees a partial engine; the next push sends only what is missing."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from specpilot_build.cache.objects import object_name, pack
from specpilot_build.cache.remote import IDS, KEYS, MANIFESTS, OBJECTS, BinaryCache
from specpilot_build.cache.signing import SigningKey, signed_entry
from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.store.engines import Engine, index_keys
from specpilot_build.store.manifest import MANIFEST_NAME, canonical_json, digest_bytes, read_regular

Progress = Callable[[str, int], None]  # (object digest, compressed bytes sent), after each object sent
BATCH = 64  # objects put at once (concurrently on s3 and hf)


@dataclass
class PushSummary:
    engine: str
    objects_sent: int = 0
    bytes_sent: int = 0  # compressed bytes put into the cache
    objects_skipped: int = 0  # already in the cache
    bytes_skipped: int = 0  # their content's size
    keys: list[str] = field(default_factory=list)

    def line(self, cache: BinaryCache) -> str:
        return (
            f"pushed {self.engine} to {cache}: {self.objects_sent} objects sent ({self.bytes_sent} bytes), "
            f"{self.objects_skipped} already there ({self.bytes_skipped} bytes skipped); "
            f"{len(self.keys)} signed entr{'y' if len(self.keys) == 1 else 'ies'}"
        )


def push_engine(
    engine: Engine,
    cache: BinaryCache,
    key: SigningKey,
    root: Path,
    progress: Progress | None = None,
    batch: int = BATCH,
) -> PushSummary:
    """Push `engine`, signing an entry for every build key the store's index maps to it. Each file is re-hashed
    before it is sent: a damaged store is never copied into a cache."""
    raw = read_regular(engine.path / MANIFEST_NAME)[0]
    if blake3.blake3(raw).hexdigest() != engine.id:
        raise IntegrityError(
            f"engine {engine.id[:12]}: {MANIFEST_NAME} does not hash to its id; refused (`specpilot engine check`)"
        )
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or canonical_json(manifest) != raw:
        raise IntegrityError(f"engine {engine.id[:12]}: {MANIFEST_NAME} is not canonical; refused")
    keys = index_keys(root, engine.id)
    if not keys:
        raise SpecPilotError(
            f"engine {engine.id[:12]}: no build key in {root}/.index names it (it was neither built nor pulled "
            f"into this store); build it here with `make engine` first"
        )
    summary = PushSummary(engine.id)
    unique: dict[str, dict[str, Any]] = {}
    for entry in manifest["files"]:
        unique.setdefault(entry["blake3"], entry)
    present = set(cache.names(OBJECTS))  # one listing; an object another push adds meanwhile is sent twice
    todo: dict[str, dict[str, Any]] = {}
    for digest, entry in unique.items():
        if digest.split(":", 1)[1] in present:
            summary.objects_skipped += 1
            summary.bytes_skipped += entry["size"]
        else:
            todo[digest] = entry
    digests = list(todo)
    for start in range(0, len(digests), batch):
        packed: dict[str, bytes] = {}
        for digest in digests[start : start + batch]:
            entry = todo[digest]
            data = read_regular(engine.path / entry["path"])[0]
            if digest_bytes(data) != digest or len(data) != entry["size"]:
                raise IntegrityError(
                    f"engine {engine.id[:12]}: {entry['path']} differs from its manifest; refused before sending "
                    f"it (`specpilot engine check {engine.id[:12]}`)"
                )
            packed[object_name(digest)] = pack(data)
        cache.write_many(packed)
        for rel, blob in packed.items():
            summary.objects_sent += 1
            summary.bytes_sent += len(blob)
            if progress is not None:
                progress("blake3:" + rel.rsplit("/", 1)[1], len(blob))
    manifest_rel = f"{MANIFESTS}/{engine.id}.json"
    if cache.read(manifest_rel) != raw:
        cache.write(manifest_rel, raw)
    for build_key in keys:
        entry = signed_entry(key, build_key, engine.id, manifest["setting"], manifest["arm"])
        cache.write(f"{KEYS}/{build_key}.json", canonical_json(entry))
        cache.write(f"{IDS}/{engine.id}/{build_key}", b"")
        summary.keys.append(build_key)
    return summary
