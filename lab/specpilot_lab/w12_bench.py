"""GPU benchmark: cuBLAS bf16 vs the fused W12 GEMM per weight family, a 64-layer decode stack under a CUDA
graph, the escape cliff, and eager (one call at a time) cost per call.

    python -m specpilot_lab.w12_bench --table --stack --cliff --eager [--family normal,student-t4] --out results.json
    python -m specpilot_lab.w12_bench --pick --table --stack --out results.json      # also re-pick the configs (normal family)
    python -m specpilot_lab.w12_bench --dry-run --table --stack --cliff --eager       # CPU: tiny shapes, reference path

(w12 is installed with the repository; on a machine where it is not, such as the bare GPU device, prefix
PYTHONPATH=kernels from the repository root, or run from kernels/.)

Weights come from w12_families.py (default: every family; smollm2-135m reads its extract from $W12_SMOLLM2,
see w12_smollm2.py, and a family whose file is missing is skipped with the reason while the others run). The
GEMM table and the decode stack are timed under CUDA graphs over rotated buffers (> L2), cuBLAS side by side,
per family. --cliff times W12 on the normal
family with 0.01% and 0.1% planted escapes; --eager times calls made one at a time with no graph, and the host
cost of one call (CPU timer around it, no sync). --pick checks and times a few finalist configs per shape and M
bucket under CUDA graphs and keeps the best (the wider sweeps they came from are in benchmarks/w12_gemm.md; explore.py, which
ran them, is in commit e009eac).

Prints a compact summary at the end; every table is in the --out JSON (`--render` prints them as markdown,
the source of benchmarks/w12_gemm.md). --dry-run runs the same plumbing on CPU with tiny shapes and wall-clock times (the
reference path: decode, then F.linear): it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

import w12
from specpilot_lab.w12_families import FAMILIES, SHAPES, draw, normal_with_escapes, parse_families
from w12.format import W12Tensor, decode, encode
from w12.gemm import (
    BUCKETS,
    FUSED_MAX_M,
    TABLE_GPUS,
    TUNED,
    Config,
    bucket_of,
    config_for,
    fused_gemm,
    keep_dense,
    linear,
    pick_config,
    tuned_key,
    tuned_name,
)

DRY_SHAPES = {"qkv": (160, 128), "o": (64, 256), "gate_up": (352, 128), "down": (64, 448)}  # --dry-run
MS = (1, 2, 4, 8, 16, 32, 64)  # the normal family
EXTRA_MS = (1, 8, 16, 32, 64)  # every other family (the 10-minute budget of one device command)
STACK_MS = (1, 8, 16, 32)
CLIFF_MS = (1, 8, 16, 32)
CLIFF_RATES = (1e-4, 1e-3)
EAGER_MS = (1, 8, 16, 32, 64)
COPY_TBPS = 4.27  # measured device-to-device copy bandwidth (read + write), H200
BUFFERS = 3  # weight copies rotated per measurement
# Candidate tables go here, outside the kernel package; `make w12-promote` is the one way into it.
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PACKAGE = Path(w12.__file__).resolve().parent
LABELS = {
    "stories260k": "stories260k (real rows, tiled to the shape)",
    "smollm2-135m": "smollm2-135m (real matrices per role, tiled to the shape)",
}


HEAVY_CLASS = ("student-t4", "outliers")  # the families whose geomean decides the heavy class's fallback (as
# its tuned configs were picked on them); the light class: normal


def with_dense(packed: W12Tensor, weight: torch.Tensor) -> W12Tensor:
    """The same planes as a new W12Tensor (its own plans) carrying the bf16 copy where its shape falls back."""
    twin = dataclasses.replace(packed, plans={}, dense=None, dense_buckets=())
    keep_dense(twin, weight)
    return twin


def w12_path(m: int, device) -> str:
    """Which path w12.gemm.linear takes at M (by its FUSED_MAX_M): the fused kernel or decode + cuBLAS."""
    if torch.device(device).type == "cpu":
        return "reference (CPU)"
    return "fused" if m <= FUSED_MAX_M else "decode+cuBLAS"


# --- timing -------------------------------------------------------------------------------------------------


def time_us(fn, rep_ms: int = 200, flush: str = "write") -> float:
    """Median time of fn. L2 is cleared before every call: flush="write" is do_bench's own (it zeroes 256 MB,
    leaving L2 full of dirty lines that fn's first kernel must write back), "read" reads 256 MB instead
    (L2 full of clean lines), "none" relies on the rotated buffers alone."""
    if flush == "write":
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda").random_()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    reps = max(20, min(1000, int(rep_ms / max(1e-3, start.elapsed_time(end) / 5))))
    samples = []
    for _ in range(reps):
        if flush == "read":
            cache.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        samples.append((start, end))
    torch.cuda.synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in samples)


def graph_time_us(launch, items, launches: int = 6, flush: str = "write") -> float:
    """Median time of one launch, from a CUDA graph of `launches` back-to-back launches over rotated
    buffers (no Python launch overhead in the timing; L2 cleared before every replay, see time_us).
    On CPU (--dry-run): the median wall time of a few plain calls."""
    if items[0].device.type == "cpu":
        return cpu_time_us(lambda: launch(items[0]))
    for item in items:
        launch(item)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(items[i % len(items)])
    t = time_us(graph.replay, rep_ms=150, flush=flush) / launches
    del graph
    return t


def cpu_time_us(fn, reps: int = 5) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --- weights ------------------------------------------------------------------------------------------------


def family_weights(family: str, shapes: dict, device) -> dict:
    """BUFFERS distinct matrices per shape (bf16 and W12), drawn from the family on the device."""
    return _encoded(lambda name, n, k, seed: draw(family, n, k, seed=seed, device=device, role=name), shapes, device)


def escape_weights(rate: float, shapes: dict, device) -> dict:
    return _encoded(lambda name, n, k, seed: normal_with_escapes(n, k, rate, seed=seed, device=device), shapes, device)


def _encoded(make, shapes: dict, device) -> dict:
    weights = {}
    for i, (name, (n, k)) in enumerate(shapes.items()):
        bf16s = [make(name, n, k, 10 * i + b) for b in range(BUFFERS)]
        weights[name] = {"bf16": bf16s, "w12": [encode(w) for w in bf16s]}
    sync(device)
    return weights


def check_correctness(
    name: str, w: torch.Tensor, packed: W12Tensor, cfg: Config | None = None, ms=(1, 5, 16, 32, 64)
) -> dict:
    """decode(encode(W)) bit-exact; W12's y within one bf16 ulp (+1e-5 sum|x||w|) of float64 and deterministic."""
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)), f"{name}: decode not bit-exact"
    if w.device.type == "cpu":  # --dry-run: the reference path (decode, then F.linear) at every M
        ms = ms[:1]
    worst = 0.0
    for m in ms:
        x = torch.randn(m, w.shape[1], device=w.device).to(torch.bfloat16)
        y = linear(x, packed, config=cfg).double()
        assert torch.equal(linear(x, packed, config=cfg).double(), y), f"{name} M={m}: not deterministic"
        ref = x.double() @ w.double().T
        bound = 2.0**-7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
        bad = ((y - ref).abs() > bound).sum().item()
        assert bad == 0, f"{name} M={m}: {bad} outputs off by more than one bf16 ulp"
        worst = max(worst, ((y - ref).abs() / (ref.abs() + 1e-30)).max().item())
    return {
        "escapes": packed.escapes,
        "escape_rate": packed.escapes / (packed.rows * packed.cols),
        "bits_per_weight": packed.bits_per_weight(),
        "max_rel_err": worst,
    }


