"""The decode loop: admit requests, prefill them, then step all running sequences together.

One worker thread owns the model. Each step scores, for every running sequence, its last token plus the
drafter's proposals in one forward pass (sequences padded to the same length and batched); the longest
prefix of proposals equal to the target's argmax is accepted, followed by the target's own next token.
The KV cache is rolled back simply by moving the sequence's cache length, so the output is the target's
greedy decoding by construction, whatever the drafter proposes.

CPU time per request (`meta_info.cpu_s`): the CPU time of the engine thread (time.thread_time, nanosecond
clock) spent on the request: its prefill, and per decode step an equal share of the batched work (drafting,
the forward, argmax) among the sequences in that step plus the request's own bookkeeping (acceptance,
logprobs, stop checks, detokenising, the drafter's updates). It excludes the HTTP thread (parsing, JSON) and
the time a request waits; with torch running more than one intra-op thread (/server_info `num_threads`),
the other threads' share of a forward is not in it either (the reference runtime runs small models on one).

Wall time per request (`meta_info.timing_s`, what `specpilot gaps` splits a token's time by): `queue` (submitted
until admitted), `prefill`, and per decode step an equal share of the step's `draft` (the drafter's proposals)
and `target` (the batched forward and argmax) among its sequences, plus the request's own `bookkeeping`
(acceptance, logprobs, stop checks, detokenising, the drafter's updates); `engine` is submitted until done, so
`engine` minus the parts is the time the request waited inside the loop on other sequences' own work.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import tree

log = logging.getLogger("specpilot_runtime")
TIMED_PARTS = ("queue", "prefill", "draft", "target", "bookkeeping")


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    # emit(kind, payload): "text" (streamed text so far), "logprobs" (streamed with return_logprob: the output
    # token and top logprobs since the last such event), "done" (result dict), "error" (message).
    emit: Callable[[str, object], None] = lambda kind, payload: None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class Sequence:
    request: GenerationRequest
    slot: int
    tokens: list[int]
    prompt_len: int
    cache_len: int = 0
    verify_ct: int = 0
    decode_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cpu_s: float = 0.0  # engine-thread CPU time charged to this request so far
    cpu_since: float | None = None  # thread_time when this request's own (uncharged) work began
    wall_since: tuple[str, float] | None = None  # (part, perf_counter) of the request's own work under way
    finish_reason: dict | None = None
    text: str = ""
    streamed_upto: int = 0
    streamed_logprobs: int = 0
    timing: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMED_PARTS, 0.0))
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    aux: torch.Tensor | None = None  # the target's features of new positions, for an EAGLE-3 drafter

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Engine:
    def __init__(self, model, tokenizer, drafter, num_draft_tokens: int, max_running_requests: int):
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.num_draft_tokens = num_draft_tokens
        self.trees = hasattr(drafter, "propose_tree")
        self.max_running = max_running_requests
        self.free_slots = list(range(model.num_slots))  # a heap: the lowest free slot is taken first, so
        # running sequences tend to hold slots 0..n-1, which the batched forward reads without a gather
        self.waiting: queue.Queue[GenerationRequest] = queue.Queue()
        self.running: list[Sequence] = []
        # Totals over decode steps (prefill excluded): tokens produced per target forward of a sequence.
        self.decode_tokens = 0
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.finished_requests = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.seconds = dict.fromkeys(TIMED_PARTS[1:], 0.0)  # engine-thread wall time per part, all requests
        self.thread = threading.Thread(target=self._run, name="specpilot-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: GenerationRequest) -> None:
        self.waiting.put(request)

    def generate(self, input_ids: list[int], max_new_tokens: int, timeout: float | None = None, **options) -> dict:
        """Submit one request and wait for its result dict (for in-process callers; the server streams)."""
        done = threading.Event()
        box: dict = {}

        def emit(kind, payload):
            if kind in ("done", "error"):
                box[kind] = payload
                done.set()

        self.submit(GenerationRequest(input_ids, max_new_tokens, emit=emit, **options))
        if not done.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        if "error" in box:
            raise RuntimeError(box["error"])
        return box["done"]

    @property
    def avg_accept_length(self) -> float:
        return self.decode_tokens / self.verify_steps if self.verify_steps else 0.0

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                self._admit(block=not self.running)
                if self.running:
                    self._guarded(self.running, self._step)

    def _admit(self, block: bool) -> None:
        while len(self.running) < self.max_running and self.free_slots:
            try:
                request = self.waiting.get(block=block)
            except queue.Empty:
                return
            block = False
            if request.cancelled:
                continue
            seq = Sequence(request, heapq.heappop(self.free_slots), list(request.input_ids), len(request.input_ids))
            seq.timing["queue"] = time.perf_counter() - request.submitted_at
            self.running.append(seq)
            self._guarded([seq], lambda seqs: self._own_work(seqs[0], self._prefill, "prefill"))

    def _guarded(self, seqs: list[Sequence], work) -> None:
        try:
            work(seqs)
        except Exception as exc:  # a bug must fail these requests, not the server
            log.exception("engine step failed")
            for seq in list(seqs):
                if seq in self.running:
                    self._release(seq)
                    seq.request.emit("error", f"internal error: {exc}")

    def _own_work(self, seq: Sequence, work, part: str) -> None:
        """Run work(seq), charging its engine-thread CPU time to seq (to the result too, if it finishes) and its
        wall time to seq's `part`."""
        seq.cpu_since = time.thread_time()
        seq.wall_since = (part, time.perf_counter())
        work(seq)
        if seq.wall_since is not None:
            self._charge(seq, part, time.perf_counter() - seq.wall_since[1])
            seq.wall_since = None
        if seq.cpu_since is not None:
            seq.cpu_s += time.thread_time() - seq.cpu_since
            seq.cpu_since = None

    def _charge(self, seq: Sequence, part: str, seconds: float) -> None:
        seq.timing[part] += seconds
        self.seconds[part] += seconds

    # ---------------------------------------------------------------- prefill
    def _prefill(self, seq: Sequence) -> None:
        req, model = seq.request, self.model
        prompt = seq.tokens
        want_input = req.return_logprob and req.logprob_start_len >= 0
        first_row = max(req.logprob_start_len - 1, 0) if want_input else len(prompt) - 1
        rows = torch.arange(first_row, len(prompt), device=model.device)
        logits = model.forward(torch.tensor([prompt], device=model.device), [seq.slot], [0], logit_rows=rows)[0]
        seq.cache_len = len(prompt)
        self._keep_aux(seq, model.last_aux, 0, len(prompt))
        if want_input:
            self._input_logprobs(seq, logits[:-1], first_row)
        self.drafter.start(seq)
        if req.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return
        self._append(seq, [int(logits[-1].argmax())], logits[-1:])

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor, first_row: int) -> None:
        """SGLang's input logprobs: position i scores token i given tokens[:i]; position 0 has none."""
        req, prompt = seq.request, seq.tokens
        start = req.logprob_start_len
        if start == 0:
            seq.input_logprobs.append((None, prompt[0], None))
            seq.input_top_logprobs.append(None)
        first = max(start, 1)
        if first >= len(prompt):
            return
        # One batched pass over all scored rows: rows first-1-first_row .. len(prompt)-2 score tokens first..end.
        logprobs = torch.log_softmax(logits[first - 1 - first_row :], dim=-1)
        targets = torch.tensor(prompt[first:], device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, targets).squeeze(1).tolist()
        tops = _top_rows(logprobs, req.top_logprobs_num)
        for k, pos in enumerate(range(first, len(prompt))):
            seq.input_logprobs.append((chosen[k], prompt[pos], None))
            seq.input_top_logprobs.append(tops[k] if tops is not None else None)

    # ---------------------------------------------------------------- decode / verify
    def _step(self, running: list[Sequence]) -> None:
        for seq in [s for s in running if s.request.cancelled]:
            self._finish(seq, {"type": "abort", "message": "request cancelled"})
        running = sorted(self.running, key=lambda s: s.slot)
        if not running:
            return
        if self.trees:  # the drafter proposes trees: every node verified in one forward (tree.py)
            tree.step(self, running)
            return
        shared_since, drafting = time.thread_time(), time.perf_counter()
        proposals = []
        for seq in running:
            budget = min(self.num_draft_tokens, seq.request.max_new_tokens - len(seq.output_ids) - 1)
            proposals.append(self.drafter.propose(seq, budget)[:budget] if budget > 0 else [])
        self._verify(running, proposals, shared_since, drafting)

    def _verify(
        self, running: list[Sequence], proposals: list[list[int]], shared_since: float, drafting: float
    ) -> None:
        """Score each sequence's last token and its proposed chain in one forward and accept; the engine-thread CPU
        time since `shared_since` and the wall time since `drafting` (when proposing began) are shared out."""
        forwarding = time.perf_counter()
        width = 1 + max(len(p) for p in proposals)
        rows = [[seq.tokens[-1]] + p + [0] * (width - 1 - len(p)) for seq, p in zip(running, proposals)]
        model = self.model
        logits = model.forward(
            torch.tensor(rows, device=model.device), [s.slot for s in running], [s.cache_len for s in running]
        )
        targets = logits.argmax(dim=-1).tolist()
        done = time.perf_counter()
        share = (time.thread_time() - shared_since) / len(running)  # the batched work, in equal shares
        for b, (seq, proposal) in enumerate(zip(running, proposals)):
            seq.cpu_s += share
            self._charge(seq, "draft", (forwarding - drafting) / len(running))
            self._charge(seq, "target", (done - forwarding) / len(running))
            self._own_work(
                seq, lambda seq: self._accept(seq, proposal, targets[b], logits[b], model.last_aux, b), "bookkeeping"
            )

    def _keep_aux(self, seq: Sequence, aux: torch.Tensor | None, row: int, count: int) -> None:
        """The target's features (model.capture) of `count` positions now known, appended for the drafter."""
        if aux is None:
            return
        new = aux[row, :count]
        seq.aux = new if seq.aux is None else torch.cat([seq.aux, new])

    def _accept(
        self,
        seq: Sequence,
        proposal: list[int],
        targets: list[int],
        logits: torch.Tensor,
        aux: torch.Tensor | None = None,
        row: int = 0,
    ) -> None:
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == targets[accepted]:
            accepted += 1
        self._keep_aux(seq, aux, row, accepted + 1)  # the last token's and the accepted proposals' positions
        self._commit(seq, len(proposal), accepted, proposal[:accepted] + [targets[accepted]], logits[: accepted + 1])

    def _commit(self, seq: Sequence, drafted: int, accepted: int, new_tokens: list[int], logits: torch.Tensor) -> None:
        """Count a verify step of `drafted` proposed tokens, `accepted` of them kept, and append `new_tokens` (the
        accepted ones and the target's next, their logits rows in order)."""
        seq.cache_len += accepted + 1
        seq.verify_ct += 1
        seq.draft_tokens += drafted
        seq.accepted_tokens += accepted
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self._append(seq, new_tokens, logits, decoded=True)

    def _append(self, seq: Sequence, new_tokens: list[int], logits: torch.Tensor, decoded: bool = False) -> None:
        """Append tokens one by one until a stop condition (`decoded`: they come from a decode step)."""
        req = seq.request
        first_new = len(seq.tokens)
        logprobs = torch.log_softmax(logits, dim=-1) if req.return_logprob else None
        kept = 0
        reason = None
        for i, token in enumerate(new_tokens):
            seq.tokens.append(token)
            kept += 1
            if logprobs is not None:
                seq.output_logprobs.append((float(logprobs[i, token]), token, None))
                seq.output_top_logprobs.append(_top(logprobs[i], req.top_logprobs_num))
            if token in req.stop_token_ids:
                reason = {"type": "stop", "matched": token}
            elif req.stop_strings:
                reason = self._match_stop_string(seq)
            if reason is None and len(seq.output_ids) >= req.max_new_tokens:
                reason = {"type": "length", "length": req.max_new_tokens}
            if reason is not None:
                break
        if decoded:
            seq.decode_tokens += kept
            self.decode_tokens += kept
        self.drafter.observe(seq, first_new)
        if reason is not None:
            self._finish(seq, reason)
        elif req.stream:
            self._stream(seq)

    def _match_stop_string(self, seq: Sequence) -> dict | None:
        text = self._decode(seq.output_ids)
        for stop in seq.request.stop_strings:
            at = text.find(stop)
            if at >= 0:
                seq.text = text[:at]
                return {"type": "stop", "matched": stop}
        return None

    def _stream(self, seq: Sequence) -> None:
        if seq.request.return_logprob:
            sent, seq.streamed_logprobs = seq.streamed_logprobs, len(seq.output_logprobs)
            seq.request.emit("logprobs", (seq.output_logprobs[sent:], seq.output_top_logprobs[sent:]))
        text = self._decode(seq.output_ids)
        hold = max((len(s) for s in seq.request.stop_strings), default=1) - 1
        upto = len(text) - hold
        while upto > 0 and text[upto - 1] == "\ufffd":  # an incomplete UTF-8 sequence so far
            upto -= 1
        if upto > seq.streamed_upto:
            seq.streamed_upto = upto
            seq.request.emit("text", text[:upto])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- finish
    def _finish(self, seq: Sequence, reason: dict) -> None:
        seq.finish_reason = reason
        if not (reason.get("type") == "stop" and isinstance(reason.get("matched"), str)):
            seq.text = self._decode(seq.output_ids)
        self._release(seq)
        self.finished_requests += 1
        self.prompt_tokens += seq.prompt_len
        self.generated_tokens += len(seq.output_ids)
        seq.request.emit("done", self._result(seq))

    def _release(self, seq: Sequence) -> None:
        self.drafter.finish(seq)
        self.running.remove(seq)
        heapq.heappush(self.free_slots, seq.slot)

    def _result(self, seq: Sequence) -> dict:
        req = seq.request
        if seq.cpu_since is not None:  # finished during its own work: charge it up to now
            now = time.thread_time()
            seq.cpu_s += now - seq.cpu_since
            seq.cpu_since = None
        if seq.wall_since is not None:
            part, since = seq.wall_since
            self._charge(seq, part, time.perf_counter() - since)
            seq.wall_since = None
        meta = {
            "prompt_tokens": seq.prompt_len,
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "finish_reason": seq.finish_reason,
            "spec_verify_ct": seq.verify_ct,
            "spec_accept_length": seq.decode_tokens / seq.verify_ct if seq.verify_ct else 0.0,
            "spec_accept_token_num": seq.accepted_tokens,
            "spec_draft_token_num": seq.draft_tokens,
            "spec_accept_rate": seq.accepted_tokens / seq.draft_tokens if seq.draft_tokens else 0.0,
            "cpu_s": seq.cpu_s,
            "timing_s": {**seq.timing, "engine": time.perf_counter() - req.submitted_at},
        }
        if req.return_logprob:
            meta.update(
                input_token_logprobs=seq.input_logprobs,
                input_top_logprobs=seq.input_top_logprobs,
                output_token_logprobs=seq.output_logprobs,
                output_top_logprobs=seq.output_top_logprobs,
            )
        return {"text": seq.text, "output_ids": seq.output_ids, "meta_info": meta}


def _top_rows(logprobs: torch.Tensor, n: int) -> list | None:
    """Per row the n best (logprob, id, None) triples, computed in one topk."""
    if n <= 0:
        return None
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)
    return [[(v, i, None) for v, i in zip(vs, is_)] for vs, is_ in zip(values.tolist(), ids.tolist())]


def _top(logprobs: torch.Tensor, n: int) -> list | None:
    if n <= 0:
        return None
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return [(float(v), int(i), None) for v, i in zip(values.tolist(), ids.tolist())]
