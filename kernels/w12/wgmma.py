"""y = x @ W.T with W in W12 form on Hopper (sm_90): warpgroup MMA with the decoded weights as the
register A operand (Gluon). Exploration only (explore.py --wgmma; BENCH.md has why it is not used).

Each program (one or two warpgroups) owns 64 weight rows per warpgroup and accumulates y.T[rows, M] with
wgmma m64nMk16; x.T is the B operand. A ring of cp.async stages brings each K step's plane bytes and x
tiles into shared memory; every thread reads back its own BK/4 contiguous bytes per row and plane (16-byte
loads), decodes them in registers and hands them to the MMA as they lie. That works because a dot product
does not care in which order it visits K: the register A fragment holds, in thread `q = lane % 4`, the
logical columns `16c + 8h + 2q + b`; we let logical column `16c + 8h + 2q + b` be physical column
`(BK/4) q + 4c + 2h + b` of the step (a bit permutation, so a relabelling of registers in the compiled
code) and copy x at the same permuted columns (4-byte copies), so sum_k A[r, k] B[k, m] is still the sum
over the step's columns of W[r, col] x[m, col].

Escapes are added after the main loop as two more small MMAs (true weight, minus the planes' value), as
in the Triton kernel (gemm.py); split K uses the same fp32 partials and arrival counters.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                             warpgroup_mma_wait)

from .format import W12Tensor

ROWS = 64      # weight rows per warpgroup: the wgmma's m64
ESC_BLOCK = gl.constexpr(64)   # escape entries per correction MMA


@functools.lru_cache(maxsize=None)
def layouts(block_m: int, block_k: int, warps: int = 4):
    """(accumulator, A operand, plane words, x words, x tile in shared memory as int32 / bf16, escapes)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])
    a_op = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    # [row, word, byte] of one step's plane bytes, physical column p = 4 word + byte = (BK/4) q + 4c + 2h + b:
    # registers run over byte, word (BK/4 contiguous bytes), then row + 8; lanes over q and rows 0..7; warps
    # over 16-row slabs. Planes are loaded as int32 words (the byte dim sliced off) and broadcast over it.
    words = block_k // 4
    planes = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]] + [[0, 1 << i, 0] for i in range(words.bit_length() - 3)] + [[8, 0, 0]],
        lane_bases=[[0, words // 4, 0], [0, words // 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[],
        shape=[16 * warps, words, 4])
    x_words = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[warps, 1],
                               order=[1, 0])
    x_smem32 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    x_smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    esc = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[4, 8], warps_per_cta=[warps, 1], order=[1, 0])
    return acc, a_op, planes, x_words, x_smem32, x_smem, esc


