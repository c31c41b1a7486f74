"""`make env-lock RUNTIME=... HOST=...`: resolve the exact wheels a runtime needs on a host, with pip's own
resolver for the host's platform, and keep only what the host does not already have.

pip resolves the whole requirement set for the host profile's Python and platform tags (`pip install --dry-run
--ignore-installed --only-binary=:all: --report`, isolated from this machine's pip configuration, against PyPI);
that gives one consistent set. Then, walking from the requirements, a package the host has at a version that
satisfies every requirement on it (from the requirements and from the packages that travel) stays on the host
and its own dependencies are not followed; anything else travels, at the version pip chose. A later, stricter
requirement can still make a staying package travel (the walk only ever moves packages to travelling)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse
from pathlib import Path

import httpx
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from specpilot_build.errors import PinError, SpecPilotError
from specpilot_build.hosts.profiles import (
    HostProfile,
    digest_of,
    env_lock_path,
    host_profile_path,
    lock_body,
    profile_body,
)
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import WheelPin

INDEX_URL = "https://pypi.org/simple"


def host_requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """What `specpilot serve` imports on a host, from pyproject.toml [tool.specpilot] host-serve."""
    with open(pyproject, "rb") as fh:
        reqs = tomllib.load(fh).get("tool", {}).get("specpilot", {}).get("host-serve")
    if not isinstance(reqs, list) or not reqs:
        raise SpecPilotError(f"{pyproject}: [tool.specpilot] host-serve must list what `specpilot serve` needs")
    return [str(r) for r in reqs]


def runtime_requirement(pin: WheelPin) -> str:
    return f"{pin.distribution}=={pin.version}"


def target_environment(profile: HostProfile) -> dict[str, str]:
    """The marker environment of the host (Linux x86-64 CPython of the profile's version)."""
    env = {key: str(value) for key, value in default_environment().items()}
    env.update(
        {
            "python_version": profile.python_short,
            "python_full_version": profile.python,
            "implementation_name": "cpython",
            "implementation_version": profile.python,
            "platform_python_implementation": "CPython",
            "sys_platform": "linux",
            "os_name": "posix",
            "platform_system": "Linux",
            "platform_machine": "x86_64",
        }
    )
    return env


def pip_report(requirements: list[str], profile: HostProfile) -> list[dict]:
    """pip's resolution of `requirements` for the host's platform: the report's `install` items."""
    with tempfile.TemporaryDirectory(prefix="specpilot-envlock-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--only-binary=:all:",
            "--index-url",
            INDEX_URL,
            "--python-version",
            profile.python_short,
            "--implementation",
            "cp",
            "--target",
            str(Path(tmp) / "target"),
            "--report",
            str(Path(tmp) / "report.json"),
        ]
        for tag in profile.platforms:
            cmd += ["--platform", tag]
        cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
        if cert:
            cmd += ["--cert", cert]
        done = subprocess.run(cmd + requirements, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")] or (
                done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            )
            raise SpecPilotError(
                f"pip could not resolve {' '.join(requirements)} for Python {profile.python} on "
                f"{profile.platforms[0]} (host {profile.name}): {errors[-1]}"
            )
        return json.loads((Path(tmp) / "report.json").read_text())["install"]


def split_travelling(
    items: list[dict], requirements: list[str], profile: HostProfile
) -> tuple[dict[str, dict], dict[str, str]]:
    """(travelling: name -> report item, staying: name -> host version) — see the module docstring."""
    env = target_environment(profile)
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in items}
    specifiers: dict[str, list] = {}
    travelling: dict[str, dict] = {}
    staying: dict[str, str] = {}
    extras_of: dict[str, tuple] = {}
    queue = [(_requirement(r, "the requirements"), ()) for r in requirements]
    while queue:
        req, extras = queue.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or ("",))):
            continue
        specifiers.setdefault(name, []).append(req.specifier)
        if name not in resolved:
            raise SpecPilotError(f"pip's resolution has no {name}, which {req} needs")
        if name in travelling:
            continue
        if _host_satisfies(profile.packages.get(name), specifiers[name]):
            staying[name] = profile.packages[name]
            continue
        staying.pop(name, None)
        travelling[name] = resolved[name]
        extras_of[name] = tuple(
            sorted(set(extras_of.get(name, ())) | set(req.extras) | set(resolved[name].get("requested_extras") or ()))
        )
        for dep in resolved[name]["metadata"].get("requires_dist") or ():
            queue.append((_requirement(dep, name), extras_of[name]))
    return travelling, staying


def travelling_edges(travelling: dict[str, dict], profile: HostProfile, requirements: list[str]) -> dict:
    """name -> the travelling distributions it requires (markers evaluated for the host), and "" -> those the
    requirements name: what the environment's fetch walks to leave out distributions no kept one needs."""
    env = target_environment(profile)

    def needs(texts, extras):
        out = set()
        for text in texts:
            req = _requirement(text, "requires")
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or ("",))):
                if canonicalize_name(req.name) in travelling:
                    out.add(canonicalize_name(req.name))
        return sorted(out)

    edges = {"": needs(requirements, ())}
    for name, item in travelling.items():
        extras = tuple(item.get("requested_extras") or ())
        edges[name] = needs(item["metadata"].get("requires_dist") or (), extras)
    return edges


