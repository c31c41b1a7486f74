"""What a bundle holds, as archive members, each with the digest its bytes must have when they are packed.

The layout is the installed prefix's:

    engines/<id>/...                    each engine tree exactly as stored (its manifest included)
    data/huggingface/hub/<repo>/snapshots/<revision>/<file>
                                        the pinned checkpoint files (regular files, no blob links)
    data/converted/<repo>/<revision>/<name>[-padded]/...
                                        llama2.c checkpoints as serve loads them (converted, checked)
    data/synthetic/<repo>/<revision>/...  checkpoints SpecPilot writes itself (and their tokenizer source)
    data/drafters/<id hex>/...          drafters `make draft` made, as serve finds them by their pinned id
    data/datasets/<file>                the pinned benchmark files bench reads
    env/...                             the engine's environment, first on the engine's PYTHONPATH after its tree
    specpilot/specpilot_build/, specpilot/lockfiles/, specpilot/conf/
                                        SpecPilot itself, to run serve/stop/bench/verify/compare there
    bin/specpilot                       the launcher: SpecPilot with everything pointed into the prefix
    install.py                          the installer (also shipped beside the parts)

so that on the host serve finds the engine in the store, and `hub.checkpoints.model_dirs` finds and verifies
the models in the data directory, exactly as on the build machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.locations import REPO_ROOT, data_dir, hf_cache_dir, mirror_dir
from specpilot_build.models.checkpoints import (
    LLAMA2C_FORMATS,
    WHEEL_FORMATS,
    model_dirs,
    padded_pins,
    snapshot_dir,
    synthetic_tokenizer_dir,
)
from specpilot_build.models.synthetic import is_synthetic
from specpilot_build.store.engines import Engine, check_engine, checked_manifest
from specpilot_build.store.manifest import MANIFEST_NAME, entry_kind

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "specpilot.sh"
INSTALLER = HERE / "install.py"
# SpecPilot's own files a prefix needs at run time: the package, its pins and its settings (bench builds the
# ar oracle from them). Tests, benchmarks, the venv and build inputs (overlays, kernels, wheels) stay out.
SPECPILOT_DIRS = ("specpilot_build", "lockfiles", "conf")
SKIPPED_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Member:
    """One archive member: `name` inside the archive, read from `source`; `blake3` ("blake3:<hex>") or
    `sha256` (hex) is what those bytes must hash to, checked while they are packed."""

    name: str
    source: Path
    executable: bool
    blake3: str | None = None
    sha256: str | None = None


def bundle_members(
    engines: list[Engine], env_dir: Path | None = None, env_files: dict[str, str] | None = None
) -> list[Member]:
    """Every member of a bundle of `engines` (and the environment directory `env_dir`, whose files must be
    exactly `env_files`, path → "blake3:<hex>", when given), in a fixed order (`_order`)."""
    members: dict[str, Member] = {}
    for engine in engines:
        for member in engine_members(engine) + model_members(engine):
            _add(members, member)
    groups = [
        specpilot_members(),
        dataset_members(),
        [Member("bin/specpilot", LAUNCHER, True), Member("install.py", INSTALLER, True)],
    ]
    if env_dir is not None:
        groups.append(environment_members(env_dir, env_files))
    for group in groups:
        for member in group:
            _add(members, member)
    return [members[name] for name in sorted(members, key=_order)]


def _order(name: str) -> tuple[bytes, bytes]:
    """Each engine tree's files side by side with the same file of the other engines (engines/<id>/<path> by
    <path> first), so that the compressor's window sees the copies together and stores them once."""
    parts = name.split("/", 2)
    inner = parts[2] if parts[0] == "engines" and len(parts) == 3 else name
    return inner.encode("utf-8", "surrogateescape"), name.encode("utf-8", "surrogateescape")


