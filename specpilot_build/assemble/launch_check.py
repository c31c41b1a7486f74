"""The launch-args check of SGLang engines, without a GPU: the engine tree's own SGLang parses and validates the
engine's launch argv (`prepare_server_args`), and every .py file in the tree compiles.

This catches a prune rule that dropped a module the launcher imports, an overlay that broke a module, and a
tuned argument SGLang does not know. One subprocess checks many engines: torch and transformers are imported
once, and between engines every `sglang` module is dropped from sys.modules and sys.path becomes the next
engine's PYTHONPATH from its launch spec (the check asserts SGLang was imported from inside that engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from specpilot_build.assemble.sglang_flags import STAND_IN_PREAMBLE, flag_env
from specpilot_build.store.engines import Engine

PLACEHOLDER_DEFAULTS = {"host": "127.0.0.1", "port": "30000"}

_DRIVER = r"""
import contextlib, io, json, os, sys, traceback
jobs = json.loads(sys.stdin.read())
results = {}
import torch, transformers  # imported once, before any engine's SGLang
for job in jobs:
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    sys.path[:] = job["path"] + [p for p in sys.path if p not in job["others"]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            import sglang
            from sglang.srt.server_args import prepare_server_args
            where = os.path.realpath(sglang.__file__)
            if not where.startswith(os.path.realpath(job["python"]) + os.sep):
                raise RuntimeError(f"sglang was imported from {where}, not from the engine")
            prepare_server_args(job["argv"])
        results[job["id"]] = None
    except SystemExit as exc:
        results[job["id"]] = (err.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]
    except BaseException as exc:
        results[job["id"]] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
print("RESULTS " + json.dumps(results))
"""


def server_argv(engine: Engine, model_dir: Path, draft_dir: Path | None = None) -> list[str]:
    """The engine's launch argv after `-m sglang.launch_server`, placeholders filled for a check. Where the argv
    names no device, the check names the engine's hardware device: SGLang 0.5.17 asks the machine otherwise and
    refuses one with no accelerator, which says nothing about the engine."""
    argv = [arg.format(**_values(engine, model_dir, draft_dir)) for arg in _spec(engine)["argv"]]
    module = argv.index("sglang.launch_server")
    argv = argv[module + 1 :]
    device = _hardware_device(engine)
    return argv + ["--device", device] if device and "--device" not in argv else argv


def _hardware_device(engine: Engine) -> str | None:
    try:
        return engine.manifest["config"].get("hardware", {}).get("device")
    except FileNotFoundError:
        return None


def python_path(engine: Engine) -> list[str]:
    """The PYTHONPATH entries the launch spec gives the server (the engine's python/ first)."""
    value = _spec(engine).get("env", {}).get("PYTHONPATH", "{engine}/python")
    return [entry.format(engine=str(engine.path)) for entry in value.split(os.pathsep) if entry]


def _spec(engine: Engine) -> dict:
    return json.loads((engine.path / "launch.json").read_bytes())


def _values(engine: Engine, model_dir: Path, draft_dir: Path | None) -> dict:
    return {
        **PLACEHOLDER_DEFAULTS,
        "engine": str(engine.path),
        "engine_id": engine.id,
        "python": sys.executable,
        "model": str(model_dir),
        "draft_model": str(draft_dir or model_dir),
    }


def check_launch_args(
    engines: list[Engine], model_dir: Path, timeout: float = 900, draft_dirs: dict[str, Path] | None = None
) -> dict[str, str | None]:
    """{engine id: None when its SGLang accepts its argv, else the error line}. One subprocess per flag-check
    environment: a runtime whose SGLang this interpreter cannot import (runtime.flag_check, as for the build's
    flag table) is checked with its pinned packages first on the path and its stand-ins. `draft_dirs` (engine id →
    directory) fills an engine's {draft_model}, as serve does; otherwise the model directory stands in for it."""
    groups: dict[str, list[Engine]] = {}
    for engine in engines:
        spec = _flag_check_of(engine)
        groups.setdefault(json.dumps(spec, sort_keys=True), []).append(engine)
    results: dict[str, str | None] = {}
    for key, members in groups.items():
        results.update(_check_group(members, json.loads(key), model_dir, timeout, draft_dirs or {}))
    return results


def _flag_check_of(engine: Engine) -> dict:
    """The engine's runtime.flag_check; a tree without a manifest (a hand-made copy for a check) has none."""
    try:
        return engine.manifest["config"].get("runtime", {}).get("flag_check") or {}
    except FileNotFoundError:
        return {}


def _check_group(
    engines: list[Engine], flag_check: dict, model_dir: Path, timeout: float, draft_dirs: dict[str, Path]
) -> dict[str, str | None]:
    paths = [python_path(e) for e in engines]
    everyone = sorted({entry for path in paths for entry in path})
    jobs = [
        {
            "id": e.id,
            "python": str(e.path / "python"),
            "path": path,
            "others": everyone,
            "argv": server_argv(e, model_dir, draft_dirs.get(e.id)),
        }
        for e, path in zip(engines, paths)
    ]
    packages = list(flag_check.get("packages") or [])
    first = [str(flag_env(packages))] if packages else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(first + paths[0]), "PYTHONDONTWRITEBYTECODE": "1"}
    driver = f"STAND_INS = {json.dumps(list(flag_check.get('stand_ins') or []))}\n" + STAND_IN_PREAMBLE + _DRIVER
    proc = subprocess.run(
        [sys.executable, "-c", driver],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(model_dir),
    )
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULTS ")), None)
    if line is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        return {e.id: f"the check did not finish (exit {proc.returncode}): {tail}" for e in engines}
    return json.loads(line[len("RESULTS ") :])


def compile_engines(engines: list[Engine]) -> dict[str, str]:
    """Compile every .py file of every engine (each distinct content once, by its manifest digest).
    Returns {path in the engine: error} for the files that do not compile; nothing is written."""
    seen: dict[str, Path] = {}
    for engine in engines:
        for entry in engine.manifest["files"]:
            if entry["path"].endswith(".py") and entry["blake3"] not in seen:
                seen[entry["blake3"]] = engine.path / entry["path"]
    failures = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # SGLang's own invalid escapes: not our failure
        warnings.simplefilter("ignore", DeprecationWarning)
        for path in seen.values():
            try:
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                failures[str(path)] = f"{type(exc).__name__}: {exc}"
    return failures
