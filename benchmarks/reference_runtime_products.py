"""Benchmark: the float32 CPU products of one forward step of M rows (a decode step: 1, a verify step: k + 1, a
prefill: the prompt), rowgemm against MKL (torch.mm) and against rowgemm at an older commit, on CPU.

    python benchmarks/reference_runtime_products.py [--threads 1] [--repeats 20] [--mkl] [--against REV]
        [--model smollm2|stories260k] [--rows 1,2,...]

Per projection of the lean forward ([in, out] weights: qkv with its rotated q/k rows, o, gate+up, down, the
tied lm_head) on SmolLM2-135M's shapes (30 layers) or stories260K's (5 layers): the CPU milliseconds of one product
of M rows (median of `--repeats`, process CPU time, which a shared machine distorts less than wall time), its
GFLOP/s, and whether each row of it equals, bit for bit, the same row in a 64-row product (the batch invariance the
runtime needs; `≠` where it differs). Then one step's products summed (layers x per-layer products + lm_head), in
ms, GFLOP/s, and as a multiple of the same kernel's 1-row step: what a verify of M rows costs in decode steps.
`--against REV` builds runtimes/reference/specpilot_runtime/rowgemm.c as it was at REV and times it in the same
run, the arms taking turns per shape and row count. The FMA peak of one core (a loop
of independent AVX2 FMAs, compiled here) is printed for scale. Weights are random (scaled as trained ones): the
timings and the invariance depend on shapes, not values.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from specpilot_runtime import rowgemm

REPO = Path(__file__).resolve().parent.parent
MODELS = {  # per-layer products [in, out] and the lm_head, layer count
    "smollm2": (
        {"qkv": (576, 1728), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)},
        30,
    ),
    "stories260k": (
        {"qkv": (64, 224), "o": (64, 64), "gate_up": (64, 344), "down": (172, 64), "lm_head": (64, 512)},
        5,
    ),
}
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 32, 64)
TABLE_ROWS = (1, 2, 3, 4, 6, 8, 11, 16, 64)  # per-product table (the step table has every M)
PEAK_C = r"""
#include <immintrin.h>
double peak(long n) {  /* 12 independent chains of AVX2 FMAs: 12 * 16 FLOP per iteration */
    __m256 a[12], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i);
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    }
    double s = 0;
    for (int i = 0; i < 12; i++) s += a[i][0];
    return s;
}
"""


def cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def fma_peak_gflops() -> float:
    """One core's AVX2 FMA throughput, measured."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(PEAK_C)
        subprocess.run(["cc", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
        peak = ctypes.CDLL(str(lib)).peak
        peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_long]
        n = 50_000_000
        best = min(_timed(lambda: peak(n)) for _ in range(3))
    return n * 12 * 16 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def older_rowgemm(rev: str):
    """rowgemm.c at `rev`, built: (pack, mm) for its layout (16-column panels, or 32-column tiles before them)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:runtimes/reference/specpilot_runtime/rowgemm.c"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rowgemm.c"
        path.write_bytes(source)
        library = rowgemm.build(path)
    width = 16 if b"#define PANEL 16" in source else 32

    def pack(w: torch.Tensor) -> torch.Tensor:
        k, n = w.shape
        tiles = -(-n // width)
        padded = torch.zeros(k, tiles * width)
        padded[:, :n] = w
        return padded.view(k, tiles, width).transpose(0, 1).contiguous()

    def mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        rows, k = x.shape
        out = torch.empty(rows, n)
        library.rowgemm(x.data_ptr(), rows, k, packed.data_ptr(), width, k * width, n, out.data_ptr(), 1, 0, 0, 0)
        return out

    return pack, mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--mkl", action="store_true", help="also MKL's torch.mm (rows not invariant below 4)")
    parser.add_argument("--against", metavar="REV", help="also rowgemm.c as it was at this git revision")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = parser.parse_args()
    rows_list = tuple(int(m) for m in args.rows.split(","))
    torch.set_num_threads(args.threads)
    if not rowgemm.available():
        raise SystemExit("rowgemm is not available here (see the log line above)")
    shapes, layers = MODELS[args.model]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(
        f"# products of one {args.model} forward step — {platform.node()}, {platform.machine()}, {os.cpu_count()} "
        f"cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), commit {commit.strip()}, {datetime.now(UTC):%Y-%m-%d %H:%M} "
        f"UTC\n"
    )
    peak = fma_peak_gflops()
    print(f"AVX2 FMA peak of one core, measured: {peak:.0f} GFLOP/s\n")
    kernels = {}
    if args.mkl:
        kernels["mkl"] = (lambda w: w, lambda x, w, n: torch.mm(x, w))
    kernels["rowgemm"] = (rowgemm.Packed, lambda x, w, n: rowgemm.mm(x, w))
    if args.against:
        kernels[f"rowgemm@{args.against}"] = older_rowgemm(args.against)
    shown = [m for m in TABLE_ROWS if m in rows_list]
    print("CPU ms per product (median), GFLOP/s in brackets; `≠`: its rows differ from the same rows in a 64-row one\n")
    print("| product [in, out] | kernel | " + " | ".join(f"M={m}" for m in shown) + " |")
    print("|---|---|" + "---:|" * len(shown))
    step = {kernel: dict.fromkeys(rows_list, 0.0) for kernel in kernels}
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in shapes.items():
        w = torch.randn(k, n, generator=gen) / k**0.5
        x = torch.randn(64, k, generator=gen)
        cells: dict[str, list[str]] = {kernel: [] for kernel in kernels}
        packed = {kernel: pack(w) for kernel, (pack, _) in kernels.items()}
        full = {kernel: product(x, packed[kernel], n) for kernel, (_, product) in kernels.items()}
        for m in rows_list:
            rows = x[:m].contiguous()
            for kernel, (_, product) in kernels.items():  # arms take turns per row count
                wk = packed[kernel]
                ms = cpu_ms(lambda p=product, wk=wk: p(rows, wk, n), args.repeats)
                step[kernel][m] += ms * (1 if name == "lm_head" else layers)
                if m in shown:
                    same = torch.equal(product(rows, wk, n), full[kernel][:m])
                    cells[kernel].append(f"{ms:.3f} ({2 * m * k * n / ms / 1e6:.0f}){'' if same else ' ≠'}")
        for kernel in kernels:
            print(f"| {name} [{k}, {n}] | {kernel} | " + " | ".join(cells[kernel]) + " |")
    flops_per_row = 2 * sum(k * n * (1 if name == "lm_head" else layers) for name, (k, n) in shapes.items())
    print(f"\nOne step's products ({layers} layers + lm_head) by rows M: CPU ms, GFLOP/s, cost in 1-row steps\n")
    print("| M | " + " | ".join(f"{kernel} ms | GFLOP/s | x 1-row" for kernel in kernels) + " |")
    print("|---:|" + "---:|---:|---:|" * len(kernels))
    for m in rows_list:
        cells_m = []
        for kernel in kernels:
            ms = step[kernel][m]
            base = step[kernel][1] if 1 in rows_list else float("nan")
            cells_m.append(f"{ms:.2f} | {m * flops_per_row / ms / 1e6:.0f} | {ms / base:.2f}")
        print(f"| {m} | " + " | ".join(cells_m) + " |")


if __name__ == "__main__":
    main()
