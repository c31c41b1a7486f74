"""Push an engine from the store to a cache: objects, then the manifest, then one signed entry per build key.

Small objects travel in packs (cache/packs.py: each pack before its index), large ones loose. A push that dies
half-way leaves whole objects and packs (named by their content), perhaps a pack without its index (invisible)
and a manifest, but no entry, so no pull or substitution ever sees a partial engine; the next push sends only
what is missing. After its packs a push writes a new merged index and points to it when MERGE_AFTER packs are
outside the pointed one (cache/packs.py); a pack's upload reports its bytes as they go."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from specpilot_build.cache.objects import object_name, pack
from specpilot_build.cache.packs import (
    MERGE_AFTER,
    PACK_BYTES,
    POINTER,
    SMALL,
    PackWriter,
    index_rel,
    load_indexes,
    merged_index,
    merged_rel,
    pack_rel,
    pointer_to,
)
from specpilot_build.cache.progress import Meter, share
from specpilot_build.cache.remote import IDS, KEYS, MANIFESTS, OBJECTS, BinaryCache
from specpilot_build.cache.signing import SigningKey, signed_entry
from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.store.engines import Engine, index_keys
from specpilot_build.store.manifest import MANIFEST_NAME, canonical_json, digest_bytes, read_regular

BATCH = 64  # loose objects put at once (concurrently on s3 and hf)


@dataclass
class PushSummary:
    engine: str
    objects_sent: int = 0  # loose or in a pack
    packs_sent: int = 0
    bytes_sent: int = 0  # compressed bytes put into the cache (packs with their indexes, the merged index)
    merged_bytes: int = 0  # of which the merged index and its pointer
    objects_skipped: int = 0  # already in the cache
    bytes_skipped: int = 0  # their content's size
    keys: list[str] = field(default_factory=list)

    def line(self, cache: BinaryCache) -> str:
        return (
            f"pushed {self.engine} to {cache}: {self.objects_sent} objects sent ({self.packs_sent} packs, "
            f"{self.bytes_sent} bytes{f', {self.merged_bytes} of them the merged index' if self.merged_bytes else ''}), "
            f"{self.objects_skipped} already there ({self.bytes_skipped} bytes skipped); "
            f"{len(self.keys)} signed entr{'y' if len(self.keys) == 1 else 'ies'}"
        )


def push_engine(
    engine: Engine,
    cache: BinaryCache,
    key: SigningKey,
    root: Path,
    meter: Meter | None = None,
    batch: int = BATCH,
    small: int = SMALL,
    pack_bytes: int = PACK_BYTES,
    merge_after: int = MERGE_AFTER,
) -> PushSummary:
    """Push `engine`, signing an entry for every build key the store's index maps to it. Each file is re-hashed
        before it is sent: a damaged store is never copied into a cache. Objects whose zstd frame is shorter than
        `small` go into packs of about `pack_bytes` (small=0: every object loose, as caches were before packs); a new
    merged index is written once `merge_after` listed packs are outside the pointed one."""
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
    # one look; an object another push adds meanwhile is sent twice
    found = load_indexes(cache)
    present = set(cache.names(OBJECTS)) | set(found.located)
    todo: dict[str, dict[str, Any]] = {}
    for digest, entry in unique.items():
        if digest.split(":", 1)[1] in present:
            summary.objects_skipped += 1
            summary.bytes_skipped += entry["size"]
        else:
            todo[digest] = entry
    meter = meter or Meter()
    meter.start(f"push {engine.id[:12]}", sum(e["size"] for e in todo.values()))
    packs = PackWriter(pack_bytes)
    loose: dict[str, tuple[bytes, int]] = {}  # rel -> (frame, content size), put `batch` at a time
    sent_packs: dict[str, dict[str, Any]] = {}  # pack digest -> {"bytes", "objects"}, for the merged index

    def put_loose() -> None:
        cache.write_many({rel: frame for rel, (frame, _) in loose.items()})
        for rel, (frame, size) in loose.items():
            summary.objects_sent += 1
            summary.bytes_sent += len(frame)
            meter.advance("blake3:" + rel.rsplit("/", 1)[1], size)
        loose.clear()

    def put_pack(done: tuple[str, bytes, bytes] | None) -> None:
        if done is None:
            return
        digest, data, index = done
        objects = json.loads(index)["objects"]
        content = sum(size for _, _, size in objects.values())
        cache.write(pack_rel(digest), data, sent=share(meter, content, len(data)))  # whole, before its index
        cache.write(index_rel(digest), index)
        sent_packs[digest] = {"bytes": len(data), "objects": objects}
        summary.packs_sent += 1
        summary.bytes_sent += len(data) + len(index)
        for name, (_, _, size) in objects.items():
            summary.objects_sent += 1
            meter.advance("blake3:" + name, size)

    with meter:
        for digest, entry in todo.items():
            data = read_regular(engine.path / entry["path"])[0]
            if digest_bytes(data) != digest or len(data) != entry["size"]:
                raise IntegrityError(
                    f"engine {engine.id[:12]}: {entry['path']} differs from its manifest; refused before sending "
                    f"it (`specpilot engine check {engine.id[:12]}`)"
                )
            frame = pack(data)
            if len(frame) < small:
                put_pack(packs.add(digest.split(":", 1)[1], frame, len(data)))
            else:
                loose[object_name(digest)] = (frame, len(data))
                if len(loose) >= batch:
                    put_loose()
        put_loose()
        put_pack(packs.close())
    outside = (set(found.packs) - found.merged) | set(sent_packs)
    if outside and (len(outside) >= merge_after or found.merged_refused):
        digest, merged = merged_index({**found.packs, **sent_packs})
        pointer = pointer_to(digest)
        cache.write(merged_rel(digest), merged)  # whole, before the pointer that names it
        cache.write(POINTER, pointer)
        summary.merged_bytes = len(merged) + len(pointer)
        summary.bytes_sent += summary.merged_bytes
    manifest_rel = f"{MANIFESTS}/{engine.id}.json"
    if cache.read(manifest_rel) != raw:
        cache.write(manifest_rel, raw)
    for build_key in keys:
        entry = signed_entry(key, build_key, engine.id, manifest["setting"], manifest["arm"])
        cache.write(f"{KEYS}/{build_key}.json", canonical_json(entry))
        cache.write(f"{IDS}/{engine.id}/{build_key}", b"")
        summary.keys.append(build_key)
    return summary
