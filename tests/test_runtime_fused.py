"""specpilot_lab.fused: the residual adds with the RMSNorms, the SiLU product, the q/k norm with the
rotary embedding and the cache writes, and the attention of the Qwen3 forward. On CPU (what CI runs) they are the
torch expressions the forward had, bit for bit; on CUDA the Triton kernels against those expressions (and the
attention against float64 attention), called eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from specpilot_lab import fused

EPS = 1e-6
HIDDEN, INTERMEDIATE = 5120, 17408  # the 27B shapes of benchmarks/qwen3_e2e.py
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or fused.triton is None,
    reason="the Triton kernels run on a CUDA device with Triton installed",
)


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


def torch_attention_inputs(qkv, weight, cos, signed_sin, positions, k_cache, v_cache, heads):
    """The forward's code before fused.attention_inputs: the q/k norm with the rotation, then the cache writes by
    index."""
    kv_heads = k_cache.shape[1]
    qk = torch_norm_rotate(qkv[:, :, : heads + kv_heads], weight, cos, signed_sin)
    rows = torch.arange(qkv.shape[0], device=qkv.device)[:, None]
    k_cache[rows, :, positions] = qk[:, :, heads:]
    v_cache[rows, :, positions] = qkv[:, :, heads + kv_heads :]
    return qk[:, :, :heads]


def torch_attention(q, k_cache, v_cache, positions):
    """The forward's attention before fused.attention: SDPA over the cache with an additive mask, the rows of one
    KV head (token, head in group)."""
    batch, steps, heads, dim = q.shape
    kv_heads, length = k_cache.shape[1:3]
    group = heads // kv_heads
    hidden = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    mask = torch.where(torch.arange(length, device=q.device) <= positions[..., None], 0.0, hidden).to(q.dtype)
    mask = mask[:, None, :, None].expand(batch, 1, steps, group, length).reshape(batch, 1, steps * group, length)
    grouped = q.reshape(batch, steps, kv_heads, group, dim).transpose(1, 2).reshape(batch, kv_heads, -1, dim)
    with sdpa_kernel(fused.ATTENTION_BACKENDS):
        o = F.scaled_dot_product_attention(grouped, k_cache, v_cache, attn_mask=mask)
    return o.reshape(batch, kv_heads, steps, group, dim).transpose(1, 2).reshape(batch, steps, heads, dim)


def float64_attention(q, k_cache, v_cache, positions):
    """The exact attention of the same bf16 values, in float64."""
    group = q.shape[2] // k_cache.shape[1]
    k, v = (c.double().repeat_interleave(group, 1) for c in (k_cache, v_cache))  # [B, heads, length, dim]
    scores = torch.einsum("bthd,bhld->bthl", q.double(), k) / q.shape[-1] ** 0.5
    later = torch.arange(k.shape[2], device=q.device) > positions[:, :, None, None]
    return torch.einsum("bthl,bhld->bthd", scores.masked_fill(later, float("-inf")).softmax(-1), v)


def attention_case(batch, steps, length, dtype, device="cpu", heads=64, kv_heads=8, dim=128, seed=0):
    """Queries, caches of keys with a spread of magnitudes (peaked and flat softmaxes), random positions
    (position 0 and the cache's last among them)."""
    q = draw((batch, steps, heads, dim), dtype, device, seed=seed)
    k = (
        draw((batch, kv_heads, length, dim), torch.float32, device, seed=seed + 1)
        * draw((batch, kv_heads, length, 1), torch.float32, device, scale=1.5, seed=seed + 2).exp()
    )
    v = draw((batch, kv_heads, length, dim), dtype, device, seed=seed + 3)
    positions = torch.randint(0, length, (batch, steps), generator=torch.Generator().manual_seed(seed)).to(device)
    positions[0, 0], positions[-1, -1] = 0, length - 1
    return q, k.to(dtype), v, positions


def qkv_output(batch, steps, dtype, device="cpu", heads=64, kv_heads=8, dim=128, seed=0):
    """The qkv projection's output [B, T, heads + 2 kv, dim], the q/k norm's weight, and rotary tables
    [B, T, 1, dim] of random angles."""
    qkv = draw((batch, steps, heads + 2 * kv_heads, dim), dtype, device, seed=seed)
    weight = 1 + 0.3 * draw((heads + kv_heads, dim), torch.float32, device, seed=seed + 1).to(dtype)
    angles = draw((batch, steps, 1, dim), torch.float32, device, scale=3.0, seed=seed + 2)
    return qkv, weight, angles.cos().to(dtype), angles.sin().to(dtype)


def caches(batch, kv_heads, length, dim, dtype, device="cpu"):
    """A layer's key and value caches [B, kv_heads, length, dim] as views of a model's, filled with a pattern
    that a write must leave alone where it does not write."""
    k, v = (draw((2, batch, kv_heads, length, dim), dtype, device, seed=seed)[1] for seed in (7, 8))
    return k, v


def decode_positions(batch, steps, length, device="cpu"):
    """Distinct positions per sequence, as a batch of prompts at different lengths has: [B, T] (strided)."""
    start = torch.arange(batch, device=device)[:, None] * 3 % (length - steps)
    return start + torch.arange(steps, device=device)


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
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (1, 1, HIDDEN)])
def test_add_rms_norm_on_cpu_is_the_torch_expressions(shape, dtype):
    x, delta, weight = draw(shape, dtype), draw(shape, dtype, seed=5), norm_weight(shape[-1], dtype)
    total, normed = fused.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(total, x + delta) and torch.equal(normed, torch_rms_norm(x + delta, weight))
    same, alone = fused.add_rms_norm(x, None, weight, EPS)
    assert same is x and torch.equal(alone, torch_rms_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,steps", [(1, 1), (3, 2)])
def test_attention_inputs_on_cpu_are_the_torch_expressions(batch, steps, dtype):
    qkv, weight, cos, sin = qkv_output(batch, steps, dtype, heads=4, kv_heads=2, dim=16)
    positions = decode_positions(batch, steps, 12)
    k, v = caches(batch, 2, 12, 16, dtype)
    k_expected, v_expected = k.clone(), v.clone()
    expected = torch_attention_inputs(qkv, weight, cos, sin, positions, k_expected, v_expected, 4)
    assert torch.equal(fused.attention_inputs(qkv, weight, cos, sin, EPS, positions, k, v, 4), expected)
    assert torch.equal(k, k_expected) and torch.equal(v, v_expected)
    assert not torch.equal(k, caches(batch, 2, 12, 16, dtype)[0])  # it wrote


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,steps", [(1, 1), (3, 2)])
def test_attention_on_cpu_is_the_sdpa_expression(batch, steps, dtype):
    q, k, v, positions = attention_case(batch, steps, 12, dtype, heads=4, kv_heads=2, dim=16)
    got = fused.attention(q, k, v, positions)
    assert torch.equal(got, torch_attention(q, k, v, positions))
    assert (got.double() - float64_attention(q, k, v, positions)).abs().max() <= 0.02  # and it is attention


def test_cpu_tensors_take_the_torch_path_under_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, weight, gate_up = draw((4, 64), torch.bfloat16), norm_weight(64, torch.bfloat16), draw((4, 192), torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, weight, EPS), torch_rms_norm(x, weight))
    assert torch.equal(fused.silu_mul(gate_up), torch_silu_mul(gate_up))


