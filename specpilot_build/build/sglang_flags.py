"""SGLang's launch flags, checked at build time against the pinned SGLang's own argument parser.

The flag table (option, action kind, nargs, value type, choices) is read once from the assembled tree's
`ServerArgs.add_cli_args` in a child interpreter — after the overlays, since an overlay may add a choice (W12
adds `--quantization w12`) — and cached per wheel sha256 and overlay digests under <data>/cache/sglang-flags/,
the cached table checked against its own digest before it is used. A build then checks every launch argument in
milliseconds: an unknown flag is refused naming the nearest one and where it was set, a value of the wrong type
or outside the flag's choices naming the flag and the value."""
from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

from specpilot_build.errors import ConfigError, SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.store.manifest import canonical_json, digest_bytes

_EXTRACT = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
flags = {}
for action in parser._actions:
    for option in action.option_strings:
        flags[option] = {"kind": type(action).__name__, "nargs": action.nargs,
                         "type": getattr(action.type, "__name__", None) if action.type else None,
                         "choices": [str(c) for c in action.choices] if action.choices is not None else None}
print("FLAGS " + json.dumps(flags))
"""
CHECKED_TYPES = {"int": int, "float": float}
BARE = ("_StoreTrueAction", "_StoreFalseAction", "BooleanOptionalAction", "DeprecatedStoreTrueAction",
        "_StoreConstAction", "DeprecatedStoreConstAction")


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
                raise ConfigError(f"{option} (set by {origin}) is a switch in SGLang {version}: give it `true`, "
                                  f"not {value!r}")
            continue
        if value is True:
            raise ConfigError(f"{option} (set by {origin}) takes a value in SGLang {version}, not a bare switch")
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and spec["nargs"] in (None, 0):
            raise ConfigError(f"{option} (set by {origin}) takes one value in SGLang {version}, not a list")
        for item in values:
            text = str(item)
            if spec["choices"] is not None and text not in spec["choices"]:
                raise ConfigError(f"{option} (set by {origin}): {text!r} is not one of SGLang {version}'s "
                                  f"choices ({', '.join(spec['choices'])})")
            convert = CHECKED_TYPES.get(spec["type"])
            if convert is not None and "{" not in text:  # a {placeholder} is filled in at serve time
                try:
                    convert(text)
                except ValueError:
                    raise ConfigError(f"{option} (set by {origin}): {text!r} is not {spec['type']} as SGLang "
                                      f"{version} requires") from None


def flag_table(python_dir: Path, wheel_sha256: str, overlays: list[dict], version: str) -> dict:
    """The flag table of the SGLang in `python_dir` (an assembled tree's python/), cached by its inputs."""
    key = digest_bytes(canonical_json({"wheel": wheel_sha256, "overlays": overlays})).split(":")[1]
    cache = data_dir() / "cache" / "sglang-flags" / f"{key}.json"
    try:
        record = json.loads(cache.read_text())
        if record["digest"] == digest_bytes(canonical_json(record["flags"])):
            return record["flags"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        pass  # absent or damaged: extract again
    flags = _extract(python_dir, version)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_bytes(canonical_json({"flags": flags, "digest": digest_bytes(canonical_json(flags))}))
    os.replace(tmp, cache)
    return flags


def _extract(python_dir: Path, version: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(python_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _EXTRACT], capture_output=True, text=True, env=env,
                              timeout=600, cwd=python_dir)
    except subprocess.TimeoutExpired:
        raise SpecPilotError("reading SGLang's launch flags took over 600 s; try again") from None
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("FLAGS ")), None)
    if done.returncode != 0 or line is None:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SpecPilotError(f"cannot read SGLang {version}'s launch flags from the engine tree to check them "
                             f"({last}); the builder's Python needs what that SGLang's argument parsing imports "
                             f"(for the default SGLang: .venv/bin/pip install -e '.[sglang-check]')")
    return json.loads(line[len("FLAGS "):])
