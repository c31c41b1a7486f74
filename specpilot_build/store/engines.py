"""The content-addressed engine store: engines/<id>/ trees whose files are hardlinks into engines/.objects/.

A build assembles a tree under engines/.tmp/, hashes it, moves each file's content into the object store (one
copy per distinct content and executable bit), writes the manifest and renames the tree to engines/<id> in one
step. Two builds of the same engine race harmlessly: the loser finds the id present and drops its tree.

Objects are named by their digest and never trusted: every build that uses an object re-checks it (size,
content, mode) and replaces a damaged one with the bytes it has just checked against their pinned source."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import blake3

from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.locations import engines_dir
from specpilot_build.store.manifest import (
    MANIFEST_NAME,
    FileEntry,
    JsonObject,
    canonical_json,
    digest_bytes,
    digest_file,
    engine_id,
    entry_kind,
    file_entry,
    manifest_problem,
    walk_tree,
)
from specpilot_build.store.names import engine_prefix

OBJECTS = ".objects"
TMP = ".tmp"
INDEX = ".index"
LOCK = ".lock"
ROOTS = ".roots"
HEX = frozenset("0123456789abcdef")


def is_engine_id(name: object) -> bool:
    return isinstance(name, str) and len(name) == 64 and set(name) <= HEX


@dataclass(frozen=True)
class Engine:
    id: str
    path: Path

    @cached_property
    def manifest(self) -> JsonObject:
        return _json_object(self.path / MANIFEST_NAME, (self.path / MANIFEST_NAME).read_bytes())

    @cached_property
    def config(self) -> JsonObject:
        return _json_object(self.path / "config.json", (self.path / "config.json").read_bytes())

    @property
    def model_pin(self) -> dict[str, str]:
        pin = self.manifest["inputs"]["checkpoints"]["model"]
        return {"repo": pin["repo"], "revision": pin["revision"]}


def _json_object(path: Path, raw: bytes) -> JsonObject:
    """The JSON object `raw` holds; anything else is an IntegrityError naming `path`."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise IntegrityError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _with_manifest(eid: str, path: Path, manifest: JsonObject) -> Engine:
    """An Engine whose manifest is the one just parsed from bytes checked against its id."""
    engine = Engine(eid, path)
    engine.__dict__["manifest"] = manifest
    return engine


@dataclass(frozen=True)
class DamagedEngine:
    """A directory named like an engine whose manifest is missing, unreadable, invalid or not its id."""

    id: str
    path: Path
    reason: str

    def advice(self) -> str:
        return (
            f"engine directory {self.path} is damaged ({self.reason}); it cannot be repaired: remove it with "
            f"`specpilot engine rm {self.id[:12]}` and build its setting again"
        )


def checked_manifest(engine: Engine) -> JsonObject:
    """The engine's manifest as read from disk, refused unless those bytes hash to the engine's id."""
    raw = (engine.path / MANIFEST_NAME).read_bytes()
    digest = blake3.blake3(raw).hexdigest()
    if digest != engine.id:
        raise IntegrityError(
            f"engine {engine.id[:12]}: {MANIFEST_NAME} hashes to {digest[:12]}, not its id; "
            f"`specpilot engine check {engine.id[:12]}`"
        )
    return _json_object(engine.path / MANIFEST_NAME, raw)


def manifest_head(manifest: JsonObject) -> JsonObject:
    """Everything a manifest records about how the engine was asked for: all but the files and the base record."""
    return {k: v for k, v in manifest.items() if k not in ("files", "base")}


def store_root() -> Path:
    return engines_dir()