def engine_members(engine: Engine) -> list[Member]:
    """The engine tree as stored, refused (naming every differing file) unless it matches its manifest; each
    file then carries its manifest digest, so bytes that change before they are packed are refused too."""
    manifest = checked_manifest(engine)
    problems = check_engine(engine)
    if problems:
        raise IntegrityError(
            f"engine {engine.id[:12]} differs from its manifest, refusing to bundle it: "
            f"{'; '.join(problems[:5])}; `specpilot engine check --repair {engine.id[:12]}`"
        )
    root = f"engines/{engine.id}"
    members = [Member(f"{root}/{MANIFEST_NAME}", engine.path / MANIFEST_NAME, False)]
    for entry in manifest["files"]:
        members.append(
            Member(f"{root}/{entry['path']}", engine.path / entry["path"], entry["exec"], blake3=entry["blake3"])
        )
    return members


def model_members(engine: Engine) -> list[Member]:
    """The checkpoint files serve resolves for the engine, where serve looks for them under a data directory:
    the pinned files in the Hugging Face cache layout and, for llama2.c checkpoints, the converted directory.
    Fetched (or taken from the mirror) and verified here first, as serve does."""
    checkpoints, config = engine.manifest["inputs"]["checkpoints"], engine.config
    dirs = model_dirs(checkpoints, config)
    cache, data = hf_cache_dir(), data_dir()
    members = []
    for role, record in checkpoints.items():
        if record is None:
            continue
        section = config[role]
        if role == "drafter" and section.get("recipe"):  # a drafter `make draft` made: its store directory
            members += _directory_members(dirs[role], data, {f["path"]: f["sha256"] for f in record["converted"]})
            continue
        if is_synthetic(record["repo"]):
            members += _synthetic_members(record, dirs[role], cache, data)
            continue
        wheel_dtype = WHEEL_FORMATS.get(section.get("source_format") or "hf")
        if wheel_dtype:  # the converted directory alone: serve finds it verified and needs no wheel
            key = "converted" if wheel_dtype == "float32" else "converted_bf16"
            members += _directory_members(dirs[role], data, {f["path"]: f["sha256"] for f in record.get(key, [])})
            continue
        files = [f for f in record.get("files", []) if not section.get("files") or f["path"] in section["files"]]
        if not files:
            raise SpecPilotError(
                f"engine {engine.id[:12]}: {record['repo']} ({role}) is pinned without its files "
                f"(no sizes/sha256 in checkpoints.toml), so the host could not verify them; "
                f"run `make lock SETTING={config['setting']}` and rebuild"
            )
        members += _snapshot_members(
            cache, record["repo"], record["revision"], [(f["path"], f["sha256"]) for f in files]
        )
        source_format = section.get("source_format") or "hf"
        if source_format in LLAMA2C_FORMATS:
            members += _directory_members(
                dirs[role], data, _converted_pins(record, padded=source_format == "llama2c-padded")
            )
    return members


def _snapshot_members(cache: Path, repo: str, revision: str, files: list[tuple[str, str]]) -> list[Member]:
    """Pinned files (path, sha256) of a hub snapshot, at their place in the Hugging Face cache layout."""
    snapshot = snapshot_dir(cache, repo, revision)
    return [
        Member(
            "data/huggingface/hub/" + (snapshot / path).relative_to(cache).as_posix(),
            (snapshot / path).resolve(),
            False,
            sha256=sha256,
        )
        for path, sha256 in files
    ]


def _directory_members(directory: Path, data: Path, expected: dict[str, str]) -> list[Member]:
    """Every file of a converted or generated directory under the data directory, with its pinned sha256."""
    return [
        Member("data/" + path.relative_to(data).as_posix(), path, False, sha256=expected.get(path.name))
        for path in sorted(directory.iterdir())
    ]


def _synthetic_members(record: dict, directory: Path, cache: Path, data: Path) -> list[Member]:
    """A checkpoint SpecPilot writes itself (models/synthetic.py): its generated files, checked against the pin's
    `converted`, and the tokenizer source serve materializes (and verifies) before it finds them already written."""
    from specpilot_build.models.synthetic import TOKENIZER_SOURCE
    from specpilot_build.pins.lockfile import load_lock

    members = [
        Member(
            "data/" + (directory / f["path"]).relative_to(data).as_posix(),
            directory / f["path"],
            False,
            sha256=f["sha256"],
        )
        for f in record["converted"]
    ]
    repo = TOKENIZER_SOURCE["repo"]
    pin = load_lock().checkpoints[repo]
    members += _snapshot_members(
        cache, repo, pin.revision, [(f.path, f.sha256) for f in pin.files if f.path in TOKENIZER_SOURCE["files"]]
    )
    members += _directory_members(synthetic_tokenizer_dir(), data, {f.path: f.sha256 for f in pin.converted})
    return members


