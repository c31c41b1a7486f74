"""Store maintenance: repair an engine, check the whole store, remove engines, collect garbage.

Functions return reports and raise typed errors; the command line prints them. Exit codes, by failure kind
(like `nix store verify`), are the constants below: the CLI help and README name them."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.store.engines import (
    INDEX,
    OBJECTS,
    ROOTS,
    TMP,
    DamagedEngine,
    Engine,
    inspect_engine,
    is_engine_id,
    link_into,
    object_mode,
    object_path,
    object_state,
    put_object,
    remove_tree,
    scan_store,
    store_lock,
    store_root,
)
from specpilot_build.store.manifest import (
    JsonObject,
    digest_file,
    entry_kind,
    read_regular,
)
from specpilot_build.store.names import ID_PREFIX, engine_prefix

EXIT_OK = 0  # intact (or everything found was repaired)
EXIT_DAMAGED = 1  # files or objects differ from their digests (`engine check --repair` mends them)
EXIT_ERROR = 2  # a usage error: no such engine, an engine in use, a bad argument
EXIT_DAMAGED_DIR = 3  # an engine directory whose manifest is missing, unreadable or not its id: `engine rm`
EXIT_UNREPAIRED = 4  # --repair could not mend everything (each such file is named)

EXIT_CODES_HELP = (
    "exit codes: 0 intact or repaired, 1 damage found, 2 usage error, 3 damaged engine directory "
    "(remove it with `engine rm`), 4 damage that --repair could not mend"
)

_OBJECT_NAME = re.compile(r"([0-9a-f]{64})(\.x)?")
_TEMP_PID = re.compile(r"\.(?:tmp|link)-(\d+)-[0-9a-f]+$")


class RepairSource(Protocol):
    """Where a repair finds the bytes of a file whose object is damaged or missing."""

    origin: dict[str, str]  # manifest path -> where its bytes were found, for each file `find` returned

    def find(self, rel: str, entry: JsonObject) -> bytes | None: ...

    def why_not(self, rel: str) -> str: ...

    def close(self) -> None: ...


RepairSources = Callable[[Engine, JsonObject, Path], RepairSource]


class ObjectsOnly:
    """The store alone holds no other source of bytes: a damaged file is mended only from a good object.
    assemble/repair.py supplies the pinned wheel, the checkout and a rebuild (the store does not import the build)."""

    def __init__(self, engine: Engine, manifest: JsonObject, root: Path):
        self.origin: dict[str, str] = {}

    def find(self, rel: str, entry: JsonObject) -> bytes | None:
        return None

    def why_not(self, rel: str) -> str:
        return "no good object holds these bytes"

    def close(self) -> None:
        pass


# --- repair --------------------------------------------------------------------------------------------------


@dataclass
class RepairReport:
    engine: Engine
    found: list[str]  # the differences before the repair
    repaired: list[str] = field(default_factory=list)
    unrepairable: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_UNREPAIRED if self.unrepairable else EXIT_OK


def repair_engine(engine: Engine, root: Path | None = None, sources: RepairSources = ObjectsOnly) -> RepairReport:
    """Make engine's tree match its manifest again: remove what the manifest does not list (links, special
    files, stray files and directories), and re-link each differing file from its object once that object is
    good. A damaged or missing object is re-made from bytes that hash to the manifest's digest: the member of
    the sha256-pinned base wheel, the checkout's runtime, overlay or kernel file, the config and launch spec the
    manifest records, or, for files an overlay patched, a rebuild of the engine's setting and arm when that
    build has exactly the engine's manifest head (`sources`: assemble/repair.py). Anything else is named as
    unrepairable."""
    root = root or store_root()
    with store_lock(root):
        state = inspect_engine(engine)
        report = RepairReport(engine, state.lines())
        if not state.manifest_ok:
            raise IntegrityError(
                DamagedEngine(engine.id, engine.path, "manifest.json does not hash to the directory's name").advice()
            )
        for rel, kind in sorted(state.extras, key=lambda e: e[0].count("/")):
            remove_tree(engine.path / rel)
            report.repaired.append(f"{rel}: removed (a {kind} not in the manifest)")
        entries = {e["path"]: e for e in state.manifest["files"]}
        todo = [(rel, entries[rel], why) for rel, why in state.bad]
        source = sources(engine, state.manifest, root)
        for rel, entry, why in todo:
            obj = object_path(root, entry["blake3"], entry["exec"])
            status = object_state(obj, entry["size"], entry["blake3"], entry["exec"])
            if status == "mode":
                os.chmod(obj, object_mode(entry["exec"]))
            elif status != "ok":
                data = source.find(rel, entry)
                if data is None:
                    continue
                obj = put_object(root, data, entry["exec"], entry["blake3"])
                status = f"re-made from {source.origin[rel]}"
            target = engine.path / rel
            _make_parents(engine.path, rel)
            link_into(obj, target)
            report.repaired.append(
                f"{rel}: {why}; re-linked from its object" + ("" if status in ("ok", "mode") else f" ({status})")
            )
        source.close()
        remaining = inspect_engine(engine)
        for rel, why in remaining.bad:
            report.unrepairable.append(f"{rel}: {why}; {source.why_not(rel)}")
        report.unrepairable += [
            line for line in remaining.lines() if not any(line.startswith(f"{rel}: ") for rel, _ in remaining.bad)
        ]
    return report


def _make_parents(tree: Path, rel: str) -> None:
    current = tree
    for part in rel.split("/")[:-1]:
        current = current / part
        if os.path.lexists(current) and entry_kind(os.lstat(current).st_mode) != "directory":
            remove_tree(current)
        current.mkdir(exist_ok=True)


# --- fsck ----------------------------------------------------------------------------------------------------


@dataclass
class FsckReport:
    objects: int = 0
    objects_bad: list[str] = field(default_factory=list)
    objects_mode: list[str] = field(default_factory=list)
    temporaries: int = 0
    engines: int = 0
    engines_bad: dict[str, list[str]] = field(default_factory=dict)
    damaged: list[DamagedEngine] = field(default_factory=list)
    repairs: list[RepairReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.damaged:
            return EXIT_DAMAGED_DIR
        if self.repairs:
            return EXIT_UNREPAIRED if any(r.unrepairable for r in self.repairs) else EXIT_OK
        return EXIT_DAMAGED if (self.objects_bad or self.objects_mode or self.engines_bad) else EXIT_OK


def fsck(root: Path | None = None, repair: bool = False, sources: RepairSources = ObjectsOnly) -> FsckReport:
    """Hash every object against its name and check every engine against its manifest (a file that is a
    hardlink of an object just found good is not hashed twice). With `repair`: damaged objects are deleted
    (content addressing: they are garbage), wrong modes reset, and each differing engine repaired."""
    started = time.perf_counter()
    root = root or store_root()
    report = FsckReport()
    verified: dict[tuple[int, int], str] = {}
    objects = root / OBJECTS
    for shard in sorted(objects.iterdir()) if objects.is_dir() else []:
        if not shard.is_dir() or shard.is_symlink():
            report.objects_bad.append(
                f"{OBJECTS}/{shard.name}: a {entry_kind(os.lstat(shard).st_mode)}, not an object directory"
            )
            continue
        for obj in sorted(shard.iterdir()):
            rel = f"{OBJECTS}/{shard.name}/{obj.name}"
            m = _OBJECT_NAME.fullmatch(obj.name)
            if not m:
                if _TEMP_PID.search(obj.name):
                    report.temporaries += 1
                else:
                    report.objects_bad.append(f"{rel}: not named like an object")
                continue
            report.objects += 1
            st = os.lstat(obj)
            digest, executable = "blake3:" + m.group(1), bool(m.group(2))
            if entry_kind(st.st_mode) != "file":
                report.objects_bad.append(f"{rel}: a {entry_kind(st.st_mode)}, not a file")
                continue
            if not m.group(1).startswith(shard.name) or digest_file(obj) != digest:
                report.objects_bad.append(f"{rel}: content does not match its name")
                if repair:
                    os.unlink(obj)
                continue
            verified[st.st_dev, st.st_ino] = digest
            if (st.st_mode & 0o7777) != object_mode(executable):
                report.objects_mode.append(f"{rel}: mode {st.st_mode & 0o7777:o}, not {object_mode(executable):o}")
                if repair:
                    os.chmod(obj, object_mode(executable))
    engines, report.damaged = scan_store(root)
    report.engines = len(engines)
    for engine in engines:
        lines = inspect_engine(engine, verified).lines()
        if lines:
            report.engines_bad[engine.id] = lines
            if repair:
                report.repairs.append(repair_engine(engine, root, sources))
    report.seconds = time.perf_counter() - started
    return report


# --- rm and gc -----------------------------------------------------------------------------------------------


def in_use(root: Path | None = None) -> dict[str, str]:
    """Engines that must be kept: {id: why}: a live run record (<data>/runs/<port>.json whose pid runs that
    engine) or a line of engines/.roots (full ids or unique prefixes, `#` comments)."""
    root = root or store_root()
    kept: dict[str, str] = {}
    runs = data_dir() / "runs"
    for record_file in sorted(runs.glob("*.json")) if runs.is_dir() else []:
        try:
            record = json.loads(read_regular(record_file)[0])
            pid, eid, port = int(record["pid"]), str(record["engine_id"]), record["port"]
        except (SpecPilotError, OSError, ValueError, KeyError, TypeError):
            continue
        if _serving(pid, eid, port):
            kept[eid] = f"served on port {port} (pid {pid}, {record_file})"
    roots = root / ROOTS
    if os.path.lexists(roots):
        ids = [p.name for p in root.iterdir() if is_engine_id(p.name)]
        for line in read_regular(roots, "engines/.roots")[0].decode("utf-8", "replace").splitlines():
            ref = line.split("#", 1)[0].strip().lower().removeprefix(ID_PREFIX)
            if ref:
                for eid in ids:
                    if eid.startswith(ref):
                        kept.setdefault(eid, f"listed in {roots}")
    return kept


def _serving(pid: int, eid: str, port: object) -> bool:
    """As serve/process.py's _is_our_process: the pid runs and its command line names the engine or the port."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return eid.encode() in cmdline or str(port).encode() in cmdline.split(b"\0")


