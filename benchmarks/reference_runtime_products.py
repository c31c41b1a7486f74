"""Benchmark: one decode step's products on SmolLM2-135M's shapes, MKL (torch.mm) against rowgemm, on CPU.

    python benchmarks/reference_runtime_products.py [--threads 1] [--repeats 20]

Per projection of the lean forward ([in, out] weights: qkv with its rotated q/k rows, o, gate+up, down, the
tied lm_head), the CPU milliseconds of one product of M rows (median of `--repeats`, process CPU time, which a
shared machine distorts less than wall time), and whether each row of it equals, bit for bit, the same row in a
64-row product (the batch invariance the runtime needs: `=`; `≠` where it differs). The runtime padded every
MKL product to 16 rows for that reason; rowgemm needs no padding, so a decode step costs its 1-row product.
The weights are random (scaled as trained ones): the timings and the invariance depend on shapes, not values.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import UTC, datetime

import torch

from specpilot_runtime import rowgemm

SHAPES = {"qkv": (576, 1728), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
LAYERS = 30
ROWS = (1, 2, 4, 11, 16)


def cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not rowgemm.available():
        raise SystemExit("rowgemm is not available here (see the log line above)")
    gen = torch.Generator().manual_seed(0)
    print(
        f"# products of one SmolLM2-135M decode step — {platform.node()}, {platform.machine()}, {os.cpu_count()} "
        f"cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n"
    )
    print("CPU ms per product (median); `≠`: its rows differ from the same rows in a 64-row product\n")
    print("| product [in, out] | kernel | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in ROWS) + " |")
    print("|---|---|" + "---:|" * len(ROWS))
    step = {"mkl": {m: 0.0 for m in ROWS}, "rowgemm": {m: 0.0 for m in ROWS}}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(k, n, generator=gen) / k**0.5
        packed = rowgemm.Packed(w)
        x = torch.randn(64, k, generator=gen)
        kernels = {"mkl": lambda a: torch.mm(a, w), "rowgemm": lambda a: rowgemm.mm(a, packed)}
        for kernel, product in kernels.items():
            full = product(x)
            cells = []
            for m in ROWS:
                rows = x[:m].contiguous()
                ms = cpu_ms(lambda: product(rows), args.repeats)
                step[kernel][m] += ms * (1 if name == "lm_head" else LAYERS)
                cells.append(f"{ms:.3f}{'' if torch.equal(product(rows), full[:m]) else ' ≠'}")
            print(f"| {name} [{k}, {n}] | {kernel} | " + " | ".join(cells) + " |")
    print(f"\nOne step's products ({LAYERS} layers + lm_head), CPU ms, by rows scored:\n")
    print("| kernel | " + " | ".join(str(m) for m in ROWS) + " |")
    print("|---|" + "---:|" * len(ROWS))
    for kernel, by_rows in step.items():
        print(f"| {kernel} | " + " | ".join(f"{by_rows[m]:.1f}" for m in ROWS) + " |")


if __name__ == "__main__":
    main()
