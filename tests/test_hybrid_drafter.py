"""The hybrid drafter (`drafter.fallback: eagle3`): n-gram proposals where the n-grams match, the EAGLE-3 head's chain
where they do not. On stories260K with a small head made by `make draft` (as tests/test_eagle3.py makes it): the
output is the target's greedy decoding token for token at c1 and batched, both sides draft, the head's proposals after
n-gram steps are what a fresh head computes from the whole sequence's features, and every bad key is one line."""

from __future__ import annotations

import pytest
import torch

SETTING = "cpu_c1_stories260k_ngram"


@pytest.fixture(scope="module")
def head(eagle3_head):
    """The small head made once for the session (tests/conftest.py)."""
    return eagle3_head


def hybrid_config(k=3, fallback_k=2, min_n=2, max_running=1, shared=True, **drafter):
    from reference_runtime_helpers import engine_config

    config = engine_config(
        "final",
        k=k,
        min_n=min_n,
        runtime_options={"shared_ngram_cache": True} if shared else {},
        max_running=max_running,
    )
    config["drafter"].update(fallback="eagle3", fallback_num_draft_tokens=fallback_k, **drafter)
    return config


def load(tmp_path, config, stories_dir, head_dir):
    from reference_runtime_helpers import write_engine

    from specpilot_runtime.runtime import load_runtime

    return load_runtime(str(write_engine(tmp_path / "eng", config)), "id", str(stories_dir), str(head_dir), None)


@pytest.mark.parametrize("shared_cache", [True, False], ids=["shared-cache", "prompt-lookup"])
def test_the_hybrid_serves_the_targets_exact_tokens_and_both_sides_draft(
    head, stories_dir, golden, tmp_path, shared_cache
):
    """Matches of >= 2 tokens go to the n-grams, the rest to the head (k 2); llama2.c's golden token for token."""
    runtime = load(tmp_path, hybrid_config(shared=shared_cache), stories_dir, head.directory)
    assert runtime.engine.model.capture == (0, 2, 4)
    prompt = golden["prompt_ids"]
    result = runtime.engine.generate(prompt, len(golden["sequence_ids"]) - len(prompt), timeout=60)
    assert prompt + result["output_ids"] == golden["sequence_ids"]
    info = runtime.server_info()
    steps = info["drafted_steps"]
    assert steps["ngram"] > 0 and steps["eagle3"] > 0
    assert info["drafter_fallback"] == "eagle3" and info["fallback_num_draft_tokens"] == 2
    assert info["spec_accept_token_num"] > 0


def test_after_ngram_steps_the_head_proposes_what_a_fresh_head_computes_from_the_whole_sequence(
    head, stories_dir, golden, tmp_path
):
    """The head sees the target's features of every accepted position, n-gram steps included: each of its first
    proposals equals step 0 of a fresh head (own slot, empty cache) over all of the sequence's features at once."""
    from specpilot_runtime.eagle3 import Eagle3Head
    from specpilot_runtime.model import LeanLlama, load_hf_model

    runtime = load(tmp_path, hybrid_config(k=3, fallback_k=1), stories_dir, head.directory)
    hybrid = runtime.engine.drafter
    seen: list[tuple[list[int], list[int]]] = []
    propose = hybrid.head.propose

    def recording(seq, k):
        proposal = propose(seq, k)
        seen.append((list(seq.tokens), proposal))
        return proposal

    hybrid.head.propose = recording
    prompt = golden["prompt_ids"]
    runtime.engine.generate(prompt, len(golden["sequence_ids"]) - len(prompt), timeout=60)
    assert hybrid.steps["ngram"] > 0
    after_ngram = [tokens for tokens, _ in seen]
    assert any(len(b) - len(a) > 1 for a, b in zip(after_ngram, after_ngram[1:]))  # n-gram steps in between

    target = LeanLlama(load_hf_model(stories_dir, "float32", "cpu"), 1, 1, "cpu")
    fresh = Eagle3Head(head.directory, target, 1)
    target.capture = fresh.aux_layers
    with torch.inference_mode():
        for tokens, proposal in seen:
            target.forward(torch.tensor([tokens[:-1]]), [0], [0])
            want, _ = fresh.step(0, 0, tokens[1:], target.last_aux[0], from_target=True)
            assert proposal == [want]


