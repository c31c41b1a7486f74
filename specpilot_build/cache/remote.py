"""One binary cache at an fsspec URL, and what each backend guarantees about a write.

Layout under the URL: objects/<blake3 hex> (zstd-compressed content of one large file), packs/<blake3>.pack and
.idx (many small objects in one file, and where each lies: cache/packs.py), manifests/<engine id>.json (the
canonical manifest bytes), keys/<build key>.json (a signed entry), ids/<engine id>/<build key> (an empty marker:
the keys that name an engine, so a pull by id finds its entries with one listing).

Writes never expose a partial file. file://: the bytes go to a temporary name in the same directory and are
renamed over the final one (rename(2) is atomic on one file system). s3://: a PUT (single or multipart) becomes
visible only when complete, so a write goes straight to its name; a write that reports progress goes as a
multipart upload of PART-byte parts, aborted (never completed) when anything fails mid-way. hf://: every write
is one commit of the repository, atomic by construction. Two pushes of the same engine may both write an object or manifest: the
bytes are the same (named by their digest), so the last writer changes nothing; two entries for one build key
written at once leave one of them, whole."""

from __future__ import annotations

import asyncio
import os
import queue
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime

from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs

from specpilot_build.errors import SpecPilotError

OBJECTS = "objects"
MANIFESTS = "manifests"
KEYS = "keys"
IDS = "ids"
PART = 5 << 20  # a reported write goes in parts this long (S3's smallest multipart part but the last)
PIECE = 2 << 20  # a reported range read goes in pieces this long (concurrently on s3)
READS_AT_ONCE = 32

Sent = Callable[[int], None]  # told the number of bytes of a write that just reached the cache
Received = Callable[[int, int], None]  # told (which range, how many more bytes of it) as a read goes


class CacheError(SpecPilotError):
    """A cache that cannot be reached or answered with an error (after fsspec's own retries)."""


