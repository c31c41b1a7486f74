"""gaps for SGLang engines: the counters read from the pinned wheels' own source, a c1 pass that reads /metrics
around each request of a real HTTP server on loopback (its counters made by prometheus_client under the wheel's
names), the cost model on such a run, and refusals of bad pages, restarted servers and runs without the counters."""

from __future__ import annotations

import ast
import json
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from reference_runtime_helpers import free_port

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import gaps, sglang_metrics
from specpilot_build.measure.bench import attach_metrics, metrics_probes, request_record
from specpilot_build.measure.results import SCHEMA
from specpilot_build.serve import client

RUNTIMES = ("sglang-0.5.17", "sglang")  # lockfiles/runtimes.toml keys of every pinned SGLang
COLLECTOR = "sglang/srt/observability/metrics_collector.py"
FORWARD_MODES = "sglang/srt/model_executor/forward_batch_info.py"


def wheel_of(repo, key: str) -> zipfile.ZipFile:
    from specpilot_build.pins.lockfile import load_lock
    from specpilot_build.pins.wheels import wheel_file

    return zipfile.ZipFile(wheel_file(load_lock(repo / "lockfiles").runtimes[key]))


def declared_metrics(source: str) -> dict[str, tuple[str, list[str]]]:
    """sglang:... metric name -> (Counter/Histogram/Gauge, its label names beyond the collector's own labels)."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        name = keywords.get("name")
        if isinstance(name, ast.Constant) and str(name.value).startswith("sglang:"):
            labels = keywords.get("labelnames")
            extra = [c.value for c in ast.walk(labels) if isinstance(c, ast.Constant)] if labels is not None else []
            found[name.value] = (node.func.id, extra)
    return found


def timer_categories(wheel: zipfile.ZipFile) -> set[str]:
    """Every category the device timer can label a forward with, read from each device_timer_ctx(...) call: a
    string, a variable assigned strings in that function, or `...forward_mode.name.lower()` (any ForwardMode)."""
    modes_tree = ast.parse(wheel.read(FORWARD_MODES).decode())
    forward_mode = next(n for n in ast.walk(modes_tree) if isinstance(n, ast.ClassDef) and n.name == "ForwardMode")
    modes = {t.id.lower() for s in forward_mode.body if isinstance(s, ast.Assign) for t in s.targets}
    categories: set[str] = set()
    for name in wheel.namelist():
        if not name.startswith("sglang/srt/") or not name.endswith(".py"):
            continue
        source = wheel.read(name).decode()
        if "device_timer_ctx(" not in source or name.endswith("utils/device_timer.py"):
            continue
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "device_timer_ctx"):
                    continue
                arg = call.args[1]
                if isinstance(arg, ast.Constant):
                    categories.add(arg.value)
                elif isinstance(arg, ast.Name):
                    values = [
                        c.value
                        for a in ast.walk(function)
                        if isinstance(a, ast.Assign) and any(getattr(t, "id", None) == arg.id for t in a.targets)
                        for c in ast.walk(a.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    ]
                    assert values, f"{name}: category variable {arg.id} assigned no string"
                    categories.update(values)
                elif "forward_mode.name.lower()" in ast.unparse(arg):
                    categories.update(modes)
                else:
                    raise AssertionError(f"{name}: a device timer category this test cannot read: {ast.unparse(arg)}")
    return categories


@pytest.mark.parametrize("key", RUNTIMES)
def test_the_counters_and_categories_read_are_the_pinned_wheels_own(repo, key):
    with wheel_of(repo, key) as wheel:
        declared = declared_metrics(wheel.read(COLLECTOR).decode())
        environ = wheel.read("sglang/srt/environ.py").decode()
        categories = timer_categories(wheel)
    assert declared[sglang_metrics.FORWARD] == ("Counter", ["category"])
    assert declared[sglang_metrics.QUEUE.removesuffix("_sum")][0] == "Histogram"
    assert declared[sglang_metrics.E2E.removesuffix("_sum")][0] == "Histogram"
    assert declared[sglang_metrics.GENERATED][0] == declared[sglang_metrics.REQUESTS][0] == "Counter"
    assert "SGLANG_ENABLE_METRICS_DEVICE_TIMER = EnvBool(" in environ
    # every category maps to a part, and no mapped category is one the wheel cannot emit
    assert categories == set(sglang_metrics.CATEGORY_PARTS)


def test_every_sglang_launch_spec_turns_the_counters_on():
    from specpilot_build.assemble.launch import launch_spec
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config

    for setting, arm in (("h100_c1_smollm2-135m_eagle3", "final"), ("h200_c1_stories260k-padded_ngram", "ar")):
        spec = launch_spec(effective_config(compose_setting(setting, arm, []).config))
        assert "--enable-metrics" in spec["argv"]
        assert spec["env"]["SGLANG_ENABLE_METRICS_DEVICE_TIMER"] == "1"
    reference = launch_spec(effective_config(compose_setting("cpu_c1_stories260k_ngram", "final", []).config))
    assert "SGLANG_ENABLE_METRICS_DEVICE_TIMER" not in reference["env"]


# --- a server that counts as SGLang does ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel_metrics(repo):
    """The five metrics' declarations as the pinned 0.5.17 wheel makes them (name, kind, extra labels)."""
    with wheel_of(repo, "sglang-0.5.17") as wheel:
        declared = declared_metrics(wheel.read(COLLECTOR).decode())
    names = [sglang_metrics.FORWARD, sglang_metrics.QUEUE, sglang_metrics.E2E]
    names = [n.removesuffix("_sum") for n in names] + [sglang_metrics.GENERATED, sglang_metrics.REQUESTS]
    return {name: declared[name] for name in names}


