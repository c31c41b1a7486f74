"""Packs: many small objects in one cache file, so a push and a pull move a few large files, not thousands of
small ones.

A pack is the concatenation of the objects' zstd frames (each exactly as a loose object holds it), named by the
blake3 of its own bytes: `packs/<digest>.pack`. Its index, `packs/<digest>.idx`, is the canonical JSON of the
pack's digest and length and, per object digest, [offset, length, content size]. A push writes the pack, then
its index, so an index never names a pack still on its way; a pull trusts an index only as a map (every object
read through it is still decompressed and re-hashed against the digest its manifest records), and skips an index
that is malformed or whose pack is absent (`cache check` names it; a later push re-sends what it held).

The merged index saves a pull from reading every pack's index (one request each, growing with every push): the
union of the per-pack indexes (canonical JSON, zstd-compressed), `merged/<blake3>.json.zst`, named by the blake3
of its own bytes and so immutable,
and a pointer `merged/latest.json` naming the newest. A push after which MERGE_AFTER or more listed packs are not
in the pointed index (its own included), or that found the pointed index refused, writes a new merged index, then
the pointer, both after its packs' indexes: a pull reads at most MERGE_AFTER - 1 per-pack indexes besides the
merged one, and a push re-sends the merged index (which grows with the cache) only every MERGE_AFTER packs. The listing of packs/ stays
the authority on which packs exist: a reader takes from the merged index only packs that are listed with their
index, and reads the per-pack index of every listed pack it lacks. So two pushes at once, whose pointers
overwrite each other, lose nothing (the loser's packs are read through their own indexes until the next push
merges them), a pack gc removed is ignored, and a cache without a merged index reads as before. A merged index
that does not hash to the digest its pointer names, or is malformed, is refused by name and ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import blake3
import zstandard

from specpilot_build.cache.objects import LEVEL
from specpilot_build.cache.remote import BinaryCache
from specpilot_build.errors import IntegrityError
from specpilot_build.store.engines import is_engine_id
from specpilot_build.store.manifest import canonical_json

PACKS = "packs"
INDEX_SCHEMA = "specpilot.cache-pack-index/1"
MERGED = "merged"
MERGED_SCHEMA = "specpilot.cache-merged-index/1"
POINTER = f"{MERGED}/latest.json"
POINTER_SCHEMA = "specpilot.cache-merged-pointer/1"
MERGE_AFTER = 8  # packs outside the merged index that make a push write a new one
MERGED_LIMIT = 1 << 30  # a merged index that says it decompresses to more is refused
SMALL = 1 << 20  # objects whose zstd frame is shorter go into packs; larger ones stay loose (one request each)
PACK_BYTES = 32 << 20  # a pack is closed once it holds this many bytes
SPAN_GAP = 1 << 20  # a pull reads two wanted objects of one pack in one range when at most this far apart
SPAN_BYTES = 8 << 20  # ... and cuts ranges at object boundaries past this length (ranges are read concurrently)


def pack_rel(digest: str) -> str:
    return f"{PACKS}/{digest}.pack"


def index_rel(digest: str) -> str:
    return f"{PACKS}/{digest}.idx"


def merged_rel(digest: str) -> str:
    return f"{MERGED}/{digest}.json.zst"


@dataclass(frozen=True)
class Located:
    """Where an object lies: in pack `pack` (its digest), `length` bytes from `offset`; `size` bytes of content."""

    pack: str
    offset: int
    length: int
    size: int


class PackWriter:
    """Objects gathered into packs of about PACK_BYTES; `close` returns the last, partly filled one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._frames: list[bytes] = []
        self._objects: dict[str, list[int]] = {}
        self._length = 0

    def add(self, digest_hex: str, frame: bytes, size: int) -> tuple[str, bytes, bytes] | None:
        """Add one object (its zstd frame, its content size); a full pack (digest, pack bytes, index bytes) when
        this object closed one."""
        if digest_hex in self._objects:
            return None
        self._objects[digest_hex] = [self._length, len(frame), size]
        self._frames.append(frame)
        self._length += len(frame)
        return self.close() if self._length >= self.limit else None

    def close(self) -> tuple[str, bytes, bytes] | None:
        if not self._frames:
            return None
        data = b"".join(self._frames)
        digest = blake3.blake3(data).hexdigest()
        index = {"schema": INDEX_SCHEMA, "pack": digest, "bytes": len(data), "objects": self._objects}
        self._frames, self._objects, self._length = [], {}, 0
        return digest, data, canonical_json(index)


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{where}: not JSON; refused") from None


