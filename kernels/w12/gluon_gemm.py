"""y = x @ W.T with W in W12 form: mma.sync with both operands assembled in registers (Gluon), K visited in a
permuted order so that every thread reads contiguous runs of both the planes and x.

In the m16n8k16 fragments, thread `q = lane % 4` holds the columns `16c + 8h + 2q + b` of each operand (A:
weights, rows lane / 4 and + 8; B: x.T, token lane / 4). A dot product does not care in which order it
visits K, so logical column `16c + 8h + 2q + b` is taken to be physical column `16q + 4c + 2h + b` of a
64-column sub-step, for both operands: thread q then owns physical columns 16q..16q+15, i.e. 16
contiguous plane bytes per row (one 16-byte load, decoded in place) and 16 contiguous x values per token
(two 16-byte loads); the relabelling is free in the compiled code. Each warp owns 16 weight rows and all
tokens (no weight is decoded twice), so the program's rows are 16 x warps.

A ring of cp.async stages brings each K step (128 columns of each half) of the three planes and of x into
shared memory (swizzled 16-byte vectors). Escapes are added after the main loop as two more small dots, and
split K uses the same fp32 partials and arrival counters as the Triton kernel (gemm.py).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .format import W12Tensor

SUB = gl.constexpr(64)          # columns of each half per sub-step (the permutation's span)
ESC_BLOCK = gl.constexpr(32)    # escape entries per correction dot


@functools.lru_cache(maxsize=None)
def layouts(block_m: int, warps: int):
    """Register and shared-memory layouts for `warps` warps (16 weight rows each) and block_m tokens."""
    rows = 16 * warps
    warp_rows = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # A sub-step's plane bytes as [row, word, byte], physical column 4 word + byte = 16q + 4c + 2h + b:
    # registers over byte, word (16 contiguous bytes), row + 8; lanes over q and rows 0..7; warps over rows.
    planes = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
        lane_bases=[[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[b + [0] for b in warp_rows], block_bases=[], shape=[rows, 16, 4])
    # x as [token, physical column]: 16 contiguous columns per thread (its q), tokens lane / 4 (+ 8 j), the
    # same in every warp.
    x_regs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + [[8 << j, 0] for j in range((block_m // 8).bit_length() - 1)],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * (warps.bit_length() - 1), block_bases=[], shape=[block_m, 64])
    copy_words = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[warps, 1],
                                  order=[1, 0])
    copy_x = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[warps, 1],
                              order=[1, 0])
    ring_words = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    ring_x = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    esc = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[4, 8], warps_per_cta=[warps, 1], order=[1, 0])
    return dict(MMA=mma, A_OP=a_op, B_OP=b_op, PLANES=planes, X_REGS=x_regs, COPY_WORDS=copy_words,
                COPY_X=copy_x, RING_WORDS=ring_words, RING_X=ring_x, ESC=esc)


# The byte-parallel decode of gemm.py on one 32-bit word per plane: $2 = 4 low bytes, $6 = 4 code-plane bytes,
# $10 = base x4 (each word arrives 4 times, once per byte of the broadcast [row, word, byte] tile).
_DECODE_PTX = """
{
.reg .b32 t, h;
%s
add.u32 t, t, $10;
or.b32 h, h, t;
prmt.b32 $0, $2, h, 0x5140;
prmt.b32 $1, $2, h, 0x7362;
}
"""
_PTX_LOW = gl.constexpr(_DECODE_PTX % "and.b32 t, $6, 0x07070707;\nshl.b32 h, $6, 4;\nand.b32 h, h, 0x80808080;")
_PTX_HIGH = gl.constexpr(_DECODE_PTX % "shr.b32 t, $6, 4;\nand.b32 t, t, 0x07070707;\nand.b32 h, $6, 0x80808080;")
_CONSTRAINTS = gl.constexpr("=r,=r," + ",".join(["r"] * 12))


@gluon.jit
def _weights(low, nib, base, HIGH: gl.constexpr, PLANES: gl.constexpr, A_OP: gl.constexpr):
    """int32 plane words [rows, 16] (4 weights each, physical order) -> the bf16 A operand [rows, 64]."""
    ROWS: gl.constexpr = low.shape[0]
    shape: gl.constexpr = [ROWS, 16, 4]
    low = gl.broadcast(gl.expand_dims(low, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    nib = gl.broadcast(gl.expand_dims(nib, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    base = gl.broadcast(gl.expand_dims(base, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    if HIGH:
        w = gl.inline_asm_elementwise(_PTX_HIGH, _CONSTRAINTS, [low, nib, base], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        w = gl.inline_asm_elementwise(_PTX_LOW, _CONSTRAINTS, [low, nib, base], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    return gl.convert_layout(_logical(gl.reshape(w, [ROWS, 64])), A_OP, assert_trivial=True)


@gluon.jit
def _logical(t):
    """[n, 64] in physical column order 16q + 4c + 2h + b -> logical order 16c + 8h + 2q + b (registers only)."""
    t = gl.reshape(t, [t.shape[0], 4, 4, 2, 2])
    t = gl.permute(t, (0, 2, 3, 1, 4))
    return gl.reshape(t, [t.shape[0], 64])


@gluon.jit
def _activations(x, B_OP: gl.constexpr):
    """x [tokens, 64] in physical column order (X_REGS) -> the bf16 B operand [64, tokens]."""
    return gl.convert_layout(gl.permute(_logical(x), (1, 0)), B_OP, assert_trivial=True)


@gluon.jit
def _issue(low_s, nib_s, xs, slot, low_ptrs, nib_ptrs, x_ptrs, x_mask, k0, pred, HALF, X_RING: gl.constexpr):
    """cp.async one K step (columns k0.. of both halves) into ring slot `slot`; an empty group past the end."""
    if pred:
        async_copy.async_copy_global_to_shared(low_s.index(2 * slot), low_ptrs + k0 // 4)
        async_copy.async_copy_global_to_shared(low_s.index(2 * slot + 1), low_ptrs + (HALF + k0) // 4)
        async_copy.async_copy_global_to_shared(nib_s.index(slot), nib_ptrs + k0 // 4)
        if X_RING:
            async_copy.async_copy_global_to_shared(xs.index(2 * slot), x_ptrs + k0, mask=x_mask)
            async_copy.async_copy_global_to_shared(xs.index(2 * slot + 1), x_ptrs + HALF + k0, mask=x_mask)
    async_copy.commit_group()


@gluon.jit
def _w12_gluon_kernel(
    x_ptr, low_ptr, nib_ptr, base_ptr, esc_ptr_ptr, esc_col_ptr, esc_bits_ptr, y_ptr, part_ptr, count_ptr,
    M, N, HALF, stride_xm, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    SPLIT: gl.constexpr, PROBE: gl.constexpr, X_RING: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, PLANES: gl.constexpr, X_REGS: gl.constexpr,
    COPY_WORDS: gl.constexpr, COPY_X: gl.constexpr, RING_WORDS: gl.constexpr, RING_X: gl.constexpr,
    ESC: gl.constexpr,
):
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    splits = gl.num_programs(1)
    WORDS: gl.constexpr = gl.SliceLayout(2, PLANES)

    # cp.async sources: plane words of BLOCK_N rows (clamped: no masks), x rows (beyond M: zero-filled).
    c_rows = gl.minimum(pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY_WORDS)), N - 1)
    c_words = gl.arange(0, BLOCK_K // 4, layout=gl.SliceLayout(0, COPY_WORDS))
    low_ptrs = low_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + \
        c_rows.to(gl.int64)[:, None] * (HALF // 2) + c_words[None, :]
    nib_ptrs = nib_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + \
        c_rows.to(gl.int64)[:, None] * (HALF // 4) + c_words[None, :]
    x_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, COPY_X))
    x_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, COPY_X))
    x_ptrs = x_ptr + x_m[:, None] * stride_xm + x_k[None, :]
    x_mask = (x_m < M)[:, None] & (x_k < BLOCK_K)[None, :]

    p_rows = gl.minimum(pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORDS)), N - 1)
    base = gl.load(base_ptr + p_rows).to(gl.int32) * 0x01010101
    base = gl.broadcast(base[:, None], gl.full([BLOCK_N, 16], 0, gl.int32, WORDS))[0]

    low_s = gl.allocate_shared_memory(gl.int32, [2 * STAGES, BLOCK_N, BLOCK_K // 4], RING_WORDS)
    nib_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 4], RING_WORDS)
    xs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES if X_RING else 1, BLOCK_M, BLOCK_K], RING_X)
    # Without the ring, x is read straight from global memory (L1 / L2) into its operand registers.
    # Token rows beyond M are clamped, not masked (no zeroing per load): their columns of y are not stored.
    r_m = gl.minimum(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_REGS)), M - 1)
    r_k = gl.arange(0, SUB, layout=gl.SliceLayout(0, X_REGS))
    r_ptrs = x_ptr + r_m[:, None] * stride_xm + r_k[None, :]

    steps = gl.cdiv(gl.cdiv(HALF, BLOCK_K), splits)
    k_first = pid_k * steps * BLOCK_K
    k_last = gl.minimum(HALF, k_first + steps * BLOCK_K)
    n_steps = gl.cdiv(k_last - k_first, BLOCK_K)

    for i in gl.static_range(STAGES - 1):
        _issue(low_s, nib_s, xs, i, low_ptrs, nib_ptrs, x_ptrs, x_mask, k_first + i * BLOCK_K, i < n_steps, HALF,
               X_RING)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    for i in range(n_steps):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()          # step i has landed for every thread; every thread is done with step i - 1
        nxt = i + STAGES - 1
        _issue(low_s, nib_s, xs, nxt % STAGES, low_ptrs, nib_ptrs, x_ptrs, x_mask, k_first + nxt * BLOCK_K,
               nxt < n_steps, HALF, X_RING)
        slot = i % STAGES
        for s in gl.static_range(BLOCK_K // SUB):
            nib = nib_s.index(slot).slice(s * SUB // 4, SUB // 4, dim=1).load(WORDS)
            low_a = low_s.index(2 * slot).slice(s * SUB // 4, SUB // 4, dim=1).load(WORDS)
            low_b = low_s.index(2 * slot + 1).slice(s * SUB // 4, SUB // 4, dim=1).load(WORDS)
            if X_RING:
                x_a = _activations(xs.index(2 * slot).slice(s * SUB, SUB, dim=1).load(X_REGS), B_OP)
                x_b = _activations(xs.index(2 * slot + 1).slice(s * SUB, SUB, dim=1).load(X_REGS), B_OP)
            else:
                k_sub = k_first + i * BLOCK_K + s * SUB
                x_a = _activations(gl.load(r_ptrs + k_sub), B_OP)
                x_b = _activations(gl.load(r_ptrs + HALF + k_sub), B_OP)
            acc = mma_v2(_weights(low_a, nib, base, False, PLANES, A_OP), x_a, acc)
            acc = mma_v2(_weights(low_b, nib, base, True, PLANES, A_OP), x_b, acc)
    async_copy.wait_group(0)

    # Escapes of this block's rows (the first K range adds them): acc += D_true @ X_e + D_undo @ X_e.
    if PROBE != 1:
        e_offs = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ESC))
        e_rows = gl.minimum(e_offs, N - 1)
        row_lo = gl.load(esc_ptr_ptr + e_rows)
        row_hi = gl.where(e_offs < N, gl.load(esc_ptr_ptr + e_rows + 1), row_lo)
        e_base = gl.load(base_ptr + e_rows)
        neg_planes = ((e_base.to(gl.int32) << 8) | 0x8000).to(gl.int16).to(gl.bfloat16, bitcast=True)
        esc_start = gl.load(esc_ptr_ptr + pid * BLOCK_N)
        esc_end = gl.load(esc_ptr_ptr + gl.minimum(pid * BLOCK_N + BLOCK_N, N))
        esc_end = gl.where(pid_k == 0, esc_end, esc_start)
        xe_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ESC))
        for e0 in range(esc_start, esc_end, ESC_BLOCK):
            offs_e = e0 + gl.arange(0, ESC_BLOCK, layout=gl.SliceLayout(0, ESC))
            emask = offs_e < esc_end
            col = gl.load(esc_col_ptr + offs_e, mask=emask, other=0)
            wbits = gl.load(esc_bits_ptr + offs_e, mask=emask, other=0)
            mine = (offs_e[None, :] >= row_lo[:, None]) & (offs_e[None, :] < row_hi[:, None]) & emask[None, :]
            true_w = gl.where(mine, wbits.to(gl.bfloat16, bitcast=True)[None, :], 0.0).to(gl.bfloat16)
            undo = gl.where(mine, neg_planes[:, None], 0.0).to(gl.bfloat16)                # [BN, E]
            e_col = gl.convert_layout(col, gl.SliceLayout(1, ESC))
            e_ok = gl.convert_layout(emask, gl.SliceLayout(1, ESC))
            xg = gl.load(x_ptr + xe_m[None, :] * stride_xm + e_col[:, None],
                         mask=(xe_m < M)[None, :] & e_ok[:, None], other=0.0)                  # [E, BM]
            xg = gl.convert_layout(xg, B_OP)
            acc = mma_v2(gl.convert_layout(true_w, A_OP), xg, acc)
            acc = mma_v2(gl.convert_layout(undo, A_OP), xg, acc)

    # y[m, row] = acc[row, m]
    o_rows = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    o_mask = (o_rows < N)[:, None] & (o_m < M)[None, :]
    y_ptrs = y_ptr + o_m[None, :] * stride_ym + o_rows[:, None]
    if not SPLIT:
        gl.store(y_ptrs, acc.to(gl.bfloat16), mask=o_mask)
    else:
        part = part_ptr + o_m[None, :] * N + o_rows[:, None]
        gl.store(part + pid_k * (32 * N), acc, mask=o_mask)
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            for s in range(0, splits):
                total += gl.load(part + s * (32 * N), mask=o_mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(gl.bfloat16), mask=o_mask)
            gl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


def supports(packed: W12Tensor, m: int, block_k: int = 128) -> bool:
    """Whole K steps in each half, at most 32 rows of x."""
    half = packed.cols_padded // 2
    return m <= 32 and half % block_k == 0 and packed.cols == 2 * half and len(packed.shape) == 2


def fused_gemm(x: torch.Tensor, packed: W12Tensor, split_k: int = 1, stages: int = 3, warps: int = 2,
               block_k: int = 128, x_ring: bool = False, probe: int = 0) -> torch.Tensor:
    from .gemm import FUSED_MAX_M, _split_workspace
    m, k = x.shape
    if not supports(packed, m, block_k) or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError(f"the Gluon W12 kernel does not take x {tuple(x.shape)} {x.dtype} with {packed.shape}")
    x = x.contiguous()
    n = packed.rows
    block_m = 8 if m <= 8 else 16 if m <= 16 else 32
    rows = 16 * warps
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    row_blocks = triton.cdiv(n, rows)
    steps = (packed.cols_padded // 2) // block_k
    split_k = triton.cdiv(steps, triton.cdiv(steps, max(1, min(split_k, steps))))   # no empty K range
    partials, counters = _split_workspace(x.device, split_k * FUSED_MAX_M * n if split_k > 1 else 0, row_blocks)
    _w12_gluon_kernel[(row_blocks, split_k)](
        x, packed.low, packed.codes, packed.base, packed.esc_ptr, packed.esc_col, packed.esc_bits, y,
        partials, counters, m, n, packed.cols_padded // 2, x.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=rows, BLOCK_K=block_k, STAGES=stages, SPLIT=split_k > 1, PROBE=probe, X_RING=x_ring,
        num_warps=warps, **layouts(block_m, warps))
    return y
