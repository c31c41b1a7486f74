"""Host profiles and environment locks: what an air-gapped GPU host already has, and the exact wheels an SGLang
runtime needs there on top of it (lockfiles/hosts/<host>.toml, lockfiles/envs/<runtime>@<host>.toml).

A host profile is the host's Python, the platform tags its pip accepts, its CUDA major and its packages
(name → version, as `pip list --format=freeze` prints them). Its digest is over the parsed values, so comments
do not move it. An environment lock names the profile digest it was resolved against and carries a digest of its
own entries: a lock edited by hand, or resolved against a profile that has changed since, is refused naming
`make env-lock`. Resolution itself (pip) is hosts/resolve.py."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import blake3
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from specpilot_build.errors import PinError
from specpilot_build.locations import lockfiles_dir

SHA256 = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^blake3:[0-9a-f]{64}$")
PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
PROFILE_KEYS = {"name", "python", "platforms", "cuda_major", "packages"}
LOCK_KEYS = {
    "runtime",
    "host",
    "profile_digest",
    "python",
    "platforms",
    "cuda_major",
    "requirements",
    "staying",
    "wheel",
    "digest",
}
WHEEL_KEYS = {"name", "version", "filename", "url", "sha256", "size", "requires"}


def digest_of(obj) -> str:
    """blake3 of canonical JSON (sorted keys, fixed separators) — the store's own canonical form."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "blake3:" + blake3.blake3(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class HostProfile:
    name: str
    python: str  # "3.12.3"
    platforms: tuple[str, ...]  # platform tags the host's pip accepts, most specific first
    cuda_major: int
    packages: dict  # canonical name -> version string, as the host's freeze prints it
    path: Path
    digest: str

    @property
    def python_short(self) -> str:
        return ".".join(self.python.split(".")[:2])


@dataclass(frozen=True)
class LockedWheel:
    name: str  # canonical distribution name
    version: str
    filename: str
    url: str
    sha256: str
    size: int
    requires: tuple[str, ...]  # the travelling distributions it needs on the host


@dataclass(frozen=True)
class EnvLock:
    runtime: str
    host: str
    profile_digest: str
    python: str
    platforms: tuple[str, ...]
    cuda_major: int
    requirements: tuple[str, ...]
    staying: dict  # canonical name -> host version: required, and the host's copy satisfies every requirement
    wheels: tuple[LockedWheel, ...]  # what travels, sorted by name
    path: Path
    digest: str

    def record(self) -> dict:
        """What an engine's manifest records of it (the id covers the lock through its digest)."""
        return {"lock": f"envs/{self.path.name}", "digest": self.digest, "profile_digest": self.profile_digest}


def hosts_dir(directory: Path | None = None) -> Path:
    return (directory or lockfiles_dir()) / "hosts"


def envs_dir(directory: Path | None = None) -> Path:
    return (directory or lockfiles_dir()) / "envs"


def env_lock_path(runtime: str, host: str, directory: Path | None = None) -> Path:
    return envs_dir(directory) / f"{_plain(runtime, 'runtime')}@{_plain(host, 'host')}.toml"


def _plain(value, what: str) -> str:
    if not isinstance(value, str) or not PLAIN.fullmatch(value):
        raise PinError(f"{what} {value!r} is not a plain name (letters, digits, '._+-')")
    return value


