"""An SGLang engine's environment on its host: the locked wheels (hosts/profiles.py) that travel, fetched once,
unpacked as plain zip extraction into a --target-style prefix (no pip on the host), and pruned by data rules.

The native prune rules are data beside the Python ones (conf/runtime/<runtime>.yaml, `prune.native`), each with
`why` and an optional `when` (dotted config keys; a value, or a list of values any of which matches):
- `distributions: [names]` leaves whole distributions out (and with them what only they need, following the
  lock's `requires` edges from the requirements); a name the lock does not know is an error;
- `keep: [names]` keeps distributions the runtime imports without declaring them (walked from like a requirement);
- `files: [globs]` leaves files out of the kept wheels (paths in the prefix; `*` crosses `/`); a glob that
  matches no file is an error (a rule gone stale with a new wheel must not silently keep more).
A kept distribution built for another CUDA major than the host's (`…-cu12` on a CUDA 13 host) is refused."""

from __future__ import annotations

import fnmatch
import os
import re
import zipfile
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from specpilot_build.config.effective import rule_applies
from specpilot_build.errors import ConfigError, PinError, SpecPilotError
from specpilot_build.hosts.profiles import EnvLock, LockedWheel
from specpilot_build.pins.wheels import cached_wheel, wheel_sha256
from specpilot_build.store.manifest import digest_bytes
from specpilot_build.store.names import plain_relpath

RULE_KEYS = {"why", "when", "distributions", "files", "keep"}
CUDA_NAME = re.compile(r"-cu(?:da)?(\d\d)\d?x?(?:-|$)")


def cuda_major_of(distribution: str) -> int | None:
    """The CUDA major a distribution's name says it is built for (nvidia-cudnn-cu13, cupy-cuda13x), if any."""
    match = CUDA_NAME.search(distribution)
    return int(match.group(1)) if match else None


def native_rules(cfg: dict) -> list[dict]:
    """The runtime's native prune rules, shape-checked."""
    rules = (cfg["runtime"].get("prune") or {}).get("native") or []
    where = f"conf/runtime/{cfg['runtime']['name']}.yaml prune.native"
    if not isinstance(rules, list):
        raise ConfigError(f"{where}: a list of rules")
    for rule in rules:
        if not isinstance(rule, dict) or not isinstance(rule.get("why"), str) or set(rule) - RULE_KEYS:
            raise ConfigError(f"{where}: each rule has `why` and only {', '.join(sorted(RULE_KEYS))}; got {rule!r}")
        if sum(bool(rule.get(kind)) for kind in ("distributions", "files", "keep")) != 1:
            raise ConfigError(f"{where} '{rule['why']}': give one of `distributions`, `files` or `keep`")
        if not isinstance(rule.get("when") or {}, dict):
            raise ConfigError(f"{where} '{rule['why']}': `when` maps config keys to values")
    return rules


def select_distributions(lock: EnvLock, rules: list[dict], cfg: dict) -> tuple[list[LockedWheel], dict]:
    """(the wheels to install, {dropped distribution: the rule's why}) for this setting."""
    by_name = {w.name: w for w in lock.wheels}
    dropped: dict[str, str] = {}
    roots: list[str] = [canonicalize_name(Requirement(r).name) for r in lock.requirements]
    for rule in rules:
        for name in map(canonicalize_name, rule.get("keep") or ()):
            if name not in by_name and name not in lock.staying:
                raise ConfigError(
                    f"prune.native rule '{rule['why']}': distribution {name} is not in {lock.path.name}; fix the rule"
                )
            if rule_applies(rule, cfg):
                roots.append(name)
        for name in map(canonicalize_name, rule.get("distributions") or ()):
            if name not in by_name and name not in lock.staying:
                raise ConfigError(
                    f"prune.native rule '{rule['why']}': distribution {name} is not in {lock.path.name}; fix the rule"
                )
            if rule_applies(rule, cfg) and name in by_name:
                dropped[name] = rule["why"]
    keep: set[str] = set()
    stack: list[str] = [n for n in roots if n in by_name]
    while stack:
        wanted = stack.pop()
        if wanted in keep or wanted in dropped:
            continue
        keep.add(wanted)
        stack.extend(by_name[wanted].requires)
    for unneeded in sorted(set(by_name) - keep - set(dropped)):
        dropped[unneeded] = "needed only by dropped distributions"
    kept = [w for w in lock.wheels if w.name in keep]
    return kept, dropped


def fetch_wheel(wheel: LockedWheel) -> Path:
    """The locked wheel in <data>/wheels (from there, the mirror's wheels/, or its https url), checked."""
    return cached_wheel(
        wheel.filename,
        f"{wheel.name}: wheel filename",
        check=lambda path, hint: _check(path, wheel, hint),
        download=lambda into: _download(wheel, into),
        fresh_hint="the download is not what the lock pins; nothing was kept",
    )


