"""The reference runtime in process: the lean forward, the engine's speculative loop, drafters, config."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from reference_runtime_helpers import STORY_PROMPTS, engine_config, hf_greedy, write_engine

from specpilot_runtime import rowgemm
from specpilot_runtime.config import RuntimeConfigError, parse_engine_config
from specpilot_runtime.drafters import DraftModelDrafter, NgramIndex, NoDrafter, PromptLookup, SharedNgramCache
from specpilot_runtime.engine import Engine
from specpilot_runtime.model import LeanLlama, load_hf_model

torch.set_num_threads(1)


def test_lean_forward_matches_transformers_logits(hf, golden):
    ids = golden["sequence_ids"]
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits
    lean = LeanLlama(hf, num_slots=1, max_tokens_per_step=4, device="cpu")
    prefill = lean.forward(torch.tensor([ids[:150]]), [0], [0])
    steps = [lean.forward(torch.tensor([ids[p : p + 3]]), [0], [p]) for p in range(150, 201 - 3, 3)]
    assert torch.allclose(prefill[0], reference[0, :150], atol=1e-4)
    assert torch.allclose(torch.cat(steps, dim=1)[0], reference[0, 150:198], atol=1e-4)


def test_batched_forward_equals_one_sequence_at_a_time(hf, golden):
    ids = golden["sequence_ids"]
    lean = LeanLlama(hf, num_slots=3, max_tokens_per_step=4, device="cpu")
    for slot, length in enumerate((40, 7, 90)):
        lean.forward(torch.tensor([ids[:length]]), [slot], [0])
    batch = lean.forward(torch.tensor([ids[40:44], ids[7:11], ids[90:94]]), [0, 1, 2], [40, 7, 90])
    with torch.no_grad():
        reference = hf(torch.tensor([ids[:94]])).logits[0]
    for row, start in enumerate((40, 7, 90)):
        assert torch.allclose(batch[row], reference[start : start + 4], atol=1e-4)


def _run(engine: Engine, prompt: list[int], max_new: int, **kw) -> dict:
    return engine.generate(prompt, max_new, timeout=60, **kw)


def _engine(hf, tokenizer, drafter, k: int, max_running: int = 1) -> Engine:
    lean = LeanLlama(hf, num_slots=max_running, max_tokens_per_step=k + 1, device="cpu")
    engine = Engine(lean, tokenizer, drafter, k, max_running)
    engine.start()
    return engine


@pytest.mark.parametrize("name", ["none", "prompt_lookup", "shared_cache", "draft_model"])
def test_every_drafter_reproduces_llama2c_golden_output(hf, tokenizer, name, golden):
    drafters = {
        "none": lambda: NoDrafter(),
        "prompt_lookup": lambda: PromptLookup(1, 4),
        "shared_cache": lambda: SharedNgramCache(1, 6, 100_000),
        "draft_model": lambda: DraftModelDrafter(LeanLlama(hf, 1, 6, "cpu")),
    }
    engine = _engine(hf, tokenizer, drafters[name](), k=5 if name != "none" else 0)
    prompt = golden["prompt_ids"]
    result = _run(engine, prompt, len(golden["sequence_ids"]) - len(prompt))
    assert prompt + result["output_ids"] == golden["sequence_ids"]
    assert result["text"] == golden["decoded_text_without_bos"][len(golden["prompt"]) :]


def test_target_as_its_own_draft_model_accepts_every_proposal(hf, tokenizer, golden):
    engine = _engine(hf, tokenizer, DraftModelDrafter(LeanLlama(hf, 1, 5, "cpu")), k=4)
    meta = _run(engine, golden["prompt_ids"], 101)["meta_info"]
    assert meta["spec_draft_token_num"] > 0
    assert meta["spec_accept_token_num"] == meta["spec_draft_token_num"]
    assert meta["spec_accept_length"] == 5.0  # 1 + 100 tokens = prefill + 20 full steps of 4 + 1


@pytest.mark.slow
def test_shared_cache_learns_across_requests_and_stays_exact(hf, tokenizer, stories_dir):
    engine = _engine(hf, tokenizer, SharedNgramCache(1, 16, 100_000), k=8)
    prompts = [tokenizer(p)["input_ids"] for p in STORY_PROMPTS[:4]]
    first = [_run(engine, p, 120) for p in prompts]
    again = [_run(engine, p, 120) for p in prompts]
    for prompt, a, b in zip(prompts, first, again):
        assert a["output_ids"] == b["output_ids"] == hf_greedy(stories_dir, prompt, 120)
    # The second pass finds its continuation in the cache: most steps accept all 8 proposals (+1).
    assert all(r["meta_info"]["spec_accept_length"] > 6 for r in again)


@pytest.mark.slow
def test_batched_engine_serves_concurrent_requests_exactly(hf, tokenizer, stories_dir):
    engine = _engine(hf, tokenizer, PromptLookup(1, 3), k=4, max_running=4)
    prompts = [tokenizer(p)["input_ids"] for p in STORY_PROMPTS[:6]]
    results, threads = {}, []
    for i, prompt in enumerate(prompts):
        thread = threading.Thread(target=lambda i=i, p=prompt: results.__setitem__(i, _run(engine, p, 60 + 7 * i)))
        threads.append(thread)
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(prompts):
        assert results[i]["output_ids"] == hf_greedy(stories_dir, prompt, 60 + 7 * i)


def test_logprobs_match_transformers(hf, tokenizer, golden):
    engine = _engine(hf, tokenizer, PromptLookup(1, 3), k=3)
    ids = golden["sequence_ids"][:30]
    meta = _run(engine, ids, 5, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)["meta_info"]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([golden["sequence_ids"][:35]])).logits[0], -1)
    assert meta["input_token_logprobs"][0] == (None, ids[0], None)
    for pos in range(1, 30):
        logprob, token, _ = meta["input_token_logprobs"][pos]
        assert token == ids[pos] and abs(logprob - float(reference[pos - 1, token])) < 1e-4
        top1, top2 = meta["input_top_logprobs"][pos]
        assert top1[1] == int(reference[pos - 1].argmax()) and top1[0] >= top2[0]
    for i, (logprob, token, _) in enumerate(meta["output_token_logprobs"]):
        assert token == golden["sequence_ids"][30 + i]
        assert abs(logprob - float(reference[29 + i, token])) < 1e-4


def test_ngram_index_proposes_what_followed_the_longest_match():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    index = NgramIndex(1, 3)
    index.add(tokens, 0)
    # Suffix (2, 6, 7) never occurred; (6, 7) did, most recently followed by 3, 4, 2.
    assert index.lookup(tokens, 3) == [3, 4, 2]
    assert index.lookup([1, 6, 7], 2) == [3, 4]
    assert index.lookup([42], 4) == []


def test_bfloat16_forward_is_as_close_to_float32_as_transformers_bfloat16(hf, golden, stories_dir):
    ids = torch.tensor([golden["sequence_ids"][:200]])
    hf16 = load_hf_model(stories_dir, "bfloat16", "cpu")
    lean = LeanLlama(hf16, 1, 1, "cpu")
    assert lean.k_cache.dtype == torch.bfloat16
    with torch.no_grad():
        exact, theirs = hf(ids).logits, hf16(ids).logits.float()
    ours = lean.forward(ids, [0], [0])
    assert (ours - exact).abs().max() <= 1.25 * (theirs - exact).abs().max()
    # bf16 near-ties may flip an argmax now and then (as between any two bf16 kernels), not more.
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.98


def test_config_refuses_unknown_runtime_option():
    raw = engine_config("final", runtime_options={"shared_ngram_cache": True, "tree_attention": True})
    with pytest.raises(RuntimeConfigError, match="runtime_options.tree_attention"):
        parse_engine_config(raw, "engines/x/config.json")


def test_config_reads_builder_keys():
    cfg = parse_engine_config(engine_config("final", k=7, max_n=5, min_n=2, max_running=16))
    assert (cfg.arm, cfg.drafter.algorithm, cfg.drafter.num_draft_tokens) == ("final", "ngram", 7)
    assert (cfg.drafter.ngram_max_n, cfg.drafter.ngram_min_n, cfg.max_running_requests) == (5, 2, 16)
    assert cfg.runtime_options == {"shared_ngram_cache": True}


@pytest.mark.slow
def test_server_refuses_bad_config_in_one_line(tmp_path, stories_dir):
    engine = write_engine(tmp_path / "eng", engine_config("final", runtime_options={"warp_drive": 1}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specpilot_runtime.server",
            "--engine",
            str(engine),
            "--engine-id",
            "x",
            "--model",
            str(stories_dir),
            "--port",
            "1",
        ],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "runtime_options.warp_drive" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eos_ends_generation_unless_ignore_eos(tokenizer):
    from specpilot_runtime.protocol import ModelLimits, parse_generate

    limits = ModelLimits(vocab_size=512, context_length=512, eos_token_ids=frozenset({2}))
    request, _ = parse_generate({"text": "Hi", "sampling_params": {"stop_token_ids": [13]}}, tokenizer, limits)
    assert request.stop_token_ids == {2, 13}
    request, _ = parse_generate({"text": "Hi", "sampling_params": {"ignore_eos": True}}, tokenizer, limits)
    assert request.stop_token_ids == set()


def test_runtime_starts_a_draft_model_engine_from_an_engine_dir(tmp_path, golden, stories_dir):
    from specpilot_runtime.runtime import load_runtime

    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="draft_model", k=3))
    runtime = load_runtime(str(engine_dir), "id-draft", str(stories_dir), str(stories_dir), None)
    assert runtime.limits.eos_token_ids == {2}
    result = _run(runtime.engine, golden["prompt_ids"], 41)
    assert golden["prompt_ids"] + result["output_ids"] == golden["sequence_ids"][:46]
    info = runtime.server_info()
    assert (info["engine_id"], info["speculative_algorithm"], info["avg_spec_accept_length"]) == (
        "id-draft",
        "draft_model",
        4.0,
    )  # its own draft: every step accepts all 3 proposals + 1
    assert info["cpu_products"] == ("rowgemm" if rowgemm.available() else "torch")


def test_runtime_refuses_draft_model_without_its_checkpoint(tmp_path, stories_dir):
    from specpilot_runtime.runtime import load_runtime

    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="draft_model", k=3))
    with pytest.raises(RuntimeConfigError, match="--draft-model"):
        load_runtime(str(engine_dir), "x", str(stories_dir), None, None)
