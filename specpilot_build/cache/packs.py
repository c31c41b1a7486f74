"""Packs: many small objects in one cache file, so a push and a pull move a few large files, not thousands of
small ones.

A pack is the concatenation of the objects' zstd frames (each exactly as a loose object holds it), named by the
blake3 of its own bytes: `packs/<digest>.pack`. Its index, `packs/<digest>.idx`, is the canonical JSON of the
pack's digest and length and, per object digest, [offset, length, content size]. A push writes the pack, then
its index, so an index never names a pack still on its way; a pull trusts an index only as a map (every object
read through it is still decompressed and re-hashed against the digest its manifest records), and skips an index
that is malformed or whose pack is absent (`cache check` names it; a later push re-sends what it held)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import blake3

from specpilot_build.cache.remote import BinaryCache
from specpilot_build.errors import IntegrityError
from specpilot_build.store.engines import is_engine_id
from specpilot_build.store.manifest import canonical_json

PACKS = "packs"
INDEX_SCHEMA = "specpilot.cache-pack-index/1"
SMALL = 1 << 20  # objects whose zstd frame is shorter go into packs; larger ones stay loose (one request each)
PACK_BYTES = 32 << 20  # a pack is closed once it holds this many bytes
SPAN_GAP = 1 << 20  # a pull reads two wanted objects of one pack in one range when at most this far apart
SPAN_BYTES = 8 << 20  # ... and cuts ranges at object boundaries past this length (ranges are read concurrently)


def pack_rel(digest: str) -> str:
    return f"{PACKS}/{digest}.pack"


def index_rel(digest: str) -> str:
    return f"{PACKS}/{digest}.idx"


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


def parse_index(raw: bytes, digest: str, where: str) -> dict[str, Located]:
    """The objects an index places, if it is the canonical index of pack `digest` and every range lies inside
    the pack; else an IntegrityError naming `where`."""
    try:
        data: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{where}: not JSON; refused") from None
    ok = (
        isinstance(data, dict)
        and set(data) == {"schema", "pack", "bytes", "objects"}
        and data["schema"] == INDEX_SCHEMA
        and isinstance(data["bytes"], int)
        and isinstance(data["objects"], dict)
    )
    if not ok:
        raise IntegrityError(f"{where}: not a {INDEX_SCHEMA} index; refused")
    if data["pack"] != digest:
        raise IntegrityError(f"{where}: indexes pack {str(data['pack'])[:12]}, not {digest[:12]}; refused")
    if canonical_json(data) != raw:
        raise IntegrityError(f"{where}: not canonical JSON; refused")
    located = {}
    for name, place in data["objects"].items():
        good = (
            is_engine_id(name)
            and isinstance(place, list)
            and len(place) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in place)
            and place[1] > 0
            and place[0] + place[1] <= data["bytes"]
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


def read_indexes(cache: BinaryCache) -> tuple[dict[str, Located], list[str]]:
    """Where the cache's packs place each object (by digest hex), from every index whose pack is present, and
    one problem line per index skipped (malformed, or naming a pack that is absent)."""
    names = set(cache.names(PACKS))
    digests = sorted(n.removesuffix(".idx") for n in names if n.endswith(".idx"))
    raws = cache.read_many([index_rel(d) for d in digests])
    located: dict[str, Located] = {}
    problems = []
    for digest in digests:
        rel, raw = index_rel(digest), raws[index_rel(digest)]
        if raw is None:
            continue  # removed since the listing (a gc)
        if f"{digest}.pack" not in names:
            problems.append(f"{cache.where(rel)}: its pack {pack_rel(digest)} is absent; index ignored")
            continue
        try:
            placed = parse_index(raw, digest, cache.where(rel))
        except IntegrityError as exc:
            problems.append(f"{exc}".removesuffix("; refused") + "; index ignored")
            continue
        for name, place in placed.items():
            located.setdefault(name, place)
    return located, problems