# --- --pick (normal family, CUDA) ---------------------------------------------------------------------------


# Finalists re-timed under CUDA graphs by --pick, per M bucket (8, 16, 32), from earlier tile sweeps. Split K for
# N = 5120, where 160 row blocks of 32 would leave SMs idle.
def _swap(bucket, *tiles):
    return [Config(bn, bk, w, s, swap=True, block_m=bucket, split_k=sp) for bn, bk, w, s, sp in tiles]


def finalists(n: int, k: int, bucket: int) -> list[Config]:
    """The tiles to time, each with the escape handling the shape's tuned light entry has now (esc_step, xt:
    chosen per escape class by the escape arms of 2026-12-01), so a re-pick keeps it."""
    now = pick_config(n, k, bucket)
    return [dataclasses.replace(cfg, esc_step=now.esc_step, xt=now.xt) for cfg in _tiles(n, bucket)]


def _tiles(n: int, bucket: int) -> list[Config]:
    narrow = n <= 5120
    if bucket == 8:
        return _swap(
            8,
            *(
                [(32, 128, 2, 3, 3), (32, 128, 2, 4, 3), (16, 128, 1, 3, 1), (16, 128, 1, 3, 2)]
                if narrow
                else [(32, 128, 2, 3, 1), (32, 128, 2, 4, 1), (16, 128, 1, 3, 1), (16, 128, 1, 4, 1)]
            ),
        )
    if bucket == 16:
        return _swap(
            16,
            *(
                [(32, 128, 2, 3, 3), (16, 128, 1, 3, 2)]
                if narrow
                else [(32, 128, 2, 3, 1), (32, 128, 2, 4, 1), (16, 128, 1, 3, 1)]
            ),
        ) + ([Config(32, 128, 4, 3, split_k=3)] if narrow else [])
    # M = 32: the best of explore.py --m32 (2026-11-30), escape entries loaded after the main loop
    if narrow:
        return [Config(64, 128, 4, 3, split_k=3, esc_after=True), Config(64, 128, 4, 3, split_k=3)]
    return [
        Config(64, 128, 4, 3, esc_after=True),
        Config(64, 128, 4, 2, split_k=2, esc_after=True),
        Config(64, 128, 4, 3),
    ]


PICK_BUCKETS = ((8, (1, 8)), (16, (16,)), (32, (32,)))  # M bucket, the M values it is timed at


