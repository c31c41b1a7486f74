"""`cache ls`, `cache check` and `cache gc`: what a cache holds, whether every byte of it is what it claims, and
removing what no entry reaches."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from specpilot_build.cache.objects import object_name, unpack
from specpilot_build.cache.packs import (
    MERGED,
    PACKS,
    POINTER,
    index_rel,
    load_indexes,
    pack_rel,
    parse_index,
)
from specpilot_build.cache.pull import fetch_manifest
from specpilot_build.cache.remote import IDS, KEYS, MANIFESTS, OBJECTS, BinaryCache
from specpilot_build.cache.signing import check_entry
from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import is_engine_id


@dataclass(frozen=True)
class Listed:
    build_key: str
    engine: str
    setting: str
    arm: str
    signer: str
    problem: str | None  # why the entry is not usable, or None


def list_entries(cache: BinaryCache, trusted: dict[str, Ed25519PublicKey]) -> list[Listed]:
    """Every entry under keys/, each checked against `trusted` (an untrusted or bad signature is its problem)."""
    listed = []
    for name in cache.names(KEYS):
        key = name.removesuffix(".json")
        raw = cache.read(f"{KEYS}/{name}")
        try:
            data = json.loads(raw or b"")
        except (ValueError, UnicodeDecodeError):
            data = None
        fields = data if isinstance(data, dict) else {}
        problem = None
        try:
            check_entry(data, trusted, cache.where(f"{KEYS}/{name}"))
        except SpecPilotError as exc:
            problem = str(exc)
        listed.append(
            Listed(
                key,
                str(fields.get("engine", "?")),
                str(fields.get("setting", "?")),
                str(fields.get("arm", "?")),
                str(fields.get("signer", "?")),
                problem,
            )
        )
    return listed


@dataclass
class CacheReport:
    entries: int = 0
    manifests: int = 0
    objects: int = 0  # distinct, loose or in a pack
    packs: int = 0
    problems: list[str] = field(default_factory=list)


def check_cache(cache: BinaryCache, trusted: dict[str, Ed25519PublicKey]) -> CacheReport:
    """Re-check everything: each entry's signature and the manifest it names; each manifest against its id and
    each object it lists (decompressed, size and blake3); every pack whole, each object in it; loose objects no
    manifest lists are counted, not hashed."""
    report = CacheReport()
    for item in list_entries(cache, trusted):
        report.entries += 1
        if item.problem:
            report.problems.append(item.problem)
        elif not cache.exists(f"{MANIFESTS}/{item.engine}.json"):
            report.problems.append(
                f"{cache.where(f'{KEYS}/{item.build_key}.json')}: names engine {item.engine[:12]}, "
                f"whose manifest is not in the cache"
            )
    per_pack = load_indexes(cache, merged=False)
    located = per_pack.located
    report.problems += per_pack.problems
    report.problems += _check_merged(cache, per_pack.packs)
    checked = _check_packs(cache, report)
    for name in cache.names(MANIFESTS):
        eid = name.removesuffix(".json")
        if not is_engine_id(eid) or not name.endswith(".json"):
            report.problems.append(f"{cache.where(f'{MANIFESTS}/{name}')}: not named <engine id>.json")
            continue
        report.manifests += 1
        try:
            manifest = fetch_manifest(cache, eid)
        except SpecPilotError as exc:
            report.problems.append(str(exc))
            continue
        for entry in manifest["files"]:
            name = entry["blake3"].split(":", 1)[1]
            place = located.get(name)
            if place is not None:  # its pack was read whole above; the manifest must agree on the size
                if place.size != entry["size"]:
                    report.problems.append(
                        f"{cache.where(pack_rel(place.pack))} (object {name[:12]}: {entry['path']} of engine "
                        f"{eid[:12]}): {place.size} bytes in the pack's index, {entry['size']} in the manifest"
                    )
                continue
            if entry["blake3"] in checked:
                continue
            checked.add(entry["blake3"])
            rel = object_name(entry["blake3"])
            where = f"{cache.where(rel)} ({entry['path']} of engine {eid[:12]})"
            blob = cache.read(rel)
            if blob is None:
                report.problems.append(f"{where}: missing")
                continue
            try:
                unpack(blob, entry["size"], entry["blake3"], where)
            except SpecPilotError as exc:
                report.problems.append(str(exc))
    report.objects = len(set(cache.names(OBJECTS)) | set(located))
    return report


def _check_merged(cache: BinaryCache, packs: dict[str, dict[str, Any]]) -> list[str]:
    """The merged index the pointer names must be trusted as a map and agree with each pack's own index."""
    merged = load_indexes(cache)
    problems = [p for p in merged.problems if p.startswith(cache.where(f"{MERGED}/"))]
    for digest in sorted(merged.merged):
        if merged.packs[digest] != packs.get(digest):
            problems.append(
                f"{cache.where(POINTER)}: its merged index places the objects of {pack_rel(digest)} otherwise than "
                f"{index_rel(digest)} does"
            )
    return problems


