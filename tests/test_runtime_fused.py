"""specpilot_runtime.fused: the RMSNorms, the SiLU product and the q/k norm with the rotary embedding of the
Qwen3 forward. On CPU (what CI runs) they are the torch expressions the forward had, bit for bit; on CUDA the
Triton kernels against those expressions, called eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specpilot_runtime import fused

EPS = 1e-6
HIDDEN, INTERMEDIATE = 5120, 17408   # the 27B shapes of benchmarks/qwen3_e2e.py
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

cuda = pytest.mark.skipif(not torch.cuda.is_available() or fused.triton is None,
                          reason="the Triton kernels run on a CUDA device with Triton installed")


def torch_rms_norm(x, weight, eps=EPS):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def torch_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_norm_rotate(x, weight, cos, signed_sin, eps=EPS):
    normed = torch_rms_norm(x, weight, eps)
    return normed * cos + normed.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def heads_of_qkv(batch, steps, dtype, device="cpu", heads=64, kv_heads=8, dim=128, seed=0):
    """The query and key heads as the forward passes them: a strided slice of qkv [B, T, heads + 2 kv, dim], the
    q/k norm's weight, and rotary tables [B, T, 1, dim] of random angles."""
    qkv = draw((batch, steps, heads + 2 * kv_heads, dim), dtype, device, seed=seed)
    weight = 1 + 0.3 * draw((heads + kv_heads, dim), torch.float32, device, seed=seed + 1).to(dtype)
    angles = draw((batch, steps, 1, dim), torch.float32, device, scale=3.0, seed=seed + 2)
    return qkv[:, :, :heads + kv_heads], weight, angles.cos().to(dtype), angles.sin().to(dtype)


