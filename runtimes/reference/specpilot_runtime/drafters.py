"""Drafters: propose up to k tokens that the target model is likely to produce next.

Every drafter sees a sequence's full token list (prompt + output so far) and is told about each token
appended to it; verification decides what is kept, so a drafter only affects speed, never the output.
- `NoDrafter`: plain autoregressive decoding.
- `PromptLookup` (stock `ngram`): match the last n tokens (n from max_n down to min_n) earlier in this
  sequence and propose the tokens that followed that earlier occurrence.
- `SharedNgramCache` (final mechanism `shared_ngram_cache`): the same lookup over one index shared by all
  requests, holding earlier prompts and outputs too, like SGLang's NGRAM cache. A corpus drafter (corpus.py)
  seeds it at start-up with rows that the capacity's clearing keeps (NgramIndex.seed).
- `DraftModelDrafter` (`draft_model`): a small model sharing the tokenizer proposes k tokens greedily; with a
  reduced draft vocabulary (`draft_to_target`, a drafter's draft_vocab.safetensors) its head scores only those
  tokens and the argmax is mapped back to the target's id.
- `Eagle3Drafter` (`eagle3`): an EAGLE-3 head (eagle3.py) on the target's hidden states from its last forward
  (prefill or verify: the engine keeps them in `seq.aux` when the drafter names `aux_layers`), its own KV cache,
  k chained steps, each proposal mapped back to a target id by d2t.
- `HybridDrafter` (`ngram` with `fallback: eagle3`): each step the n-gram drafter's proposal (prompt lookup or the
  shared cache, matches of at least ngram_min_n tokens) when it has one, else the EAGLE-3 head's chain (its own k).
  The head is not run on n-gram steps; the target's features of every position those steps settled wait in
  `seq.aux`, and its next step 0 feeds them all at once, so its KV cache holds every accepted position either way.
"""

from __future__ import annotations

import dataclasses

import torch


class NoDrafter:
    def start(self, seq) -> None:
        pass

    def observe(self, seq, first_new: int) -> None:
        pass

    def propose(self, seq, k: int) -> list[int]:
        return []

    def finish(self, seq) -> None:
        pass