def pick(weights: dict) -> dict:
    """Per shape and M bucket: every finalist checked for correctness, then timed under CUDA graphs at the
    bucket's M values and ranked by the product of those times."""
    best = {}
    for name, (n, k) in SHAPES.items():
        packs = weights[name]["w12"]
        for bucket, ms in PICK_BUCKETS:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in ms]
            timed = []
            for cfg in finalists(n, k, bucket):
                try:
                    check_correctness(
                        name, weights[name]["bf16"][0], packs[0], cfg, ms=tuple(sorted({1, bucket // 2 + 1, bucket}))
                    )
                    times = [graph_time_us(lambda p: fused_gemm(x, p, cfg), packs) for x in xs]
                except Exception as err:
                    print(f"pick {name:8s} M<={bucket}: REJECTED {cfg}: {type(err).__name__}: {str(err)[:300]}")
                    continue
                timed.append((math.prod(times), times, cfg))
                print(f"pick {name:8s} M<={bucket:2d} " + " ".join(f"{t:7.1f}" for t in times) + f" us  {cfg}")
            best[(n, k, bucket, False)] = min(timed, key=lambda r: r[0])[2]
    return best


# --- the GEMM table -----------------------------------------------------------------------------------------


def table(weights: dict, shapes: dict, ms, family: str = "normal") -> list[dict]:
    """Per shape and M: cuBLAS and w12.gemm.linear, each over the rotated buffers under a CUDA graph."""
    rows = []
    for name, (n, k) in shapes.items():
        bf16s, packs = weights[name]["bf16"], weights[name]["w12"]
        device = bf16s[0].device
        w12_bytes = packs[0].nbytes()
        twins = [with_dense(p, w) for p, w in zip(packs, bf16s)] if device.type == "cuda" else []
        for m in ms:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            t_ref2 = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s) if m == 1 else float("nan")
            row = dict(
                family=family,
                shape=name,
                N=n,
                K=k,
                M=m,
                path=w12_path(m, device),
                cublas_us=t_ref,
                cublas_us_repeat=t_ref2,
                escape_rate=packs[0].escapes / (n * k),
                bits_per_weight=packs[0].bits_per_weight(),
            )
            try:
                t_w12 = graph_time_us(lambda p: linear(x, p), packs)
                diff = (linear(x, packs[0]).float() - torch.nn.functional.linear(x, bf16s[0]).float()).abs().max()
                if twins and m <= FUSED_MAX_M and bucket_of(m) in twins[0].dense_buckets:
                    t_fb = graph_time_us(lambda p: linear(x, p), twins)
                    row.update(picked="cuBLAS on the bf16 copy", picked_us=t_fb, picked_speedup=t_ref / t_fb)
                else:
                    row.update(picked=w12_path(m, device), picked_us=t_w12, picked_speedup=t_ref / t_w12)
            except Exception as err:  # a refusal (e.g. an M the kernel does not take) is a result, not a crash
                row.update(w12_us=float("nan"), speedup=float("nan"), error=f"{type(err).__name__}: {str(err)[:200]}")
                rows.append(row)
                print(f"{family:12s} {name:8s} M={m:2d} cuBLAS {t_ref:7.1f} us  W12 REFUSED {row['error']}")
                continue
            act = 2 * m * (n + k)
            row.update(
                w12_us=t_w12,
                speedup=t_ref / t_w12,
                bf16_bytes=2 * n * k + act,
                w12_bytes=w12_bytes + act,
                cublas_tbps=(2 * n * k + act) / t_ref / 1e6,
                w12_tbps=(w12_bytes + act) / t_w12 / 1e6,
                roofline_w12_us=(w12_bytes + act) / COPY_TBPS / 1e6,
                roofline_bf16_us=(2 * n * k + act) / COPY_TBPS / 1e6,
                max_abs_diff=diff.item(),
                config=vars(config_for(packs[0], bucket_of(m))) if m <= FUSED_MAX_M else None,
            )
            rows.append(row)
            print(
                f"{family:12s} {name:8s} M={m:2d} cuBLAS {t_ref:7.1f} us (repeat {t_ref2:.1f})  W12 {t_w12:7.1f} us "
                f"[{row['path']}] ({row['w12_tbps']:.2f} TB/s)  x{row['speedup']:.3f}  "
                f"roofline {row['roofline_w12_us']:.1f} us  max|diff| {row['max_abs_diff']:.3g}  "
                f"picked {row['picked']} x{row['picked_speedup']:.3f}",
                flush=True,
            )
    return rows


# --- the decode stack ---------------------------------------------------------------------------------------


def stack_weights(layers: int, family: str, shapes: dict, device):
    """layers x (qkv, o, gate_up, down): distinct bf16 matrices of the family and their W12 encodings."""
    bf16_layers, w12_layers = [], []
    for layer in range(layers):
        ws = [
            draw(family, n, k, seed=1000 + 4 * layer + j, device=device, role=name)
            for j, (name, (n, k)) in enumerate(shapes.items())
        ]
        bf16_layers.append(ws)
        w12_layers.append([encode(w) for w in ws])
    sync(device)
    return bf16_layers, w12_layers


def replay_us(step, device, replays: int = 7) -> tuple[float, float, float]:
    """(median, min, max) time of one replay of a CUDA graph of step() (on CPU: of plain calls)."""
    step()  # compile / pick algorithms before capture
    if torch.device(device).type == "cpu":
        samples = [cpu_time_us(step, reps=1) for _ in range(3)]
        return statistics.median(samples), min(samples), max(samples)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(samples), min(samples), max(samples)


def stack(layers: int, family: str = "normal", ms=STACK_MS, shapes: dict = SHAPES, device="cuda") -> list[dict]:
    """layers x (qkv, o, gate_up, down) per decode step, bf16 vs W12, each replayed from a CUDA graph."""
    bf16_layers, w12_layers = stack_weights(layers, family, shapes, device)
    bf16_total = sum(w.numel() * 2 for bl in bf16_layers for w in bl)
    w12_total = sum(p.nbytes() for wl in w12_layers for p in wl)
    print(f"stack {family}: {layers} layers, bf16 {bf16_total / 1e9:.2f} GB, W12 {w12_total / 1e9:.2f} GB", flush=True)
    # the fallback arm: twins of the W12 weights holding the bf16 layers as their copies (shared, no new memory)
    twins = (
        [[with_dense(p, w) for p, w in zip(wl, bl)] for wl, bl in zip(w12_layers, bf16_layers)]
        if torch.device(device).type == "cuda"
        else []
    )
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device=device).to(torch.bfloat16) for (_, k) in shapes.values()]
        outs = {}

        def step_bf16():
            for bl in bf16_layers:
                for x, w in zip(xs, bl):
                    outs[w.shape] = torch.nn.functional.linear(x, w)

        def step_w12(layers=w12_layers):
            for wl in layers:
                for x, p in zip(xs, wl):
                    outs[p.shape] = linear(x, p)

        falls = sorted(
            {
                name
                for wl in twins[:1]
                for name, p in zip(shapes, wl)
                if m <= FUSED_MAX_M and bucket_of(m) in p.dense_buckets
            }
        )
        arms = [("bf16", step_bf16), ("w12", step_w12)]
        if falls:
            arms.append(("w12_fallback", lambda t=twins: step_w12(t)))
        row = dict(
            family=family,
            M=m,
            layers=layers,
            path=w12_path(m, device),
            bf16_bytes=bf16_total,
            w12_bytes=w12_total,
            fallback_shapes=falls,
        )
        try:
            times = {label: replay_us(step, device) for label, step in arms + [("bf16_again", step_bf16)]}
        except Exception as err:
            row.update(error=f"{type(err).__name__}: {str(err)[:200]}", speedup=float("nan"))
            rows.append(row)
            print(f"stack {family} M={m:2d} FAILED {row['error']}")
            continue
        row.update(
            bf16_us=times["bf16"][0],
            bf16_again_us=times["bf16_again"][0],
            w12_us=times["w12"][0],
            picked_us=times.get("w12_fallback", times["w12"])[0],
            spread=times,
        )
        row["speedup"] = row["bf16_us"] / row["w12_us"]
        row["picked_speedup"] = row["bf16_us"] / row["picked_us"]
        row["bf16_tbps"] = bf16_total / row["bf16_us"] / 1e6
        row["w12_tbps"] = w12_total / row["w12_us"] / 1e6
        rows.append(row)
        print(
            f"stack {family} M={m:2d} bf16 {row['bf16_us'] / 1e3:.2f} ms ({row['bf16_tbps']:.2f} TB/s, again "
            f"{row['bf16_again_us'] / 1e3:.2f})  W12 {row['w12_us'] / 1e3:.2f} ms ({row['w12_tbps']:.2f} TB/s)"
            f"  x{row['speedup']:.3f}  with the fallback ({', '.join(falls) or 'none'}) x{row['picked_speedup']:.3f}",
            flush=True,
        )
    del twins
    return rows