def _download(wheel: LockedWheel, into: Path) -> Path:
    import httpx

    target = into / wheel.filename
    try:
        with httpx.stream("GET", wheel.url, follow_redirects=True, timeout=120) as response, open(target, "wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes(1 << 20):
                out.write(chunk)
    except (httpx.HTTPError, OSError) as exc:
        raise SpecPilotError(f"could not fetch {wheel.filename} from {wheel.url}: {exc}") from None
    return target


def _check(path: Path, wheel: LockedWheel, hint: str) -> None:
    try:
        sha256, size = wheel_sha256(path)
    except OSError:
        raise PinError(f"{path}: not a regular file; {hint}") from None
    if sha256 != wheel.sha256 or size != wheel.size:
        raise PinError(
            f"wheel {wheel.filename}: sha256 {sha256[:16]}… ({size} bytes) does not match "
            f"the lock's {wheel.sha256[:16]}… ({wheel.size} bytes); {hint}"
        )


def prefix_path(member: str) -> str | None:
    """Where a wheel member goes in a --target prefix: `<dist>.data/{purelib,platlib}/x` → x, `scripts/x` →
    bin/x; headers and data files are not installed (nothing imports them)."""
    parts = PurePosixPath(member).parts
    if parts and parts[0].endswith(".data") and len(parts) > 2:
        if parts[1] in ("purelib", "platlib"):
            return "/".join(parts[2:])
        if parts[1] == "scripts":
            return "/".join(("bin",) + parts[2:])
        return None
    return member


def install_environment(lock: EnvLock, rules: list[dict], config: dict, target_dir: Path) -> dict:
    """Fetch (once), check and unpack the setting's locked wheels into `target_dir`, prune by `rules`; return
    the record: wheels installed, distributions dropped, and every file kept (path, size, blake3) and dropped
    (path, size, rule). `target_dir` goes first on the engine's PYTHONPATH, ahead of the host's packages."""
    applied = [r for r in rules if rule_applies(r, config)]
    kept_wheels, dropped_dists = select_distributions(lock, rules, config)
    for wheel in kept_wheels:
        major = cuda_major_of(wheel.name)
        if major is not None and major != lock.cuda_major:
            raise PinError(
                f"{lock.path.name}: {wheel.name} is built for CUDA {major}, host {lock.host} has CUDA "
                f"{lock.cuda_major}; drop it with a prune.native rule or fix the lock"
            )
    file_rules = [(r["why"], g) for r in applied for g in r.get("files") or ()]
    matched = {g: 0 for _, g in file_rules}
    kept, dropped = [], []
    for wheel in kept_wheels:
        path = fetch_wheel(wheel)
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                rel = prefix_path(plain_relpath(info.filename, f"{wheel.filename}: member", error=PinError))
                if (info.external_attr >> 16) & 0o170000 not in (0, 0o100000):
                    raise PinError(f"{wheel.filename}: member {info.filename!r} is not a regular file")
                if rel is None:
                    dropped.append({"path": info.filename, "size": info.file_size, "rule": "not installed (data)"})
                    continue
                hits = [(w, g) for w, g in file_rules if fnmatch.fnmatchcase(rel, g)]
                if hits:
                    for _, g in hits:
                        matched[g] += 1
                    dropped.append({"path": rel, "size": info.file_size, "rule": hits[0][0]})
                    continue
                data = zf.read(info)
                out = target_dir / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                if out.exists():
                    raise PinError(f"{wheel.filename}: {rel} is also installed by another wheel of {lock.path.name}")
                out.write_bytes(data)
                os.chmod(out, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
                kept.append({"path": rel, "size": len(data), "blake3": digest_bytes(data)})
    stale = [g for g, n in matched.items() if n == 0]
    if stale:
        why = next(w for w, g in file_rules if g == stale[0])
        raise ConfigError(f"prune.native rule '{why}': {stale[0]} matches no file of the kept wheels; fix the rule")
    return {
        "lock": lock.record(),
        "target": str(target_dir),
        "wheels": [
            {"name": w.name, "version": w.version, "filename": w.filename, "sha256": w.sha256} for w in kept_wheels
        ],
        "dropped_distributions": dict(sorted(dropped_dists.items())),
        "kept": sorted(kept, key=lambda f: f["path"]),
        "dropped": sorted(dropped, key=lambda f: f["path"]),
        "kept_bytes": sum(f["size"] for f in kept),
        "dropped_bytes": sum(f["size"] for f in dropped),
        "rules": [r["why"] for r in applied],
    }
