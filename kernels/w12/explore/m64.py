"""Where the fused kernel's time goes at M = 16 / 32 / 64 (issue #18, history only): the main loop of
gemm._w12_gemm_kernel (no escapes, no split K) with parts left out, side by side with cuBLAS and the picked
config, each under CUDA graphs over rotated weights.

    PYTHONPATH=kernels python3 -m w12.explore.m64            # the parts left out, picked configs
    PYTHONPATH=kernels python3 -m w12.explore.m64 --sweep    # wider row tiles at M = 32 / 64: full and noplane
    PYTHONPATH=kernels python3 -m w12.explore.m64 --bk64     # the same with BK 64 (the picked config as a control)

Modes (the same tiles, warps, stages and split K as the picked config of the shape and bucket; split-K ranges
store fp32 partials and are not summed):
  full     planes read, decoded, x read, tl.dot             (the kernel without escapes)
  nodot    planes read and decoded, x read; the decoded bits XOR-folded instead of the dot
  noplane  x read and tl.dot with a constant weight tile    (the x / MMA side alone)
  read     planes read and XOR-folded                       (the weight stream alone)
"""
from __future__ import annotations

import itertools
import sys
import time

import torch
import triton
import triton.language as tl

from ..families import SHAPES, draw
from ..format import encode
from ..gemm import Config, _decode, _dot, bucket_of, config_for, fused_gemm
from ..bench import graph_time_us

MODES = {"full": 0, "nodot": 1, "noplane": 2, "read": 3}


@triton.jit
def _probe_kernel(x_ptr, low_ptr, nib_ptr, base_ptr, y_ptr, part_ptr, M, N, HALF, stride_xm, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                  MODE: tl.constexpr, PTX: tl.constexpr = True):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    steps = tl.cdiv(tl.cdiv(HALF, BLOCK_K), tl.num_programs(1))
    k_first = pid_k * steps * BLOCK_K
    k_last = tl.minimum(HALF, k_first + steps * BLOCK_K)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    xmask = offs_m < M
    base = tl.load(base_ptr + rows)
    low_rows = low_ptr + rows.to(tl.int64)[:, None] * (2 * HALF)
    nib_rows = nib_ptr + rows.to(tl.int64)[:, None] * HALF
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    fold = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    const_w = tl.full((BLOCK_N, BLOCK_K), 0.5, tl.bfloat16)
    for k0 in range(k_first, k_last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if MODE != 2:
            nib = tl.load(nib_rows + offs_k[None, :])
            low_a = tl.load(low_rows + offs_k[None, :])
            low_b = tl.load(low_rows + HALF + offs_k[None, :])
        if MODE != 3:
            x_lo = tl.load(x_rows + offs_k[None, :], mask=xmask[:, None], other=0.0)
            x_hi = tl.load(x_rows + HALF + offs_k[None, :], mask=xmask[:, None], other=0.0)
        if MODE == 3:
            fold ^= nib.to(tl.int32) ^ (low_a.to(tl.int32) << 8) ^ (low_b.to(tl.int32) << 16)
        elif MODE == 2:
            if SWAP:
                acc = _dot(const_w, tl.trans(x_lo), acc, not PTX)
                acc = _dot(const_w, tl.trans(x_hi), acc, not PTX)
            else:
                acc = _dot(x_lo, tl.trans(const_w), acc, not PTX)
                acc = _dot(x_hi, tl.trans(const_w), acc, not PTX)
        else:
            w_lo = _decode(low_a, nib, base, False, PTX)
            w_hi = _decode(low_b, nib, base, True, PTX)
            if MODE == 1:
                fold ^= w_lo.to(tl.int16, bitcast=True).to(tl.int32) ^ w_hi.to(tl.int16, bitcast=True).to(tl.int32)
                xs = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)   # keeps x's loads
                if SWAP:
                    acc += xs[None, :]
                else:
                    acc += xs[:, None]
            elif SWAP:
                acc = _dot(w_lo, tl.trans(x_lo), acc, not PTX)
                acc = _dot(w_hi, tl.trans(x_hi), acc, not PTX)
            else:
                acc = _dot(x_lo, tl.trans(w_lo), acc, not PTX)
                acc = _dot(x_hi, tl.trans(w_hi), acc, not PTX)
    folded = tl.sum(fold, axis=1).to(tl.float32)
    if SWAP:
        acc += folded[:, None]
        acc = tl.trans(acc)
    else:
        acc += folded[None, :]
    ymask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if tl.num_programs(1) == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(tl.bfloat16), mask=ymask)
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=ymask)


