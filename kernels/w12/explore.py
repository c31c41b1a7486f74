"""Exploration runs on the H200 (not the benchmark of record, which is bench.py): tile shapes, split K
and decode ablations timed side by side under CUDA graphs, plus a pure-read kernel that streams the
same planes with the same tiling (the floor for that access pattern).

    cd kernels && python3 -m w12.explore --out explore.json
    cd kernels && python3 -m w12.explore --swap          # swap-orientation tiles per M bucket
    cd kernels && python3 -m w12.explore --m16           # M = 16 tiles with less shared memory per program
    cd kernels && python3 -m w12.explore --layout        # read floor: row-strided vs contiguous per program
    cd kernels && python3 -m w12.explore --balance       # read floor: the GEMM's grid vs stream-K order
    cd kernels && python3 -m w12.explore --ncu qkv      # a few plain launches, for Nsight Compute
    cd kernels && python3 -m w12.explore --m32          # M = 32 tiles x escape placement x split K
    cd kernels && python3 -m w12.explore --m32-swap     # M = 32 with x.T as the n32 operand
    cd kernels && python3 -m w12.explore --tail         # per-launch overhead: L2 clearing, escape placement, read floors
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from .bench import (BUFFERS, COPY_TBPS, SHAPES, bucket_of, check_correctness, graph_time_us, llm_like_weight,
                    replay_us, stack_weights)
from .format import encode
from .gemm import TUNED, Config, default_config, fused_gemm

SMS = 132
TILES = [  # block_n, block_k, num_warps, num_stages
    (32, 128, 4, 4), (64, 64, 2, 4), (128, 64, 4, 4), (64, 64, 4, 6), (64, 128, 2, 4),
    (64, 64, 2, 6),
]


def shape_weights(name: str):
    """(N, K, BUFFERS bf16 weights, their W12 encodings) for a benchmark shape."""
    n, k = SHAPES[name]
    bf16s = [llm_like_weight(n, k, seed=7 * b + 1) for b in range(BUFFERS)]
    return n, k, bf16s, [encode(w) for w in bf16s]


def splits_for(n: int, block_n: int) -> list[int]:
    blocks = -(-n // block_n)
    out = {1}
    for target in (2 * SMS, 4 * SMS):
        out.add(max(1, min(8, round(target / blocks))))
    return sorted(out)


@triton.jit
def _read_kernel(low_ptr, nib_ptr, out_ptr, N, HALF, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    steps = tl.cdiv(tl.cdiv(HALF, BLOCK_K), splits)
    k_first = pid_k * steps * BLOCK_K
    k_last = tl.minimum(HALF, k_first + steps * BLOCK_K)
    acc = _read_rows(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32), low_ptr, nib_ptr, rows, k_first, k_last, HALF)
    tl.store(out_ptr + pid_k * N + rows, tl.xor_sum(acc, axis=1))


@triton.jit
def _read_rows(acc, low_ptr, nib_ptr, rows, k_first, k_last, HALF):
    """Read the plane words of `rows` over columns k_first..k_last of each half, folded into acc."""
    BLOCK_K: tl.constexpr = acc.shape[1]
    low_rows = low_ptr + rows.to(tl.int64)[:, None] * (2 * HALF)
    nib_rows = nib_ptr + rows.to(tl.int64)[:, None] * HALF
    for k0 in range(k_first, k_last, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)[None, :]
        acc ^= tl.load(nib_rows + offs) + tl.load(low_rows + offs) + tl.load(low_rows + HALF + offs)
    return acc


@triton.jit
def _read_contiguous_kernel(buf_ptr, out_ptr, STEPS, TILE: tl.constexpr):
    """Each program streams its own contiguous region, TILE int32 words per step."""
    pid = tl.program_id(0)
    start = buf_ptr + pid.to(tl.int64) * STEPS * TILE
    acc = tl.zeros((TILE,), dtype=tl.int32)
    for s in range(0, STEPS):
        acc ^= tl.load(start + s * TILE + tl.arange(0, TILE))
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@triton.jit
def _read_balanced_kernel(low_ptr, nib_ptr, out_ptr, N, HALF, UNITS, STEPS, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Stream-K order: program p reads units [p U / P, (p + 1) U / P) of the (row block, K step) sequence,
    one pipelined K loop per row block it touches; every program gets the same bytes within one step."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first = (pid * UNITS) // programs
    last = ((pid + 1) * UNITS) // programs
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for tile in range(first // STEPS, tl.cdiv(last, STEPS)):
        rows = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
        k_first = (tl.maximum(first, tile * STEPS) - tile * STEPS) * BLOCK_K
        k_last = (tl.minimum(last, (tile + 1) * STEPS) - tile * STEPS) * BLOCK_K
        acc = _read_rows(acc, low_ptr, nib_ptr, rows, k_first, k_last, HALF)
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.xor_sum(acc, axis=1))


def balance_floor(shapes: list[str]) -> list[dict]:
    """Is load balance worth a stream-K GEMM? The plane read of the GEMM's grid (row blocks x split K: some
    SMs get one program more than others) vs the same tiles read in stream-K order by 2-8 programs per SM."""
    rows = []
    for name in shapes:
        n, k, _, packs = shape_weights(name)
        nbytes = packs[0].low.numel() + packs[0].codes.numel()
        split = 3 if n <= 5120 else 1
        out = torch.empty(8 * 4096, dtype=torch.int32, device="cuda")
        for bn in (32, 64):
            grid_programs = -(-n // bn) * split
            t = graph_time_us(lambda p: read_planes(p, bn, 128, split, out, 4, 4), packs)
            rows.append(dict(shape=name, kind="grid", block_n=bn, programs=grid_programs, us=t,
                             tbps=nbytes / t / 1e6))
            line = f"{name:8s} {bn}-row grid {grid_programs:5d} programs {t:6.1f} us"
            words = packs[0].cols_padded // 8
            steps = words // 32
            units = -(-n // bn) * steps
            for per_sm in (2, 3, 4, 6, 8):
                g = SMS * per_sm

                def read(p, g=g):
                    _read_balanced_kernel[(g,)](p.low.view(torch.int32), p.codes.view(torch.int32), out, p.rows,
                                                words, units, steps, BLOCK_N=bn, BLOCK_K=32,
                                                num_warps=4, num_stages=4)
                t = graph_time_us(read, packs)
                rows.append(dict(shape=name, kind="stream-k", block_n=bn, programs=g, us=t, tbps=nbytes / t / 1e6))
                line += f" | stream-K {per_sm}/SM {t:6.1f}"
            print(line, flush=True)
        torch.cuda.empty_cache()
    return rows


def layout_floor(shapes: list[str]) -> list[dict]:
    """The same bytes as the W12 planes, read by the same number of programs: row-strided
    as the GEMM reads them (12 KB steps: 32 rows x 3 runs of 128 bytes) vs each program's data contiguous
    (16 KB steps; what a tile-major layout would give), and contiguous with 4x the programs."""
    rows = []
    for name in shapes:
        n, k, _, packs = shape_weights(name)
        nbytes = packs[0].low.numel() + packs[0].codes.numel()
        split = 3 if n <= 5120 else 1
        programs = -(-n // 32) * split
        out = torch.empty(8 * programs, dtype=torch.int32, device="cuda")
        t = graph_time_us(lambda p: read_planes(p, 32, 128, split, out, 4, 4), packs)
        rows.append(dict(shape=name, kind="strided", programs=programs, us=t, tbps=nbytes / t / 1e6))
        print(f"{name:8s} strided    {programs:5d} programs: {t:6.1f} us {nbytes / t / 1e6:.2f} TB/s", flush=True)
        tile = 4096                                  # int32 words: 16 KB per step (a power of two)
        for mult in (1, 4):
            g = programs * mult
            steps = nbytes // 4 // (g * tile)
            bufs = [torch.randint(0, 2 ** 30, (g * steps * tile,), dtype=torch.int32, device="cuda")
                    for _ in range(BUFFERS)]
            used = g * steps * tile * 4
            t = graph_time_us(lambda b: _read_contiguous_kernel[(g,)](b, out, steps, TILE=tile, num_warps=4), bufs)
            rows.append(dict(shape=name, kind=f"contiguous x{mult}", programs=g, us=t, tbps=used / t / 1e6))
            print(f"{name:8s} contiguous {g:5d} programs: {t:6.1f} us {used / t / 1e6:.2f} TB/s "
                  f"({used / 1e6:.1f} MB)", flush=True)
            del bufs
        torch.cuda.empty_cache()
    return rows


def read_planes(p, block_n, block_k, split, out, warps=4, stages=4):
    words = p.cols_padded // 8          # 32-bit words per row of the nibble plane (and per half-row of bytes)
    grid = (triton.cdiv(p.rows, block_n), split)
    _read_kernel[grid](p.low.view(torch.int32), p.codes.view(torch.int32), out, p.rows, words,
                       BLOCK_N=block_n, BLOCK_K=block_k // 4,
                       num_warps=warps, num_stages=stages)


def swap_candidates(n: int, bucket: int) -> list[Config]:
    """W12 tiles as the dot's A operand (x.T as B, n8 per MMA): fewer instructions per weight (compiler
    report) than x as A. Split K where the row blocks alone would leave SMs idle."""
    tiles = {8: [(64, 128, 4, 3), (32, 128, 2, 4), (128, 64, 4, 4), (32, 128, 2, 3)],
             16: [(32, 128, 2, 3), (32, 128, 2, 4), (64, 128, 2, 3)],
             32: [(32, 128, 2, 3), (32, 64, 2, 4)]}[bucket]
    out = []
    for bn, bk, warps, stages in tiles:
        blocks = -(-n // bn)
        for split in sorted({1, max(1, min(8, round(4 * SMS / blocks)))}):
            out.append(Config(bn, bk, warps, stages, swap=True, block_m=bucket, split_k=split))
    return out


# M = 16: tiles that need less shared memory per program than the picked one (2 stages, 16-row tiles on one
# warp) or read longer runs per row (BK 256); the x tile staged with the planes grows with M.
M16_TILES = [(32, 128, 2, 2), (16, 128, 1, 2), (16, 128, 1, 4), (32, 256, 2, 2), (16, 256, 1, 2),
             (32, 64, 2, 4), (64, 128, 4, 2)]


def m16_candidates(n: int, bucket: int) -> list[Config]:
    return [Config(bn, bk, warps, stages, swap=True, block_m=16, split_k=split)
            for bn, bk, warps, stages in M16_TILES for split in splits_for(n, bn)]


SWAP_BUCKETS = ((8, (1, 8)), (16, (16,)), (32, (32,)))


def sweep_swap(shapes: list[str], buckets=SWAP_BUCKETS, candidates=swap_candidates) -> list[dict]:
    """Swap-orientation tiles vs the tuned configs, per M bucket, under CUDA graphs; every swap config is
    first checked against a float64 reference."""
    rows = []
    for name in shapes:
        n, k, bf16s, packs = shape_weights(name)
        nbytes = packs[0].nbytes()
        for bucket, ms in buckets:
            tuned = TUNED.get((n, k, max(16, bucket))) or default_config(n, k, max(16, bucket))
            configs = [tuned] + candidates(n, bucket)
            for cfg in configs:
                try:
                    if cfg is not tuned:
                        check_correctness(name, bf16s[0], packs[0], cfg, ms=ms)
                except Exception as err:
                    print(f"{name:8s} {cfg}: REJECTED {type(err).__name__} {str(err)[:200]}", flush=True)
                    continue
                for m in ms:
                    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                    t = graph_time_us(lambda p: fused_gemm(x, p, cfg), packs)
                    rows.append(dict(shape=name, M=m, cfg=vars(cfg), us=t, tbps=nbytes / t / 1e6))
                    print(f"{name:8s} M={m:2d} {cfg.block_n:3d}x{cfg.block_k:3d} w{cfg.num_warps} s{cfg.num_stages} "
                          f"swap={int(cfg.swap)} bm={cfg.block_m} split{cfg.split_k}: {t:6.1f} us "
                          f"{nbytes / t / 1e6:.2f} TB/s", flush=True)
        for m in sorted({m for _, ms in buckets for m in ms}):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            rows.append(dict(shape=name, M=m, cfg="cublas", us=t))
            print(f"{name:8s} M={m:2d} cuBLAS {t:6.1f} us", flush=True)
        del bf16s, packs
        torch.cuda.empty_cache()
    return rows


# Programmatic dependent launch and TMA weight tiles (commit 7a19373) were measured here on 2026-11-30 and
# removed as slower (BENCH.md).
VARIANTS = {"tuned": {}, "esc_after": {"esc_after": True}}


def _variants(cfg: Config, names) -> dict[str, Config]:
    return {v: Config(**{**vars(cfg), **VARIANTS[v]}) for v in names}


@triton.jit
def _read_tma_kernel(low_desc, nib_desc, out_ptr, N, HALF, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    steps = tl.cdiv(tl.cdiv(HALF, BLOCK_K), splits)
    k_first = pid_k * steps * BLOCK_K
    k_last = tl.minimum(HALF, k_first + steps * BLOCK_K)
    for k0 in tl.range(k_first, k_last, BLOCK_K, num_stages=STAGES):
        a = nib_desc.load([pid * BLOCK_N, k0])
        b = low_desc.load([pid * BLOCK_N, k0])
        c = low_desc.load([pid * BLOCK_N, HALF + k0])
        acc ^= a.to(tl.int32) + b.to(tl.int32) + c.to(tl.int32)
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    tl.store(out_ptr + pid_k * N + rows, tl.xor_sum(acc, axis=1))


def read_planes_tma(p, block_n, block_k, split, out, warps=2, stages=3):
    from triton.tools.tensor_descriptor import TensorDescriptor
    half = p.cols_padded // 2
    low = TensorDescriptor(p.low, [p.rows, 2 * half], [2 * half, 1], [block_n, block_k])
    nib = TensorDescriptor(p.codes, [p.rows, half], [half, 1], [block_n, block_k])
    _read_tma_kernel[(triton.cdiv(p.rows, block_n), split)](low, nib, out, p.rows, half, BLOCK_N=block_n,
                                                            BLOCK_K=block_k, STAGES=stages, num_warps=warps,
                                                            num_stages=stages)


def sweep_tail(shapes: list[str], layers: int) -> list[dict]:
    """Where the per-launch overhead goes: the L2-clearing method (write / read / none) for cuBLAS and W12;
    escape-table loads before vs after the main loop; the plain-read floor by pointers vs TMA; then the
    decode stack with those variants."""
    rows = []
    for name in shapes:
        n, k, bf16s, packs = shape_weights(name)
        nbytes = packs[0].nbytes()
        split = 3 if n <= 5120 else 1
        out = torch.empty(8 * n, dtype=torch.int32, device="cuda")
        for label, fn in (("read ptr", lambda p: read_planes(p, 32, 128, split, out, 2, 3)),
                          ("read tma", lambda p: read_planes_tma(p, 32, 128, split, out, 2, 3)),
                          ("read tma w4s4", lambda p: read_planes_tma(p, 32, 128, split, out, 4, 4))):
            t = graph_time_us(fn, packs)
            rows.append(dict(shape=name, kind=label, us=t, tbps=nbytes / t / 1e6))
            print(f"{name:8s} {label:14s} {t:6.1f} us {nbytes / t / 1e6:.2f} TB/s", flush=True)
        for m in (1, 8, 16, 32):
            bucket = bucket_of(m)
            variants = _variants(TUNED.get((n, k, bucket)) or default_config(n, k, bucket), VARIANTS)
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for flush in (("write", "read", "none") if m in (1, 16) else ("write",)):
                t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s, flush=flush)
                line = f"{name:8s} M={m:2d} {flush:5s} cuBLAS {t_ref:6.1f}"
                for label, cfg in variants.items():
                    if flush != "write" and label != "tuned":
                        continue
                    try:
                        if flush == "write":
                            check_correctness(name, bf16s[0], packs[0], cfg, ms=(m,))
                        t = graph_time_us(lambda p: fused_gemm(x, p, cfg), packs, flush=flush)
                    except Exception as err:
                        print(f"{name} M={m} {label}: REJECTED {type(err).__name__} {str(err)[:300]}", flush=True)
                        continue
                    rows.append(dict(shape=name, M=m, flush=flush, variant=label, us=t, cublas_us=t_ref,
                                     speedup=t_ref / t, tbps=nbytes / t / 1e6))
                    line += f" | {label} {t:6.1f} x{t_ref / t:.3f}"
                print(line, flush=True)
        del bf16s, packs
        torch.cuda.empty_cache()
    if layers:
        bf16_layers, w12_layers = stack_weights(layers)
        for m in (1, 8, 32):
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for (_, k) in SHAPES.values()]
            outs = {}
            names = tuple(VARIANTS)
            configs = {key: _variants(TUNED.get(key) or default_config(*key), names)
                       for key in [(n, k, bucket_of(m)) for n, k in SHAPES.values()]}

            def step_bf16():
                for bl in bf16_layers:
                    for x, w in zip(xs, bl):
                        outs[w.shape] = torch.nn.functional.linear(x, w)

            def step_w12(label):
                def step():
                    for wl in w12_layers:
                        for x, p in zip(xs, wl):
                            outs[p.shape] = fused_gemm(x, p, configs[(p.rows, p.cols, bucket_of(m))][label])
                return step
            t_ref = replay_us(step_bf16)[0]
            line = f"stack M={m:2d} | bf16 {t_ref / 1e3:.3f} ms"
            for label in names + ("bf16",):
                t = replay_us(step_bf16 if label == "bf16" else step_w12(label))[0]
                rows.append(dict(stack=layers, M=m, variant=label, us=t, speedup=t_ref / t))
                line += f" | {label} {t / 1e3:.3f} ms x{t_ref / t:.3f}"
            print(line, flush=True)
    return rows


M32_TILES = [  # block_n, block_k, num_warps, num_stages, swap
    (64, 128, 4, 3, False), (64, 128, 4, 2, False), (64, 64, 4, 4, False), (64, 64, 4, 3, False),
    (32, 128, 4, 3, False), (32, 128, 2, 3, False), (128, 64, 4, 3, False), (128, 64, 8, 3, False),
    (64, 128, 8, 3, False), (32, 128, 2, 3, True), (64, 128, 4, 3, True), (64, 64, 4, 4, True),
]
# x.T as the n32 operand with every warp on whole 32-row slabs: Triton's mma layout splits the n dimension
# (duplicating the decode) unless rows per warp >= 2 x 16 (warpsPerTileV2), so 1-2 warps on 32-64 rows.
M32_SWAP_TILES = [
    (64, 128, 2, 3, True), (64, 128, 2, 2, True), (64, 64, 2, 4, True), (64, 64, 2, 3, True),
    (32, 128, 1, 3, True), (32, 128, 1, 2, True), (32, 64, 1, 4, True), (32, 64, 1, 3, True),
]


def sweep_m32(shapes: list[str], tiles=M32_TILES, placements=(False, True)) -> list[dict]:
    """M = 32: tiles x escape-table placement x split K, each checked against float64, then timed."""
    rows = []
    for name in shapes:
        n, k, bf16s, packs = shape_weights(name)
        nbytes = packs[0].nbytes()
        x = torch.randn(32, k, device="cuda").to(torch.bfloat16)
        t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
        tuned = TUNED.get((n, k, 32)) or default_config(n, k, 32)
        t_tuned = graph_time_us(lambda p: fused_gemm(x, p, tuned), packs)
        print(f"{name:8s} M=32 cuBLAS {t_ref:6.1f} us, tuned {t_tuned:6.1f} us x{t_ref / t_tuned:.3f} {tuned}", flush=True)
        results = [(t_tuned, tuned)]
        for bn, bk, warps, stages, swap in tiles:
            blocks = -(-n // bn)
            for split in sorted({1, max(1, min(4, round(2 * SMS / blocks)))} if blocks < 2 * SMS else {1}):
                for after in placements:
                    cfg = Config(bn, bk, warps, stages, swap=swap, block_m=32 if swap else 0, split_k=split,
                                 esc_after=after)
                    try:
                        check_correctness(name, bf16s[0], packs[0], cfg, ms=(32,))
                        t = graph_time_us(lambda p: fused_gemm(x, p, cfg), packs)
                    except Exception as err:
                        print(f"  {cfg}: REJECTED {type(err).__name__} {str(err)[:200]}", flush=True)
                        continue
                    results.append((t, cfg))
                    rows.append(dict(shape=name, M=32, cfg=vars(cfg), us=t, cublas_us=t_ref, speedup=t_ref / t,
                                     tbps=nbytes / t / 1e6))
                    print(f"{name:8s} M=32 {bn:3d}x{bk:3d} w{warps} s{stages} swap={int(swap)} split{split} "
                          f"after={int(after)}: {t:6.1f} us x{t_ref / t:.3f}", flush=True)
        best = min(results, key=lambda r: r[0])
        print(f"{name:8s} M=32 best {best[0]:.1f} us x{t_ref / best[0]:.3f} {best[1]}", flush=True)
        del bf16s, packs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="explore.json")
    ap.add_argument("--ncu", help="shape name: run a few plain launches for a profiler and exit")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--swap", action="store_true", help="swap-orientation sweep per M bucket")
    ap.add_argument("--balance", action="store_true", help="plane read: the GEMM's grid vs stream-K order")
    ap.add_argument("--m16", action="store_true", help="M = 16: tiles with less shared memory or longer runs")
    ap.add_argument("--layout", action="store_true", help="read floor: row-strided vs contiguous per program")
    ap.add_argument("--m32", action="store_true", help="M = 32 tiles x escape placement x split K")
    ap.add_argument("--m32-swap", action="store_true", help="M = 32, x.T as the n32 operand, 32-row slabs per warp")
    ap.add_argument("--tail", action="store_true", help="per-launch overhead: L2 clearing, escape placement, read floors")
    ap.add_argument("--layers", type=int, default=64, help="decode stack depth for --tail (0: no stack)")
    args = ap.parse_args()
    if args.m32 or args.m32_swap:
        tiles, placements = (M32_SWAP_TILES, (True,)) if args.m32_swap else (M32_TILES, (False, True))
        json.dump(sweep_m32(args.shapes.split(","), tiles, placements), open(args.out, "w"), indent=1)
        return
    if args.tail:
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
        json.dump(sweep_tail(args.shapes.split(","), args.layers), open(args.out, "w"), indent=1)
        return
    if args.balance:
        json.dump(balance_floor(args.shapes.split(",")), open(args.out, "w"), indent=1)
        return
    if args.layout:
        json.dump(layout_floor(args.shapes.split(",")), open(args.out, "w"), indent=1)
        return
    if args.swap or args.m16:
        sweep = sweep_swap(args.shapes.split(",")) if args.swap else \
            sweep_swap(args.shapes.split(","), ((16, (16,)),), m16_candidates)
        json.dump(sweep, open(args.out, "w"), indent=1)
        return
    if args.ncu:
        n, k = SHAPES[args.ncu]
        w = llm_like_weight(n, k, seed=1)
        p = encode(w)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        for bucket in (8, 16, 32):
            cfg = TUNED.get((n, k, bucket)) or default_config(n, k, bucket)
            for _ in range(3):
                fused_gemm(x, p, cfg)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        return

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for name in args.shapes.split(","):
        n, k, bf16s, packs = shape_weights(name)
        nbytes = packs[0].nbytes()
        out = torch.empty(8 * n, dtype=torch.int32, device="cuda")
        for bn, bk, warps, stages in ((32, 128, 4, 4), (64, 64, 2, 4), (128, 64, 4, 4)):
            for split in splits_for(n, bn):
                t = graph_time_us(lambda p: read_planes(p, bn, bk, split, out, warps, stages), packs)
                rows.append(dict(shape=name, kind="read", cfg=[bn, bk, warps, stages, split], us=t,
                                 tbps=nbytes / t / 1e6))
                print(f"{name:8s} read  {bn:3d}x{bk:3d} w{warps} s{stages} split{split}: {t:6.1f} us "
                      f"{nbytes / t / 1e6:.2f} TB/s (roofline {nbytes / COPY_TBPS / 1e6:.1f} us)", flush=True)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            rows.append(dict(shape=name, M=m, kind="cublas", us=t_ref))
            print(f"{name:8s} M={m:2d} cuBLAS {t_ref:6.1f} us", flush=True)
            base_cfg = TUNED.get((n, k, 16)) or default_config(n, k, 16)
            configs = [base_cfg] + [Config(bn, bk, w_, s_, split_k=sp) for bn, bk, w_, s_ in TILES
                                    for sp in splits_for(n, bn)]
            for cfg in configs:
                for probe in (0,) if cfg is not base_cfg else (0, 1, 2, 3):
                    variant = Config(**{**vars(cfg), "probe": probe})
                    try:
                        t = graph_time_us(lambda p: fused_gemm(x, p, variant), packs)
                    except Exception as err:
                        print(f"  {variant}: {type(err).__name__} {str(err)[:120]}", flush=True)
                        continue
                    rows.append(dict(shape=name, M=m, kind="w12", cfg=vars(variant), us=t,
                                     speedup=t_ref / t, tbps=nbytes / t / 1e6))
                    print(f"{name:8s} M={m:2d} {cfg.block_n:3d}x{cfg.block_k:3d} w{cfg.num_warps} "
                          f"s{cfg.num_stages} split{cfg.split_k} probe{probe}: {t:6.1f} us  x{t_ref / t:.3f} "
                          f"{nbytes / t / 1e6:.2f} TB/s", flush=True)
        del bf16s, packs
        torch.cuda.empty_cache()
        json.dump(rows, open(args.out, "w"), indent=1)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