class CountingServer:
    """/generate sleeps through a queue wait, a prefill and per two tokens a draft and a verify forward, counting
    each in the wheel's metrics (prometheus_client's own registry and types) and in `truth`; like SGLang it counts
    the finished request just after answering. /metrics serves the registry."""

    def __init__(self, declared: dict, leave_out: str | None = None, category: str = "target_verify"):
        self.declared, self.leave_out, self.category = declared, leave_out, category
        self.truth: list[dict] = []
        self.restart()
        self.port = free_port()
        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def restart(self):
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        self.metrics = {}
        for name, (kind, extra) in self.declared.items():
            if name.startswith(self.leave_out or "\0"):
                continue
            make = {"Counter": prom.Counter, "Histogram": prom.Histogram}[kind]
            self.metrics[name] = make(name, name, ["model_name", *extra], registry=self.registry)

    def metric(self, name: str, **labels):
        found = self.metrics.get(name.removesuffix("_sum"))
        return found.labels(model_name="m", **labels) if found is not None else None

    def count(self, name: str, seconds: float, **labels):
        metric = self.metric(name, **labels)
        if metric is not None:
            (metric.observe if hasattr(metric, "observe") else metric.inc)(seconds)

    def timed(self, part: str, seconds: float, name: str, spent: dict, **labels):
        start = time.perf_counter()
        time.sleep(seconds)
        took = time.perf_counter() - start
        spent[part] = spent.get(part, 0.0) + took
        self.count(name, took, **labels)

    def generate(self, body: dict) -> tuple[dict, dict]:
        tokens = int(body["sampling_params"]["max_new_tokens"])
        start, spent = time.perf_counter(), {}
        self.timed("queue", 0.002, sglang_metrics.QUEUE, spent)
        self.timed("prefill", 0.003, sglang_metrics.FORWARD, spent, category="extend")
        for _ in range(0, tokens, 2):
            self.timed("draft", 0.001, sglang_metrics.FORWARD, spent, category="eagle_draft")
            self.timed("target", 0.002, sglang_metrics.FORWARD, spent, category=self.category)
            time.sleep(0.0005)  # the scheduler's own work, timed by nothing
        spent["engine"] = time.perf_counter() - start
        passes = (tokens + 1) // 2
        meta = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": tokens, "spec_verify_ct": passes}
        return {"text": "", "output_ids": list(range(tokens)), "meta_info": meta}, spent

    def finished(self, tokens: int, spent: dict):
        self.count(sglang_metrics.E2E, spent["engine"], is_streaming="false")
        self.count(sglang_metrics.GENERATED, tokens, is_streaming="false")
        self.count(sglang_metrics.REQUESTS, 1, is_streaming="false")
        self.truth.append({**spent, "tokens": tokens})

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, payload: bytes, kind: str):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()

            def do_GET(self):
                import prometheus_client as prom

                if self.path != "/metrics":
                    return self.reply(404, b"{}", "application/json")
                self.reply(200, prom.generate_latest(server.registry), prom.CONTENT_TYPE_LATEST)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer, spent = server.generate(body)
                self.reply(200, json.dumps(answer).encode(), "application/json")
                server.finished(answer["meta_info"]["completion_tokens"], spent)

        return Handler

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def counting(wheel_metrics):
    servers: list[CountingServer] = []

    def start(**kwargs) -> CountingServer:
        servers.append(CountingServer(wheel_metrics, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


SGLANG_CONFIG = {"runtime": {"name": "sglang-0.5.17"}}


def bodies(*tokens: int) -> list[dict]:
    return [{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n, "temperature": 0.0}} for n in tokens]


def probed_requests(server: CountingServer, *tokens: int) -> tuple[list[dict], client.Pass]:
    """A c1 pass as bench makes it against an SGLang engine (after a warm-up, as bench's: SGLang's labelled
    counters appear once counted), with each request's counter differences."""
    client.post_all(server.url, bodies(2), 1)
    server.truth.clear()
    probes = metrics_probes(server.url, SGLANG_CONFIG, 1)
    assert probes is not None
    done = client.post_all(server.url, bodies(*tokens), 1, probe=probes())
    entries = [{"dataset": "gsm8k", "item_id": str(i), "prompt_ids": [1, 2, 3]} for i in range(len(tokens))]
    requests = [request_record(entry, answer) for entry, answer in zip(entries, done.answers)]
    attach_metrics(requests, done.probes, server.url)
    return requests, done


def test_each_requests_counter_differences_are_what_the_server_spent_on_it(counting):
    server = counting()
    requests, done = probed_requests(server, 16, 40, 8)
    assert len(done.probes) == 4  # before the first request and after each answer
    for request, truth in zip(requests, server.truth):
        sglang_metrics.check_one_request(request["sglang_metrics"], truth["tokens"], "test")
        timing = sglang_metrics.timing(request["sglang_metrics"], "test")
        for part in ("target", "draft", "prefill", "queue", "engine"):
            assert timing[part] == pytest.approx(truth[part], rel=1e-6), part


def test_a_probe_is_kept_out_of_the_wall_time(counting):
    server = counting()

    def slow_probe():
        time.sleep(0.3)
        return sglang_metrics.scrape(server.url)

    client.post_all(server.url, bodies(2), 1)  # a warm-up, as bench's
    done = client.post_all(server.url, bodies(2, 2, 2), 1, probe=slow_probe)
    assert len(done.probes) == 4
    assert done.wall_s < 0.6  # three probes of 0.3 s ran inside the pass, none counted
    assert done.client_gap_s < 0.3
    with pytest.raises(SpecPilotError, match="one request in flight, not 4"):
        client.post_all(server.url, bodies(2), 4, probe=slow_probe)


def test_gaps_of_an_sglang_run_sum_to_the_time_per_token(counting, tmp_path):
    server = counting()
    requests, _ = probed_requests(server, 24, 48, 32, 16)
    engine = SimpleNamespace(
        id="e" * 64,
        config={
            "hardware": {"name": "h100"},
            "model": {"name": "m", "params_b": 0.135, "dtype": "bfloat16"},
            "drafter": {"num_draft_tokens": 4},
        },
    )
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"schema": SCHEMA, "engine_id": engine.id, "concurrency": 1, "requests": requests}))
    report = gaps.gaps_report(engine, run, bandwidth=gaps.Bandwidth(3.35e12, "test"))
    overall = report["datasets"]["overall"]
    tokens = sum(t["tokens"] for t in server.truth)
    assert overall["tokens"] == tokens == 120
    assert sum(overall["per_token_s"].values()) == pytest.approx(overall["measured_per_token_s"], rel=0.05)
    assert overall["per_token_s"]["target"] == pytest.approx(sum(t["target"] for t in server.truth) / tokens)
    assert overall["per_token_s"]["draft"] == pytest.approx(sum(t["draft"] for t in server.truth) / tokens)
    assert overall["accept_length"] == pytest.approx(2.0)
    # 135M bf16 weights read at 3.35 TB/s take 81 us a forward: the ~2 ms verify sleeps are the largest gap
    assert overall["gaps"][0]["gap"] == "target forward above its bandwidth ceiling"
    json_path, png_path = gaps.write_report(report, tmp_path / "gaps_run")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(json_path.read_text())["schema"]


