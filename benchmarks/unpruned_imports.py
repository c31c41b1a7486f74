"""Pruned vs unpruned (issue #19): serve an engine's tree with the *whole* SGLang wheel beneath it, log every module
its processes import, and check that each imported SGLang file is one the pruned engine kept.

    python benchmarks/unpruned_imports.py <engine id> --wheel <the pinned sglang wheel> --golden <golden_greedy.json> \
        --out <dir> [--port 30002]

The unpruned tree is a copy of the engine tree (its overlaid files win) with every other member of the wheel added,
launched from the engine's own launch spec and audit hook (run/serve.py, run/audit.py), on the GPU the setting
names; one golden prompt through /generate, then the whole process group is stopped. Prints the audit table
(imported and pruned must be 0) and writes <out>/unpruned-<id12>.json. Exit 1 when the pruned engine lacks a file
the unpruned run imported."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import httpx

from specpilot_build.hub.checkpoints import model_dirs
from specpilot_build.run.audit import AUDIT_ENV, audit_env, compare_imports
from specpilot_build.run.serve import HOST, _terminate, _wait_healthy, launch_command
from specpilot_build.store.engines import Engine, check_engine, resolve_engine


def unpruned_tree(engine: Engine, wheel: Path, dest: Path) -> int:
    """Copy the engine tree to `dest` and add every wheel member it lacks under python/; returns how many."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(engine.path, dest)
    added = 0
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            target = dest / "python" / name
            if name.endswith("/") or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
            added += 1
    return added


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--golden", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=30002)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    engine = resolve_engine(args.engine)
    problems = check_engine(engine)
    if problems:
        sys.exit(f"engine {engine.id[:12]} differs from its manifest: {problems[:3]}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    tree = Path(tempfile.mkdtemp(prefix="unpruned-")) / engine.id[:12]  # not under --out: a whole tree
    added = unpruned_tree(engine, args.wheel, tree)
    log = out / f"unpruned-imports-{engine.id[:12]}.log"
    log.unlink(missing_ok=True)
    os.environ[AUDIT_ENV] = str(log)
    argv, env = launch_command(Engine(engine.id, tree), model_dirs(engine.manifest["inputs"]["checkpoints"],
                                                                     engine.config), args.port)
    env = audit_env({**env, "CUDA_VISIBLE_DEVICES": "0"})
    server_log = out / f"unpruned-server-{engine.id[:12]}.log"
    with open(server_log, "wb") as sink:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tree, start_new_session=True)
    try:
        _wait_healthy(proc, args.port, engine.id, args.timeout, server_log)
        golden = json.loads(args.golden.read_text())
        prompt, want = golden["prompt_ids"], golden["sequence_ids"][len(golden["prompt_ids"]):]
        reply = httpx.post(f"http://{HOST}:{args.port}/generate", timeout=300, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": len(want), "temperature": 0}}).json()
        got = reply["output_ids"]
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    finally:
        _terminate(proc.pid)
        shutil.rmtree(tree.parent)
    with zipfile.ZipFile(args.wheel) as zf:
        universe = [name for name in zf.namelist() if not name.endswith("/")]
    audit = compare_imports(log, [f["path"] for f in engine.manifest["files"]], "sglang", universe)
    print(f"engine {engine.id[:12]}: unpruned tree = engine tree + {added} wheel members; golden {same}/{len(want)}")
    print(audit.table())
    (out / f"unpruned-{engine.id[:12]}.json").write_text(json.dumps(
        {"engine": engine.id, "wheel": args.wheel.name, "added": added, "golden": f"{same}/{len(want)}",
         **audit.__dict__}, indent=1) + "\n")
    return 1 if audit.imported_pruned else 0


if __name__ == "__main__":
    sys.exit(main())
