"""Pull an engine from a cache into the store, trusting nothing that arrives.

The entry must be signed by a trusted key and name what was asked for; the manifest must hash to the engine id
(and be canonical, with a well-formed file list); every object must decompress to exactly the size and blake3 its
manifest entry records. Files are written into a temporary tree and committed like a build (store/engines.py:
commit), so an interrupted or refused pull leaves the store as it was."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from specpilot_build.cache.objects import object_name, unpack
from specpilot_build.cache.packs import Span, load_indexes, pack_rel, spans
from specpilot_build.cache.progress import Meter, share
from specpilot_build.cache.remote import IDS, KEYS, MANIFESTS, BinaryCache, CacheError
from specpilot_build.cache.signing import check_entry
from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.store.engines import (
    HEX,
    Engine,
    commit,
    damage_of,
    index_put,
    is_engine_id,
    manifest_head,
    new_build_dir,
    object_path,
    object_state,
    remove_tree,
    store_lock,
)
from specpilot_build.store.manifest import MANIFEST_NAME, FileEntry, canonical_json
from specpilot_build.store.names import plain_relpath

BATCH = 64  # loose objects or pack ranges asked for at once (concurrently on s3 and hf)
CHUNK_BYTES = 64 << 20  # ... and no more pack bytes than this at once


@dataclass
class PullResult:
    engine: Engine
    created: bool
    objects_fetched: int = 0
    bytes_fetched: int = 0  # compressed bytes received
    objects_local: int = 0  # content already in the store: linked, not fetched
    keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # indexes ignored (a refused merged index: per-pack ones read)

    def summary(self, cache: BinaryCache) -> str:
        if not self.created:
            return f"{self.engine.id}  {self.engine.path}  (already in the store)"
        return (
            f"{self.engine.id}  {self.engine.path}  (pulled from {cache}: {self.objects_fetched} objects, "
            f"{self.bytes_fetched} bytes fetched; {self.objects_local} already in the store)"
        )


def pull_engine(
    cache: BinaryCache,
    ref: str,
    trusted: dict[str, Ed25519PublicKey],
    root: Path,
    meter: Meter | None = None,
    batch: int = BATCH,
) -> PullResult:
    """Pull engine `ref` (its id or a unique prefix of an id the cache holds); at least one entry naming it must
    be signed by a trusted key."""
    eid = _resolve(cache, ref)
    problems: list[str] = []
    entries = []
    for key in cache.names(f"{IDS}/{eid}"):
        try:
            entry = _read_entry(cache, key, trusted)
        except FileNotFoundError:
            continue  # a marker whose entry was removed
        except IntegrityError as exc:
            problems.append(str(exc))
            continue
        if entry["engine"] == eid:
            entries.append(entry)
    if not entries:
        why = problems[0] if problems else f"no entry in {cache.where(KEYS)}/ names it"
        raise IntegrityError(f"engine {eid[:12]}: no entry signed by a trusted key in {cache}: {why}")
    result = fetch(cache, entries[0], root, meter=meter, batch=batch)
    for entry in entries:
        index_put(root, entry["build_key"], eid)
        result.keys.append(entry["build_key"])
    return result


def pull_key(
    cache: BinaryCache,
    build_key: str,
    head: dict[str, Any],
    trusted: dict[str, Ed25519PublicKey],
    root: Path,
    meter: Meter | None = None,
    batch: int = BATCH,
) -> PullResult | None:
    """The engine the cache's entry for `build_key` names, pulled and checked to record exactly `head` (what
    the build would make); None when the cache has no entry for the key."""
    try:
        entry = _read_entry(cache, build_key, trusted)
    except FileNotFoundError:
        return None
    if (entry["setting"], entry["arm"]) != (head["setting"], head["arm"]):
        raise IntegrityError(
            f"{cache.where(f'{KEYS}/{build_key}.json')}: build key {build_key[:12]} is for {head['setting']} "
            f"{head['arm']}, but the entry names engine {entry['engine'][:12]} of {entry['setting']} "
            f"{entry['arm']}; refused"
        )
    result = fetch(cache, entry, root, head=head, meter=meter, batch=batch)
    index_put(root, build_key, result.engine.id)
    result.keys.append(build_key)
    return result


def _read_entry(cache: BinaryCache, build_key: str, trusted: dict[str, Ed25519PublicKey]) -> dict[str, str]:
    rel = f"{KEYS}/{build_key}.json"
    raw = cache.read(rel)
    if raw is None:
        raise FileNotFoundError(cache.where(rel))
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{cache.where(rel)}: not JSON; refused") from None
    entry = check_entry(data, trusted, cache.where(rel))
    if entry["build_key"] != build_key:
        raise IntegrityError(
            f"{cache.where(rel)}: signed for build key {entry['build_key'][:12]}, not {build_key[:12]}; refused"
        )
    if not is_engine_id(entry["engine"]):
        raise IntegrityError(f"{cache.where(rel)}: engine {entry['engine'][:16]!r} is not an engine id; refused")
    return entry


def _resolve(cache: BinaryCache, ref: str) -> str:
    ref = (ref or "").strip().lower()
    if len(ref) < 4 or any(c not in HEX for c in ref):
        raise SpecPilotError(f"'{ref}' is not an engine id (give at least 4 hex digits; `specpilot cache ls`)")
    if len(ref) == 64:
        return ref
    found = [n.removesuffix(".json") for n in cache.names(MANIFESTS) if n.startswith(ref) and n.endswith(".json")]
    if not found:
        raise SpecPilotError(f"no engine {ref} in cache {cache}")
    if len(found) > 1:
        raise SpecPilotError(f"engine prefix {ref} is ambiguous in cache {cache}: {', '.join(f[:12] for f in found)}")
    return found[0]


def fetch_manifest(cache: BinaryCache, eid: str) -> dict[str, Any]:
    """The manifest of `eid` from the cache: bytes hashing to the id, canonical JSON, a well-formed file list."""
    rel = f"{MANIFESTS}/{eid}.json"
    where = cache.where(rel)
    raw = cache.read(rel)
    if raw is None:
        raise IntegrityError(f"engine {eid[:12]}: the cache has no {rel} (a push that never finished?); refused")
    digest = blake3.blake3(raw).hexdigest()
    if digest != eid:
        raise IntegrityError(f"{where}: hashes to {digest[:12]}, not the engine id {eid[:12]}; refused")
    manifest = json.loads(raw)  # bytes that hash to the id were written by a builder; still checked below
    if not isinstance(manifest, dict) or canonical_json(manifest) != raw:
        raise IntegrityError(f"{where}: not a canonical manifest; refused")
    check_files(manifest, where)
    return manifest


def check_files(manifest: dict[str, Any], where: str) -> None:
    files = manifest.get("files")
    if not isinstance(files, list):
        raise IntegrityError(f"{where}: no file list; refused")
    previous = b""
    for entry in files:
        ok = (
            isinstance(entry, dict)
            and set(entry) == {"path", "size", "exec", "blake3"}
            and isinstance(entry["size"], int)
            and entry["size"] >= 0
            and isinstance(entry["exec"], bool)
            and isinstance(entry["blake3"], str)
            and entry["blake3"].startswith("blake3:")
            and is_engine_id(entry["blake3"][7:])
        )
        if not ok:
            raise IntegrityError(f"{where}: malformed file entry {str(entry)[:80]}; refused")
        plain_relpath(entry["path"], f"{where}: file path", error=IntegrityError)
        key = entry["path"].encode("utf-8", "surrogateescape")
        if key <= previous or entry["path"] == MANIFEST_NAME:
            raise IntegrityError(f"{where}: file list not sorted, repeated or naming the manifest; refused")
        previous = key


def fetch(
    cache: BinaryCache,
    entry: dict[str, str],
    root: Path,
    head: dict[str, Any] | None = None,
    meter: Meter | None = None,
    batch: int = BATCH,
) -> PullResult:
    eid = entry["engine"]
    manifest = fetch_manifest(cache, eid)
    where = cache.where(f"{MANIFESTS}/{eid}.json")
    if (manifest.get("setting"), manifest.get("arm")) != (entry["setting"], entry["arm"]):
        raise IntegrityError(
            f"{where}: engine {eid[:12]} is {manifest.get('setting')} {manifest.get('arm')}, but its entry "
            f"(build key {entry['build_key'][:12]}) says {entry['setting']} {entry['arm']}; refused"
        )
    if head is not None and canonical_json(manifest_head(manifest)) != canonical_json(head):
        differs = sorted(k for k in set(head) | set(manifest_head(manifest)) if head.get(k) != manifest.get(k))
        raise IntegrityError(
            f"{where}: engine {eid[:12]} (build key {entry['build_key'][:12]}) was not built from these inputs "
            f"({', '.join(differs)} differ); refused"
        )
    final = root / eid
    if os.path.lexists(final) and damage_of(final) is None:
        return PullResult(Engine(eid, final), created=False)
    result = PullResult(Engine(eid, final), created=True)
    with store_lock(root):
        tree = new_build_dir(root)
        try:
            with meter or Meter() as reporting:
                known = _materialise(cache, manifest, tree, root, result, reporting, batch)
            engine, created = commit(tree, {k: v for k, v in manifest.items() if k != "files"}, root, known=known)
        except BaseException:
            remove_tree(tree)
            raise
    if engine.id != eid:  # the files were checked entry by entry, so this is a bug, never a cache's doing
        raise IntegrityError(f"engine {eid[:12]}: the pulled tree committed as {engine.id[:12]}")
    result.engine, result.created = engine, created
    return result


def _materialise(
    cache: BinaryCache,
    manifest: dict[str, Any],
    tree: Path,
    root: Path,
    result: PullResult,
    meter: Meter,
    batch: int,
) -> dict[str, tuple[FileEntry, tuple[int, int]]]:
    """Write every file of the manifest into `tree`: content the store already holds is linked from its
    object (checked), the rest fetched and checked on arrival: from packs in few large ranges (`batch` at once),
    loose objects `batch` at a time. Returns commit's `known` entries."""
    eid = blake3.blake3(canonical_json(manifest)).hexdigest()
    known: dict[str, tuple[FileEntry, tuple[int, int]]] = {}
    wanted: dict[str, list[FileEntry]] = {}  # digest -> the entries holding it, in manifest order
    made: set[Path] = set()
    for entry in manifest["files"]:
        path = tree / entry["path"]
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        obj = object_path(root, entry["blake3"], entry["exec"])
        if entry["blake3"] not in wanted and object_state(obj, entry["size"], entry["blake3"], entry["exec"]) == "ok":
            os.link(obj, path)
            result.objects_local += 1
            st = os.lstat(path)
            known[entry["path"]] = (entry, (st.st_dev, st.st_ino))
        else:
            wanted.setdefault(entry["blake3"], []).append(entry)
    located = {}
    if wanted:
        found = load_indexes(cache)
        located = found.located
        result.notes += found.problems
    in_packs = {d: located[d.split(":", 1)[1]] for d in wanted if d.split(":", 1)[1] in located}
    meter.start(f"pull {eid[:12]}", sum(entries[0]["size"] for entries in wanted.values()))

    def arrived(digest: str, blob: bytes, where: str) -> None:
        first = wanted[digest][0]
        data = unpack(blob, first["size"], digest, where)
        result.objects_fetched += 1
        result.bytes_fetched += len(blob)
        for entry in wanted[digest]:
            known[entry["path"]] = (entry, _write(tree / entry["path"], data, entry["exec"]))
        meter.advance(digest, first["size"])

    reads = spans({d.split(":", 1)[1]: place for d, place in in_packs.items()})
    chunks: list[list[Span]] = [[]]
    for span in reads:  # at most `batch` ranges and about CHUNK_BYTES in memory at once
        if chunks[-1] and (len(chunks[-1]) >= batch or sum(s.end - s.start for s in chunks[-1]) >= CHUNK_BYTES):
            chunks.append([])
        chunks[-1].append(span)
    for chunk in chunks:
        got = _read_spans(cache, chunk, eid, wanted, meter)
        for span, blob in zip(chunk, got, strict=True):
            for name, place in span.objects:
                digest = "blake3:" + name
                where = (
                    f"{cache.where(pack_rel(span.pack))} (object {name[:12]} at bytes {place.offset}+{place.length}: "
                    f"{wanted[digest][0]['path']} of engine {eid[:12]})"
                )
                part = blob[place.offset - span.start : place.offset - span.start + place.length]
                if len(part) != place.length:
                    raise IntegrityError(f"{where}: the pack ends before the object does (truncated); refused")
                arrived(digest, part, where)
    digests = [d for d in wanted if d not in in_packs]
    for start in range(0, len(digests), batch):
        some = digests[start : start + batch]
        blobs = cache.read_many([object_name(d) for d in some])
        for digest in some:
            rel = object_name(digest)
            where = f"{cache.where(rel)} ({wanted[digest][0]['path']} of engine {eid[:12]})"
            loose = blobs[rel]
            if loose is None:
                raise IntegrityError(f"{where}: missing from the cache; refused")
            arrived(digest, loose, where)
    return known


