"""SGLang's launch flags, checked at build time against the pinned SGLang's own argument parser.

The flag table (option, action kind, nargs, value type, choices) is read once from the assembled tree's
`ServerArgs.add_cli_args` in a child interpreter — after the overlays, since an overlay may add a choice (W12
adds `--quantization w12`) — and cached per wheel sha256 and overlay digests under <data>/cache/sglang-flags/,
the cached table checked against its own digest before it is used. A build then checks every launch argument in
milliseconds: an unknown flag is refused naming the nearest one and where it was set, a value of the wrong type
or outside the flag's choices naming the flag and the value.

A runtime whose parser this interpreter's packages cannot import declares `runtime.flag_check` (schema.FlagCheck):
its exact pins are installed once with `pip install --target --no-deps` into <data>/cache/flag-env/<digest>/
(a temporary folder renamed into place; every file re-hashed against the folder's record before use), put first on
the child's sys.path; each stand-in is an import-only placeholder module, put in place only when the real module
fails to import in the child, so that argparse's table can be read. The flags still come from SGLang's own
parser; the table records which stand-ins were used."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from specpilot_build.errors import ConfigError, SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.store.manifest import canonical_json, digest_bytes, digest_file

STAND_IN_PREAMBLE = r"""
import argparse, importlib, importlib.abc, importlib.machinery, json, sys, types

class _Placeholder(types.ModuleType):
    # import-only: any attribute is another placeholder, so `from x.y import z` at module level succeeds
    # transformers asks importlib whether a package exists, then parses its version: "0+stand.in" sorts below
    # every real release, so version-gated code takes its oldest path
    __path__ = []
    __version__ = "0+stand.in"
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")
    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a stand-in placeholder for reading SGLang's flags")

class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        return _Placeholder(spec.name)
    def exec_module(self, module):
        pass