def find_entry(ref: str, root: Path) -> tuple[str, Path, str | None]:
    """(id, path, damage or None) of the engine directory an id or unique prefix names, damaged ones included."""
    ref = engine_prefix(ref)
    engines, damaged = scan_store(root, ref)
    found: list[tuple[str, Path, str | None]] = [(e.id, e.path, None) for e in engines]
    found += [(d.id, d.path, d.reason) for d in damaged]
    if not found:
        raise SpecPilotError(f"no engine {ref} in {root}")
    if len(found) > 1:
        raise SpecPilotError(f"engine prefix {ref} is ambiguous: {', '.join(f[0][:12] for f in found)}")
    return found[0]


def remove_engine(ref: str, root: Path | None = None, force: bool = False) -> str:
    """Remove one engine directory (damaged or not); refuses an engine in use unless `force`. Returns its id.
    The tree is first renamed into engines/.tmp/, so no half-removed engine is ever visible."""
    root = root or store_root()
    with store_lock(root, exclusive=True):
        eid, path, _ = find_entry(ref, root)
        why = in_use(root).get(eid)
        if why and not force:
            raise SpecPilotError(f"engine {eid[:12]} is {why}; stop it / unlist it first (or --force)")
        (root / TMP).mkdir(exist_ok=True)
        doomed = root / TMP / f"{os.getpid()}-rm-{uuid.uuid4().hex[:12]}"
        os.rename(path, doomed)
        remove_tree(doomed)
        _drop_index_entries(root, {eid})
    return eid