class BinaryCache:
    def __init__(self, url: str) -> None:
        url = url.rstrip("/")
        if "://" not in url:
            raise SpecPilotError(f"cache {url!r} is not a URL (file:///path, s3://bucket/prefix, hf://datasets/o/r)")
        self.url = url
        try:
            # a fresh instance with no listings cache: another pusher may have written since the last look
            self.fs, self.root = url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
        except (ImportError, ValueError) as exc:
            raise SpecPilotError(f"cache {url}: {exc}") from None
        protocol = self.fs.protocol
        protocols = protocol if isinstance(protocol, tuple) else (protocol,)
        self.local = "file" in protocols
        self.s3 = any(p in ("s3", "s3a") for p in protocols)

    def __str__(self) -> str:
        return self.url

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    @contextmanager
    def _talking(self, what: str) -> Iterator[None]:
        try:
            yield
        except SpecPilotError:
            raise
        except FileNotFoundError:
            raise
        except Exception as exc:  # fsspec backends raise their own types (OSError, botocore's, aiohttp's)
            text = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise CacheError(f"cache {self.url}: {what} failed: {type(exc).__name__}: {text}") from exc

    def read(self, rel: str) -> bytes | None:
        """The bytes at `rel`, or None when there is nothing there."""
        with self._talking(f"reading {rel}"):
            try:
                return bytes(self.fs.cat_file(self._path(rel)))
            except FileNotFoundError:
                return None

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """`read` of several paths at once: one concurrent batch on an async backend (s3, hf), in turn on file://."""
        if self.local or len(rels) < 2:
            return {rel: self.read(rel) for rel in rels}
        with self._talking(f"reading {rels[0]} and {len(rels) - 1} more"):
            got = self.fs.cat([self._path(r) for r in rels], on_error="return")
        out: dict[str, bytes | None] = {}
        for rel in rels:
            value = got.get(self._path(rel), FileNotFoundError())
            if isinstance(value, FileNotFoundError):
                out[rel] = None
            elif isinstance(value, BaseException):
                with self._talking(f"reading {rel}"):
                    raise value
            else:
                out[rel] = bytes(value)
        return out

    def read_ranges(self, ranges: list[tuple[str, int, int]], received: Received | None = None) -> list[bytes | None]:
        """The bytes [start, end) of each (rel, start, end), concurrently on s3 and hf; fewer bytes where the file
        is shorter, None where it is absent. With `received` (and always on file://), ranges are read in
        PIECE-byte pieces and `received(i, n)` hears of each piece of range i as it arrives, in this thread."""
        if not ranges:
            return []
        if received is None and not self.local:
            return self._cat_ranges(ranges)
        pieces = [(i, s, min(s + PIECE, e)) for i, (_, start, e) in enumerate(ranges) for s in range(start, e, PIECE)]

        def arrived(k: int, value: bytes) -> None:
            if received is not None:
                received(pieces[k][0], len(value))

        got = self._pieces([(ranges[i][0], s, e) for i, s, e in pieces], arrived)
        out: list[bytes | None] = []
        for i, (rel, _, _) in enumerate(ranges):
            parts: list[bytes] | None = []
            for k in [k for k, piece in enumerate(pieces) if piece[0] == i]:
                value, (_, s, e) = got[k], pieces[k]
                if isinstance(value, BaseException):
                    if isinstance(value, FileNotFoundError) and not parts:
                        parts = None
                        break
                    if parts and (self.size(rel) or 0) <= s:
                        break  # the file ends where the piece before ended (S3 refuses a range past the end)
                    with self._talking(f"reading {rel}"):
                        raise value
                assert parts is not None
                parts.append(value)
                if len(value) < e - s:
                    break  # the file ends inside this piece
            out.append(None if parts is None else b"".join(parts))
        return out

    def _cat_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | None]:
        paths = [self._path(rel) for rel, _, _ in ranges]
        with self._talking(f"reading {ranges[0][0]} and {len(ranges) - 1} more"):
            got = self.fs.cat_ranges(paths, [s for _, s, _ in ranges], [e for _, _, e in ranges], on_error="return")
        results: list[bytes | None] = []
        for (rel, _, _), value in zip(ranges, got, strict=True):
            if isinstance(value, FileNotFoundError):
                results.append(None)
            elif isinstance(value, BaseException):
                with self._talking(f"reading {rel}"):
                    raise value
            else:
                results.append(bytes(value))
        return results

    def _pieces(
        self, pieces: list[tuple[str, int, int]], arrived: Callable[[int, bytes], None]
    ) -> list[bytes | BaseException]:
        """Each piece (rel, start, end) read: its bytes or the error reading it; `arrived(k, bytes)` is called in
        this thread as piece k comes (concurrently READS_AT_ONCE at a time on an async backend, else in turn)."""
        got: list[bytes | BaseException] = [b""] * len(pieces)
        if self.local or not isinstance(self.fs, AsyncFileSystem):
            for k, (rel, start, end) in enumerate(pieces):
                try:
                    piece = self._read_piece(rel, start, end)
                except Exception as exc:
                    got[k] = exc
                    continue
                got[k] = piece
                arrived(k, piece)
            return got
        fs = self.fs
        done: queue.SimpleQueue[tuple[int, bytes | BaseException]] = queue.SimpleQueue()

        async def one(k: int, gate: asyncio.Semaphore) -> None:
            rel, start, end = pieces[k]
            async with gate:
                try:
                    value: bytes | BaseException = bytes(await fs._cat_file(self._path(rel), start=start, end=end))
                except Exception as exc:
                    value = exc
            done.put((k, value))

        async def every() -> None:
            gate = asyncio.Semaphore(READS_AT_ONCE)
            await asyncio.gather(*(one(k, gate) for k in range(len(pieces))))

        running = asyncio.run_coroutine_threadsafe(every(), fs.loop)
        try:
            for _ in pieces:
                while True:
                    try:
                        k, value = done.get(timeout=0.5)
                        break
                    except queue.Empty:
                        if running.done():
                            running.result()  # raises what stopped it
                            raise RuntimeError("a range read ended without its pieces") from None
                got[k] = value
                if not isinstance(value, BaseException):
                    arrived(k, value)
            running.result()
        finally:
            running.cancel()
        return got

    def _read_piece(self, rel: str, start: int, end: int) -> bytes:
        if not self.local:
            return bytes(self.fs.cat_file(self._path(rel), start=start, end=end))
        with open(self._path(rel), "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)

    def size(self, rel: str) -> int | None:
        """The length of the file at `rel`, or None when there is nothing there."""
        with self._talking(f"looking up {rel}"):
            try:
                return int(self.fs.info(self._path(rel))["size"])
            except FileNotFoundError:
                return None

    def write_many(self, items: dict[str, bytes]) -> None:
        """`write` of several paths at once (concurrently on s3 and hf; each is still whole or absent)."""
        if self.local or len(items) < 2:
            for rel, data in items.items():
                self.write(rel, data)
            return
        first = next(iter(items))
        with self._talking(f"writing {first} and {len(items) - 1} more"):
            self.fs.pipe({self._path(rel): data for rel, data in items.items()})

    def exists(self, rel: str) -> bool:
        with self._talking(f"looking up {rel}"):
            return bool(self.fs.exists(self._path(rel)))

    def write(self, rel: str, data: bytes, sent: Sent | None = None) -> None:
        """Put `data` at `rel` so that no reader ever sees a part of it (see the module docstring). With `sent`,
        it hears of the bytes as they reach the cache: on file:// and s3:// PART bytes at a time; on hf:// (one
        commit of the whole file) all at once, at the end."""
        with self._talking(f"writing {rel}"):
            path = self._path(rel)
            if self.s3 and sent is not None and len(data) > PART:
                self._write_parts(path, data, sent)
            elif not self.local:
                self.fs.pipe_file(path, data)
                if sent is not None:
                    sent(len(data))
            else:
                self._write_local(path, data, sent)

    def _write_local(self, path: str, data: bytes, sent: Sent | None) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as fh:
                for start in range(0, len(data), PART):
                    fh.write(data[start : start + PART])
                    if sent is not None:
                        sent(min(PART, len(data) - start))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _write_parts(self, path: str, data: bytes, sent: Sent) -> None:
        """A multipart upload, one PART-byte part per write (s3fs sends a full block before `write` returns);
        the object appears when `close` completes the upload. On any failure the upload is aborted and the file
        object marked closed, so neither an exit handler nor the garbage collector completes it part-way."""
        fh = self.fs.open(path, "wb", block_size=PART)
        try:
            last = (len(data) - 1) // PART * PART
            for start in range(0, last, PART):
                fh.write(data[start : start + PART])
                sent(PART)
            fh.write(data[last:])
            fh.close()
        except BaseException:
            with suppress(Exception):
                fh.discard()
            fh.closed = True
            raise
        sent(len(data) - last)

    def names(self, folder: str) -> list[str]:
        """The names directly under `folder` (none if it does not exist), temporaries left out, sorted."""
        with self._talking(f"listing {folder}/"):
            try:
                listed = self.fs.ls(self._path(folder), detail=False)
            except FileNotFoundError:
                return []
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed}
        return sorted(n for n in names if n and not n.startswith("."))

    def age(self, rel: str, now: float) -> float:
        """Seconds since `rel` was last written; 0 when the backend does not say (hf:// reports no time, so
        `cache gc` there removes nothing unless its grace is 0); infinite when `rel` is already gone."""
        with self._talking(f"looking up {rel}"):
            try:
                info = self.fs.info(self._path(rel))
            except FileNotFoundError:
                return float("inf")
        stamp = info.get("mtime", info.get("LastModified", info.get("last_modified")))
        if isinstance(stamp, datetime):
            stamp = stamp.timestamp()
        return now - float(stamp) if isinstance(stamp, (int, float)) else 0.0

    def remove(self, rel: str) -> None:
        with self._talking(f"removing {rel}"):
            try:
                self.fs.rm_file(self._path(rel))
            except FileNotFoundError:
                pass
