"""The Qwen3 forward's work between its projections as Triton kernels that signal programmatic dependent launch
(PDL) on CUDA; the torch expressions elsewhere: the residual adds with the RMSNorms after them (`add_rms_norm`),
the SiLU product (`silu_mul`), and from the qkv projection's output the q/k norm with the rotary embedding and
the writes of the keys and values into the cache (`attention_inputs`).

Why they exist: each runs just before a projection (qkv and gate_up after a norm, down after the SiLU product),
and W12's ws GEMM kernel is launched as a programmatic dependent, so it can start and load its weight while the
kernel ahead of it finishes, but only once every program of that kernel has signalled `launch_dependents`.
torch's own kernels never do, so a ws kernel after them starts only when they complete (benchmarks/w12_gemm.md,
items 15 and 16). These signal it at the start of every program, on compute capability 9.0 and later (as
kernels/w12/gemm.py's Triton GEMM does); the signal is a no-op before a kernel not launched as a dependent. They
also replace many small torch kernels by one each: a residual add and the norm's eight by one, the SiLU
product's two by one, the q/k norm with the rotary embedding (twelve) and the cache writes' indexing by one.

Numerics are the torch path's: the same float32 operations in the same order (libdevice's expf and rsqrtf and
IEEE division, as torch's CUDA kernels use) and the same roundings to the model dtype, except the order in which
the norm's mean of squares is summed: on the GPU a norm (and the rotation of a q/k norm) may differ from the
torch path in the last bit of a rare element, while the residual sum, the SiLU product and the values written to
the cache are torch's bit for bit (tests/test_runtime_fused.py checks them on a GPU). Both arms of a benchmark,
bf16 and W12, run these kernels.

The torch path (CPU, Triton not installed, TRITON_INTERPRET=1, a non-contiguous tensor or another dtype) is the
code the forward had before, bit for bit. Both paths are capturable in a CUDA graph: no host sync, and the only
allocations are the outputs.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, libdevice
except ImportError:  # torch without Triton (the CPU CI machine): the torch path only
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_NORM_BLOCK = 32768  # widest row the norm kernel holds in registers (one program per row); wider: torch
SILU_BLOCK = 1024
# Attention with a mask (the torch path): memory-efficient attention on CUDA, the math kernel elsewhere (both
# capturable).
ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KEY_BLOCK = 64  # keys a program of the attention kernel scores at a time
SPLIT_KEYS = 256  # fewest keys worth a split of their own (H200: benchmarks/decode_attention.md)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim: statistics in float32, rounded to x's dtype, then the weight
    applied in the model dtype (transformers' Qwen3RMSNorm)."""
    if _triton_path(x) and _norm_fits(x, weight):
        return _rms_norm_triton(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the gate_up projection's output [..., 2I] (gate the first half): [..., I]."""
    if _triton_path(gate_up) and gate_up.shape[-1] % 2 == 0:
        return _silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (x + delta, rms_norm(x + delta, weight, eps)), the sum rounded to
    x's dtype as torch's add rounds it; one kernel on CUDA instead of torch's add and the norm's kernel. No delta:
    (x, rms_norm(x))."""
    if delta is None:
        return x, rms_norm(x, weight, eps)
    if _triton_path(x) and _norm_fits(x, weight) and _same_layout(x, delta):
        return _rms_norm_triton(x, weight, eps, delta)
    x = x + delta
    return x, rms_norm(x, weight, eps)


def attention_inputs(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """From the qkv projection's output [B, T, heads + 2 kv_heads, head_dim]: the query and key heads normed and
    rotated (`norm_rotate`, weight [heads + kv_heads, head_dim]), the keys and values written into the caches
    [B, kv_heads, length, head_dim] at each token's position (positions [B, T]); returns the queries
    [B, T, heads, head_dim]. One kernel on CUDA instead of torch's twelve for the q/k norm and rotary
    embedding and the cache writes' indexing kernels. The kernel does not write a position outside
    [0, length) (torch's indexing raises a device-side error there): the caller keeps positions in the cache
    (Qwen3.forward checks them once per forward)."""
    kv_heads = k_cache.shape[1]
    if _triton_path(qkv, strided=True) and _attention_inputs_fit(
        qkv, weight, cos, signed_sin, positions, k_cache, v_cache, num_heads
    ):
        return _attention_inputs_triton(qkv, weight, cos, signed_sin, eps, positions, k_cache, v_cache, num_heads)
    qk = norm_rotate(qkv[:, :, : num_heads + kv_heads], weight, cos, signed_sin, eps)
    rows = torch.arange(qkv.shape[0], device=qkv.device)[:, None]
    k_cache[rows, :, positions] = qk[:, :, num_heads:]  # [batch, steps, kv_heads, head_dim] at each position
    v_cache[rows, :, positions] = qkv[:, :, num_heads + kv_heads :]
    return qk[:, :, :num_heads]


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, splits: int | None = None
) -> torch.Tensor:
    """Grouped-query attention of the queries q [B, T, heads, head_dim] over the caches [B, kv_heads, length,
    head_dim], query head h reading KV head h // group, the query at positions[b, t] seeing the keys at positions
    up to its own: [B, T, heads, head_dim], SDPA's default scale 1 / sqrt(head_dim).

    On CUDA one Triton kernel (two when the keys are split, `splits`: default from the cache's length and the
    number of programs): each program takes one token's queries of one KV head (the group's rows together, so
    a key is read once per group) over a range of keys, with an online softmax in float32 (scores as exp2 of
    log2e-scaled logits, probabilities rounded to the model dtype for the value product, as flash attention
    does), and scores only keys up to the token's position. Elsewhere scaled_dot_product_attention with an additive mask
    (memory-efficient attention or the math kernel), the forward's code before this function."""
    if _triton_path(q) and _attention_fits(q, k_cache, v_cache, positions):
        return _attention_triton(q, k_cache, v_cache, positions, splits)
    batch, steps, heads, dim = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    # Query row (token t, head g of a group) sees the keys at or before t's position: an additive mask.
    hidden = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    key_positions = torch.arange(length, device=q.device)
    mask = torch.where(key_positions <= positions[..., None], 0.0, hidden).to(q.dtype)
    mask = mask[:, None, :, None].expand(batch, 1, steps, group, length).reshape(batch, 1, steps * group, length)
    # Rows of one KV head are (token, head in group), token-major: no copy of the cache per query head.
    q = q.reshape(batch, steps, kv_heads, group, dim).transpose(1, 2).reshape(batch, kv_heads, steps * group, dim)
    with sdpa_kernel(ATTENTION_BACKENDS):
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
    # (reshape: memory-efficient attention may return its output in another memory layout)
    return o.reshape(batch, kv_heads, steps, group, dim).transpose(1, 2).reshape(batch, steps, heads, dim)


def norm_rotate(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """rotate(rms_norm(x, weight, eps), cos, signed_sin) for the query and key heads x [B, T, heads, head_dim],
    weight [heads, head_dim], cos and signed_sin [B, T, 1, head_dim]: the per-head q/k norm and the rotary
    embedding (attention_inputs' torch path)."""
    return rotate(rms_norm(x, weight, eps), cos, signed_sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention: x * cos + rotate_half(x) * sin, where rotate_half(x) * sin
    == roll(x, half) * signed_sin, signed_sin being sin with its first half negated (exact: a sign)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _triton_path(x: torch.Tensor, strided: bool = False) -> bool:
    laid_out = x.stride(-1) == 1 if strided else x.is_contiguous()
    return triton is not None and x.is_cuda and not _interpreting() and x.dtype in DTYPES and laid_out and x.numel() > 0


def _norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n = x.shape[-1]
    return (
        weight.dtype == x.dtype
        and weight.shape == (n,)
        and weight.is_contiguous()
        and weight.device == x.device
        and triton.next_power_of_2(n) <= MAX_NORM_BLOCK
    )


def _same_layout(x: torch.Tensor, other: torch.Tensor) -> bool:
    return other.shape == x.shape and other.dtype == x.dtype and other.device == x.device and other.is_contiguous()


def _attention_inputs_fit(qkv, weight, cos, signed_sin, positions, k_cache, v_cache, num_heads) -> bool:
    if qkv.dim() != 4 or not _caches_fit(qkv, k_cache, v_cache, positions):
        return False
    batch, steps, all_heads, dim = qkv.shape
    table = (batch, steps, 1, dim)
    return (
        dim >= 2
        and all_heads == num_heads + 2 * k_cache.shape[1]
        and weight.shape == (num_heads + k_cache.shape[1], dim)
        and weight.is_contiguous()
        and all(t.shape == table and t.is_contiguous() for t in (cos, signed_sin))
        and all(t.dtype == qkv.dtype and t.device == qkv.device for t in (weight, cos, signed_sin))
    )


def _attention_fits(q, k_cache, v_cache, positions) -> bool:
    return (
        q.dim() == 4
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] >= 16
        and _caches_fit(q, k_cache, v_cache, positions)
        and q.shape[2] % k_cache.shape[1] == 0
    )


def _caches_fit(heads, k_cache, v_cache, positions) -> bool:
    """Caches [B, kv_heads, length, head_dim] and positions [B, T] that go with heads [B, T, any, head_dim]."""
    batch, steps, _, dim = heads.shape
    return (
        k_cache.dim() == 4
        and k_cache.shape[1] > 0
        and triton.next_power_of_2(dim) == dim
        and k_cache.shape[0] == batch
        and k_cache.shape[3] == dim
        and k_cache.shape == v_cache.shape
        and k_cache.stride(3) == 1
        and v_cache.stride() == k_cache.stride()
        and all(t.dtype == heads.dtype and t.device == heads.device for t in (k_cache, v_cache))
        and positions.shape == (batch, steps)
        and positions.device == heads.device
        and positions.dtype in (torch.int32, torch.int64)
    )


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None):
    """rms_norm(x); with delta, (x + delta, rms_norm(x + delta))."""
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    y = torch.empty_like(x)
    total = y if delta is None else torch.empty_like(x)
    # inv_n: torch's CUDA mean multiplies the sum by float32(1 / n). No FMA contraction: torch rounds each
    # square, the mean and the mean + eps (separate kernels).
    _rms_norm_kernel[(x.numel() // n,)](
        x,
        x if delta is None else delta,
        total,
        weight,
        y,
        n,
        1.0 / n,
        eps,
        BLOCK=block,
        ADD=delta is not None,
        TRIGGER=_pdl_capable(x.device),
        num_warps=max(4, min(16, block // 1024)),
        enable_fp_fusion=False,
    )
    return y if delta is None else (total, y)


def _attention_inputs_triton(qkv, weight, cos, signed_sin, eps, positions, k_cache, v_cache, num_heads):
    batch, steps, all_heads, dim = qkv.shape
    kv_heads = k_cache.shape[1]
    q = torch.empty((batch, steps, num_heads, dim), dtype=qkv.dtype, device=qkv.device)
    _attention_inputs_kernel[(batch * steps, all_heads)](
        qkv,
        weight,
        cos,
        signed_sin,
        positions,
        q,
        k_cache,
        v_cache,
        steps,
        *qkv.stride()[:3],
        *positions.stride(),
        *k_cache.stride()[:3],
        k_cache.shape[2],
        num_heads,
        kv_heads,
        1.0 / dim,
        eps,
        DIM=dim,
        TRIGGER=_pdl_capable(qkv.device),
        num_warps=1,
        enable_fp_fusion=False,
    )
    return q


def _silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    y = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gate_up.numel() // (2 * inter), triton.cdiv(inter, SILU_BLOCK))](
        gate_up, y, inter, BLOCK=SILU_BLOCK, TRIGGER=_pdl_capable(gate_up.device), num_warps=4
    )
    return y


def _attention_triton(q, k_cache, v_cache, positions, splits):
    batch, steps, heads, dim = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    programs, blocks = batch * steps * kv_heads, triton.cdiv(length, KEY_BLOCK)
    splits = default_splits(batch * steps, kv_heads, length, q.device) if splits is None else splits
    per_split = triton.cdiv(blocks, max(1, min(splits, blocks)))
    splits = triton.cdiv(blocks, per_split)
    rows = max(16, triton.next_power_of_2(group))  # tl.dot wants 16 rows or more
    o = torch.empty_like(q)
    split = splits > 1
    part = torch.empty((programs, splits, rows, dim + 2) if split else (1,), dtype=torch.float32, device=q.device)
    args = dict(GROUP=group, ROWS=rows, DIM=dim, KEY_BLOCK=KEY_BLOCK, TRIGGER=_pdl_capable(q.device))
    _attention_kernel[(batch * steps, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        positions,
        o,
        part,
        steps,
        *positions.stride(),
        *k_cache.stride()[:3],
        length,
        heads,
        kv_heads,
        splits,
        per_split * KEY_BLOCK,
        dim**-0.5 * 1.4426950408889634,
        SPLIT=split,
        num_warps=4,
        **args,
    )
    if split:
        _attention_combine_kernel[(batch * steps, kv_heads)](part, o, heads, kv_heads, splits, num_warps=4, **args)
    return o


def default_splits(tokens: int, kv_heads: int, length: int, device: torch.device) -> int:
    """Programs per (token, KV head) of the attention kernel: split the keys only where one program each leaves
    most SMs idle, and never into fewer than SPLIT_KEYS keys a split."""
    programs, sms = tokens * kv_heads, _multiprocessors(device)
    return 1 if 2 * programs >= sms else min(triton.cdiv(2 * sms, programs), triton.cdiv(length, SPLIT_KEYS))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _weighted(x, scale, w, dtype: tl.constexpr):
        """weight * (x * scale) as torch's ops round it: the normalised x to the model dtype, then the product."""
        return (w * (x * scale).to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        delta_ptr,
        total_ptr,
        w_ptr,
        y_ptr,
        n,
        inv_n,
        eps,
        BLOCK: tl.constexpr,
        ADD: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):
        if TRIGGER:  # every program has started: a ws kernel next in the stream may launch
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64) * n
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
        if ADD:  # the residual sum, rounded as torch's add rounds it, is what is normed
            x = (x.to(tl.float32) + tl.load(delta_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(total_ptr + row + cols, x, mask=mask)
        x = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        tl.store(y_ptr + row + cols, _weighted(x, scale, w, y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attention_inputs_kernel(
        qkv_ptr,
        w_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        steps,
        stride_b,
        stride_t,
        stride_h,
        stride_pb,
        stride_pt,
        stride_cb,
        stride_ch,
        stride_cp,
        length,
        num_heads,
        kv_heads,
        inv_n,
        eps,
        DIM: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):
        """Program (token, head): a query head's normed, rotated row to q; a key head's to k_cache, a value
        head's row as it is to v_cache, at the token's position."""
        if TRIGGER:
            gdc_launch_dependents()
        token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, t = token // steps, token % steps
        cols = tl.arange(0, DIM)
        x_row = qkv_ptr + b * stride_b + t * stride_t + head * stride_h
        position = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)
        in_cache = cols < tl.where((position >= 0) & (position < length), DIM, 0)  # all or none of the row
        if head < num_heads + kv_heads:
            rolled = (cols + DIM // 2) % DIM  # roll by half: out[i] = in[(i - half) mod DIM] = in[(i + half) mod DIM]
            x = tl.load(x_row + cols).to(tl.float32)
            x_rolled = tl.load(x_row + rolled).to(tl.float32)
            scale = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
            dtype = q_ptr.dtype.element_ty
            # each step rounded to the model dtype where torch's ops round: the norm, the weight, each product,
            # their sum
            normed = _weighted(x, scale, tl.load(w_ptr + head * DIM + cols).to(tl.float32), dtype)
            normed_rolled = _weighted(x_rolled, scale, tl.load(w_ptr + head * DIM + rolled).to(tl.float32), dtype)
            cos = tl.load(cos_ptr + token * DIM + cols).to(tl.float32)
            sin = tl.load(sin_ptr + token * DIM + cols).to(tl.float32)
            first = (normed.to(tl.float32) * cos).to(dtype).to(tl.float32)
            second = (normed_rolled.to(tl.float32) * sin).to(dtype).to(tl.float32)
            rotated = (first + second).to(dtype)
            if head < num_heads:
                tl.store(q_ptr + (token * num_heads + head) * DIM + cols, rotated)
            else:
                cached = k_ptr + b * stride_cb + (head - num_heads) * stride_ch + position * stride_cp
                tl.store(cached + cols, rotated, mask=in_cache)
        else:
            cached = v_ptr + b * stride_cb + (head - num_heads - kv_heads) * stride_ch + position * stride_cp
            tl.store(cached + cols, tl.load(x_row + cols), mask=in_cache)

    @triton.jit
    def _attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        o_ptr,
        part_ptr,
        steps,
        stride_pb,
        stride_pt,
        stride_cb,
        stride_ch,
        stride_cp,
        length,
        heads,
        kv_heads,
        splits,
        split_keys,
        scale_log2,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        DIM: tl.constexpr,
        KEY_BLOCK: tl.constexpr,
        SPLIT: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):
        """Program (token, KV head, split): the group's query rows against the keys of the split up to the
        token's position. SPLIT: the unnormalised sum and its running max and sum to part, else the output."""
        if TRIGGER:
            gdc_launch_dependents()
        token, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        b, t = token // steps, token % steps
        rows, cols = tl.arange(0, ROWS), tl.arange(0, DIM)
        head_rows = (token * heads + kv_head * GROUP + rows) * DIM
        in_group = rows[:, None] < GROUP
        q = tl.load(q_ptr + head_rows[:, None] + cols[None, :], mask=in_group, other=0.0)
        position = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)
        start = split * split_keys
        end = tl.minimum(tl.minimum(start + split_keys, position + 1), length)
        cache = b * stride_cb + kv_head * stride_ch
        top = tl.full((ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, DIM), tl.float32)
        for first in range(start, end, KEY_BLOCK):  # each block has a key to score: top stays finite
            keys = first + tl.arange(0, KEY_BLOCK)
            seen = keys < end
            at = cache + keys[:, None] * stride_cp + cols[None, :]
            k = tl.load(k_ptr + at, mask=seen[:, None], other=0.0)
            scores = tl.where(seen[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            rescale = tl.math.exp2(top - new_top)
            p = tl.math.exp2(scores - new_top[:, None])
            total = total * rescale + tl.sum(p, axis=1)
            v = tl.load(v_ptr + at, mask=seen[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        if SPLIT:
            slot = part_ptr + ((token * kv_heads + kv_head) * splits + split) * ROWS * (DIM + 2)
            tl.store(slot + rows[:, None] * (DIM + 2) + cols[None, :], acc)
            tl.store(slot + rows * (DIM + 2) + DIM, top)
            tl.store(slot + rows * (DIM + 2) + DIM + 1, total)
        else:
            tl.store(
                o_ptr + head_rows[:, None] + cols[None, :],
                (acc / total[:, None]).to(o_ptr.dtype.element_ty),
                mask=in_group,
            )

    @triton.jit
    def _attention_combine_kernel(
        part_ptr,
        o_ptr,
        heads,
        kv_heads,
        splits,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        DIM: tl.constexpr,
        KEY_BLOCK: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):
        """Program (token, KV head): the splits' sums rescaled to their common max, added, normalised. Split 0
        always has keys (position 0 is at or before every position); a later one without keys adds nothing."""
        if TRIGGER:
            gdc_launch_dependents()
        token, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        rows, cols = tl.arange(0, ROWS), tl.arange(0, DIM)
        top = tl.full((ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, DIM), tl.float32)
        for split in range(0, splits):
            slot = part_ptr + ((token * kv_heads + kv_head) * splits + split) * ROWS * (DIM + 2)
            part_top = tl.load(slot + rows * (DIM + 2) + DIM)
            new_top = tl.maximum(top, part_top)
            rescale, part_scale = tl.math.exp2(top - new_top), tl.math.exp2(part_top - new_top)
            total = total * rescale + tl.load(slot + rows * (DIM + 2) + DIM + 1) * part_scale
            part = tl.load(slot + rows[:, None] * (DIM + 2) + cols[None, :])
            acc = acc * rescale[:, None] + part * part_scale[:, None]
            top = new_top
        head_rows = (token * heads + kv_head * GROUP + rows) * DIM
        tl.store(
            o_ptr + head_rows[:, None] + cols[None, :],
            (acc / total[:, None]).to(o_ptr.dtype.element_ty),
            mask=rows[:, None] < GROUP,
        )

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, y_ptr, inter, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate_ptr = gate_up_ptr + row * 2 * inter + cols
        gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + inter, mask=mask, other=0.0).to(tl.float32)
        # torch's silu: x / (1 + expf(-x)) in float32, rounded to the dtype; the product of two bf16 (or fp16)
        # values is exact in float32, so rounding it once is torch's bf16 multiply.
        silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * inter + cols, (silu.to(tl.float32) * up).to(y_ptr.dtype.element_ty), mask=mask)
