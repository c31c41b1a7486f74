"""Fuzz the reference runtime's HTTP server with hostile clients: schemathesis over its OpenAPI schema, and
hypothesis strategies for the raw JSON classes that once answered 500 (lone surrogates, deep nesting,
integers past 4,300 digits, NaN/Infinity, wrong nested types, `stream_options` that is no object, garbage).

    python benchmarks/server_fuzz.py [--seconds 300] [--url http://127.0.0.1:30000] [--seed 0]

Without --url it serves stories260K itself (the `final` arm, 16 running requests, on a free loopback port).
While the fuzzer runs, a storm of valid greedy requests (their outputs known from before, sent alone) and a
/health prober run beside it. It fails (exit 1) on any 5xx, any error answer that is not JSON, any storm output
that differs from its solo output, or a /health that did not answer; it prints the request counts and the
status-code histogram. tests/test_server_fuzz.py runs the same machinery, seeded and bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO.parent / "shared" / "models" / "stories260K"
POST_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
CHAT_MAX_TOKENS = 16  # what a generated chat case without a limit gets (its default fills the context)

# Valid greedy requests: sent alone first, then again and again during the storm; each must answer the same.
STORM_PROMPTS = [
    "Once upon a time",
    "Tim had a red ball",
    "The cat was hungry",
    "Lily and Tom went to the park",
    "A little bird sat on a tree",
    "Ben found a box",
    "The rain fell all day",
    "Max saw a frog",
]


def storm_requests(n: int = 16) -> list[tuple[str, dict]]:
    """n valid greedy requests over the three endpoints (text and token-id prompts, 24..54 new tokens)."""
    out = []
    for i in range(n):
        prompt, new = STORM_PROMPTS[i % len(STORM_PROMPTS)], 24 + 2 * i
        kind = i % 4
        if kind == 0:
            out.append(("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": new, "temperature": 0}}))
        elif kind == 1:
            out.append(
                (
                    "/generate",
                    {"input_ids": [1, 403, 407, 261, 378][: 2 + i % 4], "sampling_params": {"max_new_tokens": new}},
                )
            )
        elif kind == 2:
            out.append(("/v1/completions", {"prompt": prompt, "max_tokens": new, "temperature": 0}))
        else:
            out.append(
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": prompt}], "max_tokens": new, "temperature": 0},
                )
            )
    return out


def answer_of(path: str, body: dict) -> object:
    """What must not change between solo and storm: the generated tokens (native) or text (OpenAI)."""
    if path == "/generate":
        return body["output_ids"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# --- a server of our own ----------------------------------------------------------------------------------


def engine_config(max_running: int = 16, arm: str = "final") -> dict:
    """The resolved config keys the reference runtime reads: stories260K, the n-gram `final` arm (its n-gram
    cache shared across requests) or the `ar` arm (no drafter)."""
    final = arm == "final"
    return {
        "setting": "cpu_c16_stories260k_ngram",
        "arm": {"name": arm},
        "model": {"name": "stories260K", "dtype": "float32", "quantization": None},
        "hardware": {"device": "cpu"},
        "drafter": {
            "algorithm": "ngram" if final else "none",
            "num_draft_tokens": 8,
            "ngram_max_n": 8,
            "ngram_min_n": 1,
        },
        "runtime_options": {"shared_ngram_cache": True} if final else {},
        "batching": {"concurrency": max_running, "max_running_requests": max_running},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A reference-runtime server process on a free loopback port, started as `make serve` starts it."""

    def __init__(
        self,
        workdir: Path,
        extra: list[str] = (),
        model_dir: Path = MODEL_DIR,
        max_running: int = 16,
        arm: str = "final",
    ):
        engine = workdir / "engine"
        engine.mkdir(parents=True, exist_ok=True)
        (engine / "config.json").write_text(json.dumps(engine_config(max_running, arm), indent=1))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "server.log"
        env = dict(os.environ, PYTHONPATH=str(REPO / "runtimes" / "reference"))
        argv = [
            sys.executable,
            "-m",
            "specpilot_runtime.server",
            "--engine",
            str(engine),
            "--engine-id",
            "fuzz",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- raw JSON strategies --------------------------------------------------------------------------------


class Raw(str):
    """A JSON fragment written as is (what json.dumps cannot write: 5,000-digit integers, NaN, depth 3,000)."""


def to_json(value) -> str:
    """json.dumps that writes Raw fragments verbatim; strings ASCII-escaped, so lone surrogates go out as \\udXXX."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


def raw_strategies():
    """A hypothesis strategy of (path, body bytes): valid bodies with one hostile value put somewhere, hostile
    whole bodies, and garbage."""
    from hypothesis import strategies as st

    surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    hostile_text = st.lists(st.one_of(st.characters(codec="utf-8"), surrogate), min_size=1, max_size=12).map("".join)
    json_leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        hostile_text,
    )
    json_value = st.recursive(
        json_leaf,
        lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
        max_leaves=12,
    )
    depth = st.integers(1, 3000)
    hostile = st.one_of(
        hostile_text,
        depth.map(lambda d: Raw("[" * d + "]" * d)),
        depth.map(lambda d: Raw('{"a":' * d + "1" + "}" * d)),
        st.tuples(st.integers(4290, 6000), st.booleans()).map(lambda t: Raw(("-" if t[1] else "") + "9" * t[0])),
        st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999")]),
        json_value,
    )
    bases = st.sampled_from(
        [
            ("/generate", {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
            ("/generate", {"input_ids": [1, 403, 407], "sampling_params": {"max_new_tokens": 4, "stop": ["."]}}),
            (
                "/generate",
                {
                    "text": "Tim",
                    "return_logprob": True,
                    "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": 3},
                },
            ),
            (
                "/v1/completions",
                {
                    "model": "stories260K",
                    "prompt": "Once upon",
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ),
            ("/v1/completions", {"prompt": [1, 403, 407], "max_tokens": 4}),
            (
                "/v1/chat/completions",
                {
                    "model": "stories260K",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": False},
                },
            ),
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                    "max_completion_tokens": 4,
                },
            ),
        ]
    )

    @st.composite
    def mutated(draw):
        path, body = draw(bases)
        body = json.loads(json.dumps(body))
        # every place a value sits: (container, key)
        places = []

        def walk(node):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, item in list(items):
                places.append((node, key))
                if isinstance(item, (dict, list)):
                    walk(item)

        walk(body)
        for _ in range(draw(st.integers(1, 2))):
            container, key = draw(st.sampled_from(places))
            container[key] = draw(hostile)
        if draw(st.booleans()):  # an extra field: unknown name (maybe with a surrogate), or a known one
            name = draw(
                st.one_of(
                    hostile_text,
                    st.sampled_from(["stream_options", "model", "max_tokens", "max_new_tokens", "logprobs", "rid"]),
                )
            )
            body[name] = draw(hostile)
        return path, to_json(body).encode()

    whole = st.tuples(st.sampled_from(POST_PATHS), st.one_of(hostile, json_value).map(lambda v: to_json(v).encode()))
    garbage = st.tuples(st.sampled_from(POST_PATHS), st.binary(max_size=64))
    return st.one_of(mutated(), mutated(), mutated(), whole, garbage)


# --- the run ------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    by_source: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, source: str, method: str, path: str, status: int, body: bytes, sent: bytes | None) -> None:
        problem = None
        if status >= 500:
            problem = f"{status} answer"
        elif 400 <= status < 500 and method == "POST" and path in POST_PATHS:
            try:
                payload = json.loads(body)
                message = payload["error"]["message"]
                assert isinstance(message, str) and message
            except Exception:  # noqa: BLE001 - any shape problem is the finding
                problem = "an error answer without a JSON error body"
        with self.lock:
            self.statuses[status] += 1
            self.by_source[source] += 1
            if problem:
                self.failures.append(
                    f"{source} {method} {path}: {problem}: sent {(sent or b'')[:300]!r}, got {body[:300]!r}"
                )

    @property
    def total(self) -> int:
        return sum(self.statuses.values())


def fuzz_raw(url: str, tally: Tally, examples: int, seed: int | None, client: httpx.Client) -> None:
    """Hypothesis over raw_strategies(): `examples` bodies, derandomized (seed None) or from `seed`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    @settings(
        max_examples=examples,
        derandomize=seed is None,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(raw_strategies())
    def one(case):
        path, content = case
        r = client.post(url + path, content=content, headers={"content-type": "application/json"})
        tally.record("raw", "POST", path, r.status_code, r.content, content)

    (fixed_seed(seed)(one) if seed is not None else one)()


def fuzz_schema(url: str, tally: Tally, examples: int, seed: int | None, client: httpx.Client) -> None:
    """Schemathesis over the server's own /openapi.json: positive and negative cases of every operation."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    strategy = st.one_of(
        schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
        schema.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=examples,
        derandomize=seed is None,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(case):
        body = case.body
        if (
            case.operation.path == "/v1/chat/completions"
            and isinstance(body, dict)
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            body["max_tokens"] = CHAT_MAX_TOKENS  # chat's default is the whole context: seconds per case
        kwargs = case.as_transport_kwargs(base_url=url)
        sent = (
            kwargs.get("data")
            if isinstance(kwargs.get("data"), bytes)
            else json.dumps(kwargs.get("json"), default=str).encode()
            if "json" in kwargs
            else None
        )
        r = client.request(
            kwargs["method"],
            kwargs["url"],
            params=kwargs.get("params"),
            headers={k: str(v) for k, v in (kwargs.get("headers") or {}).items()},
            content=kwargs.get("data") if "data" in kwargs else None,
            json=kwargs.get("json") if "json" in kwargs and "data" not in kwargs else None,
        )
        tally.record("schemathesis", kwargs["method"].upper(), case.operation.path, r.status_code, r.content, sent)

    (fixed_seed(seed)(one) if seed is not None else one)()


class Storm:
    """Valid greedy requests (each compared with its solo answer) from `workers` threads, and a /health prober,
    until stop()."""

    def __init__(
        self,
        url: str,
        requests: list[tuple[str, dict]],
        workers: int,
        probe_every: float = 0.05,
        health_timeout: float = 5.0,
    ):
        self.url, self.requests = url, requests
        with httpx.Client(timeout=120) as client:  # the solo answers: one request at a time, nothing else
            self.solo = [answer_of(p, client.post(url + p, json=b).raise_for_status().json()) for p, b in requests]
        self.done = threading.Event()
        self.sent = 0
        self.mismatches: list[str] = []
        self.health: list[float] = []
        self.health_failures: list[str] = []
        self.probe_every, self.health_timeout = probe_every, health_timeout
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(workers)]
        self.threads.append(threading.Thread(target=self._prober, daemon=True))

    def start(self) -> Storm:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=180)

    def _worker(self, i: int) -> None:
        with httpx.Client(timeout=180) as client:
            k = i
            while not self.done.is_set():
                path, body = self.requests[k % len(self.requests)]
                try:
                    got = answer_of(path, client.post(self.url + path, json=body).raise_for_status().json())
                except Exception as exc:  # noqa: BLE001
                    got = f"request failed: {exc!r}"
                if got != self.solo[k % len(self.requests)]:
                    self.mismatches.append(
                        f"{path} {json.dumps(body)[:120]}: storm {got!r:.200} "
                        f"!= solo {self.solo[k % len(self.requests)]!r:.200}"
                    )
                self.sent += 1
                k += 1

    def _prober(self) -> None:
        with httpx.Client(timeout=self.health_timeout) as client:
            while not self.done.is_set():
                start = time.perf_counter()
                try:
                    status = client.get(self.url + "/health").status_code
                    if status != 200:
                        self.health_failures.append(f"/health answered {status}")
                except httpx.HTTPError as exc:
                    self.health_failures.append(f"/health: {exc!r}")
                self.health.append(time.perf_counter() - start)
                self.done.wait(self.probe_every)

    def health_percentile(self, q: float) -> float:
        ordered = sorted(self.health)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(
    url: str,
    *,
    raw_examples: int,
    schema_examples: int,
    seed: int | None,
    storm_workers: int,
    seconds: float | None = None,
) -> tuple[Tally, Storm]:
    """One fuzz run against `url` with the storm beside it. With `seconds`, batches of fresh seeds repeat until
    the time is up (seed, seed+1, ...); else one seeded (or derandomized) batch of each."""
    tally = Tally()
    storm = Storm(url, storm_requests(), storm_workers).start()
    try:
        with httpx.Client(timeout=180) as client:
            deadline = None if seconds is None else time.monotonic() + seconds
            batch = 0
            while True:
                batch_seed = seed if deadline is None else (seed or 0) + batch
                fuzz_raw(url, tally, raw_examples, batch_seed, client)
                fuzz_schema(url, tally, schema_examples, batch_seed, client)
                batch += 1
                if deadline is None or time.monotonic() >= deadline:
                    break
    finally:
        storm.stop()
    return tally, storm


def report(tally: Tally, storm: Storm) -> str:
    hist = ", ".join(f"{code}: {n}" for code, n in sorted(tally.statuses.items()))
    return (
        f"fuzz requests: {tally.total} ({', '.join(f'{k} {v}' for k, v in sorted(tally.by_source.items()))}); "
        f"status codes: {hist}\n"
        f"storm: {storm.sent} valid requests, {len(storm.mismatches)} differing from solo; /health: "
        f"{len(storm.health)} probes, p50 {storm.health_percentile(0.5) * 1000:.1f} ms, "
        f"p99 {storm.health_percentile(0.99) * 1000:.1f} ms, max {max(storm.health, default=0) * 1000:.1f} ms, "
        f"{len(storm.health_failures)} failed\n"
        f"findings: {len(tally.failures)}" + "".join(f"\n  {f}" for f in tally.failures[:20])
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to fuzz (default: %(default)s)")
    parser.add_argument("--url", help="fuzz this server instead of starting one (stories260K expected)")
    parser.add_argument("--seed", type=int, default=0, help="first hypothesis seed (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=200, help="examples per strategy per batch")
    parser.add_argument("--workers", type=int, default=4, help="threads of valid storm requests")
    args = parser.parse_args(argv)
    server = None
    with tempfile.TemporaryDirectory(prefix="server_fuzz_") as tmp:
        try:
            if args.url is None:
                server = Server(Path(tmp)).wait_healthy()
            url = args.url or server.url
            started = time.monotonic()
            tally, storm = run(
                url,
                raw_examples=args.batch,
                schema_examples=args.batch,
                seed=args.seed,
                storm_workers=args.workers,
                seconds=args.seconds,
            )
            print(report(tally, storm))
            print(f"wall: {time.monotonic() - started:.0f} s")
            ok = not tally.failures and not storm.mismatches and not storm.health_failures
            if server is not None and server.proc.poll() is not None:
                print(f"the server died:\n{server.log.read_text()[-3000:]}")
                ok = False
            return 0 if ok else 1
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    sys.exit(main())
