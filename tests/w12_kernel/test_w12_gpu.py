"""The compiled kernels on a CUDA GPU (skipped without one; CI has none). Run on the device, where w12 is not
installed, with `PYTHONPATH=kernels python3 -m pytest -q tests/w12_kernel/test_w12_gpu.py`."""

import pytest
import torch
from w12_gpu_helpers import assert_close_to_exact, llm_like

import w12
from w12.format import LAYOUTS
from w12.gemm import Config, decode_on_device, default_config, fused_gemm, prepare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_kernel_is_bit_exact_on_every_pattern(layout):
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    w = w[torch.randperm(65536)].reshape(256, 256).cuda()
    w[:8] = llm_like(8, 256, 0)
    assert torch.equal(decode_on_device(w12.encode(w, layout)).view(torch.int16), w.view(torch.int16))
    odd = llm_like(200, 1000, 1)  # padding rows and columns in the units layout
    assert torch.equal(decode_on_device(w12.encode(odd, layout)).view(torch.int16), odd.view(torch.int16))


GEMM_CONFIGS = [
    Config(32, 128, 4, 4),
    Config(32, 128, 4, 3, split_k=3),
    Config(64, 256, 8, 3),
    Config(64, 128, 4, 3, split_k=2),
    Config(32, 128, 4, 3, swap=True),
    Config(32, 128, 4, 3, swap=True, block_m=8),
    # the picked H200 tiles: two warps, x.T as the n8/n16 operand, split K (benchmarks/w12_gemm.md)
    Config(32, 128, 2, 3, swap=True, block_m=8, split_k=3),
    Config(32, 256, 2, 2, swap=True, block_m=8),
    Config(32, 128, 2, 4, swap=True, block_m=16, split_k=2),
    Config(16, 128, 1, 3, swap=True, block_m=8),
    # M = 32 picks: escape entries loaded after the main loop
    Config(64, 128, 4, 3, esc_after=True),
    Config(64, 128, 4, 2, split_k=2, esc_after=True),
    # escape entries added a chunk per main-loop step, spread over the split-K ranges
    Config(32, 128, 2, 3, swap=True, block_m=8, split_k=3, esc_step=16),
    Config(32, 128, 2, 4, swap=True, block_m=16, split_k=2, esc_step=32),
    Config(64, 128, 4, 3, esc_step=16),
    # escapes' activations gathered from a transposed copy of x
    Config(32, 128, 2, 4, swap=True, block_m=16, split_k=2, xt=True),
    Config(32, 128, 2, 4, swap=True, block_m=16, split_k=2, esc_step=16, xt=True),
    Config(64, 128, 4, 3, esc_step=16, xt=True),
    Config(64, 128, 4, 3, esc_after=True, xt=True),
]


# the largest M each config serves: its block_m, else 64; Config(64, 256, 8, 3) needs more shared memory than an
# H200 has at M > 32
MAX_M = {Config(64, 256, 8, 3): 32}


# every config and M on the rows layout; on the units layout (which the Triton kernel reads where the ws kernel
# does not run), every config at three M
@pytest.mark.parametrize(
    "cfg, m, layout",
    [
        (cfg, m, layout)
        for layout in LAYOUTS
        for cfg in GEMM_CONFIGS
        for m in ((1, 3, 8, 16, 32, 48, 64) if layout == "rows" else (1, 16, 48))
        if m <= (cfg.block_m or MAX_M.get(cfg, 64))
    ],
    ids=str,
)
def test_fused_gemm_matches_exact_weights(cfg, m, layout):
    n, k = 1000, 4096 + 64
    w = llm_like(n, k, m)
    packed = w12.encode(w, layout)
    assert packed.escapes > 0
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = fused_gemm(x, packed, cfg)
    assert_close_to_exact(x, w, y)
    assert torch.equal(fused_gemm(x, packed, cfg), y)  # deterministic, counters reset


def test_default_config_and_large_m_path():
    w = llm_like(384, 2000, 7)
    packed = w12.encode(w)
    for m in (2, 24, 100):
        x = torch.randn(m, 2000, device="cuda").to(torch.bfloat16)
        y = w12.linear(x, packed)
        assert_close_to_exact(x, w, y)
    assert default_config(384, 2000, 16).split_k == 1