# --- the escape cliff ---------------------------------------------------------------------------------------


def cliff(shapes: dict, ms=CLIFF_MS, device="cuda") -> list[dict]:
    """W12 time per shape and M on the normal family with 0.01% vs 0.1% planted escapes (target: within 5%)."""
    times, checks = {}, {}
    for rate in CLIFF_RATES:
        weights = escape_weights(rate, shapes, device)
        for name, (_, k) in shapes.items():
            packs = weights[name]["w12"]
            checks[(name, rate)] = check_correctness(
                f"{name} escapes {rate:g}", weights[name]["bf16"][0], packs[0], ms=(1, 16, 32)
            )
            for m in ms:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                times[(name, m, rate)] = graph_time_us(lambda p: linear(x, p), packs)
        del weights
    lo, hi = CLIFF_RATES
    rows = []
    for name in shapes:
        for m in ms:
            t_lo, t_hi = times[(name, m, lo)], times[(name, m, hi)]
            rows.append(
                dict(
                    shape=name,
                    M=m,
                    path=w12_path(m, device),
                    rate_lo=lo,
                    rate_hi=hi,
                    escape_rate_lo=checks[(name, lo)]["escape_rate"],
                    escape_rate_hi=checks[(name, hi)]["escape_rate"],
                    w12_us_lo=t_lo,
                    w12_us_hi=t_hi,
                    ratio=t_hi / t_lo,
                )
            )
            print(
                f"cliff {name:8s} M={m:2d} W12 {t_lo:7.1f} us at {100 * lo:g}% escapes, {t_hi:7.1f} us at "
                f"{100 * hi:g}%: x{t_hi / t_lo:.3f}",
                flush=True,
            )
    return rows


# --- eager calls --------------------------------------------------------------------------------------------


def eager_us(fn, items, device, calls: int = 200, rounds: int = 5) -> float:
    """Per call, calls made one at a time with no graph, back to back over the rotated buffers: wall time of
    `calls` calls and one final sync, divided by `calls`; median of `rounds`. Host and device both count."""
    for item in items:
        fn(item)
    sync(device)
    if torch.device(device).type == "cpu":  # --dry-run
        calls, rounds = 3, 1
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(items[i % len(items)])
        sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return 1e6 * statistics.median(samples)


def host_us(pair, device, bursts: int = 20, calls: int = 10) -> tuple[float, float, float]:
    """Host cost of one call for each of two callers, measured side by side: a CPU timer around each call alone
    (no sync), the two callers alternating call by call (each burst starts with the other one than the last),
    in short bursts that start from an idle GPU, so launches never wait for a full queue and both see the same
    state of the host (clock, caches, what else runs). pair = ((fn, items), (fn, items)). Returns the median
    per caller and the median of the per-pair differences (second minus first), in microseconds."""
    for fn, items in pair:
        for item in items:
            fn(item)
    if torch.device(device).type == "cpu":  # --dry-run
        bursts = 2
    samples = ([], [])
    for burst in range(bursts):
        sync(device)
        order = (0, 1) if burst % 2 == 0 else (1, 0)
        for i in range(calls):
            for side in order:
                fn, items = pair[side]
                t0 = time.perf_counter()
                fn(items[i % len(items)])
                samples[side].append(time.perf_counter() - t0)
    sync(device)
    gaps = [b - a for a, b in zip(*samples)]
    return tuple(1e6 * statistics.median(v) for v in (samples[0], samples[1], gaps))