def parse_index(raw: bytes, digest: str, where: str) -> dict[str, Located]:
    """The objects an index places, if it is the canonical index of pack `digest` and every range lies inside
    the pack; else an IntegrityError naming `where`."""
    data = _json(raw, where)
    ok = (
        isinstance(data, dict)
        and set(data) == {"schema", "pack", "bytes", "objects"}
        and data["schema"] == INDEX_SCHEMA
    )
    if not ok:
        raise IntegrityError(f"{where}: not a {INDEX_SCHEMA} index; refused")
    if data["pack"] != digest:
        raise IntegrityError(f"{where}: indexes pack {str(data['pack'])[:12]}, not {digest[:12]}; refused")
    if canonical_json(data) != raw:
        raise IntegrityError(f"{where}: not canonical JSON; refused")
    return _placements(data["bytes"], data["objects"], digest, where)


def _placements(length: Any, objects: Any, digest: str, where: str) -> dict[str, Located]:
    """Where pack `digest` (`length` bytes) places each object, if every place is well-formed and inside it."""
    if not isinstance(length, int) or isinstance(length, bool) or not isinstance(objects, dict):
        raise IntegrityError(f"{where}: pack {digest[:12]}: not a length and a map of objects; refused")
    located = {}
    for name, place in objects.items():
        good = (
            is_engine_id(name)
            and isinstance(place, list)
            and len(place) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in place)
            and place[1] > 0
            and place[0] + place[1] <= length
        )
        if not good:
            raise IntegrityError(f"{where}: object {str(name)[:12]} has no valid place in the pack; refused")
        located[name] = Located(digest, place[0], place[1], place[2])
    return located


@dataclass(frozen=True)
class Span:
    """One range read of a pack and the objects (digest hex, place) it covers."""

    pack: str
    start: int
    end: int
    objects: tuple[tuple[str, Located], ...]


def spans(wanted: dict[str, Located], gap: int | None = None, limit: int | None = None) -> list[Span]:
    """Few, large reads covering every wanted object: per pack in offset order, neighbours at most `gap` apart
    share a read, and a read is cut at an object boundary once it is `limit` long (default SPAN_GAP and
    SPAN_BYTES, read when called)."""
    gap = SPAN_GAP if gap is None else gap
    limit = SPAN_BYTES if limit is None else limit
    by_pack: dict[str, list[tuple[str, Located]]] = {}
    for name, place in wanted.items():
        by_pack.setdefault(place.pack, []).append((name, place))
    out: list[Span] = []
    for pack, items in sorted(by_pack.items()):
        items.sort(key=lambda item: item[1].offset)
        group: list[tuple[str, Located]] = []
        start = end = 0
        for name, place in items:
            if group and (place.offset - end > gap or end - start >= limit):
                out.append(Span(pack, start, end, tuple(group)))
                group = []
            if not group:
                start = end = place.offset
            group.append((name, place))
            end = max(end, place.offset + place.length)
        out.append(Span(pack, start, end, tuple(group)))
    return out


@dataclass
class Indexes:
    """The packs a cache holds with their indexes, as a reader found them."""

    packs: dict[str, dict[str, Any]] = field(default_factory=dict)  # pack digest -> {"bytes", "objects"}
    located: dict[str, Located] = field(default_factory=dict)  # object digest hex -> its place (the first pack)
    merged: frozenset[str] = frozenset()  # the listed packs the pointed merged index covered
    merged_refused: bool = False  # the pointer named a merged index that could not be trusted as a map
    problems: list[str] = field(default_factory=list)  # one line per index ignored

    def add(self, digest: str, length: int, objects: dict[str, list[int]], placed: dict[str, Located]) -> None:
        self.packs[digest] = {"bytes": length, "objects": objects}
        for name, place in placed.items():
            self.located.setdefault(name, place)


