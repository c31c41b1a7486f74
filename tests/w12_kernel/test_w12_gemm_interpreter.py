"""The fused W12 GEMM under Triton's interpreter vs a float64 x @ W.T with the decoded weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from w12 import decode, encode
from w12.format import LAYOUTS, decode_planes

pytest.importorskip("triton")

pytestmark = pytest.mark.slow  # one Triton-interpreter subprocess runs every case (tens of seconds on 2 cores)

HERE = Path(__file__).resolve().parent
BF16_ULP = 2.0**-7  # one unit in the last place, relative (8 significant bits)


def weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    sigma = 0.02 * torch.exp(torch.randn(n, 1, generator=g))
    w = torch.randn(n, k, generator=g) * sigma
    flat = w.view(-1)
    picks = torch.randperm(n * k, generator=g)[: max(4, n * k // 40)]
    flat[picks[0::4]] *= 2.0**14  # far above the window: escapes
    flat[picks[1::4]] *= 2.0**-40  # far below: escapes and subnormals
    flat[picks[2::4]] = 0.0
    flat[picks[3::4]] = -0.0
    return w.to(torch.bfloat16)


# (M, N, K, block_n, block_k, swap, split_k, block_m, esc_after, other Config fields): tails in every dimension,
# K not a multiple of 128 (padding columns), N over several row tiles of 128, M = 1..32, split K with uneven
# ranges, both dot orientations, x.T as an n8 / n16 operand, escape entries loaded before or after the main loop,
# or added a chunk per step over the loop and the split-K ranges (with more chunks than steps: the rest after the
# loop), their activations gathered from x or x.T.
SHAPES = [
    (1, 48, 100, 16, 64, False, 1, 0, False, dict()),
    (2, 32, 256, 32, 64, True, 3, 0, True, dict()),
    (3, 40, 130, 16, 64, False, 2, 0, False, dict()),
    (5, 33, 1031, 32, 128, True, 1, 8, False, dict()),
    (8, 16, 64, 16, 64, False, 4, 0, False, dict()),
    (17, 24, 96, 16, 64, True, 2, 0, False, dict()),
    (32, 16, 66, 16, 64, False, 1, 0, True, dict()),
    (4, 16, 1024, 16, 64, False, 5, 0, False, dict()),  # 8 K steps over 5 ranges: one is empty
    (1, 40, 514, 32, 128, True, 3, 8, False, dict()),  # the H200 pick for N = 5120: swap, n8, split K
    (12, 33, 260, 32, 64, True, 2, 16, False, dict()),  # swap, n16
    (4, 16, 1024, 16, 64, False, 5, 0, False, dict(esc_step=16)),  # escapes per step over 5 ranges, one empty
    (1, 40, 514, 32, 128, True, 3, 8, False, dict(esc_step=16)),  # the N = 5120 pick with escapes per step
    (5, 33, 1031, 32, 128, True, 1, 8, False, dict(esc_step=32)),  # odd K, 5 steps: most chunks after the loop
    (32, 16, 66, 16, 64, False, 1, 0, True, dict(esc_step=16)),  # M = 32 tile; esc_after no effect with esc_step
    (3, 40, 130, 16, 64, False, 2, 0, False, dict(xt=True)),  # activations of escapes gathered from x.T
    (17, 24, 96, 16, 64, True, 2, 0, False, dict(esc_step=16, xt=True)),
    (32, 16, 66, 16, 64, False, 1, 0, True, dict(xt=True)),
    (5, 33, 1031, 32, 128, True, 1, 8, False, dict(esc_step=32, xt=True)),
    (3, 300, 640, 64, 128, True, 2, 16, False, dict()),  # three row tiles (one partial), 5 units each
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = []
    for layout in LAYOUTS:
        for i, (m, n, k, bn, bk, swap, split, bm, after, other) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            cases.append(
                dict(
                    x=x,
                    w=weights(n, k, i),
                    layout=layout,
                    config=dict(block_n=bn, block_k=bk, swap=swap, split_k=split, block_m=bm, esc_after=after, **other),
                )
            )
    all_patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    for layout in LAYOUTS:
        cases.append(dict(w=all_patterns[torch.randperm(65536, generator=g)].reshape(128, 512), layout=layout))
        cases.append(dict(w=weights(40, 1031, 99), layout=layout))
    path = tmp_path_factory.mktemp("w12") / "cases.pt"
    torch.save(cases, path)
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(HERE / "interpreter_run.py"), str(path)], env=env, check=True, timeout=300)
    return torch.load(path)


IDS = [
    f"{layout}-M{s[0]}xN{s[1]}xK{s[2]}" + "".join(f"-{k}{v}" for k, v in s[-1].items())
    for layout in LAYOUTS
    for s in SHAPES
]


@pytest.mark.parametrize("index", range(len(IDS)), ids=IDS)
def test_fused_gemm_matches_float64_reference_with_decoded_weights(results, index):
    case = results[index]
    w_decoded = decode(encode(case["w"]))
    assert torch.equal(w_decoded.view(torch.int16), case["w"].view(torch.int16))
    ref = case["x"].double() @ w_decoded.double().T
    y = case["y"].double()
    assert y.shape == ref.shape
    # fp32 accumulation, then one rounding to bf16: within one bf16 ulp of the exact sum.
    bound = BF16_ULP * ref.abs() + 1e-6 * (case["x"].double().abs() @ w_decoded.double().abs().T)
    assert torch.all((y - ref).abs() <= bound), (y - ref).abs().max()


@pytest.mark.parametrize(
    "index", [-4, -3, -2, -1], ids=[f"{layout}-{name}" for layout in LAYOUTS for name in ("all-patterns", "odd-width")]
)
def test_decode_kernel_is_bit_exact(results, index):
    case = results[index]
    assert torch.equal(case["decoded"].view(torch.int16), case["w"].view(torch.int16))


def test_escapes_matter_in_these_cases(results):
    # Guard against a vacuous test: the planes alone (escapes read as +0) give a different product.
    case = results[0]
    packed = encode(case["w"])
    assert packed.escapes > 0
    planes_only = _as_bf16(decode_planes(packed)[:, : packed.cols])
    without_escapes = case["x"].double() @ planes_only.double().T
    assert (without_escapes - case["y"].double()).abs().max() > 1.0


def _as_bf16(bits32):
    return (bits32 - ((bits32 & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def test_repeated_launches_agree(results):
    split = [case for case in results if "y_again" in case]
    assert split
    for case in split:
        assert torch.equal(case["y"].view(torch.int16), case["y_again"].view(torch.int16))
