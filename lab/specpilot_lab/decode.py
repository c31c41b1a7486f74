"""Greedy decoding of a batch over a static cache: an eager prefill, then one decode step per token, which
on CUDA is captured once in a CUDA graph and replayed (no per-token host work beyond the replay).

The step reads the current tokens and positions from fixed buffers and writes the next ones back into them,
so the same graph decodes token after token. It also keeps the TOP_K largest logits of each sequence and their
ids, so a run can later tell a near tie from a real difference the way verify does (`divergences`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

CACHE_ROUNDING = 64  # cache length rounded up to this many positions (aligned keys for the attention kernel)
# verify's default near-tie tolerance for bfloat16 (specpilot_build/measure/verify.py, dtype_tolerance): a
# log-prob margin, i.e. a logit gap; tests/test_qwen3_runtime.py pins the two equal
NEAR_TIE_BF16 = 2.0**-2
# logits kept per token: bf16 logits tie exactly often (several tokens can share the top value), so two are too few
# to find the other run's token
TOP_K = 8


@dataclass
class Decoded:
    tokens: torch.Tensor  # [B, N] the greedy tokens: the first from the prefill, the others from decode steps
    top: torch.Tensor  # [B, N, TOP_K] float32: the largest logits behind each token, largest first
    top_ids: torch.Tensor  # [B, N, TOP_K] their token ids
    seconds: float  # wall time of the N - 1 decode steps (prefill excluded), after warm-up
    graphed: bool

    @property
    def tokens_per_second(self) -> float:
        steps = self.tokens.shape[1] - 1
        return self.tokens.shape[0] * steps / self.seconds if steps and self.seconds > 0 else float("nan")


def greedy_decode(
    model, prompts: torch.Tensor, new_tokens: int, graph: bool | None = None, warmup_steps: int = 3
) -> Decoded:
    """Greedy-decode `new_tokens` tokens after each of the B prompts [B, P] (all of one length).

    graph: capture the decode step in a CUDA graph (default: on CUDA). Timing starts after `warmup_steps`
    steps, which are then undone (the tokens and positions reset; the cache entries they wrote are
    rewritten with the same values by the timed steps)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    batch, prompt_len = prompts.shape
    device = model.device
    graph = device.type == "cuda" if graph is None else graph
    length = -(-(prompt_len + new_tokens) // CACHE_ROUNDING) * CACHE_ROUNDING
    cache = model.new_cache(batch, length)
    logits = prefill(model, prompts.to(device), cache)
    tokens_out = torch.empty(new_tokens, batch, dtype=torch.long, device=device)
    k = min(TOP_K, logits.shape[-1])
    top_out = torch.empty(new_tokens, batch, k, dtype=torch.float32, device=device)
    ids_out = torch.empty(new_tokens, batch, k, dtype=torch.long, device=device)
    tokens_out[0] = logits.argmax(-1)
    top = logits.topk(k, dim=-1)
    top_out[0], ids_out[0] = top.values.float(), top.indices

    step = DecodeStep(model, cache, tokens_out[0], torch.full((batch,), prompt_len, device=device), graph, k)
    for _ in range(min(warmup_steps, new_tokens - 1)):
        step()
    step.reset(tokens_out[0], prompt_len)
    _synchronize(device)
    start = time.perf_counter()
    for i in range(1, new_tokens):
        step()
        tokens_out[i] = step.next_tokens
        top_out[i], ids_out[i] = step.top, step.top_ids
    _synchronize(device)
    seconds = time.perf_counter() - start
    return Decoded(tokens_out.t().cpu(), top_out.transpose(0, 1).cpu(), ids_out.transpose(0, 1).cpu(), seconds, graph)


def divergences(reference: Decoded, other: Decoded, tolerance: float = NEAR_TIE_BF16) -> list[dict]:
    """Each sequence whose tokens differ, at its first differing token, classified as verify classifies a token
    from the reference run's logits there (both runs had the same context up to it): margin = the reference's
    top-1 logit minus its logit for the other run's token; a near tie when the margin is within `tolerance`, else
    a real difference. The logit of a token below the reference's TOP_K is not kept: its margin is unknown (at
    least top-1 minus the last kept) and it counts as real."""
    found = []
    for b in range(reference.tokens.shape[0]):
        differ = (reference.tokens[b] != other.tokens[b]).nonzero()
        if len(differ):
            at = int(differ[0])
            top1, top2 = (float(v) for v in reference.top[b, at, :2])
            emitted = int(other.tokens[b, at])
            ranks = [j for j, token in enumerate(reference.top_ids[b, at].tolist()) if token == emitted]
            margin = top1 - float(reference.top[b, at, ranks[0]]) if ranks else None
            found.append(
                dict(
                    sequence=b,
                    token=at,
                    emitted=emitted,
                    top1=top1,
                    top2=top2,
                    margin=margin,
                    gap_ulps=(top1 - top2) / bf16_ulp(top1),
                    near_tie=margin is not None and margin <= tolerance,
                    other_top2=[float(v) for v in other.top[b, at, :2]],
                )
            )
    return found


def bf16_ulp(value: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at |value|, a normal number."""
    return 2.0 ** (math.frexp(abs(value))[1] - 8)


def prefill(model, prompts: torch.Tensor, cache) -> torch.Tensor:
    """Score the prompts [B, P] from position 0 into `cache`; the logits [B, V] of each prompt's last token."""
    positions = torch.arange(prompts.shape[1], device=prompts.device).expand(prompts.shape)
    return model(prompts, positions, cache, last_only=True)[:, -1]


class DecodeStep:
    """One greedy token for every sequence: the forward at `positions`, argmax, then the next token and
    position written back into `tokens` and `positions`. Captured in a CUDA graph when `graph`."""

    def __init__(self, model, cache, tokens: torch.Tensor, positions: torch.Tensor, graph: bool, k: int = TOP_K):
        self.model, self.cache = model, cache
        self.tokens = tokens.clone()
        self.positions = positions.clone()
        self.next_tokens = torch.empty_like(self.tokens)
        self.k = k
        self.top = torch.empty(len(tokens), self.k, dtype=torch.float32, device=tokens.device)
        self.top_ids = torch.empty(len(tokens), self.k, dtype=torch.long, device=tokens.device)
        self.graph = self._capture() if graph else None

    def __call__(self) -> None:
        if self.graph is None:
            self._step()
        else:
            self.graph.replay()

    def reset(self, tokens: torch.Tensor, position: int) -> None:
        self.tokens.copy_(tokens)
        self.positions.fill_(position)

    def _step(self) -> None:
        logits = self.model(self.tokens[:, None], self.positions[:, None], self.cache)[:, 0]
        self.next_tokens.copy_(logits.argmax(-1))
        top = logits.topk(self.k, dim=-1)
        self.top.copy_(top.values)
        self.top_ids.copy_(top.indices)
        self.tokens.copy_(self.next_tokens)
        self.positions.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # One eager step first (on a side stream, as capture wants): compiles kernels, sizes workspaces.
        tokens, positions = self.tokens.clone(), self.positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        return graph


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
