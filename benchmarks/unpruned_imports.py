"""Pruned vs unpruned (issue #19): serve an engine's tree with the *whole* SGLang wheel beneath it, log every module
its processes import, and check that each imported SGLang file is one the pruned engine kept.

    python benchmarks/unpruned_imports.py <engine id> --wheel <the pinned sglang wheel> --golden <golden_greedy.json> \
        --out <dir> [--port 30002]

The unpruned tree is a copy of the engine tree (its overlaid files win) with every other member of the wheel added,
launched from the engine's own launch spec and audit hook (serve/process.py, serve/audit.py), on the GPU the setting
names; one golden prompt through /generate, then the whole process group is stopped. `--log <file>` re-reads
such a run's import log instead of serving.

The unpruned run imports files the pruned engine does not have: registries that import every module they find
(the model registry walks sglang.srt.models with pkgutil; kernel op groups load by computed names) import whatever
is on disk. What matters is whether anything the pruned engine *kept* names one of them in an import statement
(run/audit.static_importers, at any depth, lazy imports included): such a file could fail on a path the served
run did not take. Prints the audit table, that count (must be 0) with each offender, and writes
<out>/unpruned-<id12>.json. Exit 1 when it is not 0."""

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

from golden_generate import golden_generate

from specpilot_build.errors import SpecPilotError
from specpilot_build.models.checkpoints import model_dirs
from specpilot_build.pins.wheels import wheel_sha256
from specpilot_build.serve.audit import AUDIT_ENV, audit_env, compare_imports, module_name, static_importers
from specpilot_build.serve.process import _terminate, _wait_healthy, launch_command
from specpilot_build.store.engines import Engine, check_engine, resolve_engine
from specpilot_build.store.names import plain_relpath


def unpruned_tree(engine: Engine, wheel: Path, dest: Path) -> int:
    """Copy the engine tree to `dest` and add every wheel member it lacks under python/; returns how many."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(engine.path, dest)
    added = 0
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith("/"):
                continue
            target = dest / "python" / plain_relpath(name, f"{wheel.name}: member", error=SpecPilotError)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
            added += 1
    return added


def serve_unpruned(engine: Engine, args) -> tuple[Path, str]:
    """Serve the engine tree over the whole wheel with the import audit on, one golden prompt; (log, golden n/N)."""
    out = args.out.resolve()
    tree = Path(tempfile.mkdtemp(prefix="unpruned-")) / engine.id[:12]  # not under --out: a whole tree
    unpruned_tree(engine, args.wheel, tree)
    log = out / f"unpruned-imports-{engine.id[:12]}.log"
    log.unlink(missing_ok=True)
    os.environ[AUDIT_ENV] = str(log)
    argv, env = launch_command(
        Engine(engine.id, tree), model_dirs(engine.manifest["inputs"]["checkpoints"], engine.config), args.port
    )
    env = audit_env({**env, "CUDA_VISIBLE_DEVICES": "0"})
    server_log = out / f"unpruned-server-{engine.id[:12]}.log"
    with open(server_log, "wb") as sink:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tree,
            start_new_session=True,
        )
    try:
        _wait_healthy(proc, args.port, engine.id, args.timeout, server_log)
        same, total, _, _ = golden_generate(args.port, args.golden)
    finally:
        _terminate(proc.pid)
        shutil.rmtree(tree.parent)
    return log, f"{same}/{total}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--golden", type=Path, help="golden_greedy.json (when serving)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=30002)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, help="an unpruned run's import log: compare it, serve nothing")
    args = parser.parse_args()
    engine = resolve_engine(args.engine)
    problems = check_engine(engine)
    if problems:
        sys.exit(f"engine {engine.id[:12]} differs from its manifest: {problems[:3]}")
    if not args.log and not args.golden:
        sys.exit("--golden <golden_greedy.json> is needed to serve (or --log <an unpruned run's import log>)")
    args.out.mkdir(parents=True, exist_ok=True)
    log, golden = (args.log, "not served (--log)") if args.log else serve_unpruned(engine, args)
    with zipfile.ZipFile(args.wheel) as zf:
        universe = [name for name in zf.namelist() if not name.endswith("/")]
    files = [f["path"] for f in engine.manifest["files"]]
    audit = compare_imports(log, files, "sglang", universe)
    kept = [path.removeprefix("python/") for path in files if path.startswith("python/sglang/")]
    importers = static_importers(engine.path / "python", kept, {module_name(p) for p in audit.imported_pruned})
    named = {module: paths for module, paths in sorted(importers.items()) if paths}
    print(f"engine {engine.id[:12]} over the whole {args.wheel.name}; golden {golden}")
    label = "imported and pruned (must be 0)"
    print(audit.table().split("\n  pruned but imported")[0].replace(label, "not in the pruned tree".ljust(len(label))))
    print(f"imported by the unpruned run, pruned, and named by a kept file's import (must be 0): {len(named)}")
    for module, paths in named.items():
        print(f"  {module}: imported by {', '.join(paths)}")
    (args.out / f"unpruned-{engine.id[:12]}.json").write_text(
        json.dumps(
            {
                "engine": engine.id,
                "wheel": args.wheel.name,
                "wheel_sha256": wheel_sha256(args.wheel)[0],
                "golden": golden,
                **audit.__dict__,
                "pruned_named_by_kept": named,
            },
            indent=1,
        )
        + "\n"
    )
    return 1 if named else 0


if __name__ == "__main__":
    sys.exit(main())