def test_batched_the_hybrid_gives_each_request_ar_s_tokens(head, stories_dir, golden, tmp_path):
    """Four requests at once (one verify forward for all) each get exactly what an ar engine gives alone."""
    import threading

    from reference_runtime_helpers import engine_config

    ids = golden["sequence_ids"]
    prompts = [ids[:3], ids[:9], ids[:17], golden["prompt_ids"]]
    ar = load(tmp_path / "ar", engine_config("ar", max_running=4), stories_dir, head.directory)
    want = [ar.engine.generate(p, 60, timeout=60)["output_ids"] for p in prompts]
    runtime = load(tmp_path / "hybrid", hybrid_config(max_running=4), stories_dir, head.directory)
    got: list = [None] * len(prompts)

    def run(i):
        got[i] = runtime.engine.generate(prompts[i], 60, timeout=120)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert runtime.engine.drafter.steps["eagle3"] > 0 and runtime.engine.drafter.steps["ngram"] > 0


@pytest.mark.parametrize(
    ("drafter", "words"),
    [
        ({"fallback": "draft_model"}, "drafter.fallback is 'draft_model'; expected one of eagle3"),
        ({"algorithm": "draft_model"}, "drafter.fallback eagle3 needs drafter.algorithm ngram"),
        ({"tree_breadth": 2}, "drafter.fallback eagle3 needs drafter.algorithm ngram drafting chains"),
        ({"fallback": None}, "drafter.fallback_num_draft_tokens does nothing without drafter.fallback"),
        ({"fallback_num_draft_tokens": 0}, "drafter.fallback_num_draft_tokens is 0; expected an integer >= 1"),
    ],
)
def test_a_bad_hybrid_engine_config_is_one_line_naming_the_key(drafter, words):
    from specpilot_runtime.config import RuntimeConfigError, parse_engine_config

    config = hybrid_config()
    config["drafter"].update(drafter)
    with pytest.raises(RuntimeConfigError) as exc:
        parse_engine_config(config, "eng/config.json")
    assert words in str(exc.value) and "eng/config.json" in str(exc.value) and "\n" not in str(exc.value)


def test_without_a_head_directory_the_hybrid_is_refused_in_one_line(stories_dir, tmp_path):
    from reference_runtime_helpers import write_engine

    from specpilot_runtime.config import RuntimeConfigError
    from specpilot_runtime.runtime import load_runtime

    engine_dir = write_engine(tmp_path / "eng", hybrid_config())
    with pytest.raises(RuntimeConfigError, match="pass --draft-model <EAGLE-3 head directory>"):
        load_runtime(str(engine_dir), "id", str(stories_dir), None, None)


# --- the build: keys checked, no other engine's config moves ----------------------------------------------------------


def test_the_hybrid_setting_runs_the_ngram_final_with_the_head_as_fallback():
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config

    hybrid = effective_config(compose_setting("cpu_c1_smollm2-135m_hybrid", "final").config)
    ngram = effective_config(compose_setting("cpu_c1_smollm2-135m_ngram", "final").config)
    assert hybrid["drafter"] == {
        **ngram["drafter"],
        "name": "ngram-eagle3-135m",
        "fallback": "eagle3",
        "fallback_num_draft_tokens": 2,
        "recipe": "eagle3-135m",
    }
    assert hybrid["runtime_options"] == ngram["runtime_options"] == {"shared_ngram_cache": True}
    assert "fallback" not in ngram["drafter"] and "fallback_num_draft_tokens" not in ngram["drafter"]
    for arm in ("ar", "stock"):  # the hybrid's other arms are the n-gram setting's, but for the setting's name
        mine = effective_config(compose_setting("cpu_c1_smollm2-135m_hybrid", arm).config)
        theirs = effective_config(compose_setting("cpu_c1_smollm2-135m_ngram", arm).config)
        assert mine["drafter"] == theirs["drafter"] and "fallback" not in mine["drafter"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["drafter.fallback_num_draft_tokens=2"], "drafter.fallback_num_draft_tokens 2 does nothing without"),
        (["drafter.recipe=eagle3-135m"], "drafter.recipe eagle3-135m does nothing for drafter.algorithm ngram"),
        (["drafter.fallback=eagle3"], "drafter.fallback eagle3 needs drafter.recipe"),
        (["drafter.fallback=medusa", "drafter.recipe=eagle3-135m"], "drafter.fallback is 'medusa'"),
        (
            ["drafter.fallback=eagle3", "drafter.recipe=eagle3-135m", "drafter.tree_breadth=2"],
            "only the reference runtime's ngram chain drafter",
        ),
    ],
)
def test_a_fallback_key_that_does_nothing_is_an_error(overrides, words):
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        effective_config(compose_setting("cpu_c1_smollm2-135m_ngram", "final", overrides).config)
    assert words in str(exc.value) and "\n" not in str(exc.value)