# Same byte-parallel decode as gemm.py on one 32-bit word per plane: $2 = 4 low bytes, $6 = 4 code-plane
# bytes, $10 = base x4 (each word arrives 4 times, once per byte of the broadcast [row, word, byte] tile).
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
def _decode(low, nib, base, HIGH: gl.constexpr, PLANES: gl.constexpr, A_OP: gl.constexpr):
    """int32 plane words [BN, BK/4] (4 weights each) -> the bf16 A operand [BN, BK] in logical order."""
    BLOCK_N: gl.constexpr = low.shape[0]
    BLOCK_K: gl.constexpr = low.shape[1] * 4
    shape: gl.constexpr = [BLOCK_N, BLOCK_K // 4, 4]
    low = gl.broadcast(gl.expand_dims(low, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    nib = gl.broadcast(gl.expand_dims(nib, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    base = gl.broadcast(gl.expand_dims(base, 2), gl.full(shape, 0, gl.int32, PLANES))[0]
    if HIGH:
        w = gl.inline_asm_elementwise(_PTX_HIGH, _CONSTRAINTS, [low, nib, base], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        w = gl.inline_asm_elementwise(_PTX_LOW, _CONSTRAINTS, [low, nib, base], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    # Physical column 16q + 4c + 2h + b -> logical 16c + 8h + 2q + b: a relabelling of registers.
    w = gl.reshape(w, [BLOCK_N, 4, BLOCK_K // 16, 2, 2])
    w = gl.permute(w, (0, 2, 3, 1, 4))
    w = gl.reshape(w, [BLOCK_N, BLOCK_K])
    return gl.convert_layout(w, A_OP)


@gluon.jit
def _issue(low_a_s, low_b_s, nib_s, x_lo_s, x_hi_s, slot, low_ptrs, nib_ptrs, x_ptrs, x_mask, k0, pred, HALF,
           WITH_X: gl.constexpr = True):
    """cp.async one K step (columns k0.. of both halves) into ring slot `slot`; an empty group past the end."""
    if pred:
        async_copy.async_copy_global_to_shared(low_a_s.index(slot), low_ptrs + k0 // 4)
        async_copy.async_copy_global_to_shared(low_b_s.index(slot), low_ptrs + (HALF + k0) // 4)
        async_copy.async_copy_global_to_shared(nib_s.index(slot), nib_ptrs + k0 // 4)
        if WITH_X:
            async_copy.async_copy_global_to_shared(x_lo_s.index(slot), x_ptrs + k0 // 2, mask=x_mask)
            async_copy.async_copy_global_to_shared(x_hi_s.index(slot), x_ptrs + (HALF + k0) // 2, mask=x_mask)
    async_copy.commit_group()


@gluon.jit
def _w12_wgmma_kernel(
    x_ptr, low_ptr, nib_ptr, base_ptr, esc_ptr_ptr, esc_col_ptr, esc_bits_ptr, y_ptr, part_ptr, count_ptr,
    M, N, HALF, stride_xm, stride_ym,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, PROBE: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
    ACC: gl.constexpr, A_OP: gl.constexpr, PLANES: gl.constexpr, X_WORDS: gl.constexpr,
    X_SMEM32: gl.constexpr, X_SMEM: gl.constexpr, ESC: gl.constexpr,
):
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    splits = gl.num_programs(1)
    WORDS: gl.constexpr = gl.SliceLayout(2, PLANES)

    # Plane words (4 bytes each) in physical column order; rows clamped, so no masks.
    p_rows = gl.minimum(pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORDS)), N - 1)
    p_words = gl.arange(0, BLOCK_K // 4, layout=gl.SliceLayout(0, WORDS))
    low_ptrs = low_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + \
        p_rows.to(gl.int64)[:, None] * (HALF // 2) + p_words[None, :]
    nib_ptrs = nib_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + \
        p_rows.to(gl.int64)[:, None] * (HALF // 4) + p_words[None, :]
    base = gl.load(base_ptr + p_rows).to(gl.int32) * 0x01010101
    base = gl.broadcast(base[:, None], p_words[None, :])[0]

    # x as int32 words (bf16 pairs) gathered in logical order: logical word 8c + 4h + q is physical
    # (BK/8) q + 2c + h.
    x_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_WORDS))
    x_l = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, X_WORDS))
    x_w = (x_l & 3) * (BLOCK_K // 8) + (x_l >> 3) * 2 + ((x_l >> 2) & 1)
    x_ptrs = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + x_m[:, None] * (stride_xm // 2) + x_w[None, :]
    x_mask = (x_m < M)[:, None] & (x_w < BLOCK_K // 2)[None, :]

    # A ring of STAGES steps in shared memory, filled by cp.async: the three planes (each thread later reads
    # back exactly the words it copied) and the two x tiles (read by every warp's MMA).
    RING: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    low_a_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 4], RING)
    low_b_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 4], RING)
    nib_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 4], RING)
    x_lo_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, BLOCK_K // 2], X_SMEM32)
    x_hi_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, BLOCK_K // 2], X_SMEM32)

    steps = gl.cdiv(gl.cdiv(HALF, BLOCK_K), splits)
    k_first = pid_k * steps * BLOCK_K
    k_last = gl.minimum(HALF, k_first + steps * BLOCK_K)
    n_steps = gl.cdiv(k_last - k_first, BLOCK_K)
    # The launcher gives every K range at least one step. Saying so removes the zero-trip path, whose zeroed
    # accumulator would otherwise meet the MMA pipeline's final wait and make ptxas serialize every wgmma.
    gl.assume(n_steps >= 1)

    for i in gl.static_range(STAGES - 1):
        _issue(low_a_s, low_b_s, nib_s, x_lo_s, x_hi_s, i, low_ptrs, nib_ptrs, x_ptrs, x_mask,
               k_first + i * BLOCK_K, i < n_steps, HALF)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC))
    for i in range(n_steps):
        async_copy.wait_group(STAGES - 2)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()          # step i has landed for every thread; every MMA of step i - 1 is done
        nxt = i + STAGES - 1
        _issue(low_a_s, low_b_s, nib_s, x_lo_s, x_hi_s, nxt % STAGES, low_ptrs, nib_ptrs, x_ptrs, x_mask,
               k_first + nxt * BLOCK_K, nxt < n_steps, HALF, PROBE != 1)
        slot = i % STAGES
        nib = nib_s.index(slot).load(WORDS)
        w_lo = _decode(low_a_s.index(slot).load(WORDS), nib, base, False, PLANES, A_OP)
        w_hi = _decode(low_b_s.index(slot).load(WORDS), nib, base, True, PLANES, A_OP)
        b_lo = x_lo_s.index(slot)._reinterpret(gl.bfloat16, [BLOCK_M, BLOCK_K], X_SMEM).permute((1, 0))
        b_hi = x_hi_s.index(slot)._reinterpret(gl.bfloat16, [BLOCK_M, BLOCK_K], X_SMEM).permute((1, 0))
        acc = warpgroup_mma(w_lo, b_lo, acc, is_async=True)
        acc = warpgroup_mma(w_hi, b_hi, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)

    # Escapes of this block's rows (the first K range adds them): acc += D_true @ X_e + D_undo @ X_e.
    e_rows = gl.minimum(pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ESC)), N - 1)
    row_lo = gl.load(esc_ptr_ptr + e_rows)
    row_hi = gl.where(pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ESC)) < N,
                      gl.load(esc_ptr_ptr + e_rows + 1), row_lo)
    e_base = gl.load(base_ptr + e_rows)
    neg_planes = ((e_base.to(gl.int32) << 8) | 0x8000).to(gl.int16).to(gl.bfloat16, bitcast=True)
    first_row = pid * BLOCK_N
    esc_start = gl.load(esc_ptr_ptr + first_row)
    esc_end = gl.load(esc_ptr_ptr + gl.minimum(first_row + BLOCK_N, N))
    esc_end = gl.where(pid_k == 0, esc_end, esc_start)
    xe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, ESC_BLOCK], X_SMEM)
    X_LOAD: gl.constexpr = ESC
    for e0 in range(esc_start, esc_end, ESC_BLOCK):
        offs_e = e0 + gl.arange(0, ESC_BLOCK, layout=gl.SliceLayout(0, ESC))
        emask = offs_e < esc_end
        col = gl.load(esc_col_ptr + offs_e, mask=emask, other=0)
        wbits = gl.load(esc_bits_ptr + offs_e, mask=emask, other=0)
        mine = (offs_e[None, :] >= row_lo[:, None]) & (offs_e[None, :] < row_hi[:, None]) & emask[None, :]
        w_e = wbits.to(gl.bfloat16, bitcast=True)
        true_w = gl.where(mine, w_e[None, :], 0.0).to(gl.bfloat16)                   # [BN, E]
        undo = gl.where(mine, neg_planes[:, None], 0.0).to(gl.bfloat16)              # [BN, E]
        xe_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_LOAD))
        e_cols = gl.convert_layout(col, gl.SliceLayout(0, X_LOAD))
        e_ok = gl.convert_layout(emask, gl.SliceLayout(0, X_LOAD))
        xg = gl.load(x_ptr + xe_m[:, None] * stride_xm + e_cols[None, :],
                     mask=(xe_m < M)[:, None] & e_ok[None, :], other=0.0)           # [BM, E]
        gl.thread_barrier()
        xe_smem.store(xg)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(gl.convert_layout(true_w, A_OP), xe_smem.permute((1, 0)), acc)
        acc = warpgroup_mma(gl.convert_layout(undo, A_OP), xe_smem.permute((1, 0)), acc)

    # y[m, row] = acc[row, m]
    o_rows = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
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
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
            for s in range(0, splits):
                total += gl.load(part + s * (32 * N), mask=o_mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(gl.bfloat16), mask=o_mask)
            gl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


