"""N-gram trees (issue 39): drafter.tree_breadth > 1 proposes several continuations per branch point, every node is
verified in one forward, and the output stays the target's greedy decoding bit for bit.

On the real stories260K (float32, CPU): the tree engines' tokens and logprobs equal ar's, for both n-gram drafters,
c1 and batched; a tree whose every branch is wrong and one whose right branch is not the first; random trees
(hypothesis) checked against verifying each of their paths as a chain; the schema and the runtime refusing a bad
breadth."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_runtime_helpers import STORY_PROMPTS, engine_config

from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import ConfigError
from specpilot_runtime import tree as tree_module
from specpilot_runtime.config import RuntimeConfigError, parse_engine_config
from specpilot_runtime.drafters import NoDrafter, make_drafter
from specpilot_runtime.engine import Engine, GenerationRequest
from specpilot_runtime.model import LeanLlama
from specpilot_runtime.tree import (
    ContinuationIndex,
    DraftTree,
    TreePromptLookup,
    TreeSharedNgramCache,
    build_tree,
    forward_trees,
    tree_batch,
)

torch.set_num_threads(1)
K = 12
NEW = 96
SETTING = "cpu_c1_stories260k_handwritten"  # its final names the tuned-ngram mechanism the overrides edit


@pytest.fixture(scope="module")
def ar(hf, tokenizer):
    engine = Engine(LeanLlama(hf, 4, 1, "cpu"), tokenizer, NoDrafter(), 0, 4)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in STORY_PROMPTS[:4]]


@pytest.fixture(scope="module")
def reference(ar, prompts):
    """ar's output ids and output logprobs (top 3 too) per prompt."""
    return [_generate(ar, prompt) for prompt in prompts]


def _generate(engine: Engine, prompt: list[int]) -> tuple[list[int], list, list]:
    out = engine.generate(prompt, NEW, timeout=300, return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    return out["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"]


def _engine(hf, tokenizer, drafter, slots: int = 1) -> Engine:
    engine = Engine(LeanLlama(hf, slots, K + 1, "cpu"), tokenizer, drafter, K, slots)
    engine.start()
    return engine


def _drafter(kind: str, breadth: int):
    if kind == "shared":
        return TreeSharedNgramCache(1, 8, 100_000, breadth)
    return TreePromptLookup(1, 4, breadth)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "lookup"])