@contextlib.contextmanager
def store_lock(root: Path, exclusive: bool = False) -> Iterator[None]:
    """Builds and repairs hold the store shared; gc and rm hold it exclusively (objects are not deleted while
    a build is linking them)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def new_build_dir(root: Path | None = None) -> Path:
    root = root or store_root()
    tmp = root / TMP
    tmp.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(tmp)
    path = tmp / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def commit(
    tree: Path,
    manifest_without_files: JsonObject,
    root: Path | None = None,
    known: dict[str, tuple[FileEntry, tuple[int, int]]] | None = None,
) -> tuple[Engine, bool]:
    """Hash `tree`, intern its files as objects, and move it to engines/<id>. Returns (engine, created).

    `known`: entries of files the assembler wrote as hardlinks of objects it had just checked against their
    pinned source, with the (device, inode) it linked; a file still on that inode is not hashed again."""
    root = root or store_root()
    files, dirs, others = walk_tree(tree)
    if others:
        raise SpecPilotError(f"{tree / others[0][0]}: a {others[0][1]} in an engine tree; refused")
    _remove_empty_dirs(tree, files, dirs)
    entries: list[FileEntry] = []
    for rel in files:
        k = (known or {}).get(rel)
        if k is not None:
            st = os.lstat(tree / rel)
            if (st.st_dev, st.st_ino) == k[1]:
                entries.append(k[0])
                continue
        entries.append(file_entry(tree, rel))
    manifest = dict(manifest_without_files, files=entries)
    eid = engine_id(manifest)
    final = root / eid
    if _present(final, eid):
        shutil.rmtree(tree, ignore_errors=True)
        return Engine(eid, final), False
    for entry in entries:
        _intern(root, tree / entry["path"], entry)
    (tree / MANIFEST_NAME).write_bytes(canonical_json(manifest))
    os.chmod(tree / MANIFEST_NAME, 0o444)
    try:
        os.rename(tree, final)
    except OSError:
        if not _present(final, eid):
            raise
        shutil.rmtree(tree, ignore_errors=True)  # a concurrent build of the same engine won the rename
        return Engine(eid, final), False
    return Engine(eid, final), True


def _present(final: Path, eid: str) -> bool:
    """engines/<id> exists and is whole; a damaged directory of that name is an error saying what to do."""
    try:
        os.lstat(final)
    except FileNotFoundError:
        return False
    problem = damage_of(final)
    if problem is not None:
        raise IntegrityError(DamagedEngine(eid, final, problem).advice())
    return True


def _remove_empty_dirs(tree: Path, files: list[str], dirs: list[str]) -> None:
    """Directories that hold no file are not recorded by the manifest, so they are not kept in the tree."""
    implied = {rel.rsplit("/", i)[0] for rel in files for i in range(1, rel.count("/") + 1)}
    for d in sorted(set(dirs) - implied, key=len, reverse=True):
        os.rmdir(tree / d)


def object_mode(executable: bool) -> int:
    return 0o555 if executable else 0o444


def object_state(obj: Path, size: int, digest: str, executable: bool, data: bytes | None = None) -> str:
    """'ok', 'missing', 'mode' (right content, wrong permission bits) or 'damaged' (not a file, or its size or
    content is not what its name says). `data`, when given, is compared instead of hashing the object."""
    try:
        st = os.lstat(obj)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return "damaged"
    try:
        fd = os.open(obj, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "damaged"
    with os.fdopen(fd, "rb") as fh:
        if data is not None:
            good = fh.read() == data
        else:
            hasher = blake3.blake3()
            while chunk := fh.read(1 << 20):
                hasher.update(chunk)
            good = "blake3:" + hasher.hexdigest() == digest
    if not good:
        return "damaged"
    return "ok" if stat.S_IMODE(st.st_mode) == object_mode(executable) else "mode"


def _intern(root: Path, path: Path, entry: FileEntry) -> None:
    """Make `path` (a file just hashed into `entry`) a hardlink of the object holding its content. An existing
    object is re-checked; one whose content no longer matches its name is replaced by `path`'s checked bytes."""
    obj = object_path(root, entry["blake3"], entry["exec"])
    st_path = path.lstat()
    try:
        st_obj = obj.lstat()
    except FileNotFoundError:
        st_obj = None
    if st_obj is not None and os.path.samestat(st_obj, st_path):
        return  # assembled as a hardlink of this very object, checked when it was put
    os.chmod(path, object_mode(entry["exec"]))
    obj.parent.mkdir(parents=True, exist_ok=True)
    if st_obj is None:
        try:
            os.link(path, obj)  # the first copy of this content becomes the object
            return
        except FileExistsError:
            pass
    state = object_state(obj, entry["size"], entry["blake3"], entry["exec"])
    if state == "mode":
        os.chmod(obj, object_mode(entry["exec"]))
    if state in ("ok", "mode"):
        link_into(obj, path)
        return
    staged = obj.with_name(f"{obj.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.link(path, staged)
    os.replace(staged, obj)  # the damaged inode stays with the engines holding it: `engine check --repair`


def link_into(obj: Path, path: Path) -> None:
    """Replace `path` by a hardlink of `obj` in one step."""
    tmp_link = path.with_name(f"{path.name}.link-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.link(obj, tmp_link)
    os.replace(tmp_link, path)


def object_path(root: Path, digest: str, executable: bool) -> Path:
    hexdigest = digest.split(":", 1)[-1]
    return root / OBJECTS / hexdigest[:2] / (hexdigest + (".x" if executable else ""))


def put_object(root: Path, data: bytes, executable: bool, digest: str | None = None) -> Path:
    """The read-only object holding `data` (bytes the caller has checked against their pinned source); a build
    hardlinks it into its tree. An existing object is compared with `data`: wrong permission bits are reset, a
    damaged object is replaced atomically (a new inode renamed over it)."""
    digest = digest or digest_bytes(data)
    obj = object_path(root, digest, executable)
    state = object_state(obj, len(data), digest, executable, data=data)
    if state == "ok":
        return obj
    if state == "mode":
        os.chmod(obj, object_mode(executable))
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    staged = obj.with_name(f"{obj.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(staged, "wb") as out:
        out.write(data)
    os.chmod(staged, object_mode(executable))
    try:
        if state == "missing":
            try:
                os.link(staged, obj)
            except FileExistsError:  # a concurrent build put it first: check what it put
                if object_state(obj, len(data), digest, executable, data=data) != "ok":
                    os.replace(staged, obj)
        else:
            os.replace(staged, obj)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
    return obj


def index_put(root: Path, key: str, eid: str) -> None:
    """Record that the build key `key` gives engine `eid` (engines/.index/<key>, replaced in one step)."""
    index = root / INDEX
    index.mkdir(parents=True, exist_ok=True)
    tmp = index / f".{key}.{os.getpid()}"
    tmp.write_text(eid + "\n")
    os.replace(tmp, index / key)


def index_keys(root: Path, eid: str) -> list[str]:
    """The build keys the index maps to `eid` (sorted); entries that cannot be read are skipped."""
    found = []
    try:
        names = sorted(os.listdir(root / INDEX))
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(".") or not is_engine_id(name):
            continue
        try:
            with open(root / INDEX / name, "rb") as fh:
                if fh.read(200).decode("ascii", "replace").strip() == eid:
                    found.append(name)
        except OSError:
            continue
    return found


def _sweep_abandoned(tmp: Path) -> None:
    """Remove build directories of processes that no longer run (interrupted builds)."""
    for child in tmp.iterdir():
        pid = child.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_tree(child)


def remove_tree(path: Path) -> None:
    """Remove a tree without following links (read-only files in writable directories)."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- lookup -------------------------------------------------------------------------------------------------


def damage_of(path: Path) -> str | None:
    """Why the directory engines/<id> is not a whole engine (one line), or None. Reads only its manifest."""
    return _examine(path)[0]


def _examine(path: Path) -> tuple[str | None, JsonObject | None]:
    """(why engines/<id> is not a whole engine, or None; its manifest, parsed from the bytes that hash to
    the directory's name, when it is)."""
    try:
        kind = entry_kind(os.lstat(path).st_mode)
    except OSError as exc:
        return f"cannot stat it: {exc.strerror}", None
    if kind != "directory":
        return f"a {kind}, not a directory", None
    manifest = path / MANIFEST_NAME
    try:
        mkind = entry_kind(os.lstat(manifest).st_mode)
    except FileNotFoundError:
        return f"no {MANIFEST_NAME}", None
    except OSError as exc:
        return f"{MANIFEST_NAME} cannot be read: {exc.strerror}", None
    if mkind != "file":
        return f"{MANIFEST_NAME} is a {mkind}, not a file", None
    try:
        raw = manifest.read_bytes()
    except OSError as exc:
        return f"{MANIFEST_NAME} cannot be read: {exc.strerror}", None
    if not raw:
        return f"{MANIFEST_NAME} is empty", None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{MANIFEST_NAME} is not valid JSON ({str(exc).splitlines()[0][:80]})", None
    if blake3.blake3(raw).hexdigest() != path.name:
        return f"{MANIFEST_NAME} does not hash to the directory's name", None
    problem = manifest_problem(data)
    if problem is not None:
        return f"{MANIFEST_NAME} is not an engine manifest ({problem})", None
    return None, data


def scan_store(root: Path | None = None, prefix: str = "") -> tuple[list[Engine], list[DamagedEngine]]:
    """The engines under root whose id starts with `prefix`, and the damaged directories named like engines."""
    root = root or store_root()
    try:
        names = sorted(n for n in os.listdir(root) if is_engine_id(n) and n.startswith(prefix))
    except FileNotFoundError:
        return [], []
    engines: list[Engine] = []
    damaged: list[DamagedEngine] = []
    for name in names:
        path = root / name
        problem, manifest = _examine(path)
        if manifest is not None:
            engines.append(_with_manifest(name, path, manifest))
        else:
            damaged.append(DamagedEngine(name, path, problem or "unreadable"))
    return engines, damaged


def list_engines(root: Path | None = None) -> list[Engine]:
    return scan_store(root)[0]


def resolve_engine(ref: str, root: Path | None = None) -> Engine:
    """Find an engine by its id or a unique prefix of it (at least 4 hex digits, bare or as `blake3:<hex>`),
    like git. A damaged directory matching it is an IntegrityError saying what to do."""
    prefix = engine_prefix(ref)
    engines, damaged = scan_store(root, prefix)
    if len(engines) + len(damaged) > 1:
        ids = [e.id[:12] for e in engines] + [d.id[:12] for d in damaged]
        raise SpecPilotError(f"engine prefix {prefix} is ambiguous: {', '.join(ids)}")
    if damaged:
        raise IntegrityError(damaged[0].advice())
    if not engines:
        raise SpecPilotError(f"no engine {prefix} in {root or store_root()} (build it with `make engine SETTING=...`)")
    return engines[0]


def disk_usage(paths: list[Path]) -> int:
    """Bytes the trees under `paths` take on disk, each hardlinked object counted once."""
    inodes: dict[tuple[int, int], int] = {}
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                inodes[st.st_dev, st.st_ino] = st.st_size
    return sum(inodes.values())


# --- integrity ----------------------------------------------------------------------------------------------


def check_engine(engine: Engine, verified: dict[tuple[int, int], str] | None = None) -> list[str]:
    """Re-hash the tree against its manifest and compare the whole directory listing (files, directories,
    links, special files) with it; return one line per difference (empty when intact)."""
    return inspect_engine(engine, verified).lines()


@dataclass
class EngineState:
    manifest: JsonObject
    manifest_ok: bool
    bad: list[tuple[str, str]]  # (manifest path, what is wrong): missing, size, content, exec bit
    extras: list[tuple[str, str]]  # (path, kind) present but not in the manifest: files, directories, links

    def lines(self) -> list[str]:
        out: list[str] = [] if self.manifest_ok else [f"{MANIFEST_NAME}: its digest is not the engine id"]
        out += [
            f"{rel}: a {kind}, not in the manifest" for rel, kind in self.extras if kind not in ("file", "directory")
        ]
        out += [f"{rel}/: a directory not in the manifest" for rel, kind in self.extras if kind == "directory"]
        problems = {rel: why for rel, why in self.bad}
        problems.update({rel: "not in the manifest" for rel, kind in self.extras if kind == "file"})
        out += [f"{rel}: {problems[rel]}" for rel in sorted(problems, key=_bytes_key)]
        return out


def _bytes_key(p: str) -> bytes:
    return p.encode("utf-8", "surrogateescape")


def inspect_engine(engine: Engine, verified: dict[tuple[int, int], str] | None = None) -> EngineState:
    """What differs between engine's tree and its manifest. `verified`: {(device, inode): digest} of objects
    already hashed (fsck), so a file that is a hardlink of a checked object is not hashed again."""
    raw = (engine.path / MANIFEST_NAME).read_bytes()
    manifest = _json_object(engine.path / MANIFEST_NAME, raw)
    expected: dict[str, Any] = {e["path"]: e for e in manifest["files"]}
    files, dirs, others = walk_tree(engine.path)
    implied = {rel.rsplit("/", i)[0] for rel in expected for i in range(1, rel.count("/") + 1)}
    extras = list(others) + [(d, "directory") for d in dirs if d not in implied]
    bad: list[tuple[str, str]] = []
    present = set(files)
    for rel in files:
        if rel not in expected:
            extras.append((rel, "file"))
    for rel, want in expected.items():
        if rel not in present:
            bad.append((rel, "missing"))
            continue
        path = engine.path / rel
        st = path.lstat()
        if st.st_size != want["size"]:
            bad.append((rel, f"size {st.st_size} != {want['size']}"))
            continue
        hashed = verified is not None and verified.get((st.st_dev, st.st_ino)) == want["blake3"]
        if not hashed and digest_file(path) != want["blake3"]:
            bad.append((rel, f"content differs ({want['blake3'][:19]}…)"))
            continue
        if bool(st.st_mode & 0o111) != want["exec"]:
            bad.append((rel, "executable bit differs"))
    extras.sort(key=lambda e: _bytes_key(e[0]))
    return EngineState(manifest, blake3.blake3(raw).hexdigest() == engine.id, bad, extras)
