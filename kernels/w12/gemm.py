"""y = x @ W.T with W in W12 form, decoded tile by tile in registers (Triton).

Small M (decode, M <= 32) runs the fused kernel: each program streams BLOCK_N full rows of the byte
and nibble planes, rebuilds bf16 bit patterns with integer ops and feeds them to tl.dot. Escaped
weights read as +0 there; the program then adds x[:, col] * w for its rows' escapes through one more
small bf16 dot, so the sum equals a GEMM with the exact original weights (fp32 accumulation).
Larger M decodes W to bf16 once and calls cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .format import W12Tensor, decode

FUSED_MAX_M = 32


@dataclass(frozen=True)
class Config:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False        # accumulate y.T = W @ x.T (weights as the dot's A operand)


# Chosen on the H200 by bench.py --tune (see BENCH.md); a plain default elsewhere.
TUNED: dict[tuple[int, int, int], Config] = {}


def linear(x: torch.Tensor, packed: W12Tensor, bias: torch.Tensor | None = None,
           config: Config | None = None) -> torch.Tensor:
    """F.linear(x, decode(packed), bias) for bf16 x of shape [..., K]."""
    if x.shape[-1] != packed.cols or len(packed.shape) != 2:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match W12 weight {packed.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.cols)
    if x2.shape[0] <= FUSED_MAX_M and (x2.is_cuda or _interpreting()):
        y = fused_gemm(x2, packed, config)
        if bias is not None:
            y = y + bias
    else:
        y = torch.nn.functional.linear(x2, decode(packed), bias)
    return y.reshape(*lead, packed.rows)


def fused_gemm(x: torch.Tensor, packed: W12Tensor, config: Config | None = None) -> torch.Tensor:
    m, k = x.shape
    if m > FUSED_MAX_M:
        raise ValueError(f"the fused W12 kernel takes at most {FUSED_MAX_M} rows, got {m}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"W12 GEMM takes bf16 activations, got {x.dtype}")
    x = x.contiguous()
    n = packed.rows
    block_m = 16 if m <= 16 else 32
    cfg = config or TUNED.get((n, k, block_m)) or Config()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    half = packed.cols_padded // 2
    esc_block = 16 if packed.escapes == 0 else 32
    grid = (triton.cdiv(n, cfg.block_n),)
    _w12_gemm_kernel[grid](
        x, packed.signman, packed.codes, packed.base, packed.esc_ptr, packed.esc_col,
        packed.esc_bits, y,
        m, n, k, half, x.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ESC_BLOCK=esc_block,
        SWAP=cfg.swap, EVEN_K=(half % cfg.block_k == 0 and k == 2 * half), DOT_F32=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_tile(sm, code, base):
    """int32 sign|mantissa bytes and 4-bit codes -> bf16 (escapes and code 15 -> exponent 0)."""
    exponent = tl.where(code == 15, 0, code + base[:, None])
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # Triton 3.9's interpreter computes bf16 dots wrongly; bf16 -> fp32 is exact, so the
    # interpreter runs the same sums in fp32. Compiled code keeps the bf16 tensor-core dot.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _w12_gemm_kernel(
    x_ptr, sm_ptr, nib_ptr, base_ptr, esc_ptr_ptr, esc_col_ptr, esc_bits_ptr, y_ptr,
    M, N, K, HALF, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ESC_BLOCK: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)               # clamped: loads need no row mask
    offs_m = tl.arange(0, BLOCK_M)
    xrows = tl.minimum(offs_m, M - 1)
    base = tl.load(base_ptr + rows).to(tl.int32)

    # This block's escapes, fetched before the main loop so their latency hides behind it.
    first_row = pid * BLOCK_N
    last_row = tl.minimum(first_row + BLOCK_N, N)
    esc_start = tl.load(esc_ptr_ptr + first_row)
    esc_end = tl.load(esc_ptr_ptr + last_row)
    row_lo = tl.load(esc_ptr_ptr + rows)
    row_hi = tl.where(offs_n < N, tl.load(esc_ptr_ptr + rows + 1), row_lo)

    sm_rows = sm_ptr + rows.to(tl.int64)[:, None] * (2 * HALF)
    nib_rows = nib_ptr + rows.to(tl.int64)[:, None] * HALF
    x_rows = x_ptr + xrows[:, None] * stride_xm

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HALF, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            nib = tl.load(nib_rows + offs_k[None, :]).to(tl.int32)
            sm_lo = tl.load(sm_rows + offs_k[None, :]).to(tl.int32)
            sm_hi = tl.load(sm_rows + HALF + offs_k[None, :]).to(tl.int32)
            x_lo = tl.load(x_rows + offs_k[None, :])
            x_hi = tl.load(x_rows + HALF + offs_k[None, :])
        else:
            kmask = offs_k < HALF
            nib = tl.load(nib_rows + offs_k[None, :], mask=kmask[None, :], other=0).to(tl.int32)
            sm_lo = tl.load(sm_rows + offs_k[None, :], mask=kmask[None, :], other=0).to(tl.int32)
            sm_hi = tl.load(sm_rows + HALF + offs_k[None, :], mask=kmask[None, :], other=0).to(tl.int32)
            x_lo = tl.load(x_rows + offs_k[None, :], mask=kmask[None, :], other=0.0)
            hmask = (HALF + offs_k) < K
            x_hi = tl.load(x_rows + HALF + offs_k[None, :], mask=hmask[None, :], other=0.0)
        w_lo = _decode_tile(sm_lo, nib & 0xF, base)
        w_hi = _decode_tile(sm_hi, nib >> 4, base)
        if SWAP:
            acc = _dot(w_lo, tl.trans(x_lo), acc, DOT_F32)
            acc = _dot(w_hi, tl.trans(x_hi), acc, DOT_F32)
        else:
            acc = _dot(x_lo, tl.trans(w_lo), acc, DOT_F32)
            acc = _dot(x_hi, tl.trans(w_hi), acc, DOT_F32)

    # Escapes: acc += x[:, col_e] * w_e in column row_e, as a bf16 dot against a [E, BLOCK_N]
    # matrix that holds w_e in its row's column and 0 elsewhere (products exact in fp32).
    for e0 in range(esc_start, esc_end, ESC_BLOCK):
        offs_e = e0 + tl.arange(0, ESC_BLOCK)
        emask = offs_e < esc_end
        col = tl.load(esc_col_ptr + offs_e, mask=emask, other=0)
        wbits = tl.load(esc_bits_ptr + offs_e, mask=emask, other=0)
        w_e = wbits.to(tl.bfloat16, bitcast=True)
        mine = (offs_e[:, None] >= row_lo[None, :]) & (offs_e[:, None] < row_hi[None, :])
        spread = tl.where(mine & emask[:, None], w_e[:, None], 0.0).to(tl.bfloat16)  # [E, BN]
        xg = tl.load(x_ptr + xrows[:, None] * stride_xm + col[None, :],
                     mask=emask[None, :], other=0.0)                              # [BM, E]
        if SWAP:
            acc = _dot(tl.trans(spread), tl.trans(xg), acc, DOT_F32)
        else:
            acc = _dot(xg, spread, acc, DOT_F32)

    out = acc.to(tl.bfloat16)
    if SWAP:
        out = tl.trans(out)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
