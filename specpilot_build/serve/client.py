"""The HTTP client of bench and verify: a server's identity, and many /generate requests kept in flight.

`post_all` runs `concurrency` workers; each takes the next request body, posts it, and records when it was
sent and answered. A worker's *gap* is the time between getting one answer and sending its next request: the
client-side time a slot sits empty while the client works (parsing, recording, progress). The sum of gaps over
all slots, divided by slots x wall time, is the client overhead that bench reports.

At one request in flight a `probe` (a callable, e.g. a read of the server's /metrics) can run before the first
request and after each answer; its results come back in `Pass.probes` (one more than the answers) and its time
is kept out of the wall time and the gaps, so a probed pass times the server as an unprobed one does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from specpilot_build.errors import SpecPilotError


@dataclass
class Answer:
    body: dict  # the server's JSON answer
    sent: float  # perf_counter when the request was handed to httpx
    answered: float  # perf_counter when the whole answer had been received

    @property
    def latency(self) -> float:
        return self.answered - self.sent


@dataclass
class Pass:
    answers: list[Answer]
    wall_s: float
    client_gap_s: float  # summed over slots
    client_cpu_s: float  # this process's CPU time during the pass
    concurrency: int
    probes: list | None = None  # probe() before the first request, then after each answer

    @property
    def overhead_fraction(self) -> float:
        return self.client_gap_s / (self.concurrency * self.wall_s) if self.wall_s > 0 else 0.0


def server_info(url: str, timeout: float = 10.0) -> dict:
    try:
        response = httpx.get(f"{url}/server_info", timeout=timeout)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SpecPilotError(f"no server answering {url}/server_info ({exc}); start one with `make serve`") from None


def served_engine_id(info: dict) -> str | None:
    """The engine id a server reports: reference runtime `engine_id`; an SGLang engine served from the
    store reports it through its launch spec (`engine_id` or `specpilot_engine_id`)."""
    for key in ("engine_id", "specpilot_engine_id"):
        if isinstance(info.get(key), str):
            return info[key]
    return None


def post_all(
    url: str, bodies: list[dict], concurrency: int, on_answer=None, timeout: float = 3600.0, probe=None
) -> Pass:
    """POST every body to url/generate with `concurrency` in flight; answers keep the order of bodies."""
    if probe is not None and concurrency != 1:
        raise SpecPilotError(f"a probe between requests needs one request in flight, not {concurrency}")
    return asyncio.run(_post_all(url, bodies, concurrency, on_answer, timeout, probe))


async def _post_all(url, bodies, concurrency, on_answer, timeout, probe=None) -> Pass:
    concurrency = max(1, min(concurrency, len(bodies) or 1))
    answers: list[Answer | None] = [None] * len(bodies)
    gaps = [0.0] * concurrency
    next_index = 0
    probes: list = []
    probed_s = 0.0

    def run_probe() -> float:
        """Runs the probe; returns when it finished, so the time it took counts nowhere."""
        nonlocal probed_s
        started = time.perf_counter()
        probes.append(probe())
        finished = time.perf_counter()
        probed_s += finished - started
        return finished

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def worker(slot: int, start: float) -> None:
            nonlocal next_index
            free_since = start
            while next_index < len(bodies):
                index = next_index
                next_index += 1
                sent = time.perf_counter()
                gaps[slot] += sent - free_since
                response = await client.post("/generate", json=bodies[index])
                received = time.perf_counter()
                if response.status_code != 200:
                    raise SpecPilotError(f"{url}/generate answered {response.status_code}: {response.text[:300]}")
                answers[index] = Answer(response.json(), sent, received)
                if on_answer is not None:
                    on_answer(index, answers[index])
                free_since = time.perf_counter()
                if probe is not None:
                    free_since = run_probe()

        if probe is not None:
            probes.append(probe())  # before the clock starts
        cpu0, start = time.process_time(), time.perf_counter()
        try:
            await asyncio.gather(*(worker(slot, start) for slot in range(concurrency)))
        except httpx.HTTPError as exc:
            raise SpecPilotError(f"request to {url}/generate failed: {exc!r}") from None
        wall = time.perf_counter() - start - probed_s
        cpu = time.process_time() - cpu0
    received = [a for a in answers if a is not None]
    if len(received) != len(answers):  # every worker ends only when the queue is empty: a gap is a bug, not data
        raise SpecPilotError(f"{url}/generate: {len(answers) - len(received)} of {len(answers)} requests got no answer")
    return Pass(received, wall, sum(gaps), cpu, concurrency, probes if probe is not None else None)


class progress_bar:
    """A rich progress bar over all requests (or nothing when disabled); yields the per-answer callback."""

    def __init__(self, enabled: bool, total: int, label: str = "bench", tokens_of=None):
        self.enabled, self.total, self.label = enabled, total, label
        self.tokens_of = tokens_of or (lambda index, answer: len(answer.body.get("output_ids") or []))

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn(self.label),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[tokens]} tokens"),
            refresh_per_second=4,
        )
        self.bar.start()
        self.task = self.bar.add_task(self.label, total=self.total, tokens=0)
        self.tokens = 0

        def advance(index, answer):
            self.tokens += self.tokens_of(index, answer)
            self.bar.update(self.task, advance=1, tokens=self.tokens)

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()
        return False
