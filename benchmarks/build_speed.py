"""Build speed of pruned SGLang engines vs the naive path, measured side by side in one run.

  python benchmarks/build_speed.py [--setting h100_c1_qwen3-8b_dflash] [--repeat 5]

Rows (whole processes, wall clock, median and min–max over --repeat alternating runs):
  naive      `pip install --no-deps --target` of the pinned wheel + a sha256 walk of what it installed
  naive-nc   the same with --no-compile (no .pyc written): the faster baseline, the one ratios are taken to
  cold       `specpilot engine build` into an empty engine store (wheel and its import graph cached)
  cold*      the same with no cached import graph (the first build ever made from this wheel)
  no-op      the same build again (the engine exists)
Then the disk taken by every SGLang setting x {stock, final} together vs one engine (hardlinks counted once).
Settings without real pins are built with a test lock (fake revisions), as the tests do."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from sglang_builds import ARMS, sglang_settings, write_test_lock  # noqa: E402
from specpilot_build.hub.lockfile import load_lock  # noqa: E402
from specpilot_build.build.runtime_base import wheel_file  # noqa: E402
from specpilot_build.store.engines import disk_usage  # noqa: E402

HASH_WALK = """
import hashlib, os, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        h = hashlib.sha256()
        with open(os.path.join(d, f), 'rb') as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
"""


def timed(cmd: list[str], env: dict) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="h100_c1_qwen3-8b_dflash")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="build-speed-"))
    data = work / "data"
    outer = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data") / "wheels"
    if outer.is_dir():  # reuse a wheel already fetched into the user's data directory
        shutil.copytree(outer, data / "wheels")
    lock = write_test_lock(work / "lock")
    env = {**os.environ, "SPECPILOT_DATA": str(data), "SPECPILOT_LOCKFILES": str(lock)}
    os.environ.update({"SPECPILOT_DATA": str(data), "SPECPILOT_LOCKFILES": str(lock)})
    wheel = wheel_file(load_lock().runtimes["sglang"])  # fetched (or found in the mirror) once, cached
    build = [sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", args.setting,
             "--arm", "final"]
    rows: dict[str, list[float]] = {"naive": [], "naive-nc": [], "cold": [], "cold*": [], "no-op": []}
    graph_cache = data / "cache" / "import-graph"
    timed(build, {**env, "SPECPILOT_ENGINES": str(work / "warmup")})  # warms the graph cache and the OS cache
    for i in range(args.repeat):
        target = work / f"pip-{i}"
        for row, extra in (("naive", []), ("naive-nc", ["--no-compile"])):
            rows[row].append(timed([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *extra,
                                    "--target", str(target), str(wheel)], env)
                             + timed([sys.executable, "-c", HASH_WALK, str(target)], env))
            shutil.rmtree(target)
        store = {**env, "SPECPILOT_ENGINES": str(work / f"engines-{i}")}
        rows["cold"].append(timed(build, store))
        rows["no-op"].append(timed(build, store))
        shutil.rmtree(graph_cache)
        rows["cold*"].append(timed(build, {**env, "SPECPILOT_ENGINES": str(work / f"engines-star-{i}")}))
    naive = statistics.median(rows["naive-nc"])
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}; setting {args.setting} (final); {args.repeat} runs")
    print(f"{'path':<8} {'median s':>9} {'min-max s':>13} {'vs naive':>9} {'paired':>7}")
    for name, values in rows.items():
        med = statistics.median(values)
        # paired: the median over runs of naive-nc / this row in the same run (load drifts between runs)
        paired = statistics.median(n / v for n, v in zip(rows["naive-nc"], values))
        print(f"{name:<8} {med:9.2f} {min(values):6.2f}-{max(values):<6.2f} {naive / med:8.1f}x {paired:6.1f}x")

    store = work / "all"
    all_env = {**env, "SPECPILOT_ENGINES": str(store)}
    for setting in sglang_settings():
        for arm in ARMS:
            timed([sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", setting,
                   "--arm", arm], all_env)
    engines = [p for p in store.iterdir() if len(p.name) == 64]
    print(f"\n{'setting':<42} {'arm':<6} {'kept files':>14} {'kept MB':>16} {'dropped files':>13}")
    for path in sorted(engines, key=lambda p: _setting_arm(p)):
        base = json.loads((path / "manifest.json").read_bytes())["base"]
        setting, arm = _setting_arm(path)
        print(f"{setting:<42} {arm:<6} {base['kept_files']:>6}/{base['total_files']:<7} "
              f"{base['kept_bytes'] / 1e6:6.1f}/{base['total_bytes'] / 1e6:5.1f} "
              f"({100 * base['kept_bytes'] / base['total_bytes']:2.0f}%) {base['dropped_files']:>8}")
    one = max(disk_usage([p]) for p in engines)
    together = disk_usage(engines)
    print(f"disk: {len(engines)} SGLang engines together {together / 1e6:.1f} MB, one engine {one / 1e6:.1f} MB "
          f"({together / one:.2f}x); the wheel unpacked: {wheel_members_bytes(wheel) / 1e6:.1f} MB")
    shutil.rmtree(work, ignore_errors=True)


def _setting_arm(path: Path) -> tuple[str, str]:
    manifest = json.loads((path / "manifest.json").read_bytes())
    return manifest["setting"], manifest["arm"]


def wheel_members_bytes(wheel: Path) -> int:
    import zipfile
    with zipfile.ZipFile(wheel) as zf:
        return sum(i.file_size for i in zf.infolist() if not i.is_dir())


if __name__ == "__main__":
    main()