def _converted_pins(record: dict, *, padded: bool) -> dict[str, str]:
    """file name → sha256 of a conversion: the manifest's `converted`, or the lock's `converted_padded`."""
    if not padded:
        return {f["path"]: f["sha256"] for f in record.get("converted", [])}
    revision, files = padded_pins().get(record["repo"], ("", ()))
    return {f.path: f.sha256 for f in files} if revision == record["revision"] else {}


def environment_members(env_dir: Path, env_files: dict[str, str] | None) -> list[Member]:
    """The environment as env/...; with `env_files` (the kept files its installer recorded) the directory must
    hold exactly those files, and each is packed only if its bytes still hash to the recorded digest."""
    members = directory_members(env_dir, "env", where="the environment directory")
    if env_files is None:
        return members
    present = {m.name[len("env/") :] for m in members}
    extra, missing = sorted(present - set(env_files)), sorted(set(env_files) - present)
    if extra or missing:
        what = f"{extra[0]} is not in its record" if extra else f"{missing[0]} is missing"
        raise IntegrityError(f"environment {env_dir}: {what}; refusing to bundle it")
    return [Member(m.name, m.source, m.executable, blake3=env_files[m.name[len("env/") :]]) for m in members]


def dataset_members() -> list[Member]:
    """The pinned benchmark files (lockfiles/datasets.toml) as data/datasets/<file>, where bench's loader looks
    first (measure/datasets.py), each checked against its pinned sha256 while packed; a file in neither the data
    directory nor the mirror is refused (bench here fetches it once)."""
    import tomllib

    lock_path = REPO_ROOT / "lockfiles" / "datasets.toml"
    members = []
    for name, pin in sorted(tomllib.loads(lock_path.read_text()).items()):
        mirror = mirror_dir()
        places = [data_dir() / "datasets" / pin["file"]] + ([mirror / "datasets" / pin["file"]] if mirror else [])
        source = next((p for p in places if p.is_file()), None)
        if source is None:
            raise SpecPilotError(
                f"{lock_path} [{name}]: {pin['file']} is in neither {places[0].parent.parent} nor "
                f"the mirror; run `specpilot bench` once here (it fetches it) and bundle again"
            )
        members.append(Member(f"data/datasets/{pin['file']}", source.resolve(), False, sha256=pin["sha256"]))
    return members


def specpilot_members() -> list[Member]:
    members = []
    for top in SPECPILOT_DIRS:
        members += directory_members(REPO_ROOT / top, f"specpilot/{top}", where="SpecPilot's sources")
    return [m for m in members if not m.name.endswith(".pyc")]


def directory_members(root: Path, prefix: str, *, where: str) -> list[Member]:
    """Every regular file under `root` as `prefix/<relative path>` (exec bit kept, __pycache__ left out);
    a link, FIFO, socket or device is refused naming its path."""
    if not root.is_dir():
        raise SpecPilotError(f"{root}: not a directory ({where})")
    members = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            kind = entry_kind(mode)
            if kind != "file":
                raise SpecPilotError(f"{path}: a {kind} in {where}; refused (a bundle holds files only)")
            members.append(Member(f"{prefix}/{path.relative_to(root).as_posix()}", path, bool(mode & 0o111)))
    return members


def _add(members: dict[str, Member], member: Member) -> None:
    existing = members.get(member.name)
    if existing is not None and existing != member:
        raise SpecPilotError(
            f"bundle member {member.name} comes from two places ({existing.source}, "
            f"{member.source}) with different contents or modes"
        )
    members[member.name] = member