def _read(path: Path, hint: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise PinError(f"{path} does not exist; {hint}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PinError(f"{path}: not valid TOML: {exc}") from None


def profile_body(name: str, python: str, platforms: list[str], cuda_major: int, packages: dict) -> dict:
    """The values a profile's digest covers (also what the profile writer writes)."""
    return {
        "name": name,
        "python": python,
        "platforms": list(platforms),
        "cuda_major": cuda_major,
        "packages": {canonicalize_name(k): str(v) for k, v in sorted(packages.items())},
    }


def host_profile_path(name: str, directory: Path | None = None) -> Path:
    return hosts_dir(directory) / f"{_plain(name, 'host profile')}.toml"


def load_host_profile(name: str, directory: Path | None = None) -> HostProfile:
    path = host_profile_path(name, directory)
    data = _read(path, f"a host profile is made with `specpilot env host-profile --freeze FILE --host {name}`")
    unknown = sorted(set(data) - PROFILE_KEYS)
    missing = sorted(PROFILE_KEYS - set(data))
    if unknown or missing:
        raise PinError(
            f"{path}: keys {', '.join(unknown)} are not profile keys"
            if unknown
            else f"{path}: missing key {', '.join(missing)}"
        )
    if data["name"] != name:
        raise PinError(f"{path}: name is {data['name']!r}, the file says {name!r}")
    if not isinstance(data["python"], str) or not re.fullmatch(r"3\.\d+\.\d+", data["python"]):
        raise PinError(f'{path}: python must be a full version like "3.12.3", got {data["python"]!r}')
    platforms = data["platforms"]
    if not platforms or not all(isinstance(p, str) and PLAIN.fullmatch(p) for p in platforms):
        raise PinError(f"{path}: platforms must be a non-empty list of platform tags, got {platforms!r}")
    if not isinstance(data["cuda_major"], int) or data["cuda_major"] < 1:
        raise PinError(f"{path}: cuda_major must be a positive integer, got {data['cuda_major']!r}")
    packages = data["packages"]
    if not isinstance(packages, dict) or not all(isinstance(v, str) and v for v in packages.values()):
        raise PinError(f"{path}: [packages] must map each package name to its version string")
    body = profile_body(name, data["python"], platforms, data["cuda_major"], packages)
    return HostProfile(
        name=name,
        python=data["python"],
        platforms=tuple(platforms),
        cuda_major=data["cuda_major"],
        packages=body["packages"],
        path=path,
        digest=digest_of(body),
    )


def lock_body(
    runtime: str,
    host: str,
    profile_digest: str,
    python: str,
    platforms,
    cuda_major: int,
    requirements,
    staying: dict,
    wheels,
) -> dict:
    """The values a lock's digest covers (also what the lock writer writes)."""
    return {
        "runtime": runtime,
        "host": host,
        "profile_digest": profile_digest,
        "python": python,
        "platforms": list(platforms),
        "cuda_major": cuda_major,
        "requirements": list(requirements),
        "staying": dict(sorted(staying.items())),
        "wheel": [dict(sorted(w.items())) for w in sorted(wheels, key=lambda w: w["name"])],
    }


def load_env_lock(
    runtime: str, host: str, directory: Path | None = None, profile: HostProfile | None = None
) -> EnvLock:
    """The lock of `runtime` on `host`, checked: its shape, every wheel entry, its own digest, and that it was
    resolved against the host profile as it is now."""
    path = env_lock_path(runtime, host, directory)
    again = f"run `make env-lock RUNTIME={runtime} HOST={host}`"
    data = _read(path, f"{again} to resolve it")
    unknown, missing = sorted(set(data) - LOCK_KEYS), sorted(LOCK_KEYS - set(data))
    if unknown or missing:
        raise PinError(
            f"{path}: "
            + (f"unknown keys {', '.join(unknown)}" if unknown else f"missing key {', '.join(missing)}")
            + f"; {again}"
        )
    if (data["runtime"], data["host"]) != (runtime, host):
        raise PinError(f"{path}: records runtime {data['runtime']!r} on host {data['host']!r}; {again}")
    wheels = tuple(_wheel(row, path, again) for row in data["wheel"])
    body = lock_body(
        runtime,
        host,
        data["profile_digest"],
        data["python"],
        data["platforms"],
        data["cuda_major"],
        data["requirements"],
        data["staying"],
        [dict(vars(w), requires=list(w.requires)) for w in wheels],
    )
    if not isinstance(data["digest"], str) or digest_of(body) != data["digest"]:
        raise PinError(
            f"{path}: its entries do not hash to its digest {str(data['digest'])[:23]}… (edited by hand?); {again}"
        )
    profile = profile or load_host_profile(host, directory)
    if profile.digest != data["profile_digest"]:
        raise PinError(
            f"{path} was resolved against host profile {data['profile_digest'][:23]}…, but "
            f"{profile.path} is now {profile.digest[:23]}… (stale lock); {again}"
        )
    names = [w.name for w in wheels]
    if len(set(names)) != len(names):
        raise PinError(f"{path}: a distribution is listed twice; {again}")
    dangling = sorted({r for w in wheels for r in w.requires} - set(names))
    if dangling:
        raise PinError(f"{path}: wheels require {', '.join(dangling)}, which the lock does not list; {again}")
    return EnvLock(
        runtime=runtime,
        host=host,
        profile_digest=data["profile_digest"],
        python=data["python"],
        platforms=tuple(data["platforms"]),
        cuda_major=data["cuda_major"],
        requirements=tuple(data["requirements"]),
        staying=dict(data["staying"]),
        wheels=wheels,
        path=path,
        digest=data["digest"],
    )


def _wheel(row, path: Path, again: str) -> LockedWheel:
    if not isinstance(row, dict) or set(row) != WHEEL_KEYS:
        raise PinError(f"{path}: each [[wheel]] needs exactly {', '.join(sorted(WHEEL_KEYS))}; got {row!r}")
    where = f"{path}: wheel {row.get('filename')!r}"
    try:
        name, version, _build, _tags = parse_wheel_filename(str(row["filename"]))
    except InvalidWheelFilename:
        raise PinError(f"{where}: not a wheel filename; {again}") from None
    if "/" in row["filename"] or (canonicalize_name(name), str(version)) != (row["name"], row["version"]):
        raise PinError(f"{where}: its filename does not name {row['name']} {row['version']}; {again}")
    if not SHA256.fullmatch(str(row["sha256"])):
        raise PinError(f"{where}: sha256 must be 64 hex digits; {again}")
    if not isinstance(row["size"], int) or row["size"] <= 0:
        raise PinError(f"{where}: size must be a positive integer; {again}")
    url = str(row["url"])
    if not url.startswith("https://") or unquote(url.rsplit("/", 1)[-1].split("#")[0]) != row["filename"]:
        raise PinError(f"{where}: url must be an https URL ending in the filename; {again}")
    if not isinstance(row["requires"], list) or not all(isinstance(r, str) for r in row["requires"]):
        raise PinError(f"{where}: requires must be a list of distribution names; {again}")
    return LockedWheel(**{k: row[k] for k in WHEEL_KEYS - {"requires"}}, requires=tuple(row["requires"]))
