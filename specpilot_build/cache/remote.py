"""One binary cache at an fsspec URL, and what each backend guarantees about a write.

Layout under the URL: objects/<blake3 hex> (zstd-compressed content of one large file), packs/<blake3>.pack and
.idx (many small objects in one file, and where each lies: cache/packs.py), manifests/<engine id>.json (the
canonical manifest bytes), keys/<build key>.json (a signed entry), ids/<engine id>/<build key> (an empty marker:
the keys that name an engine, so a pull by id finds its entries with one listing).

Writes never expose a partial file. file://: the bytes go to a temporary name in the same directory and are
renamed over the final one (rename(2) is atomic on one file system). s3://: a PUT (single or multipart) becomes
visible only when complete, so a write goes straight to its name. hf://: every write is one commit of the
repository, atomic by construction. Two pushes of the same engine may both write an object or manifest: the
bytes are the same (named by their digest), so the last writer changes nothing; two entries for one build key
written at once leave one of them, whole."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from fsspec.core import url_to_fs

from specpilot_build.errors import SpecPilotError

OBJECTS = "objects"
MANIFESTS = "manifests"
KEYS = "keys"
IDS = "ids"


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
        self.local = "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

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

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | None]:
        """The bytes [start, end) of each (rel, start, end), concurrently on s3 and hf; fewer bytes where the file
        is shorter, None where it is absent."""
        if not ranges:
            return []
        if self.local:
            out: list[bytes | None] = []
            for rel, start, end in ranges:
                with self._talking(f"reading {rel}"):
                    try:
                        with open(self._path(rel), "rb") as fh:
                            fh.seek(start)
                            out.append(fh.read(end - start))
                    except FileNotFoundError:
                        out.append(None)
            return out
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

    def write(self, rel: str, data: bytes) -> None:
        """Put `data` at `rel` so that no reader ever sees a part of it (see the module docstring)."""
        with self._talking(f"writing {rel}"):
            path = self._path(rel)
            if not self.local:
                self.fs.pipe_file(path, data)
                return
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)

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
