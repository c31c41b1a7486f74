"""Bundles and binary caches agree: a bundle's engines can come from a cache, and a bundle's engines can go into
a cache (a `file://` one on an air-gapped site, which then serves as its substituter).

From a cache: each engine is pulled into a scratch store exactly as `specpilot pull` does (a trusted signature,
the manifest hashing to the id, every object re-hashed), then bundled from there.

Into a cache (`specpilot cache import`): the bundle's parts are checked and joined as the installer does (sizes,
sha256, the archive's BLAKE3 id), its engine trees unpacked into a scratch store, and each engine pushed with the
site's signing key under the build key this SpecPilot computes for the engine's setting and arm, but only when
the engine's manifest records exactly what such a build would (the check substitution makes), so an entry never
maps a key to an engine built from other inputs. The push re-hashes every file before sending it."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from specpilot_build.bundle import install as installer
from specpilot_build.cache.progress import Meter
from specpilot_build.cache.pull import pull_engine
from specpilot_build.cache.push import PushSummary, push_engine
from specpilot_build.cache.remote import BinaryCache
from specpilot_build.cache.signing import SigningKey
from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.store.engines import Engine, checked_manifest, index_put, is_engine_id, manifest_head
from specpilot_build.store.manifest import MANIFEST_NAME, canonical_json
from specpilot_build.store.names import plain_relpath

# (setting, arm) -> (the head a build of it records, its build key): the assembler's, handed in by the CLI
BuildOf = Callable[[str, str], tuple[dict, str]]


def pull_for_bundle(
    cache: BinaryCache, refs: list[str], trusted: dict[str, Ed25519PublicKey], scratch: Path, meter: Meter | None
) -> list[Engine]:
    """The engines `refs` names (ids or prefixes the cache holds), pulled and verified into the store `scratch`."""
    return [pull_engine(cache, ref, trusted, scratch, meter=meter).engine for ref in refs]


def import_bundle(
    bundle_dir: Path, cache: BinaryCache, key: SigningKey, scratch: Path, build_of: BuildOf, meter: Meter | None = None
) -> list[PushSummary]:
    """Push every engine of the bundle at `bundle_dir` into `cache`, signed by `key`; `scratch` is an empty
    folder the caller removes. Refuses (naming the part, member or engine) before anything is pushed."""
    try:
        index = installer.read_index(bundle_dir)
        installer.check_parts(bundle_dir, index)
        archive = scratch / "archive.tar.xz"
        installer.join_parts(bundle_dir, index, archive)
    except installer.InstallError as exc:
        raise IntegrityError(f"bundle {bundle_dir}: {exc}") from None
    ids = [str(e.get("id")) for e in index.get("engines") or [] if isinstance(e, dict)]
    if not ids or not all(is_engine_id(i) for i in ids):
        raise IntegrityError(f"bundle {bundle_dir}: its index lists no engine ids")
    store = scratch / "engines"
    _unpack_engines(archive, ids, store, bundle_dir)
    engines = []
    for eid in ids:
        engine = Engine(eid, store / eid)
        if not (engine.path / MANIFEST_NAME).is_file():
            raise IntegrityError(f"bundle {bundle_dir}: engine {eid[:12]} is listed but not in the archive")
        build_key = _build_key_of(engine, bundle_dir, build_of)
        index_put(store, build_key, eid)
        engines.append(engine)
    return [push_engine(engine, cache, key, store, meter=meter) for engine in engines]


def _unpack_engines(archive: Path, ids: list[str], store: Path, bundle_dir: Path) -> None:
    """Write the archive's engines/<id>/... members for `ids` under `store`: plain files and folders only, every
    path inside its engine's tree."""
    wanted = set(ids)
    store.mkdir(parents=True)
    for eid in ids:
        (store / eid).mkdir()
    with tarfile.open(archive, mode="r|xz") as tar:
        for member in tar:
            parts = member.name.split("/", 2)
            if parts[0] != "engines" or len(parts) < 3 or parts[1] not in wanted:
                continue
            where = f"bundle {bundle_dir}: member {member.name}"
            plain_relpath(parts[2], where, error=IntegrityError)
            target = store / parts[1] / parts[2]
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if not member.isfile():
                raise IntegrityError(f"{where}: not a plain file; refused")
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file member always has a reader
            with open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)


def _build_key_of(engine: Engine, bundle_dir: Path, build_of: BuildOf) -> str:
    """The build key this SpecPilot computes for the engine's setting and arm, if the engine's manifest records
    exactly the head that build would have; else an IntegrityError naming the engine and what differs."""
    manifest = checked_manifest(engine)
    setting, arm = str(manifest.get("setting")), str(manifest.get("arm"))
    try:
        head, key = build_of(setting, arm)
    except SpecPilotError as exc:
        raise SpecPilotError(
            f"bundle {bundle_dir}: engine {engine.id[:12]} is {setting} {arm}, which this SpecPilot cannot "
            f"compose ({exc})"
        ) from None
    recorded = manifest_head(manifest)
    if canonical_json(recorded) != canonical_json(head):
        differs = sorted(k for k in set(head) | set(recorded) if head.get(k) != recorded.get(k))
        raise IntegrityError(
            f"bundle {bundle_dir}: engine {engine.id[:12]} ({setting} {arm}) was not built from the inputs this "
            f"SpecPilot would use ({', '.join(differs)} differ); no build key can name it; refused"
        )
    return key


def scratch_dir(near: Path, what: str) -> Path:
    """An empty folder for `what` beside `near` (on its file system, so pulled trees are cheap to place)."""
    near.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{what}-", dir=near))
