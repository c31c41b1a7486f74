"""rowgemm, the reference runtime's float32 CPU products (runtimes/reference/specpilot_runtime/rowgemm.c): a row's
result is the same bits whatever rows are multiplied beside it and however many threads run, which is what lets
a decode step multiply one row without padding and still equal verify's one-pass prefill (batch invariance)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from specpilot_runtime import rowgemm

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="rowgemm needs an x86-64 CPU with AVX2, FMA and cc")


@pytest.fixture(scope="module")
def weights(hf):
    """The trained stories260K's projections as LeanLlama stores them ([in, out]), and one as wide as a vocabulary
    with a column count that leaves a partial tile."""
    layer = hf.model.layers[0]
    found = {
        "q": layer.self_attn.q_proj.weight,
        "gate": layer.mlp.gate_proj.weight,  # 172 columns: five whole tiles and a partial one
        "down": layer.mlp.down_proj.weight,
        "lm_head": hf.lm_head.weight,
    }
    found = {name: w.detach().t().contiguous() for name, w in found.items()}
    found["wide"] = torch.randn(576, 4000, generator=torch.Generator().manual_seed(0)) / 24  # scaled as trained
    return found


@pytest.mark.parametrize("name", ["q", "gate", "down", "lm_head", "wide"])
def test_every_row_is_the_same_bits_alone_or_beside_up_to_40_others(weights, name):
    w = weights[name]
    packed = rowgemm.Packed(w)
    x = torch.randn(40, w.shape[0], generator=torch.Generator().manual_seed(1))
    full = rowgemm.mm(x, packed)
    for rows in range(1, 18):  # every block split: one 32-column pass (1-3 rows), blocks of 4-6, 6 + 1 .. 6 + 6 + 5
        for lo in (0, 7):
            assert torch.equal(rowgemm.mm(x[lo : lo + rows], packed), full[lo : lo + rows]), (rows, lo)
    # and it is the product (not merely a deterministic one): torch's own, within float32 rounding
    torch.testing.assert_close(full, x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("columns", [1, 15, 16, 17, 31, 32, 33, 48, 63])
def test_a_partial_tile_gives_each_row_the_same_bits_and_the_right_product(columns):
    """Column counts that end inside the first 16-column panel of a tile, on its edge, inside the second panel, and
    past a whole tile: no padding column spills into the outputs (a spill would land on the next row's first
    columns), and the row invariance holds."""
    gen = torch.Generator().manual_seed(columns)
    w = torch.randn(96, columns, generator=gen) / 10
    packed = rowgemm.Packed(w)
    assert torch.equal(packed.unpacked(), w)
    x = torch.randn(17, 96, generator=gen)
    full = rowgemm.mm(x, packed)
    assert full.shape == (17, columns)
    for rows in range(1, 18):
        assert torch.equal(rowgemm.mm(x[:rows], packed), full[:rows]), rows
        assert torch.equal(rowgemm.mm(x[17 - rows :], packed), full[17 - rows :]), rows
    torch.testing.assert_close(full, x @ w, rtol=1e-5, atol=1e-5)


def test_each_output_is_the_fma_chain_over_k_in_order():
    """The invariant itself, against an independent sum: acc = fma(x[m, k], w[k, n], acc) for k = 0 .. K-1, one
    rounding per step (computed exactly in fractions, rounded to the nearest float32, ties to even)."""
    gen = torch.Generator().manual_seed(4)
    k, n = 37, 40
    w, x = torch.randn(k, n, generator=gen), torch.randn(8, k, generator=gen)
    out = rowgemm.mm(x, rowgemm.Packed(w))
    for m, col in ((0, 0), (3, 17), (5, 31), (7, 39)):  # a 32-wide pass, both panels of a 6-row block, the tail
        acc = np.float32(0)
        for i in range(k):
            acc = _nearest_float32(Fraction(float(x[m, i])) * Fraction(float(w[i, col])) + Fraction(float(acc)))
        assert out[m, col].item() == float(acc), (m, col)


def _nearest_float32(exact: Fraction) -> np.float32:
    near = np.float32(float(exact))  # within one float32 step of the answer
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.int32)) & 1))


def test_the_thread_count_does_not_change_a_bit(weights):
    packed = rowgemm.Packed(weights["wide"])
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowgemm.mm(x, packed)
        torch.set_num_threads(2)
        two = rowgemm.mm(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_attention_products_read_a_strided_cache_and_masked_keys_add_nothing():
    """scores = q @ keys over a slice of a [kv, head_dim, positions] cache, and probs @ values where the keys after
    the query have probability 0: the result over 512 keys equals the one over 1024 (as the cache grows)."""
    gen = torch.Generator().manual_seed(3)
    kv, hd, rows, length = 3, 64, 3, 2048
    k_cache, v_cache = torch.randn(kv, hd, length, generator=gen), torch.randn(kv, length, hd, generator=gen)
    q = torch.randn(kv, rows, hd, generator=gen)
    scores = rowgemm.bmm(q, k_cache[:, :, :512])
    torch.testing.assert_close(scores, q @ k_cache[:, :, :512], rtol=1e-5, atol=1e-5)
    assert torch.equal(rowgemm.bmm(q, k_cache[:, :, :1024])[..., :512], scores)
    for more in range(1, 14):  # query blocks of every size: verify chunks of up to 13 rows on the same cache
        qs = torch.randn(kv, more, hd, generator=gen)
        many = rowgemm.bmm(qs, k_cache[:, :, :512])
        for i in range(more):
            assert torch.equal(rowgemm.bmm(qs[:, i : i + 1], k_cache[:, :, :512]), many[:, i : i + 1]), (more, i)
    probs = torch.softmax(torch.randn(kv, rows, 1024, generator=gen), dim=-1)
    probs[..., 300:] = 0.0
    short = rowgemm.bmm(probs[..., :512].contiguous(), v_cache[:, :512])
    assert torch.equal(rowgemm.bmm(probs, v_cache[:, :1024]), short)
    torch.testing.assert_close(short, probs[..., :512] @ v_cache[:, :512], rtol=1e-5, atol=1e-5)


def test_a_shape_it_cannot_take_is_refused_naming_both_shapes(weights):
    with pytest.raises(ValueError, match=r"\(2, 9\).*float32 \[64, 64\]"):
        rowgemm.mm(torch.zeros(2, 9), rowgemm.Packed(weights["q"]))
    with pytest.raises(ValueError, match=r"cannot multiply \(3, 2, 8\)"):
        rowgemm.bmm(torch.zeros(3, 2, 8), torch.zeros(3, 8, 40))  # 40 columns: not whole tiles


def test_a_compiler_that_fails_leaves_no_library_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(rowgemm._Unavailable, match="false failed on .*rowgemm.c"):
        rowgemm._load()
    assert list((tmp_path / "specpilot_runtime").iterdir()) == []


def test_switched_off_it_is_unavailable(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ROWGEMM", "0")
    with pytest.raises(rowgemm._Unavailable, match="SPECPILOT_ROWGEMM=0"):
        rowgemm._load()
