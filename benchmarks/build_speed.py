"""Build speed of pruned SGLang engines: this checkout beside a baseline commit, and the naive path, in one run.

  python benchmarks/build_speed.py [--setting h100_c1_qwen3-8b_dflash] [--repeat 5] [--baseline e009eac]

Rows (whole processes, wall clock, median and min–max over --repeat alternating runs):
  naive-nc     `pip install --no-deps --no-compile --target` of the pinned wheel + a sha256 walk of what it installed
  cold         `specpilot engine build` into an empty engine store (wheel, import graph and flag table cached)
  cold*        the same with no cached import graph or SGLang flag table (the first build ever from this wheel)
  no-op        the same build again (the engine exists)
each for `new` (this checkout) and `old` (the --baseline commit, run from a git worktree of it).
Then `engine fsck` of a store of every SGLang setting x {stock, final} (new), and the disk they take together.
Settings without real pins are built with a placeholder lock (made-up revisions), as the tests do."""

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

from specpilot_build.config.compose import compose_setting, list_settings
from specpilot_build.pins.lockfile import load_lock, write_placeholder_lock
from specpilot_build.pins.wheels import wheel_file
from specpilot_build.store.engines import disk_usage

REPO = Path(__file__).resolve().parent.parent
ARMS = ("stock", "final")

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


def sglang_settings() -> list[str]:
    return [s for s in list_settings() if compose_setting(s, "stock").config["runtime"]["name"] == "sglang"]


def repos_of(setting: str) -> list[str]:
    config = compose_setting(setting, "stock").config
    return [config[role]["repo"] for role in ("model", "drafter") if config[role].get("repo")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="h100_c1_qwen3-8b_dflash")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", default="e009eac", help="the commit the `old` rows build with")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="build-speed-"))
    data = work / "data"
    outer = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data") / "wheels"
    if outer.is_dir():  # reuse a wheel already fetched into the user's data directory
        shutil.copytree(outer, data / "wheels")
    settings = sglang_settings()
    lock = write_placeholder_lock(work / "lock", sorted({r for s in settings for r in repos_of(s)}))
    env = {**os.environ, "SPECPILOT_DATA": str(data), "SPECPILOT_LOCKFILES": str(lock)}
    os.environ.update({"SPECPILOT_DATA": str(data), "SPECPILOT_LOCKFILES": str(lock)})
    wheel = wheel_file(load_lock().runtimes["sglang"])  # fetched (or found in the mirror) once, cached
    old_tree = work / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(old_tree), args.baseline], check=True
    )
    trees = {"new": {**env}, "old": {**env, "PYTHONPATH": str(old_tree)}}  # the worktree's package first
    build = [
        sys.executable,
        "-m",
        "specpilot_build.cli",
        "engine",
        "build",
        "--setting",
        args.setting,
        "--arm",
        "final",
    ]
    rows: dict[str, list[float]] = {"naive-nc": []}
    caches = [data / "cache" / "import-graph", data / "cache" / "sglang-flags"]
    for which, tenv in trees.items():  # warms the caches and the OS cache
        timed(build, {**tenv, "SPECPILOT_ENGINES": str(work / f"warmup-{which}")})
        rows.update({f"{row} {which}": [] for row in ("cold", "cold*", "no-op")})
    try:
        for i in range(args.repeat):
            target = work / f"pip-{i}"
            rows["naive-nc"].append(
                timed(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--no-deps",
                        "--no-compile",
                        "--target",
                        str(target),
                        str(wheel),
                    ],
                    env,
                )
                + timed([sys.executable, "-c", HASH_WALK, str(target)], env)
            )
            shutil.rmtree(target)
            for which, tenv in list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]:
                store = {**tenv, "SPECPILOT_ENGINES": str(work / f"engines-{which}-{i}")}
                rows[f"cold {which}"].append(timed(build, store))
                rows[f"no-op {which}"].append(timed(build, store))
                for cache in caches:
                    shutil.rmtree(cache, ignore_errors=True)
                rows[f"cold* {which}"].append(
                    timed(build, {**tenv, "SPECPILOT_ENGINES": str(work / f"engines-star-{which}-{i}")})
                )
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)])
    naive = statistics.median(rows["naive-nc"])
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}; setting {args.setting} (final); {args.repeat} runs; "
        f"old = {args.baseline}; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'path':<12} {'median s':>9} {'min-max s':>13} {'vs naive':>9} {'new/old':>8}")
    for name, values in rows.items():
        med = statistics.median(values)
        ratio = ""
        if name.endswith(" new"):  # paired within each run: new / old of the same row
            old = rows[name.replace(" new", " old")]
            ratio = f"{statistics.median(n / o for n, o in zip(values, old)):7.2f}x"
        print(f"{name:<12} {med:9.2f} {min(values):6.2f}-{max(values):<6.2f} {naive / med:8.1f}x {ratio:>8}")

    store = work / "all"
    all_env = {**env, "SPECPILOT_ENGINES": str(store)}
    for setting in settings:
        for arm in ARMS:
            timed(
                [sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", setting, "--arm", arm],
                all_env,
            )
    engines = [p for p in store.iterdir() if len(p.name) == 64]
    fsck = [timed([sys.executable, "-m", "specpilot_build.cli", "engine", "fsck"], all_env) for _ in range(3)]
    print(
        f"\nengine fsck of {len(engines)} SGLang engines: median {statistics.median(fsck):.2f} s "
        f"(min {min(fsck):.2f}, max {max(fsck):.2f}), whole process"
    )
    print(f"\n{'setting':<42} {'arm':<6} {'kept files':>14} {'kept MB':>16} {'dropped files':>13}")
    for path in sorted(engines, key=lambda p: _setting_arm(p)):
        base = json.loads((path / "manifest.json").read_bytes())["base"]
        setting, arm = _setting_arm(path)
        print(
            f"{setting:<42} {arm:<6} {base['kept_files']:>6}/{base['total_files']:<7} "
            f"{base['kept_bytes'] / 1e6:6.1f}/{base['total_bytes'] / 1e6:5.1f} "
            f"({100 * base['kept_bytes'] / base['total_bytes']:2.0f}%) {base['dropped_files']:>8}"
        )
    one = max(disk_usage([p]) for p in engines)
    together = disk_usage(engines)
    print(
        f"disk: {len(engines)} SGLang engines together {together / 1e6:.1f} MB, one engine {one / 1e6:.1f} MB "
        f"({together / one:.2f}x); the wheel unpacked: {wheel_members_bytes(wheel) / 1e6:.1f} MB"
    )
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