@pytest.mark.parametrize("breadth", [2, 3, 4])
def test_tree_engines_emit_ars_tokens_and_logprobs(hf, tokenizer, prompts, reference, kind, breadth, monkeypatch):
    forwards = _count_tree_forwards(monkeypatch)
    engine = _engine(hf, tokenizer, _drafter(kind, breadth))
    for _ in range(2):  # the second round: the shared index has seen every answer, so whole answers are proposed
        for prompt, expected in zip(prompts, reference):
            assert _generate(engine, prompt) == expected
    assert forwards[0] > 0  # trees with branches were verified (chain-shaped ones go the chain's way)
    assert engine.avg_accept_length > (1.5 if kind == "shared" else 1.2)  # and paths of them accepted


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "lookup"])
def test_batched_tree_engine_emits_ars_tokens_and_logprobs(hf, tokenizer, prompts, reference, kind, monkeypatch):
    forwards = _count_tree_forwards(monkeypatch)
    engine = _engine(hf, tokenizer, _drafter(kind, 3), slots=4)
    for _ in range(2):
        results: list = [None] * len(prompts)

        def run(i: int) -> None:
            results[i] = _generate(engine, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == reference
    assert engine.avg_accept_length > (1.5 if kind == "shared" else 1.2) and forwards[0] > 0


def _count_tree_forwards(monkeypatch) -> list[int]:
    calls = [0]
    real = tree_module.forward_trees

    def counted(model, batch):
        calls[0] += 1
        return real(model, batch)

    monkeypatch.setattr(tree_module, "forward_trees", counted)
    return calls


class ScriptedTrees(NoDrafter):
    """Proposes, from the known greedy continuation, a tree shaped by `shape(truth) -> DraftTree`."""

    def __init__(self, prompt: list[int], output: list[int], shape):
        self.full, self.shape = prompt + output, shape

    def propose_tree(self, seq, k: int) -> DraftTree:
        truth = self.full[len(seq.tokens) : len(seq.tokens) + k]
        return self.shape(truth, k) if truth else DraftTree()


def _wrong(token: int) -> int:
    return (token + 1) % 512


def test_a_tree_whose_every_branch_is_wrong_accepts_nothing_and_keeps_ars_output(hf, tokenizer, prompts, reference):
    def all_wrong(truth: list[int], k: int) -> DraftTree:
        # three wrong first tokens, each with wrong children after it
        tokens = [_wrong(truth[0]), (truth[0] + 2) % 512, (truth[0] + 3) % 512, 5, 6, 7]
        return DraftTree(tokens[:k], [-1, -1, -1, 0, 1, 2][:k])

    expected = reference[0]
    engine = _engine(hf, tokenizer, ScriptedTrees(prompts[0], expected[0], all_wrong))
    assert _generate(engine, prompts[0]) == expected
    assert engine.accepted_tokens == 0 and engine.avg_accept_length == 1.0


def test_the_right_path_on_a_later_branch_is_accepted_and_its_cache_compacted(hf, tokenizer, prompts, reference):
    def right_second(truth: list[int], k: int) -> DraftTree:
        # branch A: a wrong token with a long tail; branch B (later rows): the truth, up to 5 deep
        deep = truth[:5]
        tokens = [_wrong(truth[0]), 11, 12, 13] + deep
        parents = [-1, 0, 1, 2] + [-1] + list(range(4, 4 + len(deep) - 1))
        return DraftTree(tokens[:k], parents[:k])

    expected = reference[1]
    engine = _engine(hf, tokenizer, ScriptedTrees(prompts[1], expected[0], right_second))
    assert _generate(engine, prompts[1]) == expected  # later steps read the compacted cache
    assert engine.avg_accept_length > 4.0


@st.composite
def random_trees(draw):
    """A tree of 1..K nodes: each node's parent an earlier node or the root, its token often the greedy one."""
    size = draw(st.integers(1, K))
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    picks = [draw(st.integers(0, 3)) for _ in range(size)]  # 0: the greedy token after the parent's path, else noise
    noise = [draw(st.integers(3, 511)) for _ in range(size)]
    start = draw(st.integers(0, len(STORY_PROMPTS) - 1))
    return parents, picks, noise, start


@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(random_trees())
def test_random_trees_accept_what_verifying_each_path_as_a_chain_accepts(hf, tokenizer, reference, prompts, case):
    """The accepted path is the longest that a chain verify of any of the tree's paths accepts, and its rows' logits
    equal, bit for bit, the chain's rows of that path."""
    parents, picks, noise, which = case
    prompt, greedy = prompts[which % len(prompts)], reference[which % len(reference)][0]
    model = _model(hf)
    tokens_of: list[list[int]] = []  # per node, the tokens from the root's next to it
    tokens = []
    for i, (parent, pick) in enumerate(zip(parents, picks)):
        before = [] if parent < 0 else tokens_of[parent]
        right = before == greedy[1 : 1 + len(before)] and len(before) + 1 < len(greedy)
        token = greedy[1 + len(before)] if right and pick == 0 else noise[i]
        tokens.append(token)
        tokens_of.append(before + [token])
    tree = DraftTree(tokens, parents)
    context = prompt + greedy[:1]  # the prompt and the first generated token: its row is the tree's root
    with torch.inference_mode():
        model.forward(torch.tensor([context[:-1]]), [0], [0])
        logits, _, _ = forward_trees(model, tree_batch(model, [(0, len(context) - 1, context[-1], tree)]))
        path = tree.accepted(logits.argmax(-1).tolist())
        best_tokens: list[int] = []
        best_logits = None
        for leaf_path in tree.rows()[1]:
            chain = [tree.tokens[row - 1] for row in leaf_path[1:]]
            chain_logits = model.forward(torch.tensor([[context[-1], *chain]]), [0], [len(context) - 1])[0]
            targets = chain_logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(chain) and chain[accepted] == targets[accepted]:
                accepted += 1
            if best_logits is None or accepted > len(best_tokens):
                best_tokens, best_logits = chain[:accepted], chain_logits[: accepted + 1]
    assert [tree.tokens[row - 1] for row in path[1:]] == best_tokens
    assert torch.equal(logits[path], best_logits)


_models: dict = {}


def _model(hf) -> LeanLlama:
    if "lean" not in _models:
        _models["lean"] = LeanLlama(hf, 1, K + 1, "cpu")
    return _models["lean"]


def test_continuations_rank_by_count_then_recency_and_trees_respect_budget_and_breadth():
    index = ContinuationIndex(1, 2)
    index.add([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 1, 2, 5], 0)
    # after (1, 2): 3 twice, 5 twice (more recently), 4 once
    assert [t for t, _ in index.continuations([7, 1, 2], 3)[0]] == [5, 3, 4]
    tree = build_tree(index, [9, 1, 2], budget=6, breadth=2)
    assert len(tree) == 6 and tree.tokens[:2] == [5, 3] and tree.parents[:2] == [-1, -1]
    assert len(tree.rows()[1]) <= 2  # at most `breadth` root-to-leaf paths
    assert len(build_tree(index, [9, 1, 2], budget=6, breadth=1).rows()[1]) == 1  # breadth 1: a chain


def test_breadth_one_or_absent_keeps_the_chain_engine_and_a_tree_is_its_own_engine(conf):
    base = effective_config(compose_setting(SETTING, "final").config)
    one = effective_config(
        compose_setting(SETTING, "final", ["+final.mechanisms.tuned-ngram.drafter.tree_breadth=1"]).config
    )
    three = effective_config(
        compose_setting(SETTING, "final", ["+final.mechanisms.tuned-ngram.drafter.tree_breadth=3"]).config
    )
    assert one == base and "tree_breadth" not in base["drafter"]
    assert three["drafter"]["tree_breadth"] == 3
    stock = effective_config(compose_setting(SETTING, "stock").config)
    assert "tree_breadth" not in stock["drafter"]


@pytest.mark.parametrize("value, words", [(0, ">= 1"), (9, "<= 8"), ("two", "int")])
def test_the_schema_refuses_a_bad_breadth_naming_the_key(conf, value, words):
    with pytest.raises(ConfigError) as caught:
        compose_setting(SETTING, "final", [f"+final.mechanisms.tuned-ngram.drafter.tree_breadth={value}"])
    message = str(caught.value)
    assert "\n" not in message and "drafter.tree_breadth" in message and words in message


def test_a_breadth_on_sglang_is_refused(conf):
    with pytest.raises(ConfigError) as caught:
        compose_setting(
            "h200_c1_stories260k-padded_ngram", "final", ["+final.mechanisms.tuned-ngram.drafter.tree_breadth=2"]
        )
    assert "tree_breadth" in str(caught.value) and "reference" in str(caught.value)


def test_the_runtime_refuses_a_bad_breadth_and_builds_tree_drafters():
    def parsed(breadth, algorithm="ngram"):
        raw = engine_config(algorithm=algorithm)
        raw["drafter"]["tree_breadth"] = breadth
        return parse_engine_config(raw, "engine/config.json")

    for breadth, words in ((0, ">= 1"), (9, "at most 8"), (True, ">= 1")):
        with pytest.raises(RuntimeConfigError, match=words):
            parsed(breadth)
    with pytest.raises(RuntimeConfigError, match="needs drafter.algorithm ngram"):
        parsed(2, "draft_model")
    config = parsed(3)
    assert isinstance(make_drafter(config.drafter, {"shared_ngram_cache": True}), TreeSharedNgramCache)
    assert isinstance(make_drafter(config.drafter, {}), TreePromptLookup)
    assert not hasattr(make_drafter(parsed(None).drafter, {}), "propose_tree")  # absent: today's chain


def _streamed(engine: Engine, prompt: list[int], **options) -> tuple[dict, list[str]]:
    """A streamed request's result and the texts it streamed on the way."""
    done = threading.Event()
    box: dict = {}
    texts: list[str] = []

    def emit(kind, payload):
        if kind == "text":
            texts.append(payload)
        elif kind in ("done", "error"):
            box[kind] = payload
            done.set()

    engine.submit(GenerationRequest(prompt, NEW, emit=emit, stream=True, **options))
    assert done.wait(300) and "error" not in box, box
    return box["done"], texts


@pytest.mark.slow
def test_streaming_and_stop_strings_of_a_tree_engine_match_ar(hf, tokenizer, ar, prompts, reference):
    engine = _engine(hf, tokenizer, _drafter("shared", 3))
    for prompt, (output_ids, _, _) in zip(prompts, reference):
        engine.generate(prompt, NEW, timeout=300)  # the shared index now holds the answer: trees are accepted deep
        text = tokenizer.decode(output_ids, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 6]  # a stop string in the middle of ar's answer
        for options in ({}, {"stop_strings": (stop,)}):
            got, streamed = _streamed(engine, prompt, **options)
            want, _ = _streamed(ar, prompt, **options)
            assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
            # streamed in growing pieces (several tokens a step), each a prefix of the answer
            assert streamed and all(want["text"].startswith(t) for t in streamed)
            assert all(len(a) < len(b) for a, b in zip(streamed, streamed[1:]))
        assert stop not in want["text"] and len(want["text"]) < len(text)
