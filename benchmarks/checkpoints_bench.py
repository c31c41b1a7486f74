"""How long `make models` takes: stories260K cold (mirror → HF cache → convert) and warm (already verified),
plus sha256 and mirror-copy throughput on a large file (what verifying a multi-GB checkpoint costs).

    python benchmarks/checkpoints_bench.py [--mb 1024]

Prints a markdown table; the latest results are in benchmarks/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIRROR = REPO.parent / "shared" / "models" / "stories260K" / "llama2c"


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024, help="size of the synthetic large file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(SPECPILOT_DATA=f"{tmp}/data", HF_HUB_CACHE=f"{tmp}/hub", HF_HUB_OFFLINE="1")
        from specpilot_build.models import checkpoints
        from specpilot_build.pins.lockfile import PinnedFile, load_lock

        pin = load_lock(REPO / "lockfiles").checkpoints["karpathy/tinyllamas"]
        rows = []

        def cold():
            for sub in ("data", "hub"):
                if Path(tmp, sub).exists():
                    import shutil

                    shutil.rmtree(Path(tmp, sub))
            checkpoints.materialize(pin.repo, pin, source_format="llama2c", mirror=MIRROR)

        rows.append(("stories260K cold: mirror → cache → convert → verify", timed(cold, 5), ""))
        warm = timed(lambda: checkpoints.materialize(pin.repo, pin, source_format="llama2c", mirror=MIRROR), 20)
        rows.append(("stories260K warm: already present and verified", warm, ""))

        big = Path(tmp, "mirror", "big.bin")
        big.parent.mkdir()
        with open(big, "wb") as fh:
            for _ in range(args.mb):
                fh.write(os.urandom(2**20))
        start = time.perf_counter()
        digest = checkpoints.sha256_of(big)
        hashing = time.perf_counter() - start
        rows.append((f"sha256 of a {args.mb} MiB file", hashing, f"{args.mb / hashing:.0f} MiB/s"))
        pinned = PinnedFile(path="big.bin", size=big.stat().st_size, sha256=digest)
        start = time.perf_counter()
        checkpoints.fetch_file("bench/big", "b" * 40, pinned, cache=Path(tmp, "hub"), mirror=big.parent)
        copy = time.perf_counter() - start
        rows.append(
            (f"mirror → cache, {args.mb} MiB (copy while hashing, rename, link)", copy, f"{args.mb / copy:.0f} MiB/s")
        )
        start = time.perf_counter()
        checkpoints.fetch_file("bench/big", "b" * 40, pinned, cache=Path(tmp, "hub"), mirror=big.parent)
        rows.append((f"same {args.mb} MiB file again (stamp hit, no hashing)", time.perf_counter() - start, ""))

    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n"
    )
    print("| step | seconds | throughput |\n|---|---:|---:|")
    for name, seconds, note in rows:
        print(f"| {name} | {seconds:.4f} | {note} |")


if __name__ == "__main__":
    main()
