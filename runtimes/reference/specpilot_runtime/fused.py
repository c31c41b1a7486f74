"""The RMSNorms, the SiLU product and the q/k norm with the rotary embedding of the Qwen3 forward as Triton
kernels that signal programmatic dependent launch (PDL) on CUDA; the torch expressions elsewhere.

Why they exist: each runs just before a projection (qkv and gate_up after a norm, down after the SiLU product),
and W12's ws GEMM kernel is launched as a programmatic dependent, so it can start and load its weight while the
kernel ahead of it finishes, but only once every program of that kernel has signalled `launch_dependents`.
torch's own kernels never do, so a ws kernel after them starts only when they complete (kernels/w12/BENCH.md,
items 15 and 16). These signal it at the start of every program, on compute capability 9.0 and later (as
kernels/w12/gemm.py's Triton GEMM does); the signal is a no-op before a kernel not launched as a dependent. They
also replace torch's eight kernels of a norm and two of the SiLU product by one each, and the q/k norm with the
rotary embedding (twelve) by one.

Numerics are the torch path's: the same float32 operations in the same order (libdevice's expf and rsqrtf and
IEEE division, as torch's CUDA kernels use) and the same roundings to the model dtype, except the order in which
the norm's mean of squares is summed: on the GPU a norm (and the rotation of a q/k norm) may differ from the
torch path in the last bit of a rare element, while the SiLU product is torch's bit for bit
(tests/test_runtime_fused.py checks all three on a GPU). Both
arms of a benchmark, bf16 and W12, run these kernels.

The torch path (CPU, Triton not installed, TRITON_INTERPRET=1, a non-contiguous tensor or another dtype) is the
code the forward had before, bit for bit. Both paths are capturable in a CUDA graph: no host sync, and the only
allocation is the output.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, libdevice
except ImportError:   # torch without Triton (the CPU CI machine): the torch path only
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_NORM_BLOCK = 32768   # widest row the norm kernel holds in registers (one program per row); wider: torch
SILU_BLOCK = 1024


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


def norm_rotate(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                eps: float) -> torch.Tensor:
    """rotate(rms_norm(x, weight, eps), cos, signed_sin) for the query and key heads x [B, T, heads, head_dim]
    (a strided slice of qkv is fine), weight [heads, head_dim], cos and signed_sin [B, T, 1, head_dim]: the
    per-head q/k norm and the rotary embedding, one kernel on CUDA instead of torch's twelve."""
    if _triton_path(x, strided=True) and _rotation_fits(x, weight, cos, signed_sin):
        return _norm_rotate_triton(x, weight, cos, signed_sin, eps)
    return rotate(rms_norm(x, weight, eps), cos, signed_sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention: x * cos + rotate_half(x) * sin, where rotate_half(x) * sin
    == roll(x, half) * signed_sin, signed_sin being sin with its first half negated (exact: a sign)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _triton_path(x: torch.Tensor, strided: bool = False) -> bool:
    laid_out = x.stride(-1) == 1 if strided else x.is_contiguous()
    return triton is not None and x.is_cuda and not _interpreting() and x.dtype in DTYPES and laid_out \
        and x.numel() > 0


def _norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n = x.shape[-1]
    return (weight.dtype == x.dtype and weight.shape == (n,) and weight.is_contiguous() and weight.device == x.device
            and triton.next_power_of_2(n) <= MAX_NORM_BLOCK)


def _rotation_fits(x, weight, cos, signed_sin) -> bool:
    if x.dim() != 4:
        return False
    batch, steps, heads, dim = x.shape
    table = (batch, steps, 1, dim)
    return (dim >= 2 and triton.next_power_of_2(dim) == dim and weight.shape == (heads, dim) and weight.is_contiguous()
            and all(t.shape == table and t.is_contiguous() for t in (cos, signed_sin))
            and all(t.dtype == x.dtype and t.device == x.device for t in (weight, cos, signed_sin)))


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    y = torch.empty_like(x)
    # inv_n: torch's CUDA mean multiplies the sum by float32(1 / n). No FMA contraction: torch rounds each
    # square, the mean and the mean + eps (separate kernels).
    _rms_norm_kernel[(x.numel() // n,)](
        x, weight, y, n, 1.0 / n, eps, BLOCK=block, TRIGGER=_pdl_capable(x.device),
        num_warps=max(4, min(16, block // 1024)), enable_fp_fusion=False)
    return y


def _norm_rotate_triton(x, weight, cos, signed_sin, eps):
    batch, steps, heads, dim = x.shape
    y = torch.empty((batch, steps, heads, dim), dtype=x.dtype, device=x.device)
    _norm_rotate_kernel[(batch * steps, heads)](
        x, weight, cos, signed_sin, y, steps, x.stride(0), x.stride(1), x.stride(2), heads, 1.0 / dim, eps,
        DIM=dim, TRIGGER=_pdl_capable(x.device), num_warps=1, enable_fp_fusion=False)
    return y


def _silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    y = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gate_up.numel() // (2 * inter), triton.cdiv(inter, SILU_BLOCK))](
        gate_up, y, inter, BLOCK=SILU_BLOCK, TRIGGER=_pdl_capable(gate_up.device), num_warps=4)
    return y


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
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, inv_n, eps, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:   # every program has started: a ws kernel next in the stream may launch
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64) * n
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        tl.store(y_ptr + row + cols, _weighted(x, scale, w, y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rotate_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, steps, stride_b, stride_t, stride_h, heads,
                            inv_n, eps, DIM: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:
            gdc_launch_dependents()
        token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = tl.arange(0, DIM)
        rolled = (cols + DIM // 2) % DIM    # roll by half: out[i] = in[(i - half) mod DIM] = in[(i + half) mod DIM]
        x_row = x_ptr + (token // steps) * stride_b + (token % steps) * stride_t + head * stride_h
        x = tl.load(x_row + cols).to(tl.float32)
        x_rolled = tl.load(x_row + rolled).to(tl.float32)
        scale = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        dtype = y_ptr.dtype.element_ty
        # each step rounded to the model dtype where torch's ops round: the norm, the weight, each product, their sum
        normed = _weighted(x, scale, tl.load(w_ptr + head * DIM + cols).to(tl.float32), dtype)
        normed_rolled = _weighted(x_rolled, scale, tl.load(w_ptr + head * DIM + rolled).to(tl.float32), dtype)
        cos = tl.load(cos_ptr + token * DIM + cols).to(tl.float32)
        sin = tl.load(sin_ptr + token * DIM + cols).to(tl.float32)
        first = (normed.to(tl.float32) * cos).to(dtype).to(tl.float32)
        second = (normed_rolled.to(tl.float32) * sin).to(dtype).to(tl.float32)
        tl.store(y_ptr + (token * heads + head) * DIM + cols, (first + second).to(dtype))

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
