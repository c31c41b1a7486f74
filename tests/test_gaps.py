"""gaps, the cost model: hand-worked arithmetic, ceilings files refused by name, and end to end on a real server
(its /metrics and meta_info.timing_s)."""

import json
import math

import httpx
import pytest
from reference_runtime_helpers import free_port

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import gaps

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
SETTING = "cpu_c1_stories260k_handwritten"


def request(tokens, latency, accept, **timing):
    return {
        "dataset": "gsm8k",
        "item_id": "1",
        "completion_tokens": tokens,
        "latency_s": latency,
        "accept_length": accept,
        "timing_s": timing,
    }


def test_a_hand_worked_request_splits_and_ranks_as_computed_by_hand():
    # 100 tokens in 1.0 s at acceptance 2: 50 forwards, 0.6 s of them; the weights take 1 ms to read, so the
    # ceiling per token is 1 ms / 2 = 0.5 ms and the forward's gap 6 - 0.5 = 5.5 ms a token.
    r = request(100, 1.0, 2.0, queue=0.01, prefill=0.02, draft=0.1, target=0.6, bookkeeping=0.05, engine=0.9)
    row = gaps._dataset_row([r], per_forward_ceiling_s=1e-3, width=5)
    per = row["per_token_s"]
    assert per["target"] == pytest.approx(6e-3) and per["draft"] == pytest.approx(1e-3)
    assert per["runtime"] == pytest.approx((0.05 + 0.01 + (0.9 - 0.78)) / 100)  # own work, queue, loop wait
    assert per["serving"] == pytest.approx(0.1 / 100)
    assert sum(per.values()) == pytest.approx(row["measured_per_token_s"])
    assert row["ar_ceiling_tok_s"] == pytest.approx(1000) and row["spec_ceiling_tok_s"] == pytest.approx(2000)
    assert row["engine_attributed"] == pytest.approx(0.78 / 0.9)
    ranked = {g["gap"]: g["per_token_s"] for g in row["gaps"]}
    assert ranked["target forward above its bandwidth ceiling"] == pytest.approx(5.5e-3)
    # 12 ms a forward: at acceptance 2 that is 6 ms a token, at the full width of 5 it would be 2.4 ms
    assert ranked["acceptance below the drafter's width"] == pytest.approx(6e-3 - 2.4e-3)
    assert row["gaps"][0]["gap"] == "target forward above its bandwidth ceiling"
    assert [g["per_token_s"] for g in row["gaps"]] == sorted((g["per_token_s"] for g in row["gaps"]), reverse=True)


def test_weight_bytes_follow_dtype_and_quantization():
    assert gaps.weight_bytes({"params_b": 1.0, "dtype": "bfloat16"}) == 2e9
    assert gaps.weight_bytes({"params_b": 1.0, "dtype": "bfloat16", "quantization": "w12"}) == 1.5e9
    with pytest.raises(SpecPilotError, match="no byte size for dtype 'int3'"):
        gaps.weight_bytes({"name": "m", "params_b": 1.0, "dtype": "int3"})


@pytest.mark.parametrize(
    "text,message",
    [
        ("hardware: h100\nmemory_bandwidth_gbs: 3350\nsource: x\npeak: 1\n", "unknown key 'peak'"),
        ("hardware: h200\nmemory_bandwidth_gbs: 3350\nsource: x\n", "hardware is 'h200', expected 'h100'"),
        ("hardware: h100\nmemory_bandwidth_gbs: -1\nsource: x\n", "memory_bandwidth_gbs must be a positive number"),
        ("hardware: h100\nmemory_bandwidth_gbs: 3350\n", "source must say where"),
        ("[1, 2", "not YAML"),
    ],
)
def test_a_bad_ceilings_file_is_refused_naming_it(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr(gaps, "CEILINGS_DIR", tmp_path)
    (tmp_path / "h100.yaml").write_text(text)
    with pytest.raises(SpecPilotError, match=message) as refused:
        gaps.hardware_bandwidth("h100")
    assert "h100.yaml" in str(refused.value)


def test_every_gpu_of_conf_hardware_has_ceilings(repo):
    for hardware in sorted((repo / "conf" / "hardware").glob("*.yaml")):
        if hardware.stem != "cpu":
            assert gaps.hardware_bandwidth(hardware.stem).bytes_per_s > 1e11


@pytest.fixture(scope="module")
def benched(tmp_path_factory, shared):
    """The embedded final served by the real runtime, benched c1, with /metrics read before it stops."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    root = tmp_path_factory.mktemp("gaps")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECPILOT_ENGINES", str(root / "engines"))
        env.setenv("SPECPILOT_DATA", str(root / "data"))
        engine, oracle = (build_engine(SETTING, arm).engine for arm in ("final", "ar"))
        port = free_port()
        serve(engine, port, quiet=True)
        try:
            run = bench(
                engine.id,
                "gaps_final",
                limit=2,
                max_new_tokens=64,
                port=port,
                progress=False,
                oracle_engine_id=oracle.id,
            )
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        finally:
            stop(port)
        yield {"engine": engine, "run": run, "metrics": metrics, "root": root}


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


@pytest.mark.slow
def test_metrics_count_what_the_bench_received(benched):
    requests = json.loads(benched["run"].read_text())["requests"]
    text = benched["metrics"]
    # bench's warm-up requests are served too: the counters hold at least what the run recorded
    assert _metric(text, "sglang:generation_tokens_total") >= sum(r["completion_tokens"] for r in requests)
    assert _metric(text, "sglang:num_requests_total") >= len(requests)
    assert _metric(text, "sglang:num_running_reqs") == 0
    target = _metric(text, "specpilot:engine_seconds_total", part="target")
    assert target >= sum(r["timing_s"]["target"] for r in requests) * (1 - 1e-9)
    assert "# TYPE sglang:prompt_tokens_total counter" in text


@pytest.mark.slow
def test_gaps_of_a_real_run_account_for_the_time_per_token(benched):
    report = gaps.gaps_report(benched["engine"], benched["run"])
    overall = report["datasets"]["overall"]
    assert overall["engine_attributed"] >= 0.95  # the engine's timed parts, not a remainder, cover its time
    for r in json.loads(benched["run"].read_text())["requests"]:  # the server's clock inside the client's
        timing = r["timing_s"]
        assert all(v >= 0 for v in timing.values())
        assert sum(timing[p] for p in gaps.ENGINE_PARTS) <= timing["engine"] * (1 + 1e-6) <= r["latency_s"]
    assert overall["measured_tok_s"] < overall["spec_ceiling_tok_s"]
    assert overall["accept_length"] >= 1.0 and math.isfinite(overall["ar_ceiling_tok_s"])
    json_path, png_path = gaps.write_report(report, benched["root"] / "gaps_final")
    assert json.loads(json_path.read_text())["schema"] == gaps.SCHEMA
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_gaps_refuse_a_run_of_another_engine_and_a_run_without_timing(benched, tmp_path):
    data = json.loads(benched["run"].read_text())
    with pytest.raises(SpecPilotError, match="a run of engine"):
        other = tmp_path / "other.json"
        other.write_text(json.dumps({**data, "engine_id": "0" * 64}))
        gaps.gaps_report(benched["engine"], other)
    for r in data["requests"]:
        r["timing_s"] = None
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    with pytest.raises(SpecPilotError, match="carry no server timing"):
        gaps.gaps_report(benched["engine"], bare)