def draw(shape, dtype, device="cpu", scale=1.0, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    return (scale * torch.randn(shape, generator=generator, device=device)).to(dtype)


def norm_weight(n, dtype, device="cpu"):
    return 1 + 0.3 * draw(n, torch.float32, device, seed=1).to(dtype)


def ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps: adjacent bit patterns are adjacent numbers (for values of one sign)."""
    return (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (1, 1, HIDDEN)])
def test_rms_norm_on_cpu_is_the_torch_expression(shape, dtype):
    x, weight = draw(shape, dtype), norm_weight(shape[-1], dtype)
    assert torch.equal(fused.rms_norm(x, weight, EPS), torch_rms_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 96), (2, 5, 2 * 48), (1, 1, 2 * INTERMEDIATE)])
def test_silu_mul_on_cpu_is_the_torch_expression(shape, dtype):
    gate_up = draw(shape, dtype, scale=3.0)
    got = fused.silu_mul(gate_up)
    assert got.shape == shape[:-1] + (shape[-1] // 2,)
    assert torch.equal(got, torch_silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,steps", [(1, 1), (3, 2)])
def test_norm_rotate_on_cpu_is_the_torch_expression(batch, steps, dtype):
    x, weight, cos, sin = heads_of_qkv(batch, steps, dtype, heads=4, kv_heads=2, dim=16)
    assert not x.is_contiguous() or batch * steps == 1
    assert torch.equal(fused.norm_rotate(x, weight, cos, sin, EPS), torch_norm_rotate(x, weight, cos, sin))


def test_cpu_tensors_take_the_torch_path_under_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, weight, gate_up = draw((4, 64), torch.bfloat16), norm_weight(64, torch.bfloat16), draw((4, 192), torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, weight, EPS), torch_rms_norm(x, weight))
    assert torch.equal(fused.silu_mul(gate_up), torch_silu_mul(gate_up))


@cuda
@pytest.mark.parametrize("shape", [(1, HIDDEN), (5, HIDDEN), (16, HIDDEN), (32, HIDDEN), (4, 8, HIDDEN),
                                   (3, 16384)])
def test_rms_norm_kernel_is_within_one_bf16_step_of_torch(shape):
    """The kernel sums the squares in another order than torch's mean, so a rare element rounds the other way:
    with unit weights (where the output is the normalised x itself) every element is within one bf16 step of
    torch and nearly all are equal. The weight is then applied as torch's bf16 multiply does, bit for bit, to
    the kernel's own normalised values (a one-step difference there can become two after a weight > 1)."""
    x = draw(shape, torch.bfloat16, "cuda")
    ones = torch.ones(shape[-1], dtype=torch.bfloat16, device="cuda")
    assert fused._triton_path(x)
    normed = fused.rms_norm(x, ones, EPS)
    steps = ulps(normed, torch_rms_norm(x, ones))
    assert steps.max() <= 1
    assert (steps == 0).float().mean() >= 0.999, f"{int((steps != 0).sum())} of {steps.numel()} differ"
    weight = norm_weight(shape[-1], torch.bfloat16, "cuda")
    assert torch.equal(fused.rms_norm(x, weight, EPS), weight * normed)


@cuda
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_silu_mul_kernel_is_the_torch_bits(rows):
    """Bit for bit: the same float32 operations as torch's silu kernel (libdevice expf, IEEE division), the
    same rounding to bf16, then a product of two bf16 values, exact in float32, rounded once as torch's is."""
    gate_up = draw((rows, 2 * INTERMEDIATE), torch.bfloat16, "cuda", scale=3.0)
    assert fused._triton_path(gate_up)
    steps = ulps(fused.silu_mul(gate_up), torch_silu_mul(gate_up))
    assert steps.max() == 0, f"{int((steps != 0).sum())} of {steps.numel()} differ, by up to {int(steps.max())}"


@cuda
@pytest.mark.parametrize("batch,steps", [(1, 1), (8, 1), (32, 1), (2, 16)])
def test_norm_rotate_kernel_matches_torch_but_for_the_norms_summation_order(batch, steps):
    """With unit weights and no rotation (cos 1, sin 0) the output is the normalised x: within one bf16 step
    of torch, nearly all equal (the squares are summed in another order). With the 27B layer's weights and
    tables the roundings are torch's, so a difference is only a one-step difference carried through the weight
    and the rotation: nearly all equal, none beyond 2^-6 of the two rotated terms' magnitudes."""
    x, weight, cos, sin = heads_of_qkv(batch, steps, torch.bfloat16, "cuda")
    assert fused._triton_path(x, strided=True) and fused._rotation_fits(x, weight, cos, sin)
    ones, zeros = torch.ones_like(weight), torch.zeros_like(sin)
    steps_off = ulps(fused.norm_rotate(x, ones, torch.ones_like(cos), zeros, EPS),
                     torch_rms_norm(x, ones))
    assert steps_off.max() <= 1
    assert (steps_off == 0).float().mean() >= 0.999, f"{int((steps_off != 0).sum())} of {steps_off.numel()} differ"
    got, expected = fused.norm_rotate(x, weight, cos, sin, EPS), torch_norm_rotate(x, weight, cos, sin)
    normed = torch_rms_norm(x, weight)
    terms = (normed * cos).float().abs() + (normed.roll(x.shape[-1] // 2, dims=-1) * sin).float().abs()
    assert torch.all((got.float() - expected.float()).abs() <= 2.0 ** -6 * terms)
    assert (got == expected).float().mean() >= 0.999


@cuda
def test_kernels_replay_from_a_cuda_graph():
    x = draw((16, HIDDEN), torch.bfloat16, "cuda")
    weight = norm_weight(HIDDEN, torch.bfloat16, "cuda")
    gate_up = draw((16, 2 * INTERMEDIATE), torch.bfloat16, "cuda", scale=3.0)
    side = torch.cuda.Stream()   # an eager call first, off the capture stream: compiles the kernels
    side.wait_stream(torch.cuda.current_stream())
    heads, qk_weight, cos, sin = heads_of_qkv(16, 1, torch.bfloat16, "cuda")
    with torch.cuda.stream(side):
        fused.rms_norm(x, weight, EPS), fused.silu_mul(gate_up), fused.norm_rotate(heads, qk_weight, cos, sin, EPS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, product = fused.rms_norm(x, weight, EPS), fused.silu_mul(gate_up)
        rotated = fused.norm_rotate(heads, qk_weight, cos, sin, EPS)
    x.copy_(draw(x.shape, x.dtype, "cuda", seed=2))
    gate_up.copy_(draw(gate_up.shape, gate_up.dtype, "cuda", scale=3.0, seed=3))
    heads.copy_(draw(heads.shape, heads.dtype, "cuda", seed=4))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(normed, fused.rms_norm(x, weight, EPS))
    assert torch.equal(product, fused.silu_mul(gate_up))
    assert torch.equal(rotated, fused.norm_rotate(heads, qk_weight, cos, sin, EPS))
