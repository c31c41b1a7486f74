"""The API a runtime uses: apply_w12 on the real stories260K model, W12Linear, w12.cat."""

import copy

import pytest
import torch

import w12
from w12.format import decode_planes


@pytest.fixture(scope="module")
def stories_bf16(stories_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.bfloat16).eval()


def test_apply_w12_keeps_the_model_output_bit_for_bit(stories_bf16):
    model = copy.deepcopy(stories_bf16)
    originals = {
        name: mod.weight.detach().clone() for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
    }
    replaced = w12.apply_w12(model)
    assert replaced == len(originals) == 5 * 7 + 1  # 7 projections per layer + lm_head
    for name, weight in originals.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, w12.W12Linear)
        assert torch.equal(layer.weight.view(torch.int16), weight.view(torch.int16))
    ids = torch.tensor([[1, 403, 407, 261, 378, 500, 22, 15]])
    with torch.inference_mode():
        want = stories_bf16(ids).logits
        got = model(ids).logits
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_apply_w12_refuses_float32_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    with pytest.raises(TypeError, match=r"0\.weight is torch.float32"):
        w12.apply_w12(model)


def test_cat_matches_encoding_the_concatenation():
    g = torch.Generator().manual_seed(5)
    # magnitudes in [0.01, 0.02): one octave, inside every row's window, so the planted values are the only escapes
    parts = [
        ((torch.rand(r, 96, generator=g) + 1) * 0.01 * torch.randn(r, 96, generator=g).sign()).to(torch.bfloat16)
        for r in (7, 16, 3)
    ]
    parts[1][2, 5] = float("inf")
    parts[2][0, 0] = 1e30
    joined = w12.cat([w12.encode(p) for p in parts])
    direct = w12.encode(torch.cat(parts))
    assert joined.escapes == direct.escapes == 2
    assert torch.equal(w12.decode(joined).view(torch.int16), torch.cat(parts).view(torch.int16))
    assert torch.equal(decode_planes(joined), decode_planes(direct))
    assert torch.equal(joined.esc_ptr, direct.esc_ptr)