def _read_spans(
    cache: BinaryCache, chunk: list[Span], eid: str, wanted: dict[str, list[FileEntry]], meter: Meter
) -> list[bytes]:
    """The bytes of each span (fewer where a pack was cut short), told to `meter` as they arrive; a pack that is
    absent, or shorter than a span's start (S3 refuses such a range), is an IntegrityError naming it and the
    first object it should hold."""
    steps = [share(meter, sum(p.size for _, p in s.objects), s.end - s.start) for s in chunk]

    def refuse(span: Span, size: int | None) -> IntegrityError:
        name = span.objects[0][0]
        state = "missing" if size is None else f"{size} bytes, shorter than its index says (truncated)"
        return IntegrityError(
            f"{cache.where(pack_rel(span.pack))} (object {name[:12]}: {wanted['blake3:' + name][0]['path']} of "
            f"engine {eid[:12]}): the pack is {state}; refused"
        )

    try:
        got = cache.read_ranges([(pack_rel(s.pack), s.start, s.end) for s in chunk], received=lambda i, n: steps[i](n))
    except CacheError as failed:
        for span in chunk:
            try:
                size = cache.size(pack_rel(span.pack))
            except CacheError:
                raise failed from None  # the cache is unreachable: say what failed first
            if size is None or size <= span.start:
                raise refuse(span, size) from None
        raise
    out = []
    for span, blob in zip(chunk, got, strict=True):
        if blob is None:
            raise refuse(span, None)
        out.append(blob)
    return out


def _write(path: Path, data: bytes, executable: bool) -> tuple[int, int]:
    try:
        with open(path, "wb") as fh:
            fh.write(data)
        os.chmod(path, 0o755 if executable else 0o644)
    except OSError as exc:  # a full disk, a quota: the temporary tree goes, the store keeps what it had
        raise SpecPilotError(f"{path}: cannot write it ({exc.strerror}); nothing was pulled") from None
    st = os.lstat(path)
    return st.st_dev, st.st_ino