class NgramIndex:
    """Map each n-gram (min_n <= n <= max_n) to where its most recent continuation starts.

    Sequences are stored by reference, so a continuation read from a sequence still being generated sees
    its newest tokens. An n-gram is indexed once the token after it exists.
    """

    def __init__(self, min_n: int, max_n: int, capacity: int | None = None):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.table: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.seeded: dict[tuple[int, ...], tuple[list[int], int]] = {}  # seed(): under `table`, never cleared
        self.indexed_tokens = 0
        self.seed_tokens = 0

    def seed(self, rows: list[list[int]]) -> None:
        """Index rows (a corpus) beneath everything added later: a lookup takes `table`'s entry for an n-gram, else
        the seed's, which is what one table fed the rows first would hold. Only added tokens count towards the
        capacity, and its clearing empties `table` only, so the seed is never lost."""
        seeded = self.seeded
        for tokens in rows:
            for pos in range(1, len(tokens)):
                for n in range(self.min_n, min(self.max_n, pos) + 1):
                    seeded[tuple(tokens[pos - n : pos])] = (tokens, pos)
            self.seed_tokens += len(tokens)

    def add(self, tokens: list[int], first_new: int) -> None:
        """Index the continuations at positions first_new .. len(tokens)-1."""
        if self.capacity is not None and self.indexed_tokens > self.capacity:
            self.table.clear()  # start afresh rather than grow without bound
            self.indexed_tokens = 0
        table = self.table
        for pos in range(max(first_new, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                table[tuple(tokens[pos - n : pos])] = (tokens, pos)
        self.indexed_tokens += len(tokens) - first_new

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The tokens that followed the longest earlier match of the current suffix, at most k of them."""
        table, seeded = self.table, self.seeded
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            key = tuple(tokens[len(tokens) - n :])
            hit = table.get(key) or seeded.get(key)
            if hit is not None:
                source, pos = hit
                return source[pos : pos + k]
        return []


class PromptLookup(NoDrafter):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def start(self, seq) -> None:
        seq.ngram_index = NgramIndex(self.min_n, self.max_n)
        seq.ngram_index.add(seq.tokens, 0)

    def observe(self, seq, first_new: int) -> None:
        seq.ngram_index.add(seq.tokens, first_new)

    def propose(self, seq, k: int) -> list[int]:
        return seq.ngram_index.lookup(seq.tokens, k)

    def finish(self, seq) -> None:
        seq.ngram_index = None


class SharedNgramCache(NoDrafter):
    def __init__(self, min_n: int, max_n: int, capacity: int):
        self.index = NgramIndex(min_n, max_n, capacity)

    def start(self, seq) -> None:
        self.index.add(seq.tokens, 0)

    def observe(self, seq, first_new: int) -> None:
        self.index.add(seq.tokens, first_new)

    def propose(self, seq, k: int) -> list[int]:
        return self.index.lookup(seq.tokens, k)


class DraftModelDrafter(NoDrafter):
    """Greedy proposals from a draft model with its own KV cache slot per sequence.

    `seq.draft_fed` holds the tokens whose keys/values sit in the draft cache; after verification only
    the prefix shared with the real sequence stays valid, and the rest is fed again on the next proposal.
    `draft_to_target` (sorted target ids): the model's head is cut once, here, to those columns (LeanLlama keeps
    it as [hidden, vocab]); a proposal is draft_to_target[argmax]. Proposals only steer speed: verify keeps the
    target's tokens exact, so the cut head needs no padding.
    """

    def __init__(self, model, draft_to_target: torch.Tensor | None = None):
        self.model = model
        self.to_target: list[int] | None = None
        if draft_to_target is not None:
            model.cut_head(draft_to_target)
            self.to_target = [int(i) for i in draft_to_target]

    def start(self, seq) -> None:
        seq.draft_fed = []

    def propose(self, seq, k: int) -> list[int]:
        if k <= 0:
            return []
        valid = _common_prefix(seq.draft_fed, seq.tokens)
        pending = seq.tokens[valid:]
        device = self.model.device
        proposals: list[int] = []
        fed = seq.tokens[:valid]
        for _ in range(k):
            logits = self.model.forward(
                torch.tensor([pending], device=device),
                [seq.slot],
                [len(fed)],
                logit_rows=torch.tensor([len(pending) - 1], device=device),
            )
            fed = fed + pending
            token = int(logits[0, -1].argmax())
            if self.to_target is not None:
                token = self.to_target[token]
            proposals.append(token)
            pending = [token]
        seq.draft_fed = fed
        return proposals

    def finish(self, seq) -> None:
        seq.draft_fed = []


class Eagle3Drafter(NoDrafter):
    """k chained steps of an EAGLE-3 head. `seq.eagle_len`: positions whose head KV entries were made from the
    target's features (valid for good); `seq.aux`: the target's features of the positions after those, as the
    engine collected them from its forwards. The target knows features up to the second-to-last token (the last
    is scored by the next verify), so step 0 runs those new rows at once, pairing position p with token p + 1;
    steps 1..k-1 feed the head's own output feature and its proposal, writing KV entries past eagle_len that the
    next step 0 overwrites."""

    def __init__(self, head):
        self.head = head
        self.aux_layers = head.aux_layers

    def start(self, seq) -> None:
        seq.eagle_len = 0

    def propose(self, seq, k: int) -> list[int]:
        aux, tokens = seq.aux, seq.tokens
        start = seq.eagle_len
        if k <= 0 or aux is None or start + len(aux) != len(tokens) - 1:
            return []  # features missing (nothing to pair): no proposal this step
        seq.aux = None
        token, feature = self.head.step(seq.slot, start, tokens[start + 1 :], aux, from_target=True)
        seq.eagle_len = position = len(tokens) - 1
        proposals = [token]
        for _ in range(k - 1):
            position += 1
            token, feature = self.head.step(seq.slot, position, [token], feature, from_target=False)
            proposals.append(token)
        return proposals


class HybridDrafter(NoDrafter):
    """The n-gram proposal (at most ngram_k tokens) when there is one, else the head's chain (at most head_k).
    `steps` counts the steps each side drafted (and "none": neither proposed anything)."""

    def __init__(self, ngram: NoDrafter, head: Eagle3Drafter, ngram_k: int, head_k: int):
        self.ngram, self.head = ngram, head
        self.ngram_k, self.head_k = ngram_k, head_k
        self.aux_layers = head.aux_layers
        self.steps = {"ngram": 0, "eagle3": 0, "none": 0}

    def start(self, seq) -> None:
        self.ngram.start(seq)
        self.head.start(seq)

    def observe(self, seq, first_new: int) -> None:
        self.ngram.observe(seq, first_new)

    def propose(self, seq, k: int) -> list[int]:
        proposal = self.ngram.propose(seq, min(k, self.ngram_k))
        side = "ngram"
        if not proposal:
            proposal = self.head.propose(seq, min(k, self.head_k))
            side = "eagle3" if proposal else "none"
        self.steps[side] += 1
        return proposal

    def finish(self, seq) -> None:
        self.ngram.finish(seq)
        self.head.finish(seq)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def make_drafter(drafter_config, runtime_options: dict, draft_model=None, draft_to_target=None):
    if drafter_config.fallback == "eagle3":  # config.py allows it with the ngram chain drafter only
        plain = dataclasses.replace(drafter_config, fallback=None)
        return HybridDrafter(
            make_drafter(plain, runtime_options),
            Eagle3Drafter(draft_model),
            drafter_config.num_draft_tokens,
            drafter_config.fallback_num_draft_tokens,
        )
    algorithm = drafter_config.algorithm
    if algorithm == "none":
        return NoDrafter()
    if algorithm == "ngram":
        if drafter_config.tree_breadth > 1:
            from .tree import make_tree_drafter  # tree.py imports this module

            return make_tree_drafter(drafter_config, runtime_options)
        if runtime_options.get("shared_ngram_cache"):
            return SharedNgramCache(
                drafter_config.ngram_min_n,
                drafter_config.ngram_max_n,
                runtime_options.get("ngram_cache_capacity", 1_000_000),
            )
        return PromptLookup(drafter_config.ngram_min_n, drafter_config.ngram_max_n)
    if algorithm == "draft_model":
        return DraftModelDrafter(draft_model, draft_to_target)
    if algorithm == "eagle3":
        return Eagle3Drafter(draft_model)
    raise ValueError(f"unknown drafter algorithm {algorithm!r}")