def _drop_index_entries(root: Path, ids: set[str]) -> None:
    index = root / INDEX
    for entry in index.iterdir() if index.is_dir() else []:
        try:
            if read_regular(entry)[0].decode("ascii", "replace").strip() in ids:
                os.unlink(entry)
        except (SpecPilotError, OSError):
            continue


@dataclass
class GcReport:
    dry_run: bool
    engines: list[str] = field(default_factory=list)  # engines removed (--engines)
    kept: dict[str, str] = field(default_factory=dict)  # engines kept because in use
    objects: int = 0
    object_bytes: int = 0
    temporaries: list[str] = field(default_factory=list)
    index_entries: list[str] = field(default_factory=list)


def gc(root: Path | None = None, dry_run: bool = False, engines: bool = False) -> GcReport:
    """Remove what nothing needs: objects no engine references (by manifest or by hardlink), temporary trees
    and files of processes that no longer run, index entries that do not name a whole engine. With `engines`,
    first every engine that is neither served (live run record) nor listed in engines/.roots."""
    root = root or store_root()
    report = GcReport(dry_run)
    if not root.is_dir():
        return report
    with store_lock(root, exclusive=True):
        report.kept = in_use(root)
        whole = scan_store(root)[0]
        if engines:
            for engine in whole:
                if engine.id not in report.kept:
                    report.engines.append(engine.id)
                    if not dry_run:
                        doomed = root / TMP / f"{os.getpid()}-gc-{uuid.uuid4().hex[:12]}"
                        (root / TMP).mkdir(exist_ok=True)
                        os.rename(engine.path, doomed)
                        remove_tree(doomed)
            whole = [e for e in whole if e.id not in report.engines]
        _gc_temporaries(root, report, dry_run)
        alive = {e.id for e in whole}
        index = root / INDEX
        for entry in sorted(index.iterdir()) if index.is_dir() else []:
            if entry.name.startswith("."):
                continue  # index writes left by a killed build: counted with the temporaries
            try:
                eid = read_regular(entry)[0].decode("ascii").strip()
            except (SpecPilotError, OSError, UnicodeDecodeError):
                eid = None
            if not is_engine_id(entry.name) or eid not in alive:
                report.index_entries.append(f"{INDEX}/{entry.name}")
                if not dry_run:
                    remove_tree(entry)
        referenced = set()
        for engine in whole:
            for f in engine.manifest["files"]:
                referenced.add(object_path(root, f["blake3"], f["exec"]))
        objects = root / OBJECTS
        for shard in sorted(objects.iterdir()) if objects.is_dir() else []:
            for obj in sorted(shard.iterdir()) if shard.is_dir() and not shard.is_symlink() else []:
                if _TEMP_PID.search(obj.name):
                    continue  # counted with the temporaries
                st = os.lstat(obj)
                if obj in referenced or (entry_kind(st.st_mode) == "file" and st.st_nlink > 1):
                    continue
                report.objects += 1
                report.object_bytes += st.st_size
                if not dry_run:
                    remove_tree(obj)
    return report


def _gc_temporaries(root: Path, report: GcReport, dry_run: bool) -> None:
    """Under the exclusive store lock no build or repair runs, so every temporary left is stale: build trees
    under .tmp/, staged objects (`*.tmp-<pid>-*`) and index entries being written (`.<key>.<pid>`)."""
    tmp = root / TMP
    found = sorted(tmp.iterdir()) if tmp.is_dir() else []
    objects = root / OBJECTS
    for shard in sorted(objects.iterdir()) if objects.is_dir() else []:
        if shard.is_dir() and not shard.is_symlink():
            found += [p for p in sorted(shard.iterdir()) if _TEMP_PID.search(p.name)]
    index = root / INDEX
    found += [p for p in sorted(index.iterdir()) if p.name.startswith(".")] if index.is_dir() else []
    for path in found:
        report.temporaries.append(path.relative_to(root).as_posix())
        if not dry_run:
            remove_tree(path)