def supports(packed: W12Tensor, m: int, block_k: int = 64) -> bool:
    """The wgmma path needs whole 64-column steps in each half and at most 32 rows of x."""
    half = packed.cols_padded // 2
    return m <= 32 and half % block_k == 0 and packed.cols == 2 * half and len(packed.shape) == 2


def fused_gemm(x: torch.Tensor, packed: W12Tensor, split_k: int = 1, stages: int = 4,
               block_k: int = 64, warps: int = 4, probe: int = 0) -> torch.Tensor:
    from .gemm import FUSED_MAX_M, _split_workspace
    m, k = x.shape
    if not supports(packed, m, block_k) or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError(f"the wgmma W12 kernel does not take x {tuple(x.shape)} {x.dtype} with {packed.shape}")
    x = x.contiguous()
    n = packed.rows
    block_m = 8 if m <= 8 else 16 if m <= 16 else 32
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    rows = 16 * warps
    row_blocks = triton.cdiv(n, rows)
    steps = (packed.cols_padded // 2) // block_k
    split_k = triton.cdiv(steps, triton.cdiv(steps, max(1, min(split_k, steps))))   # no empty K range
    partials, counters = _split_workspace(x.device, split_k * FUSED_MAX_M * n if split_k > 1 else 0, row_blocks)
    acc, a_op, planes, x_words, x_smem32, x_smem, esc = layouts(block_m, block_k, warps)
    _w12_wgmma_kernel[(row_blocks, split_k)](
        x, packed.low, packed.codes, packed.base, packed.esc_ptr, packed.esc_col, packed.esc_bits, y,
        partials, counters, m, n, packed.cols_padded // 2, x.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=rows, BLOCK_K=block_k, PROBE=probe, SPLIT=split_k > 1, STAGES=stages, ACC=acc, A_OP=a_op, PLANES=planes, X_WORDS=x_words,
        X_SMEM32=x_smem32, X_SMEM=x_smem, ESC=esc, num_warps=warps)
    return y
