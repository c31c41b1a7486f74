"""The reference runtime's Qwen3 forward (specpilot_lab.qwen3) and greedy decoding over its static cache
(specpilot_lab.decode), at tiny shapes on CPU, against transformers' own Qwen3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from specpilot_lab.decode import NEAR_TIE_BF16, Decoded, divergences, greedy_decode
from specpilot_lab.qwen3 import from_transformers, qwen3_shape

VOCAB = 256


def tiny_qwen3(dtype=torch.float32, seed=0) -> Qwen3ForCausalLM:
    """hidden 64, 2 layers, 4 query heads over 2 KV heads of 32 (head_dim != hidden / heads), untied lm_head;
    norm weights drawn too, so a q/k norm left out or misplaced shows."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        attn_implementation="eager",
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model.to(dtype)


def prompts(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shape_is_read_from_the_transformers_config():
    shape = qwen3_shape(tiny_qwen3().config)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.group) == (4, 2, 32, 2)
    assert shape.rope_theta == 1e6


@torch.inference_mode()
def test_forward_equals_transformers_logits_prefill_and_cached_steps():
    hf = tiny_qwen3()
    model = from_transformers(hf)
    tokens = prompts(3, 12)
    expected = hf(tokens).logits
    cache = model.new_cache(3, 64)
    positions = torch.arange(12).expand(3, 12)
    # The first 9 tokens as a prefill, then one token at a time through the cache.
    got = [model(tokens[:, :9], positions[:, :9], cache)]
    for t in range(9, 12):
        got.append(model(tokens[:, t : t + 1], positions[:, t : t + 1], cache))
    got = torch.cat(got, dim=1)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_static_cache_greedy_equals_full_recompute():
    hf = tiny_qwen3(seed=2)
    model = from_transformers(hf)
    tokens = prompts(3, 10, seed=3)
    decoded = greedy_decode(model, tokens, new_tokens=12)
    sequence = tokens
    for _ in range(12):  # transformers recomputing the whole sequence for every token, no cache
        logits = hf(sequence, use_cache=False).logits[:, -1]
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    assert decoded.tokens.tolist() == sequence[:, 10:].tolist()
    assert not decoded.graphed
    assert (decoded.top[..., :-1] >= decoded.top[..., 1:]).all()


@torch.inference_mode()
def test_w12_weights_give_the_bf16_tokens():
    pytest.importorskip("w12")
    from w12.module import W12Linear

    model = from_transformers(tiny_qwen3(torch.bfloat16, seed=4))
    tokens = prompts(2, 8, seed=5)
    bf16 = greedy_decode(model, tokens, new_tokens=10)
    model.to_w12(lm_head=True)
    converted = [name for name, _ in model.named_modules() if isinstance(_, W12Linear)]
    assert len(converted) == 2 * 4 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    w12 = greedy_decode(model, tokens, new_tokens=10)
    assert w12.tokens.tolist() == bf16.tokens.tolist()
    # On CPU the W12 path decodes the exact bf16 weights for the same F.linear: the logits are the same bits.
    assert torch.equal(w12.top, bf16.top) and torch.equal(w12.top_ids, bf16.top_ids)


@torch.inference_mode()
def test_w12_dense_fallback_keeps_the_exact_bf16_weights_beside_the_encoding():
    from w12.module import W12Linear

    model = from_transformers(tiny_qwen3(torch.bfloat16, seed=6))
    weights = {name: layer.weight.clone() for name, layer in model.projections()}
    weights["lm_head"] = model.lm_head.weight.clone()
    tokens = prompts(2, 8, seed=7)
    bf16 = greedy_decode(model, tokens, new_tokens=10)
    model.to_w12(lm_head=True, dense_fallback=True)
    converted = dict(model.projections(), lm_head=model.lm_head)
    assert converted.keys() == weights.keys()
    for name, layer in converted.items():  # tiny shapes are unmeasured: each falls back at some M, so keeps its copy
        assert isinstance(layer, W12Linear) and layer.packed.dense is not None, name
        assert torch.equal(layer.packed.dense.view(torch.int16), weights[name].view(torch.int16)), name
    kept = greedy_decode(model, tokens, new_tokens=10)
    assert torch.equal(kept.top, bf16.top) and kept.tokens.tolist() == bf16.tokens.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@torch.inference_mode()
def test_decode_steps_replayed_from_a_cuda_graph_give_the_eager_steps_bits():
    """On CUDA the forward runs fused.py's Triton kernels (where Triton is installed): they capture too."""
    model = from_transformers(tiny_qwen3(torch.bfloat16, seed=8), device="cuda")
    tokens = prompts(2, 8, seed=9)
    graphed = greedy_decode(model, tokens, new_tokens=10, graph=True)
    eager = greedy_decode(model, tokens, new_tokens=10, graph=False)
    assert graphed.graphed and not eager.graphed
    assert graphed.tokens.tolist() == eager.tokens.tolist() and torch.equal(graphed.top, eager.top)


def test_divergences_are_found_at_the_first_differing_token_and_classified_as_verify_does():
    """margin = the reference's top-1 logit minus its logit for the other run's token, near tie within verify's
    bf16 tolerance; found among the kept top logits even when more than two tie; a token below them has no known
    margin and counts as real."""
    tokens = torch.tensor([[1, 2, 3]] * 5)
    reference = Decoded(tokens, torch.zeros(5, 3, 3), torch.zeros(5, 3, 3, dtype=torch.long), 1.0, False)
    kept = {
        1: ([4.0, 3.75, 3.5], [2, 5, 6]),  # the other run took the runner-up, 0.25 below: a near tie
        2: ([4.0, 3.5, 3.0], [2, 7, 6]),  # 0.5 below: real
        3: ([4.0, 4.0, 4.0], [2, 6, 9]),  # a three-way tie, the other run took the third: margin 0
        4: ([4.0, 4.0, 3.0], [2, 6, 9]),
    }  # the other run's token is not kept: real, margin unknown
    for b, (values, ids) in kept.items():
        reference.top[b, 1], reference.top_ids[b, 1] = torch.tensor(values), torch.tensor(ids)
    other = Decoded(
        torch.tensor([[1, 2, 3], [1, 5, 9], [1, 7, 3], [1, 9, 3], [1, 8, 3]]),
        torch.zeros(5, 3, 3),
        torch.zeros(5, 3, 3, dtype=torch.long),
        1.0,
        False,
    )
    found = divergences(reference, other)
    assert [(d["sequence"], d["token"], d["emitted"], d["margin"], d["near_tie"]) for d in found] == [
        (1, 1, 5, 0.25, True),
        (2, 1, 7, 0.5, False),
        (3, 1, 9, 0.0, True),
        (4, 1, 8, None, False),
    ]
    assert found[0]["gap_ulps"] == 8.0  # 4.0's bf16 ulp is 1/32


def test_the_near_tie_tolerance_is_verifys_for_bfloat16():
    from specpilot_build.measure.verify import dtype_tolerance

    assert NEAR_TIE_BF16 == dtype_tolerance("bfloat16")