@cuda
@pytest.mark.parametrize("shape", [(1, HIDDEN), (5, HIDDEN), (16, HIDDEN), (32, HIDDEN), (4, 8, HIDDEN), (3, 16384)])
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
@pytest.mark.parametrize("shape", [(1, HIDDEN), (16, HIDDEN), (32, HIDDEN), (4, 8, HIDDEN)])
def test_add_rms_norm_kernel_sums_as_torch_and_norms_within_one_bf16_step(shape):
    x, delta = draw(shape, torch.bfloat16, "cuda"), draw(shape, torch.bfloat16, "cuda", seed=5)
    ones = torch.ones(shape[-1], dtype=torch.bfloat16, device="cuda")
    total, normed = fused.add_rms_norm(x, delta, ones, EPS)
    assert torch.equal(total, x + delta)
    steps = ulps(normed, torch_rms_norm(x + delta, ones))
    assert steps.max() <= 1
    assert (steps == 0).float().mean() >= 0.999, f"{int((steps != 0).sum())} of {steps.numel()} differ"
    assert torch.equal(normed, fused.rms_norm(x + delta, ones, EPS))  # the norm kernel's own bits


@cuda
@pytest.mark.parametrize("batch,steps", [(1, 1), (8, 1), (32, 1), (2, 16)])
def test_attention_inputs_kernel_matches_torch_but_for_the_norms_summation_order(batch, steps):
    """The values go into the cache bit for bit, at each token's position, and nothing else in the cache changes.
    With unit weights and no rotation (cos 1, sin 0) the queries and keys are the normalised heads: within one
    bf16 step of torch, nearly all equal (the squares are summed in another order). With the 27B layer's weights
    and tables the roundings are torch's, so a difference is only a one-step difference carried through the
    weight and the rotation: nearly all equal, none beyond 2^-6 of the two rotated terms' magnitudes."""
    heads, kv_heads, dim, length = 64, 8, 128, 64
    qkv, weight, cos, sin = qkv_output(batch, steps, torch.bfloat16, "cuda")
    positions = decode_positions(batch, steps, length, "cuda")
    assert fused._triton_path(qkv, strided=True)

    def both(weight, cos, sin):
        k, v = caches(batch, kv_heads, length, dim, torch.bfloat16, "cuda")
        k_torch, v_torch = k.clone(), v.clone()
        assert fused._attention_inputs_fit(qkv, weight, cos, sin, positions, k, v, heads)
        got = fused.attention_inputs(qkv, weight, cos, sin, EPS, positions, k, v, heads)
        expected = torch_attention_inputs(qkv, weight, cos, sin, positions, k_torch, v_torch, heads)
        assert torch.equal(v, v_torch)
        rows = torch.arange(batch, device="cuda")[:, None]
        untouched = torch.ones_like(k, dtype=torch.bool)
        untouched[rows, :, positions] = False
        assert torch.equal(k[untouched], k_torch[untouched])
        return torch.cat([got, k[rows, :, positions]], 2), torch.cat([expected, k_torch[rows, :, positions]], 2)

    ones, zeros = torch.ones_like(weight), torch.zeros_like(sin)
    got, _ = both(ones, torch.ones_like(cos), zeros)
    steps_off = ulps(got, torch_rms_norm(qkv[:, :, : heads + kv_heads], ones))
    assert steps_off.max() <= 1
    assert (steps_off == 0).float().mean() >= 0.999, f"{int((steps_off != 0).sum())} of {steps_off.numel()} differ"
    got, expected = both(weight, cos, sin)
    normed = torch_rms_norm(qkv[:, :, : heads + kv_heads], weight)
    terms = (normed * cos).float().abs() + (normed.roll(dim // 2, dims=-1) * sin).float().abs()
    assert torch.all((got.float() - expected.float()).abs() <= 2.0**-6 * terms)
    assert (got == expected).float().mean() >= 0.999


@cuda
def test_attention_inputs_kernel_writes_no_position_outside_the_cache():
    qkv, weight, cos, sin = qkv_output(2, 1, torch.bfloat16, "cuda")
    k, v = caches(2, 8, 64, 128, torch.bfloat16, "cuda")
    before = k.clone(), v.clone()
    fused.attention_inputs(qkv, weight, cos, sin, EPS, torch.tensor([[-1], [64]], device="cuda"), k, v, 64)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


@cuda
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize(
    "batch,steps,length", [(1, 1, 192), (8, 1, 192), (32, 1, 192), (2, 16, 192), (1, 1, 4096), (3, 2, 100)]
)
def test_attention_kernel_is_as_close_to_exact_attention_as_sdpa(batch, steps, length, splits):
    """Against float64 attention of the same bf16 values: the kernel's largest error is within that of torch's
    memory-efficient attention (the torch path on CUDA) plus a quarter of a bf16 step at the output's scale, with
    the keys in one program or split across programs and combined."""
    q, k, v, positions = attention_case(batch, steps, length, torch.bfloat16, "cuda")
    assert fused._triton_path(q) and fused._attention_fits(q, k, v, positions)
    exact = float64_attention(q, k, v, positions)
    got = fused.attention(q, k, v, positions, splits=splits)
    assert got.shape == q.shape and got.is_contiguous()
    error, sdpa_error = ((o.double() - exact).abs().max() for o in (got, torch_attention(q, k, v, positions)))
    assert error <= sdpa_error + 2.0**-10 * exact.abs().max(), f"{error:.3e} against SDPA's {sdpa_error:.3e}"


@cuda
def test_attention_kernel_reads_no_key_after_a_sequences_positions():
    """Keys after every position of a sequence (the cache's unwritten rest) do not reach its output, even NaN."""
    q, k, v, positions = attention_case(4, 2, 256, torch.bfloat16, "cuda")
    before = {splits: fused.attention(q, k, v, positions, splits=splits) for splits in (1, 4)}
    after = torch.arange(256, device="cuda")[None, :] > positions.max(1).values[:, None]  # [B, length]
    assert after.any()
    for cache in (k, v):
        cache.masked_fill_(after[:, None, :, None], float("nan"))
    for splits, expected in before.items():
        assert torch.equal(fused.attention(q, k, v, positions, splits=splits), expected)


@cuda
def test_kernels_replay_from_a_cuda_graph():
    x = draw((16, HIDDEN), torch.bfloat16, "cuda")
    delta = draw((16, HIDDEN), torch.bfloat16, "cuda", seed=5)
    weight = norm_weight(HIDDEN, torch.bfloat16, "cuda")
    gate_up = draw((16, 2 * INTERMEDIATE), torch.bfloat16, "cuda", scale=3.0)
    qkv, qk_weight, cos, sin = qkv_output(16, 1, torch.bfloat16, "cuda")
    positions = decode_positions(16, 1, 64, "cuda")
    k, v = caches(16, 8, 64, 128, torch.bfloat16, "cuda")

    def run():
        q = fused.attention_inputs(qkv, qk_weight, cos, sin, EPS, positions, k, v, 64)
        return (
            fused.rms_norm(x, weight, EPS),
            fused.add_rms_norm(x, delta, weight, EPS),
            fused.silu_mul(gate_up),
            q,
            fused.attention(q, k, v, positions),
            fused.attention(q, k, v, positions, splits=4),
        )

    side = torch.cuda.Stream()  # an eager call first, off the capture stream: compiles the kernels
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, (total, added), product, q, attended, split = run()
    for i, tensor in enumerate((x, delta, gate_up, qkv)):
        tensor.copy_(draw(tensor.shape, tensor.dtype, "cuda", scale=3.0, seed=10 + i))
    positions.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    k_replayed, v_replayed = k.clone(), v.clone()
    expected = run()
    assert torch.equal(normed, expected[0])
    assert torch.equal(total, expected[1][0]) and torch.equal(added, expected[1][1])
    assert torch.equal(product, expected[2])
    assert torch.equal(q, expected[3]) and torch.equal(k, k_replayed) and torch.equal(v, v_replayed)
    assert torch.equal(attended, expected[4]) and torch.equal(split, expected[5])


@cuda
@torch.inference_mode()
def test_qwen3_forward_on_the_kernels_matches_its_torch_path_and_its_own_cache():
    """A small bf16 Qwen3 on CUDA: the forward on the kernels against the same forward on the torch path (prefill
    logits within 5% of their range: the sums run in other orders), and a cached decode step against the prefill
    of the longer prompt, both on the kernels (the cache written and read at the right positions)."""
    from specpilot_lab.qwen3 import Qwen3, Qwen3Shape

    shape = Qwen3Shape(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_positions=256,
    )
    model = Qwen3(shape, torch.bfloat16, "cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    for name, param in model.named_parameters():
        norm = "norm" in name and "layers" in name or name == "norm"
        param.copy_(
            1 + 0.3 * torch.randn(param.shape, generator=generator, device="cuda")
            if norm
            else 0.08 * torch.randn(param.shape, generator=generator, device="cuda")
        )
    tokens = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(1)).cuda()
    positions = torch.arange(9, device="cuda").expand(3, 9)

    def prefill(length, triton=fused.triton):
        saved, fused.triton = fused.triton, triton
        try:
            cache = model.new_cache(3, 64)
            return model(tokens[:, :length], positions[:, :length], cache).float(), cache
        finally:
            fused.triton = saved

    kernels, cache = prefill(8)
    torch_path, _ = prefill(8, triton=None)
    assert (kernels - torch_path).abs().max() <= 0.05 * torch_path.abs().max()
    step = model(tokens[:, 8:], positions[:, 8:], cache).float()[:, 0]
    full = prefill(9)[0][:, -1]
    difference = (step - full).abs().max()
    assert difference <= 0.05 * full.abs().max()
    top2 = full.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * difference  # no near tie the difference could flip
    assert torch.equal(step.argmax(-1)[clear], full.argmax(-1)[clear])
