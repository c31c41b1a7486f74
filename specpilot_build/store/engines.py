"""The content-addressed engine store: engines/<id>/ trees whose files are hardlinks into engines/.objects/.

A build assembles a tree under engines/.tmp/, hashes it, moves each file's content into the object store (one
copy per distinct content and executable bit), writes the manifest and renames the tree to engines/<id> in one
step. Two builds of the same engine race harmlessly: the loser finds the id present and drops its tree."""
from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import engines_dir
from specpilot_build.store.manifest import MANIFEST_NAME, canonical_json, digest_bytes, digest_file, engine_id, file_entry, walk_files

OBJECTS = ".objects"
TMP = ".tmp"
INDEX = ".index"


@dataclass(frozen=True)
class Engine:
    id: str
    path: Path

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST_NAME).read_bytes())

    @cached_property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_bytes())

    @property
    def model_pin(self) -> dict:
        pin = self.manifest["inputs"]["checkpoints"]["model"]
        return {"repo": pin["repo"], "revision": pin["revision"]}


def store_root() -> Path:
    return engines_dir()


def new_build_dir(root: Path | None = None) -> Path:
    root = root or store_root()
    tmp = root / TMP
    tmp.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(tmp)
    path = tmp / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def commit(tree: Path, manifest_without_files: dict, root: Path | None = None) -> tuple[Engine, bool]:
    """Hash `tree`, intern its files as objects, and move it to engines/<id>. Returns (engine, created)."""
    root = root or store_root()
    entries = [file_entry(tree, rel) for rel in walk_files(tree)]
    manifest = dict(manifest_without_files, files=entries)
    eid = engine_id(manifest)
    final = root / eid
    if (final / MANIFEST_NAME).exists():
        shutil.rmtree(tree, ignore_errors=True)
        return Engine(eid, final), False
    for entry in entries:
        _intern(root, tree / entry["path"], entry)
    (tree / MANIFEST_NAME).write_bytes(canonical_json(manifest))
    os.chmod(tree / MANIFEST_NAME, 0o444)
    try:
        os.rename(tree, final)
    except OSError:
        if not (final / MANIFEST_NAME).exists():
            raise
        shutil.rmtree(tree, ignore_errors=True)  # a concurrent build of the same engine won the rename
        return Engine(eid, final), False
    return Engine(eid, final), True


def _intern(root: Path, path: Path, entry: dict) -> None:
    """Make `path` a hardlink of the object holding its content, creating the object if needed.

    An existing object is never replaced unless its content no longer matches its name: replacing an inode
    that a concurrent build is linking would make that link fail."""
    obj = object_path(root, entry["blake3"], entry["exec"])
    if obj.exists() and os.path.samestat(obj.stat(), path.lstat()):
        return  # assembled as a hardlink of this very object
    os.chmod(path, 0o555 if entry["exec"] else 0o444)
    obj.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, obj)  # the first copy of this content becomes the object
        return
    except FileExistsError:
        pass
    if obj.stat().st_size == entry["size"] and digest_file(obj) == entry["blake3"]:
        tmp_link = path.with_name(path.name + ".link-" + uuid.uuid4().hex[:8])
        os.link(obj, tmp_link)
        os.replace(tmp_link, path)
        return
    staged = obj.with_name(obj.name + ".tmp-" + uuid.uuid4().hex[:8])
    os.link(path, staged)
    os.replace(staged, obj)  # repairs an object whose content no longer matches its name


def object_path(root: Path, digest: str, executable: bool) -> Path:
    hexdigest = digest.split(":", 1)[-1]
    return root / OBJECTS / hexdigest[:2] / (hexdigest + (".x" if executable else ""))


def put_object(root: Path, data: bytes, executable: bool) -> Path:
    """The read-only object holding `data`, written once; a build hardlinks it into its tree."""
    obj = object_path(root, digest_bytes(data), executable)
    if not obj.exists():
        obj.parent.mkdir(parents=True, exist_ok=True)
        staged = obj.with_name(obj.name + ".tmp-" + uuid.uuid4().hex[:8])
        with open(staged, "wb") as out:
            out.write(data)
        os.chmod(staged, 0o555 if executable else 0o444)
        try:
            os.link(staged, obj)
        except FileExistsError:
            pass
        finally:
            os.unlink(staged)
    return obj


def _sweep_abandoned(tmp: Path) -> None:
    """Remove build directories of processes that no longer run (interrupted builds)."""
    for child in tmp.iterdir():
        pid = child.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- lookup -------------------------------------------------------------------------------------------------

def list_engines(root: Path | None = None) -> list[Engine]:
    root = root or store_root()
    if not root.is_dir():
        return []
    return [Engine(p.name, p) for p in sorted(root.iterdir())
            if len(p.name) == 64 and (p / MANIFEST_NAME).is_file()]


def resolve_engine(ref: str, root: Path | None = None) -> Engine:
    """Find an engine by its id or a unique prefix of it (at least 4 hex digits), like git."""
    ref = (ref or "").strip().lower()
    if len(ref) < 4 or any(c not in "0123456789abcdef" for c in ref):
        raise SpecPilotError(f"'{ref}' is not an engine id (give at least 4 hex digits of one; `specpilot engine ls`)")
    matches = [e for e in list_engines(root) if e.id.startswith(ref)]
    if not matches:
        raise SpecPilotError(f"no engine {ref} in {root or store_root()} (build it with `make engine SETTING=...`)")
    if len(matches) > 1:
        raise SpecPilotError(f"engine prefix {ref} is ambiguous: {', '.join(e.id[:12] for e in matches)}")
    return matches[0]


def disk_usage(paths: list[Path]) -> int:
    """Bytes the trees under `paths` take on disk, each hardlinked object counted once."""
    inodes = {}
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                inodes[st.st_dev, st.st_ino] = st.st_size
    return sum(inodes.values())


# --- integrity ----------------------------------------------------------------------------------------------

def check_engine(engine: Engine) -> list[str]:
    """Re-hash the tree against its manifest; return one line per difference (empty when intact)."""
    problems = []
    raw = (engine.path / MANIFEST_NAME).read_bytes()
    import blake3
    if blake3.blake3(raw).hexdigest() != engine.id:
        problems.append(f"{MANIFEST_NAME}: its digest is not the engine id {engine.id[:12]}")
    expected = {e["path"]: e for e in json.loads(raw)["files"]}
    present = set(walk_files(engine.path))
    for rel in sorted(set(expected) | present, key=lambda p: p.encode()):
        if rel not in present:
            problems.append(f"{rel}: missing")
            continue
        if rel not in expected:
            problems.append(f"{rel}: not in the manifest")
            continue
        want = expected[rel]
        path = engine.path / rel
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel}: not a regular file")
        elif st.st_size != want["size"]:
            problems.append(f"{rel}: size {st.st_size} != {want['size']}")
        elif digest_file(path) != want["blake3"]:
            problems.append(f"{rel}: content differs ({want['blake3'][:19]}…)")
        elif bool(st.st_mode & 0o111) != want["exec"]:
            problems.append(f"{rel}: executable bit differs")
    return problems