def eager(weights: dict, shapes: dict, ms=EAGER_MS) -> list[dict]:
    """Eager F.linear vs w12.gemm.linear per shape and M; host-only cost at M = 1."""
    rows = []
    for name, (n, k) in shapes.items():
        bf16s, packs = weights[name]["bf16"], weights[name]["w12"]
        device = bf16s[0].device
        for m in ms:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            ref = lambda w: torch.nn.functional.linear(x, w)  # noqa: E731
            w12 = lambda p: linear(x, p)  # noqa: E731
            row = dict(shape=name, N=n, K=k, M=m, path=w12_path(m, device), cublas_us=eager_us(ref, bf16s, device))
            try:
                row["w12_us"] = eager_us(w12, packs, device)
                if m == 1:
                    host = host_us(((ref, bf16s), (w12, packs)), device)
                    row.update(zip(("cublas_host_us", "w12_host_us", "host_gap_us"), host))
            except Exception as err:
                row.update(w12_us=float("nan"), error=f"{type(err).__name__}: {str(err)[:200]}")
            row["speedup"] = row["cublas_us"] / row["w12_us"]
            rows.append(row)
            host = (
                f"  host F.linear {row['cublas_host_us']:.1f} us, W12 {row['w12_host_us']:.1f} us, "
                f"paired gap {row['host_gap_us']:+.1f} us"
                if "w12_host_us" in row
                else ""
            )
            print(
                f"eager {name:8s} M={m:2d} F.linear {row['cublas_us']:7.1f} us/call  W12 {row['w12_us']:7.1f} "
                f"us/call [{row['path']}]  x{row['speedup']:.3f}{host}",
                flush=True,
            )
    return rows


# --- report -------------------------------------------------------------------------------------------------