def probe(x, packed, cfg, mode: str, ptx: bool = True):
    m, k = x.shape
    n = packed.rows
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if cfg.split_k > 1 else y
    bucket = bucket_of(m)
    block_m = cfg.block_m if cfg.block_m >= bucket else max(16, bucket)
    _probe_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, packed.low, packed.codes, packed.base, y, part, m, n, packed.cols_padded // 2, x.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP=cfg.swap, MODE=MODES[mode], PTX=ptx,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def candidates(n: int, block_ks=(128,)) -> list[Config]:
    """Row tiles of 64-256 rows (x re-read from L2 once per row block: fewer blocks, less x traffic), x as A or
    x.T as B, 4-8 warps, BK 128 (64 lost 20-25% in every earlier sweep at M <= 32; --bk64 tries it: half the x
    tile in shared memory), 2-3 stages, split K to ~1 or ~2 programs per SM."""
    out = []
    for swap, (block_n, warps), block_k, stages in itertools.product(
            (True, False), ((64, 4), (128, 4), (128, 8), (256, 8)), block_ks, (2, 3)):
        blocks = triton.cdiv(n, block_n)
        for split in sorted({1, max(1, min(8, round(132 / blocks))), max(1, min(8, round(264 / blocks)))}):
            out.append(Config(block_n, block_k, warps, stages, swap=swap, split_k=split, esc_after=True, xt=True))
    return out


def sweep(ms=(64, 32), shapes=("qkv", "down", "gate_up"), budget_s: float = 400, block_ks=(128,)) -> None:
    started = time.time()
    for m, name in itertools.product(ms, shapes):
        if time.time() - started > budget_s:
            print(f"{name} M={m}: skipped (budget)", flush=True)
            continue
        n, k = SHAPES[name]
        ws = [draw("normal", n, k, seed=s, device="cuda") for s in range(3)]
        packs = [encode(w) for w in ws]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0]).float()
        t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
        picked = config_for(packs[0], bucket_of(m))
        t_pick = graph_time_us(lambda p: fused_gemm(x, p, picked), packs)
        results = []
        for cfg in candidates(n, block_ks) + [c for c in [picked] if c.block_k not in block_ks]:
            try:
                y = fused_gemm(x, packs[0], cfg).float()
                err = ((y - ref).abs() / (ref.abs() + 1e-2)).max().item()
                t = graph_time_us(lambda p, cfg=cfg: fused_gemm(x, p, cfg), packs)
                results.append((t, cfg, err))
            except Exception as exc:        # e.g. more shared memory than the SM has
                print(f"  {name} M={m} {cfg}: {type(exc).__name__}", flush=True)
        results.sort(key=lambda r: r[0])
        print(f"{name:8s} M={m:2d} cuBLAS {t_ref:6.1f}  picked {t_pick:6.1f} (x{t_ref / t_pick:.3f})  "
              f"{len(results)} configs ran ({time.time() - started:.0f} s)", flush=True)
        for t, cfg, err in results[:5]:
            t_np = graph_time_us(lambda p, cfg=cfg: probe(x, p, cfg, "noplane"), packs)
            print(f"    {t:6.1f} us x{t_ref / t:.3f}  noplane {t_np:6.1f}  rel.err {err:.2g}  "
                  f"[{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} swap={cfg.swap} "
                  f"split={cfg.split_k}]", flush=True)
        del ws, packs
        torch.cuda.empty_cache()
    print(f"sweep done in {time.time() - started:.0f} s")


def main() -> None:
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    if "--sweep" in sys.argv:
        sweep()
        return
    if "--bk64" in sys.argv:
        sweep(ms=(64, 32), budget_s=250, block_ks=(64,))
        return
    for name in ("qkv", "gate_up", "down"):
        n, k = SHAPES[name]
        ws = [draw("normal", n, k, seed=s, device="cuda") for s in range(3)]
        packs = [encode(w) for w in ws]
        for m in (16, 32, 64):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            cfg = config_for(packs[0], bucket_of(m))
            t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
            t_pick = graph_time_us(lambda p: fused_gemm(x, p, cfg), packs)
            times = {mode: graph_time_us(lambda p, mode=mode: probe(x, p, cfg, mode), packs) for mode in MODES}
            ok = (probe(x, packs[0], cfg, "full").float() - fused_gemm(x, packs[0], cfg).float()).abs().max().item()
            ok = ok if cfg.split_k == 1 else float("nan")     # split K: the probe does not sum its partials
            print(f"{name:8s} M={m:2d} cuBLAS {t_ref:6.1f}  picked {t_pick:6.1f} (x{t_ref / t_pick:.3f})  "
                  + "  ".join(f"{mode} {t:6.1f}" for mode, t in times.items())
                  + f"  [{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} swap={cfg.swap}"
                  f" split={cfg.split_k}]  full vs picked max|diff| {ok:.3g} (escapes left out)", flush=True)
        del ws, packs
        torch.cuda.empty_cache()
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