def _check_packs(cache: BinaryCache, report: CacheReport) -> set[str]:
    """Read every indexed pack whole: it must hash to its name and hold, where its index says, each object
    whole (its size, its blake3). Returns the digests checked (a damaged one is a problem, not checked)."""
    checked: set[str] = set()
    names = set(cache.names(PACKS))
    for digest in sorted(n.removesuffix(".idx") for n in names if n.endswith(".idx")):
        raw, data = cache.read(index_rel(digest)), cache.read(pack_rel(digest))
        if raw is None or data is None:
            continue  # an absent pack is one of read_indexes' problems
        try:
            placed = parse_index(raw, digest, cache.where(index_rel(digest)))
        except SpecPilotError:
            continue  # named by read_indexes
        report.packs += 1
        found = blake3.blake3(data).hexdigest()
        if found != digest:
            report.problems.append(
                f"{cache.where(pack_rel(digest))}: {len(data)} bytes hashing to {found[:12]}, not its name; "
                "checking its objects one by one"
            )
        for name, place in placed.items():
            where = f"{cache.where(pack_rel(digest))} (object {name[:12]} at bytes {place.offset}+{place.length})"
            try:
                unpack(data[place.offset : place.offset + place.length], place.size, "blake3:" + name, where)
            except SpecPilotError as exc:
                report.problems.append(str(exc))
                continue
            checked.add("blake3:" + name)
    return checked


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)  # cache-relative paths
    kept_young: int = 0  # unreferenced but newer than the grace period (perhaps a push in progress)


def gc_cache(cache: BinaryCache, grace_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Remove manifests no entry names, objects no remaining manifest lists, packs none of whose objects a
    remaining manifest lists (whole: no repacking), packs without an index, merged indexes the pointer does not
    name (it is never removed: a stale one costs only the per-pack reads of what it lacks), and id markers of
    absent entries.
    Only what is older than `grace_s` goes: a push in progress has sent objects and packs before its entry."""
    report = GcReport()
    now = time.time()
    entries: dict[str, str] = {}
    for name in cache.names(KEYS):
        try:
            data: Any = json.loads(cache.read(f"{KEYS}/{name}") or b"")
            entries[name.removesuffix(".json")] = str(data["engine"])
        except (ValueError, UnicodeDecodeError, TypeError, KeyError):
            continue
    named = set(entries.values())
    live_objects: set[str] = set()

    def drop(rel: str) -> bool:
        """Remove `rel` unless it is young; True if it was (or, on a dry run, would be) removed."""
        if cache.age(rel, now) < grace_s:
            report.kept_young += 1
            return False
        report.removed.append(rel)
        if not dry_run:
            cache.remove(rel)
        return True

    for name in cache.names(MANIFESTS):
        eid = name.removesuffix(".json")
        if eid not in named and drop(f"{MANIFESTS}/{name}"):
            continue
        try:  # a named manifest, or a young one without an entry (a push in progress): its objects stay
            manifest = fetch_manifest(cache, eid)
        except SpecPilotError:
            continue  # damaged: `cache check` names it; objects only it lists go with the next gc after its removal
        live_objects |= {e["blake3"].split(":", 1)[1] for e in manifest["files"]}
    for name in cache.names(OBJECTS):
        if name not in live_objects:
            drop(f"{OBJECTS}/{name}")
    # A pack goes whole, index first, once no object in it is live; a pack with a live object stays whole
    # (no repacking: its dead bytes are reclaimed when its last live object dies).
    packs = cache.names(PACKS)
    indexed = {n.removesuffix(".idx") for n in packs if n.endswith(".idx")}
    for name in packs:
        digest, _, kind = name.partition(".")
        if kind == "idx":
            raw = cache.read(index_rel(digest))
            try:
                placed = parse_index(raw or b"", digest, cache.where(index_rel(digest)))
            except SpecPilotError:
                continue  # damaged: `cache check` names it; gc removes only what it understands
            if not live_objects & set(placed) and drop(index_rel(digest)):
                drop(pack_rel(digest))
        elif kind == "pack" and digest not in indexed:
            drop(pack_rel(digest))  # a push cut off between its pack and the index
    try:
        pointed = json.loads(cache.read(POINTER) or b"{}").get("index")
    except (ValueError, UnicodeDecodeError, AttributeError):
        pointed = None  # a damaged pointer: pulls refuse it and read per-pack indexes; the next push replaces it
    for name in cache.names(MERGED):
        if name.endswith(".json.zst") and name.removesuffix(".json.zst") != pointed:
            drop(f"{MERGED}/{name}")
    for eid in cache.names(IDS):
        for key in cache.names(f"{IDS}/{eid}"):
            if entries.get(key) != eid:
                drop(f"{IDS}/{eid}/{key}")
    return report