def gm(values) -> float:
    values = [v for v in values if v == v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


TARGETS = {"normal": (1.30, 1.15)}  # GEMM geomean at M <= 16, at M = 32; heavy-tailed families 1.20, 1.10


def family_summary(family: str, rows: list[dict], stack_rows: list[dict]) -> str:
    t16, t32 = TARGETS.get(family, (1.20, 1.10))
    small = [r["speedup"] for r in rows if r["M"] <= 16]
    m32 = [r["speedup"] for r in rows if r["M"] == 32]
    worst = min((r["speedup"] for r in rows if r["M"] <= 64 and r["speedup"] == r["speedup"]), default=float("nan"))
    refused = sum(1 for r in rows if "error" in r)
    stacks = ", ".join(f"M={r['M']} x{r['speedup']:.3f}" for r in stack_rows)
    line = (
        f"{family}: GEMM geomean M<=16 {gm(small):.3f} (target {t16:.2f}), M=32 {gm(m32):.3f} (target {t32:.2f}), "
        f"lowest at M<=64 {worst:.3f} (target 1.0){f', {refused} refused' if refused else ''}; "
        f"stack {stacks or '-'} (target 1.25 at M=1,8,16, 1.15 at M=32)"
    )
    picked = [r["picked_speedup"] for r in rows if r["M"] <= 64 and not math.isnan(r.get("picked_speedup", math.nan))]
    if picked:
        stacks = ", ".join(f"M={r['M']} x{r['picked_speedup']:.3f}" for r in stack_rows if "picked_speedup" in r)
        m32 = gm(r["picked_speedup"] for r in rows if r["M"] == 32)
        line += (
            f"; with the bf16 fallback: GEMM geomean M=32 {m32:.3f}, lowest at M<=64 {min(picked):.3f}, "
            f"stack {stacks or '-'}"
        )
    return line


def render(result: dict, compact: bool = False) -> str:
    """Markdown tables from a results JSON written by this script (older single-family JSONs too)."""
    if "families" not in result:  # before the families (the first recorded run, 2026-11-30)
        result = {"families": {"normal": {"table": result.get("table", []), "stack": result.get("stack", [])}}}
    fams = result["families"]
    out = []
    if not compact:
        for family, res in fams.items():
            out += [f"### {LABELS.get(family, family)}", ""] + gemm_table(res.get("table", [])) + [""]
    out += side_by_side(fams) + [""] + stack_table(fams) + [""]
    if result.get("cliff"):
        out += cliff_table(result["cliff"]) + [""]
    if result.get("eager"):
        out += eager_table(result["eager"]) + [""]
    for family, res in fams.items():
        notes = [
            f"{key.replace('_', ' ')}: {res[key]}"
            for key in ("error", "table_skipped", "stack_skipped", "stack_error")
            if key in res
        ]
        out.append(
            family_summary(family, res.get("table", []), res.get("stack", []))
            + "".join(f"; {note.strip()}" for note in notes)
        )
    return "\n".join(out)


def gemm_table(rows: list[dict]) -> list[str]:
    out = [
        "| shape (N x K) | M | path | cuBLAS us | cuBLAS TB/s | W12 us | W12 TB/s | speedup | W12 roofline us "
        "| W12 % of roofline | bf16 MB | W12 MB | escapes | max abs diff | with the bf16 fallback |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        head = f"| {r['shape']} ({r['N']} x {r['K']}) | {r['M']} | {r.get('path', 'fused')} | {r['cublas_us']:.1f} "
        if "error" in r:
            out.append(head + f"| - | refused: {r['error']} | - | - | - | - | - | - | - | - | - |")
            continue
        out.append(
            head + f"| {r['cublas_tbps']:.2f} | {r['w12_us']:.1f} | {r['w12_tbps']:.2f} | **{r['speedup']:.3f}** "
            f"| {r['roofline_w12_us']:.1f} | {100 * r['roofline_w12_us'] / r['w12_us']:.0f}% "
            f"| {r['bf16_bytes'] / 1e6:.1f} | {r['w12_bytes'] / 1e6:.1f} "
            f"| {percent(r.get('escape_rate'))} | {r['max_abs_diff']:.3g} | {fallback_cell(r)} |"
        )
    return out


def fallback_cell(r: dict) -> str:
    if "picked_speedup" not in r or r.get("picked") != "cuBLAS on the bf16 copy":
        return "-"
    return f"cuBLAS **{r['picked_speedup']:.3f}** ({r['picked_us']:.1f} us)"


def percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.4f}%"


def side_by_side(fams: dict) -> list[str]:
    """One row per shape and M, one column per family: W12 speedup over cuBLAS (W12 us)."""
    names = list(fams)
    keys = []
    for res in fams.values():
        keys += [(r["shape"], r["M"]) for r in res.get("table", []) if (r["shape"], r["M"]) not in keys]
    cell = {(f, r["shape"], r["M"]): r for f, res in fams.items() for r in res.get("table", [])}
    out = [
        "| shape | M | " + " | ".join(LABELS.get(f, f) for f in names) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for shape, m in keys:
        cells = []
        for f in names:
            r = cell.get((f, shape, m))
            cells.append(
                "-" if r is None else "refused" if "error" in r else f"**{r['speedup']:.3f}** ({r['w12_us']:.1f} us)"
            )
        out.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
    for label, pred in (
        ("geomean M <= 16", lambda m: m <= 16),
        ("geomean M = 32", lambda m: m == 32),
        ("geomean M = 64", lambda m: m == 64),
    ):
        vals = [gm(r["speedup"] for r in res.get("table", []) if pred(r["M"])) for res in fams.values()]
        out.append(f"| {label} | | " + " | ".join(f"**{v:.3f}**" for v in vals) + " |")
    return out


def stack_table(fams: dict) -> list[str]:
    out = [
        "| decode stack, 64 layers | M | bf16 ms | bf16 TB/s | W12 ms | W12 TB/s | speedup | W12 roofline ms "
        "| with the bf16 fallback: ms, speedup (shapes on cuBLAS) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for family, res in fams.items():
        for r in res.get("stack", []):
            head = (
                f"| {LABELS.get(family, family)}: bf16 {r['bf16_bytes'] / 1e9:.2f} GB / W12 {r['w12_bytes'] / 1e9:.2f} GB "
                f"| {r['M']} "
            )
            if "error" in r:
                out.append(head + f"| - | - | failed: {r['error']} | - | - | - | - |")
                continue
            fallback = (
                "-"
                if not r.get("fallback_shapes")
                else f"{r['picked_us'] / 1e3:.2f}, **{r['picked_speedup']:.3f}** ({', '.join(r['fallback_shapes'])})"
            )
            out.append(
                head + f"| {r['bf16_us'] / 1e3:.2f} | {r['bf16_tbps']:.2f} | {r['w12_us'] / 1e3:.2f} "
                f"| {r['w12_tbps']:.2f} | **{r['speedup']:.3f}** | {r['w12_bytes'] / COPY_TBPS / 1e9:.2f} "
                f"| {fallback} |"
            )
    return out


def cliff_table(rows: list[dict]) -> list[str]:
    lo, hi = rows[0]["rate_lo"], rows[0]["rate_hi"]
    out = [
        f"| shape | M | path | escapes (asked {100 * lo:g}%) | W12 us | escapes (asked {100 * hi:g}%) | W12 us "
        "| time ratio | within 5% |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['shape']} | {r['M']} | {r['path']} | {100 * r['escape_rate_lo']:.4f}% | {r['w12_us_lo']:.1f} "
            f"| {100 * r['escape_rate_hi']:.4f}% | {r['w12_us_hi']:.1f} | **{r['ratio']:.3f}** "
            f"| {'yes' if r['ratio'] <= 1.05 else 'no'} |"
        )
    return out


def eager_table(rows: list[dict]) -> list[str]:
    out = [
        "| shape | M | W12 path | F.linear us/call | W12 us/call | speedup | F.linear host us | W12 host us "
        "| host gap us (target <= 5) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        host = "| | | |"
        if "w12_host_us" in r:
            # runs before the paired measurement (no host_gap_us): the difference of the two medians
            gap = r.get("host_gap_us", r["w12_host_us"] - r["cublas_host_us"])
            host = f"| {r['cublas_host_us']:.1f} | {r['w12_host_us']:.1f} | {gap:.1f} |"
        w12 = f"refused: {r['error']}" if "error" in r else f"{r['w12_us']:.1f}"
        out.append(
            f"| {r['shape']} | {r['M']} | {r['path']} | {r['cublas_us']:.1f} | {w12} | **{r['speedup']:.3f}** " + host
        )
    return out


def run_gpu(result: dict) -> str:
    """The tables' suffix of the GPU a run was measured on (its `device` line), e.g. h100."""
    device = str(result.get("device", ""))
    for part, gpu in TABLE_GPUS.items():
        if part in device:
            return gpu
    raise ValueError(f"the run's device {device!r} is none of {', '.join(TABLE_GPUS)}: no table name for it")


def save_tuned(result: dict, path: Path | None = None) -> None:
    """Write the configs --pick chose over the package's tuned_<gpu>.json (the run's GPU; the H200's where that GPU
    has none yet) into a candidate table at `path` (default benchmarks/results/tuned_<gpu>.json, outside the
    package: `make w12-promote TABLE=<path>` moves it in), replacing those keys only: the entries --pick does not
    time (bucket 64, the heavy ones) stay. --pick times Triton tiles: an entry's kernel choice (ws) stays too."""
    path = path or RESULTS / f"tuned_{run_gpu(result)}.json"
    keep = [f.name for f in dataclasses.fields(Config) if f.name != "kernel"]
    old = _base_table(path)
    entries = {key: cfg for key, cfg in old.items() if not key.startswith("_")}
    picked = {key: {f: cfg[f] for f in keep if f in cfg} for key, cfg in result["tuned"].items()}
    for key, cfg in picked.items():
        if "kernel" in entries.get(key, {}):
            cfg["kernel"] = entries[key]["kernel"]
    for key in picked:
        tuned_key(key)  # a malformed key is an error here, not at the next import
    entries.update(picked)
    comment = old.get(
        "_comment", "Picked on an H200 (see benchmarks/w12_gemm.md); key: N,K,M bucket, or N,K,bucket,heavy"
    )
    if old.get("_from"):
        comment = (
            f"Tiles of {len(picked)} keys re-picked on {result.get('device', '?')} by `specpilot_lab.w12_bench --pick`; "
            f"{old['_from']}. Key: N,K,M bucket, or N,K,bucket,heavy"
        )
    _write_candidate(path, {"_comment": comment, **entries})
    print(f"wrote {path}: {len(picked)} entries picked, {len(entries) - len(picked)} kept")


def save_fallback(result: dict, path: Path | None = None) -> dict:
    """Write the fused kernel's speed over cuBLAS at each M bucket's largest M, per shape and escape class, over
    the package's fallback_h200.json into a candidate table at `path` (gemm.fallback_buckets falls back where it is
    below 1.0): the light class from the normal family, the heavy class from the slowest of HEAVY_CLASS (an engine's
    W12 plan promises "never slower than bf16", which a mean over families does not back). Replaces the keys this run
    measured, keeps the rest and the table's `_classes` (the escape rates its classes were measured up to).
    `make w12-promote TABLE=<path>` moves it into the package."""
    path = path or RESULTS / f"fallback_{run_gpu(result)}.json"
    fams = result["families"]
    classes = {False: ["normal"], True: [f for f in HEAVY_CLASS if f in fams]}
    measured = {}
    for heavy_class, names in classes.items():
        cells: dict = {}
        for family in names:
            for r in fams.get(family, {}).get("table", []):
                if r["M"] in BUCKETS and r.get("speedup") == r.get("speedup"):
                    cells.setdefault((r["N"], r["K"], r["M"]), []).append(r["speedup"])
        for (n, k, bucket), values in cells.items():
            if len(values) == len(names):  # every family of the class measured this cell
                measured[tuned_name((n, k, bucket, heavy_class))] = {
                    "speedup": round(min(values), 4),
                    "M": bucket,
                    "families": names,
                }
    old = _base_table(path)
    entries = {key: entry for key, entry in old.items() if not key.startswith("_")}
    entries.update(measured)
    comment = (
        f"W12 fused kernel over cuBLAS at each M bucket's largest M, per shape (N,K,bucket) and escape class "
        f"(,heavy); gemm.fallback_buckets falls back where below 1.0. Written by `specpilot_lab.w12_bench --save-fallback` "
        f"from the run of {result.get('device', '?')}."
    )
    classes = {"_classes": old["_classes"]} if "_classes" in old else {}
    _write_candidate(path, {"_comment": comment, **classes, **entries})
    print(
        f"wrote {path}: {len(measured)} entries measured, {len(entries) - len(measured)} kept; below 1.0: "
        + ", ".join(key for key, e in entries.items() if e["speedup"] < 1.0)
    )
    return entries


def _base_table(path: Path) -> dict:
    """The candidate at `path` if one was written already, else the package's table of that name, else (a GPU with
    no table yet) the package's H200 table of that kind, marked `_from`."""
    source = path if path.exists() else PACKAGE / path.name
    if source.exists():
        return json.loads(source.read_text())
    h200 = PACKAGE / f"{path.name.split('_')[0]}_h200.json"
    if not h200.exists():
        return {}
    return {**json.loads(h200.read_text()), "_from": f"entries not measured on this GPU are {h200.name}'s"}


def _write_candidate(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")


# --- main ---------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--family",
        default=",".join(FAMILIES),
        help=f"comma-separated weight families (default: all): {', '.join(FAMILIES)}",
    )
    ap.add_argument("--pick", action="store_true", help="time the FINALISTS under CUDA graphs, keep the best")
    ap.add_argument("--table", action="store_true", help="the GEMM table, per family")
    ap.add_argument("--stack", action="store_true", help="the decode stack, per family")
    ap.add_argument("--cliff", action="store_true", help="W12 at 0.01%% vs 0.1%% escapes")
    ap.add_argument("--eager", action="store_true", help="eager calls (no graph) and host cost per call")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument(
        "--deadline-s",
        type=float,
        help="start no table or stack after this many seconds (the rest "
        "is reported as skipped; keeps one device command in its limit)",
    )
    ap.add_argument("--ms", help=f"M values of the normal family's table (default {','.join(map(str, MS))})")
    ap.add_argument(
        "--extra-ms", help=f"M values of the other families' tables (default {','.join(map(str, EXTRA_MS))})"
    )
    ap.add_argument("--cliff-ms", help=f"M values of the escape cliff (default {','.join(map(str, CLIFF_MS))})")
    ap.add_argument("--eager-ms", help=f"M values of the eager table (default {','.join(map(str, EAGER_MS))})")
    ap.add_argument("--stack-ms", help=f"M values of the decode stack (default {','.join(map(str, STACK_MS))})")
    ap.add_argument("--configs", help="JSON of configs keyed N,K,bucket (the format of tuned_h200.json)")
    ap.add_argument("--out", default="w12_bench.json")
    ap.add_argument("--render", help="print the markdown tables of an earlier --out JSON and exit")
    ap.add_argument(
        "--save-tuned", help="write the picked configs of an earlier --out JSON to benchmarks/results/tuned_h200.json"
    )
    ap.add_argument(
        "--save-fallback",
        help="write the measured speedups of an earlier --out JSON (--table, families "
        "normal, student-t4, outliers) to benchmarks/results/fallback_h200.json",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, 2 layers, wall-clock times: checks the plumbing, measures nothing",
    )
    args = ap.parse_args(argv)
    try:
        args.families = parse_families(args.family)
    except ValueError as err:
        ap.error(str(err))
    for key, default in (
        ("ms", MS),
        ("extra_ms", EXTRA_MS),
        ("stack_ms", STACK_MS),
        ("cliff_ms", CLIFF_MS),
        ("eager_ms", EAGER_MS),
    ):
        value = getattr(args, key)
        setattr(args, key, tuple(int(v) for v in value.split(",")) if value else default)
    if args.dry_run and args.pick:
        ap.error("--pick times Triton configs: it needs a CUDA GPU, not --dry-run")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.render:
        print(render(json.load(open(args.render))))
        return None
    if args.save_tuned:
        save_tuned(json.load(open(args.save_tuned)))
        return None
    if args.save_fallback:
        save_fallback(json.load(open(args.save_fallback)))
        return None

    device, shapes = ("cpu", DRY_SHAPES) if args.dry_run else ("cuda", SHAPES)
    layers = min(args.layers, 2) if args.dry_run else args.layers
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.dry_run:
        head = f"DRY RUN on CPU (tiny shapes, reference path, wall clock: not a measurement), {stamp}"
    else:
        props = torch.cuda.get_device_properties(0)
        head = (
            f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
            f"triton {triton.__version__}, {stamp}"
        )
    print(head, flush=True)
    if args.configs:
        for key, cfg in json.load(open(args.configs)).items():
            TUNED[tuned_key(key)] = Config(**cfg)

    result = {"device": head, "shapes": shapes, "families": {}}
    save = lambda: json.dump(result, open(args.out, "w"), indent=1, default=str)  # noqa: E731
    t_start = time.time()
    late = lambda: args.deadline_s is not None and time.time() - t_start > args.deadline_s  # noqa: E731
    try:
        if args.cliff:
            result["cliff"] = cliff(shapes, args.cliff_ms, device)
            save()
    except Exception:
        traceback.print_exc()
        result["cliff_error"] = traceback.format_exc(limit=2)
    for family in args.families:
        res = result["families"].setdefault(family, {})
        try:
            weights = family_weights(family, shapes, device)
        except Exception as err:  # e.g. stories260K's file missing or not the pinned one: the others still run
            res["error"] = f"{type(err).__name__}: {err}"
            print(f"{family}: SKIPPED: {res['error']}", flush=True)
            continue
        try:
            res["checks"] = {
                name: check_correctness(f"{family} {name}", w["bf16"][0], w["w12"][0]) for name, w in weights.items()
            }
            print(
                f"check {family}: "
                + ", ".join(
                    f"{n} {c['bits_per_weight']:.4f} bits, {100 * c['escape_rate']:.4f}%"
                    for n, c in res["checks"].items()
                ),
                flush=True,
            )
            if args.pick and family == "normal":
                best = pick(weights)
                TUNED.update(best)
                for w in weights.values():  # plans prepared by the correctness check hold the old configs
                    for packed in w["w12"]:
                        packed.plans.clear()
                result["tuned"] = {tuned_name(k): vars(v) for k, v in best.items()}
                save()
            if args.table and late():
                res["table_skipped"] = f"deadline {args.deadline_s:.0f} s passed"
                print(f"{family}: table skipped: {res['table_skipped']}", flush=True)
            elif args.table:
                res["table"] = table(weights, shapes, args.ms if family == "normal" else args.extra_ms, family)
                save()
            if args.eager and family == args.families[0]:
                result["eager_family"] = family
                result["eager"] = eager(weights, shapes, args.eager_ms)
                save()
        except Exception:
            traceback.print_exc()
            res["error"] = traceback.format_exc(limit=2)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            if args.stack and late():
                res["stack_skipped"] = f"deadline {args.deadline_s:.0f} s passed"
                print(f"{family}: stack skipped: {res['stack_skipped']}", flush=True)
            elif args.stack:
                res["stack"] = stack(layers, family, args.stack_ms, shapes, device)
                save()
        except Exception:
            traceback.print_exc()
            res["stack_error"] = traceback.format_exc(limit=2)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{family} done at {time.time() - t_start:.0f} s", flush=True)
    result["seconds"] = time.time() - t_start
    save()
    print(
        f"\n{render(result, compact=True)}\n\nall tables: python -m specpilot_lab.w12_bench --render {args.out}  "
        f"({result['seconds']:.0f} s)"
    )
    return result


if __name__ == "__main__":
    main()