def load_indexes(cache: BinaryCache, merged: bool = True) -> Indexes:
    """Where the cache's packs place each object: from the merged index the pointer names (when `merged`), for
    the packs it covers, and from the per-pack index of every other listed pack; only packs listed with their
    index count. An index that cannot be trusted as a map is a problem line and ignored."""
    names = set(cache.names(PACKS))
    listed = sorted(
        n.removesuffix(".idx") for n in names if n.endswith(".idx") and f"{n.removesuffix('.idx')}.pack" in names
    )
    found = Indexes()
    for name in sorted(names):
        if name.endswith(".idx") and name.removesuffix(".idx") not in listed:
            rel = f"{PACKS}/{name}"
            found.problems.append(
                f"{cache.where(rel)}: its pack {pack_rel(name.removesuffix('.idx'))} is absent; index ignored"
            )
    if merged:
        try:
            for digest, entry, placed in _read_merged(cache, set(listed)):
                found.add(digest, entry["bytes"], entry["objects"], placed)
        except IntegrityError as exc:
            found.packs, found.located, found.merged_refused = {}, {}, True
            found.problems.append(f"{exc}".removesuffix("; refused") + "; refused, per-pack indexes read instead")
        found.merged = frozenset(found.packs)
    rest = [d for d in listed if d not in found.packs]
    raws = cache.read_many([index_rel(d) for d in rest])
    for digest in rest:
        rel, raw = index_rel(digest), raws[index_rel(digest)]
        if raw is None:
            continue  # removed since the listing (a gc)
        try:
            placed = parse_index(raw, digest, cache.where(rel))
        except IntegrityError as exc:
            found.problems.append(f"{exc}".removesuffix("; refused") + "; index ignored")
            continue
        data = json.loads(raw)
        found.add(digest, data["bytes"], data["objects"], placed)
    return found


def _read_merged(cache: BinaryCache, listed: set[str]) -> list[tuple[str, dict[str, Any], dict[str, Located]]]:
    """The entries of the merged index the pointer names, for the packs in `listed`; none when there is no
    pointer; an IntegrityError naming the pointer or the index when either is not what it must be."""
    raw = cache.read(POINTER)
    if raw is None:
        return []
    where = cache.where(POINTER)
    pointer = _json(raw, where)
    ok = (
        isinstance(pointer, dict)
        and set(pointer) == {"schema", "index"}
        and pointer["schema"] == POINTER_SCHEMA
        and isinstance(pointer["index"], str)
        and is_engine_id(pointer["index"])
    )
    if not ok:
        raise IntegrityError(f"{where}: not a {POINTER_SCHEMA} pointer; refused")
    digest = pointer["index"]
    rel = merged_rel(digest)
    where = cache.where(rel)
    data = cache.read(rel)
    if data is None:
        raise IntegrityError(f"{where}: named by {POINTER} but absent; refused")
    found = blake3.blake3(data).hexdigest()
    if found != digest:
        raise IntegrityError(
            f"{where}: hashes to {found[:12]}, not the digest {digest[:12]} its name and {POINTER} give; refused"
        )
    try:
        size = zstandard.frame_content_size(data)
        if not 0 <= size <= MERGED_LIMIT:
            raise zstandard.ZstdError(f"content size {size}")
        text = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as exc:
        raise IntegrityError(
            f"{where}: not a whole zstd frame of at most {MERGED_LIMIT} bytes ({exc}); refused"
        ) from None
    index = _json(text, where)
    ok = isinstance(index, dict) and set(index) == {"schema", "packs"} and index["schema"] == MERGED_SCHEMA
    if not ok or not isinstance(index["packs"], dict):
        raise IntegrityError(f"{where}: not a {MERGED_SCHEMA} index; refused")
    out = []
    for pack, entry in index["packs"].items():
        if pack not in listed:
            continue  # removed by a gc, or never finished: the listing decides
        if not isinstance(entry, dict) or set(entry) != {"bytes", "objects"}:
            raise IntegrityError(f"{where}: pack {str(pack)[:12]}: not a length and a map of objects; refused")
        out.append((pack, entry, _placements(entry["bytes"], entry["objects"], pack, f"{where} (pack {pack[:12]})")))
    return out


def merged_index(packs: dict[str, dict[str, Any]]) -> tuple[str, bytes]:
    """The merged index of `packs` (pack digest -> {"bytes", "objects"}): its digest and bytes as stored."""
    raw = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True).compress(
        canonical_json({"schema": MERGED_SCHEMA, "packs": packs})
    )
    return blake3.blake3(raw).hexdigest(), raw


def pointer_to(digest: str) -> bytes:
    return canonical_json({"schema": POINTER_SCHEMA, "index": digest})


def read_indexes(cache: BinaryCache) -> tuple[dict[str, Located], list[str]]:
    """Where the cache's packs place each object (by digest hex), and one problem line per index skipped."""
    found = load_indexes(cache)
    return found.located, found.problems