def _requirement(text: str, where: str) -> Requirement:
    try:
        return Requirement(text)
    except InvalidRequirement as exc:
        raise SpecPilotError(f"{where}: requirement {text!r} is not valid: {exc}") from None


def _host_satisfies(version: str | None, specifiers: list) -> bool:
    if version is None:
        return False
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return all(s.contains(parsed, prereleases=True) for s in specifiers)


def wheel_entry(item: dict) -> dict:
    info = item["download_info"]
    url = info["url"]
    sha256 = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
    if not url.startswith("https://") or not sha256:
        raise SpecPilotError(f"pip found {item['metadata']['name']} at {url} without a sha256 over https")
    return {
        "name": canonicalize_name(item["metadata"]["name"]),
        "version": item["metadata"]["version"],
        "filename": urllib.parse.unquote(url.rsplit("/", 1)[-1].split("#")[0]),
        "url": url,
        "sha256": sha256,
        "size": 0,
    }


def _sizes(entries: list[dict]) -> None:
    """Each wheel's size, from the index's HTTP headers (no download)."""

    def head(entry):
        response = httpx.head(entry["url"], follow_redirects=True, timeout=60)
        response.raise_for_status()
        entry["size"] = int(response.headers["content-length"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(head, e) for e in entries]:
            try:
                future.result()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                raise SpecPilotError(f"could not read a wheel's size from the index: {exc}") from None


def resolve_env_lock(runtime: str, pin: WheelPin, profile: HostProfile, extra: list[str] | None = None) -> dict:
    """The lock body for `runtime` on `profile`'s host (see lock_body)."""
    requirements = [runtime_requirement(pin)] + (host_requirements() if extra is None else list(extra))
    items = pip_report(requirements, profile)
    travelling, staying = split_travelling(items, requirements, profile)
    edges = travelling_edges(travelling, profile, requirements)
    entries = [dict(wheel_entry(i), requires=edges[n]) for n, i in travelling.items()]
    _sizes(entries)
    return lock_body(
        runtime,
        profile.name,
        profile.digest,
        profile.python,
        profile.platforms,
        profile.cuda_major,
        requirements,
        staying,
        entries,
    )


def write_env_lock(body: dict, directory: Path | None = None) -> Path:
    path = env_lock_path(body["runtime"], body["host"], directory)
    head = (
        f"# The wheels runtime {body['runtime']} needs on host {body['host']} beyond what the host has.\n"
        f"# Written by `make env-lock RUNTIME={body['runtime']} HOST={body['host']}`; do not edit (the loader "
        f"checks `digest`).\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + to_toml(dict(body, digest=digest_of(body))))
    return path


def to_toml(body: dict) -> str:
    """The lock/profile as TOML: scalars and lists first, then tables, then arrays of tables."""
    q = lambda v: json.dumps(v, ensure_ascii=False) if isinstance(v, str) else str(v)  # noqa: E731
    lines, tables, arrays = [], [], []
    for key, value in body.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            arrays.append((key, value))
        elif isinstance(value, list):
            lines.append(f"{key} = [" + ", ".join(q(v) for v in value) + "]")
        else:
            lines.append(f"{key} = {q(value)}")
    for key, table in tables:
        lines += ["", f"[{key}]"] + [f"{json.dumps(k)} = {q(v)}" for k, v in table.items()]
    for key, rows in arrays:
        for row in rows:
            lines += ["", f"[[{key}]]"] + [f"{k} = {q(v)}" for k, v in row.items()]
    return "\n".join(lines) + "\n"


def manylinux_tags(glibc: str) -> list[str]:
    """Platform tags a Linux x86-64 pip accepts for that glibc, most specific first."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise SpecPilotError(f"glibc {glibc}: host profiles cover glibc 2.17 and later")
    return [f"manylinux_2_{m}_x86_64" for m in range(minor, 16, -1)] + [
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]


def parse_freeze(text: str, where: str) -> dict[str, str]:
    """`pip list --format=freeze` (or `pip freeze`) lines: name==version; other lines are refused by number."""
    packages: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not name or not version or " " in line:
            raise PinError(f"{where}:{number}: {line!r} is not `name==version` (pip list --format=freeze)")
        packages[canonicalize_name(name)] = version
    return packages


def write_host_profile(
    name: str, freeze: Path, python: str, glibc: str, cuda_major: int, directory: Path | None = None, note: str = ""
) -> Path:
    path = host_profile_path(name, directory)  # a plain name, checked before anything is read or written
    packages = parse_freeze(freeze.read_text(), str(freeze))
    body = profile_body(name, python, manylinux_tags(glibc), cuda_major, packages)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = (
        f"# Host profile {name}: what the host's Python already has (written by `specpilot env host-profile "
        f"--freeze {freeze.name} --host {name} --python {python} --glibc {glibc} --cuda {cuda_major}`).\n"
        + "".join(f"# {line}\n" for line in note.splitlines())
    )
    path.write_text(head + to_toml(body))
    return path
