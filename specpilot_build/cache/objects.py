"""An object as a cache holds it: the zstd frame of a file's content, named by the content's blake3."""

from __future__ import annotations

import io

import zstandard

from specpilot_build.errors import IntegrityError
from specpilot_build.store.manifest import digest_bytes

LEVEL = 9


def object_name(digest: str) -> str:
    return "objects/" + digest.split(":", 1)[-1]


def pack(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=LEVEL, write_content_size=True).compress(data)


def unpack(blob: bytes, size: int, digest: str, where: str) -> bytes:
    """The content of an object that must be `size` bytes hashing to `digest`; anything else (not zstd, cut
    short, longer, other bytes) is an IntegrityError naming the object."""
    chunks: list[bytes] = []
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True) as reader:
            while got <= size:
                chunk = reader.read(min(1 << 20, size + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{where}: not a whole zstd object ({exc}); refused") from None
    data = b"".join(chunks)
    if len(data) != size:
        more = "more than" if len(data) > size else f"{len(data)} bytes, not"
        raise IntegrityError(f"{where}: decompresses to {more} the {size} bytes the manifest records; refused")
    found = digest_bytes(data)
    if found != digest:
        raise IntegrityError(f"{where}: content hashes to {found[:19]}…, not its name {digest[:19]}…; refused")
    return data
