"""Binary cache speed and dedupe: a cold SGLang engine build beside pulling the same engine from a loopback S3
server (moto's server mode, through s3fs) and a file:// cache into an empty store, in one run.

  python benchmarks/cache.py [--setting h100_c1_qwen3-8b_dflash] [--repeat 3]

Rows (whole processes, wall clock, median and min–max over --repeat runs, the rows alternating within a run):
  cold build     `specpilot engine build` of the final arm into an empty store (wheel and compose caches warm)
  fresh build    the same with a fresh data directory holding only the wheel (a new CI machine with a wheel
                 mirror: the import graph, SGLang's flag table and the compose cache are made again)
  pull s3        `specpilot pull <id> --cache s3://...` into an empty store
  pull file      `specpilot pull <id> --cache file://...` into an empty store
  substitute s3  `specpilot engine build` with the S3 cache as substituter, into an empty store
Then the bytes each push sends: the stock arm into an empty cache, then the final arm of the same setting.

With --many N (default 20; 0 skips it): N engines (every setting and arm that builds here, in order) pushed one
by one into a fresh S3 bucket, then `specpilot pull` of the --setting's final arm into an empty store with the
merged index and without it (its pointer removed: the layout of caches before it, one index read per pack),
alternating, --repeat times; and the index step alone in this process (load_indexes, median of 5)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SP = [sys.executable, "-m", "specpilot_build.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="h100_c1_qwen3-8b_dflash")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--many", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    data = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data")
    port = free_port()
    env = {
        **os.environ,
        "SPECPILOT_DATA": str(data),
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    os.environ.update(env)
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if time.monotonic() > deadline:
                raise SystemExit("moto did not start")
            time.sleep(0.1)
        report(args, work, env)
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, work: Path, env: dict[str, str]) -> None:
    import s3fs

    from specpilot_build.cache.push import push_engine
    from specpilot_build.cache.remote import BinaryCache
    from specpilot_build.cache.signing import keygen
    from specpilot_build.store.engines import Engine, disk_usage

    source = work / "source"
    key = keygen("bench", work / "bench.secret")
    public = key.public_line()
    ids = {}
    for arm in ("stock", "final"):
        _, out = run(
            [*SP, "engine", "build", "--setting", args.setting, "--arm", arm], {**env, "SPECPILOT_ENGINES": str(source)}
        )
        ids[arm] = out.split()[0]
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    s3, local = f"s3://{bucket}/specpilot", f"file://{work}/cache"
    pushes = {}
    for url in (s3, local):
        for arm in ("stock", "final"):
            started = time.perf_counter()
            summary = push_engine(Engine(ids[arm], source / ids[arm]), BinaryCache(url), key, source)
            pushes[url, arm] = (summary, time.perf_counter() - started)
    final = Engine(ids["final"], source / ids["final"])
    files, size = len(final.manifest["files"]), disk_usage([final.path])

    rows: dict[str, list[float]] = {
        "cold build": [],
        "fresh build": [],
        "pull s3": [],
        "pull file": [],
        "substitute s3": [],
    }
    for i in range(args.repeat):
        order = list(rows) if i % 2 == 0 else list(reversed(rows))
        for row in order:
            store = work / f"store-{row.replace(' ', '-')}-{i}"
            e = {**env, "SPECPILOT_ENGINES": str(store)}
            if row in ("cold build", "fresh build"):
                cmd = [*SP, "engine", "build", "--setting", args.setting, "--arm", "final"]
                if row == "fresh build":
                    fresh = work / f"data-{i}"
                    (fresh / "wheels").mkdir(parents=True)
                    for wheel in (Path(env["SPECPILOT_DATA"]) / "wheels").glob("*.whl"):
                        shutil.copyfile(wheel, fresh / "wheels" / wheel.name)
                    e["SPECPILOT_DATA"] = str(fresh)
            elif row == "substitute s3":
                cmd = [*SP, "engine", "build", "--setting", args.setting, "--arm", "final",
                       f"cache.substituters=[{s3}]", f"cache.trusted_public_keys=[{public}]"]  # fmt: skip
            else:
                cmd = [*SP, "pull", ids["final"], "--cache", s3 if row == "pull s3" else local, "--trust", public]
            elapsed, out = run(cmd, e)
            if ids["final"] not in out or (row == "substitute s3" and "pulled from" not in out):
                raise SystemExit(f"{row}: unexpected output {out!r}")
            rows[row].append(elapsed)
            shutil.rmtree(store)
            if row == "fresh build":
                shutil.rmtree(e["SPECPILOT_DATA"])

    cold = statistics.median(rows["cold build"])
    print(f"{args.setting} final: {files} files, {size / 1e6:.1f} MB; {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| path | median s | min–max s | vs cold build |\n|---|---|---|---|")
    for row, times in rows.items():
        med = statistics.median(times)
        print(f"| {row} | {med:.2f} | {min(times):.2f}–{max(times):.2f} | {cold / med:.2f}× |")
    fresh = statistics.median(rows["fresh build"])
    print(f"(vs the fresh build: pull s3 {fresh / statistics.median(rows['pull s3']):.2f}×)")
    print(
        "\n| cache | push | objects sent | packs | bytes sent | objects skipped | bytes skipped | s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for (url, arm), (s, secs) in pushes.items():
        name = "s3 (moto)" if url == s3 else "file"
        print(
            f"| {name} | {arm} | {s.objects_sent} | {s.packs_sent} | {s.bytes_sent} | {s.objects_skipped} | "
            f"{s.bytes_skipped} | {secs:.2f} |"
        )
    for url in (s3, local):
        first, second = pushes[url, "stock"][0].bytes_sent, pushes[url, "final"][0].bytes_sent
        print(f"{'s3' if url == s3 else 'file'}: the final push sent {second / first:.1%} of the stock push's bytes")
    if args.many:
        many_pushes(args, work, env, key, ids["final"])


def many_pushes(args: argparse.Namespace, work: Path, env: dict[str, str], key, final_id: str) -> None:
    import s3fs

    from specpilot_build.cache.packs import POINTER, load_indexes
    from specpilot_build.cache.push import push_engine
    from specpilot_build.cache.remote import BinaryCache
    from specpilot_build.store.engines import Engine

    source = work / "many-source"
    e = {**env, "SPECPILOT_ENGINES": str(source)}
    built: list[str] = []
    settings = sorted(p.stem for p in (REPO / "conf" / "setting").glob("*.yaml"))
    settings.remove(args.setting)
    for setting in [args.setting, *settings]:
        for arm in ("final", "stock", "ar"):
            if len(built) == args.many:
                break
            cmd = [*SP, "engine", "build", "--setting", setting, "--arm", arm]
            proc = subprocess.run(cmd, env=e, capture_output=True, text=True, cwd=REPO)
            if proc.returncode == 0 and proc.stdout.split()[0] not in built:
                built.append(proc.stdout.split()[0])
    bucket = f"many-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    url = f"s3://{bucket}/specpilot"
    pushed = []
    for eid in built:
        started = time.perf_counter()
        summary = push_engine(Engine(eid, source / eid), BinaryCache(url), key, source)
        pushed.append((summary, time.perf_counter() - started))
    cache = BinaryCache(url)
    packs = [n for n in cache.names("packs") if n.endswith(".idx")]
    print(f"\n{len(built)} engines pushed one by one into one S3 cache: {len(packs)} packs")
    print("| push | packs sent | bytes sent | of which merged index + pointer | s |\n|---|---|---|---|---|")
    for i, (s, secs) in enumerate(pushed, 1):
        print(f"| {i} | {s.packs_sent} | {s.bytes_sent} | {s.merged_bytes} | {secs:.2f} |")
    pointer = cache.read(POINTER)
    assert pointer is not None
    rows: dict[str, list[float]] = {"pull, merged index": [], "pull, per-pack indexes": []}
    steps: dict[str, list[float]] = {"pull, merged index": [], "pull, per-pack indexes": []}
    public = key.public_line()
    for i in range(args.repeat):
        for row in list(rows) if i % 2 == 0 else list(reversed(rows)):
            if row == "pull, merged index":
                cache.write(POINTER, pointer)
            else:
                cache.remove(POINTER)
            store = work / f"many-store-{i}"
            elapsed, out = run([*SP, "pull", final_id, "--cache", url, "--trust", public],
                               {**env, "SPECPILOT_ENGINES": str(store)})  # fmt: skip
            if final_id not in out:
                raise SystemExit(f"{row}: unexpected output {out!r}")
            rows[row].append(elapsed)
            shutil.rmtree(store)
            for _ in range(5):
                started = time.perf_counter()
                found = load_indexes(BinaryCache(url))
                steps[row].append(time.perf_counter() - started)
                if found.problems or len(found.packs) != len(packs):
                    raise SystemExit(f"{row}: {found.problems} {len(found.packs)} of {len(packs)} packs")
    cache.write(POINTER, pointer)
    covered = len(load_indexes(cache).merged)
    print("| path | whole pull median s | min–max s | index step median s | index files read |\n|---|---|---|---|---|")
    for row, times in rows.items():
        reads = (
            f"pointer, merged ({covered} packs), {len(packs) - covered} per-pack"
            if row == "pull, merged index"
            else f"{len(packs)} per-pack"
        )
        print(
            f"| {row} | {statistics.median(times):.2f} | {min(times):.2f}–{max(times):.2f} | "
            f"{statistics.median(steps[row]):.3f} | {reads} |"
        )


if __name__ == "__main__":
    main()