def test_prepared_launch_equals_the_bound_launch_for_every_m():
    """w12.linear launches through a Plan kept on the weight (pointers as integers, no binding per call):
    every M from 1 to 64 gives the bound launch's exact bits, also a row-sliced x and a second weight."""
    w, w2 = llm_like(1000, 4160, 11), llm_like(640, 4160, 12)
    packed, packed2 = w12.encode(w), w12.encode(w2)
    for m in range(1, 65):
        x = torch.randn(m + 1, 4160, device="cuda").to(torch.bfloat16)[1:]
        y = w12.linear(x, packed)
        assert torch.equal(y, fused_gemm(x.contiguous(), packed)), m
        assert torch.equal(w12.linear(x, packed2), fused_gemm(x.contiguous(), packed2)), m
        assert_close_to_exact(x, w, y)
    assert sorted(packed.plans) == [8, 16, 32, 64]


@pytest.mark.parametrize(
    "cfg, bucket",
    [
        (Config(32, 128, 2, 4, swap=True, block_m=16, split_k=2, esc_step=16, xt=True), 16),
        (Config(64, 128, 4, 3, esc_step=16, xt=True), 32),
        (Config(64, 128, 4, 3, esc_after=True, xt=True), 64),
    ],
    ids=str,
)
def test_prepared_launch_with_escapes_gathered_from_transposed_x(cfg, bucket):
    """A Plan whose config gathers the escapes' activations from x.T (made per call, bucket columns wide) gives
    the bound launch's exact bits at every M of its bucket."""
    w = llm_like(1000, 4160, 13)
    packed = w12.encode(w)
    prepare(packed, bucket, cfg)
    for m in range(bucket // 2 + 1, bucket + 1):
        x = torch.randn(m + 1, 4160, device="cuda").to(torch.bfloat16)[1:]
        y = w12.linear(x, packed)
        assert torch.equal(y, fused_gemm(x.contiguous(), packed, cfg)), m
        assert_close_to_exact(x, w, y)


@pytest.mark.parametrize(
    "cfg", [Config(32, 128, 4, 3, split_k=3), Config(32, 128, 2, 3, swap=True, block_m=8, split_k=3)], ids=str
)
def test_graph_replay_matches_eager(cfg):
    w = llm_like(2048, 4096, 9)
    packed = w12.encode(w)
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    eager = fused_gemm(x, packed, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_gemm(x, packed, cfg)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fallback_buckets_run_cublas_on_the_copy_and_the_rest_the_kernel(monkeypatch):
    n, k = 256, 1024
    monkeypatch.setattr(
        w12.gemm, "SPEEDUPS", {(n, k, b, h): (0.5 if b == 32 else 1.2) for b in w12.gemm.BUCKETS for h in (False, True)}
    )
    w = llm_like(n, k, 7)
    packed = w12.encode(w)
    assert w12.keep_dense(packed, w) and packed.dense_buckets == (32,)
    for m in (1, 16, 17, 32, 33, 64):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = w12.linear(x, packed)
        if m in (17, 32):
            assert torch.equal(y, torch.nn.functional.linear(x, w)), m
        else:
            assert_close_to_exact(x, w, y)
    assert sorted(packed.plans) == [8, 16, 64]  # no kernel prepared for the bucket that falls back


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decoded_slabs_equal_the_weight_and_need_only_the_scratch(layout, monkeypatch):
    """Above 64 rows W12 decodes slab by slab into one scratch buffer (no bf16 copy of the weight): every slab's
    rows bit for bit, escapes of other slabs kept out of it, the product that of F.linear on the whole weight."""
    from w12 import gemm

    w = llm_like(1000, 768, 3)
    w[::97, ::13] = 3.0e4  # escapes in every slab
    packed = w12.encode(w, layout)
    monkeypatch.setattr(gemm, "SCRATCH_BYTES", 300 * 768 * 2)  # 256-row slabs: four of them, the last short
    monkeypatch.setattr(gemm, "_SCRATCH", {})
    assert gemm.slab_rows(packed) == 256
    for first, end in ((0, 256), (256, 512), (768, 1000), (5, 133)):
        out = torch.empty(end - first + 1, 768, dtype=torch.bfloat16, device="cuda")
        got = decode_on_device(packed, first, end, out)
        assert torch.equal(got.view(torch.int16), w[first:end].view(torch.int16))
    x = torch.randn(100, 768, device="cuda").to(torch.bfloat16)
    y = w12.linear(x, packed)
    slabs = [torch.nn.functional.linear(x, w[first : first + 256]) for first in range(0, 1000, 256)]
    assert torch.equal(y, torch.cat(slabs, dim=1))  # cuBLAS on bit-equal weights, slab by slab
    assert gemm.scratch_bytes("cuda") == 300 * 768 * 2