def test_a_run_without_timing_or_counters_is_refused_saying_what_to_do(tmp_path):
    engine = SimpleNamespace(id="e" * 64, config={"hardware": {"name": "h100"}})
    request = {"dataset": "gsm8k", "item_id": "7", "completion_tokens": 3, "latency_s": 0.1, "timing_s": None}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"schema": SCHEMA, "engine_id": engine.id, "concurrency": 1, "requests": [request]}))
    with pytest.raises(SpecPilotError, match=r"gsm8k/7 carry no server timing.*--enable-metrics \(rebuild it"):
        gaps.gaps_report(engine, run, bandwidth=gaps.Bandwidth(1e12, "test"))


def test_a_metrics_page_missing_a_counter_is_refused_naming_it(counting, capsys):
    server = counting(leave_out=sglang_metrics.E2E.removesuffix("_sum"))
    client.post_all(server.url, bodies(2), 1)  # the labelled metrics appear once counted
    with pytest.raises(SpecPilotError, match=r"/metrics has no sglang:e2e_request_latency_seconds_sum; .*--enable-"):
        sglang_metrics.scrape(server.url)
    # bench goes on without per-part timing, and says gaps will refuse the run
    assert metrics_probes(server.url, SGLANG_CONFIG, 1) is None
    assert "`make gaps` will refuse this run" in capsys.readouterr().err
    assert metrics_probes(server.url, {"runtime": {"name": "reference"}}, 1) is None
    assert metrics_probes(server.url, SGLANG_CONFIG, 16) is None


def test_counters_that_go_backwards_are_a_restarted_server(counting):
    server = counting()
    client.post_all(server.url, bodies(4, 4), 1)
    before = sglang_metrics.scrape(server.url)
    server.restart()
    client.post_all(server.url, bodies(2), 1)
    with pytest.raises(SpecPilotError, match=r"^here: counter sglang:\S+ went backwards .*restarted"):
        sglang_metrics.difference(before, sglang_metrics.scrape(server.url), "here")


def test_an_unknown_forward_category_and_a_shared_server_are_refused(counting):
    server = counting(category="warp_verify")
    requests, _ = probed_requests(server, 4)
    with pytest.raises(SpecPilotError, match="forward category 'warp_verify' .* not one gaps knows"):
        sglang_metrics.timing(requests[0]["sglang_metrics"], "test")
    shared = counting()
    client.post_all(shared.url, bodies(2), 1)
    before = sglang_metrics.scrape(shared.url)
    client.post_all(shared.url, bodies(4, 6), 1)
    delta = sglang_metrics.difference(before, sglang_metrics.scrape(shared.url), "there")
    with pytest.raises(SpecPilotError, match="counted 2 requests and 10 tokens for one request of 4 tokens"):
        sglang_metrics.check_one_request(delta, 4, "there")