used = []
for root in STAND_INS:
    try:
        importlib.import_module(root)
    except Exception as exc:  # absent, or present but broken beside this torch: a placeholder instead
        for loaded in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
            del sys.modules[loaded]
        used.append({"module": root, "because": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
if used:
    sys.meta_path.insert(0, _StandIns(u["module"] for u in used))

"""
_EXTRACT = (
    STAND_IN_PREAMBLE
    + r"""
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
flags = {}
for action in parser._actions:
    for option in action.option_strings:
        flags[option] = {"kind": type(action).__name__, "nargs": action.nargs,
                         "type": getattr(action.type, "__name__", None) if action.type else None,
                         "choices": [str(c) for c in action.choices] if action.choices is not None else None}
print("STANDINS " + json.dumps(used))
print("FLAGS " + json.dumps(flags))
"""
)
CHECKED_TYPES = {"int": int, "float": float}
BARE = (
    "_StoreTrueAction",
    "_StoreFalseAction",
    "BooleanOptionalAction",
    "DeprecatedStoreTrueAction",
    "_StoreConstAction",
    "DeprecatedStoreConstAction",
)


def check_launch_args(args: dict, table: dict, where: dict[str, str], version: str) -> None:
    """`args`: flag (without --) → value as the launch spec writes it; `where`: flag → where it was set."""
    for flag, value in args.items():
        option = f"--{flag}"
        origin = where.get(flag, "runtime.launch_args")
        spec = table.get(option)
        if spec is None:
            near = difflib.get_close_matches(option, list(table), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(f"{option} (set by {origin}) is not a flag of SGLang {version}{hint}")
        if value is None or value is False:
            continue
        if spec["kind"] in BARE:
            if value is not True:
                raise ConfigError(
                    f"{option} (set by {origin}) is a switch in SGLang {version}: give it `true`, not {value!r}"
                )
            continue
        if value is True:
            raise ConfigError(f"{option} (set by {origin}) takes a value in SGLang {version}, not a bare switch")
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and spec["nargs"] in (None, 0):
            raise ConfigError(f"{option} (set by {origin}) takes one value in SGLang {version}, not a list")
        for item in values:
            text = str(item)
            if spec["choices"] is not None and text not in spec["choices"]:
                raise ConfigError(
                    f"{option} (set by {origin}): {text!r} is not one of SGLang {version}'s "
                    f"choices ({', '.join(spec['choices'])})"
                )
            convert = CHECKED_TYPES.get(spec["type"])
            if convert is not None and "{" not in text:  # a {placeholder} is filled in at serve time
                try:
                    convert(text)
                except ValueError:
                    raise ConfigError(
                        f"{option} (set by {origin}): {text!r} is not {spec['type']} as SGLang {version} requires"
                    ) from None


def cached_flag_table(wheel_sha256: str, overlays: list[dict], flag_check: dict | None = None) -> dict | None:
    """The flag table a build of these inputs read and cached (its digest checked), or None when none did yet."""
    cached = _read_cached(_cache_path(wheel_sha256, overlays, flag_check))
    return None if cached is None else cached[0]


def _cache_path(wheel_sha256: str, overlays: list[dict], flag_check: dict | None) -> Path:
    inputs: dict[str, object] = {"wheel": wheel_sha256, "overlays": overlays}
    if flag_check is not None:
        inputs["flag_check"] = flag_check
    key = digest_bytes(canonical_json(inputs)).split(":")[1]
    return data_dir() / "cache" / "sglang-flags" / f"{key}.json"


def _read_cached(cache: Path) -> tuple[dict, list[dict]] | None:
    try:
        record = json.loads(cache.read_text())
        body = {"flags": record["flags"], "stand_ins_used": record["stand_ins_used"]}
        if record["digest"] == digest_bytes(canonical_json(body)):
            return record["flags"], record["stand_ins_used"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        pass  # absent or damaged: extract again
    return None


def flag_table(
    python_dir: Path, wheel_sha256: str, overlays: list[dict], version: str, flag_check: dict | None = None
) -> tuple[dict, list[dict]]:
    """The flag table of the SGLang in `python_dir` (an assembled tree's python/), cached by its inputs, and the
    stand-ins used to read it ([] without `flag_check`: the builder's own packages)."""
    cache = _cache_path(wheel_sha256, overlays, flag_check)
    cached = _read_cached(cache)
    if cached is not None:
        return cached
    env = flag_env(flag_check["packages"]) if flag_check and flag_check.get("packages") else None
    flags, used = _extract(python_dir, version, env, list((flag_check or {}).get("stand_ins") or []))
    body = {"flags": flags, "stand_ins_used": used}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_bytes(canonical_json({**body, "digest": digest_bytes(canonical_json(body))}))
    os.replace(tmp, cache)
    return flags, used


ENV_RECORD = ".specpilot-flag-env.json"
_CHECKED: set[Path] = set()  # flag-check environments re-hashed against their record in this process


def flag_env(packages: list[str]) -> Path:
    """The folder holding exactly `packages` (exact pins, no dependencies) for this interpreter, installed once."""
    spec = {"packages": sorted(packages), "python": sys.implementation.cache_tag, "platform": sysconfig.get_platform()}
    key = digest_bytes(canonical_json(spec)).split(":")[1]
    target = data_dir() / "cache" / "flag-env" / key
    if target in _CHECKED:
        return target
    if target.is_dir():
        _check_env(target, spec)
        _CHECKED.add(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=target.parent))
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-compile",
                "--target",
                str(tmp),
                *spec["packages"],
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise SpecPilotError(f"installing runtime.flag_check.packages for the flag check failed: {last}")
        (tmp / ENV_RECORD).write_bytes(canonical_json({**spec, "files": _listing(tmp)}))
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _listing(root: Path) -> dict:
    return {
        p.relative_to(root).as_posix(): digest_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ENV_RECORD
    }


def _check_env(target: Path, spec: dict) -> None:
    try:
        record = json.loads((target / ENV_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if (
        not isinstance(record, dict)
        or {k: record.get(k) for k in spec} != spec
        or record.get("files") != _listing(target)
    ):
        raise SpecPilotError(
            f"the flag-check environment {target} differs from its record {ENV_RECORD}; "
            f"remove that folder and build again"
        )


def _extract(python_dir: Path, version: str, env_dir: Path | None, stand_ins: list[str]) -> tuple[dict, list]:
    path = [str(env_dir)] if env_dir is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(python_dir)]), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"STAND_INS = {json.dumps(stand_ins)}\n" + _EXTRACT],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=python_dir,
        )
    except subprocess.TimeoutExpired:
        raise SpecPilotError("reading SGLang's launch flags took over 600 s; try again") from None
    lines = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1]
        for ln in done.stdout.splitlines()
        if ln.startswith(("FLAGS ", "STANDINS "))
    }
    if done.returncode != 0 or "FLAGS" not in lines:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        hint = (
            "add what it imports to the runtime's flag_check (packages or stand_ins)"
            if env_dir is not None or stand_ins
            else "the builder's Python needs what that SGLang's argument parsing imports (for the default SGLang: "
            ".venv/bin/pip install -e '.[sglang-check]'), or the runtime a flag_check"
        )
        raise SpecPilotError(
            f"cannot read SGLang {version}'s launch flags from the engine tree to check them ({last}); {hint}"
        )
    return json.loads(lines["FLAGS"]), json.loads(lines["STANDINS"])
