"""compare: paired bootstrap CIs on synthetic timings with a known ratio, identity, and refusals."""

import json

import numpy as np
import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import compare as cmp
from specpilot_build.measure.prompts import prompt_digest, prompts_digest
from specpilot_build.measure.results import SCHEMA
from specpilot_build.store.manifest import engine_id as manifest_digest

PIN = {"repo": "karpathy/tinyllamas", "revision": "0bd21da7698eaf29a0d7de3992de8a46ef624add"}


def synthetic_manifest(arm, pin=PIN, dtype="float32", setting="syn_setting"):
    """The parts of an engine manifest compare reads: arm, drafter, target pin, dtype, hardware, setting."""
    return {
        "setting": setting,
        "arm": arm,
        "files": [],
        "config": {
            "arm": {"name": arm, "uses_drafter": arm != "ar"},
            "drafter": {"algorithm": "none" if arm == "ar" else "ngram"},
            "model": {"dtype": dtype, "quantization": None},
            "hardware": {"name": "cpu"},
        },
        "inputs": {"checkpoints": {"model": dict(pin)}},
    }


def synthetic_run(arm, rng, n=60, slowdown=1.0, datasets=("gsm8k", "mbpp"), concurrency=1, pin=PIN):
    """A results file whose per-prompt time per token is the ar arm's divided by a known factor (with noise)."""
    base = np.random.default_rng(7)  # the prompts and the ar timings: identical for every arm
    requests, per_dataset = [], {}
    for dataset in datasets:
        tokens = base.integers(20, 400, n)
        tpt = base.lognormal(np.log(0.01), 0.5, n)  # seconds per token, varies by prompt
        noise = rng.lognormal(-0.02, 0.2, n)  # mean-one multiplicative noise (mean of lognormal = 1)
        latency = tokens * tpt * slowdown * noise
        for i in range(n):
            requests.append(
                {
                    "dataset": dataset,
                    "item_id": str(i),
                    "prompt_digest": prompt_digest([1, i]),
                    "prompt_ids": [1, i],
                    "output_ids": list(range(int(tokens[i]))),
                    "completion_tokens": int(tokens[i]),
                    "latency_s": float(latency[i]),
                    "accept_length": None if arm == "ar" else 2.0,
                    "finish_reason": "length",
                }
            )
        per_dataset[dataset] = {"completion_tokens": int(tokens.sum()), "wall_s": float(latency.sum()) / concurrency}
    manifest = synthetic_manifest(arm, pin)
    engine_id = manifest_digest(manifest)
    return {
        "schema": SCHEMA,
        "name": f"syn-{arm}",
        "engine_id": engine_id,
        "manifest_digest": f"blake3:{engine_id}",
        "engine_manifest": manifest,
        "server_info": {"engine_id": engine_id},
        "setting": manifest["setting"],
        "arm": arm,
        "date_utc": "2026-11-29",
        "target_pin": pin,
        "max_new_tokens": 512,
        "concurrency": concurrency,
        "requests": requests,
        "prompts_digest": prompts_digest(requests),
        "per_dataset": per_dataset,
    }


def test_bootstrap_ci_covers_a_known_ratio_in_most_trials():
    covered, widths = 0, []
    for trial in range(40):
        rng = np.random.default_rng(1000 + trial)
        runs = {
            "ar": synthetic_run("ar", rng),
            "stock": synthetic_run("stock", rng, slowdown=1 / 1.5),
            "final": synthetic_run("final", rng, slowdown=1 / 2.0),
        }
        s = cmp.speed_report(runs)["speedups"]["final/ar"]["overall"]
        covered += s["ci95"][0] <= 2.0 <= s["ci95"][1]
        widths.append(s["ci95"][1] - s["ci95"][0])
    assert covered >= 34  # nominal 95% of 40 = 38
    assert np.median(widths) < 0.4  # informative, not a trivially wide interval


def test_ci_brackets_the_point_and_excludes_a_wrong_ratio():
    rng = np.random.default_rng(3)
    runs = {
        "ar": synthetic_run("ar", rng, n=200),
        "stock": synthetic_run("stock", rng, n=200, slowdown=1 / 1.5),
        "final": synthetic_run("final", rng, n=200, slowdown=1 / 2.0),
    }
    report = cmp.speed_report(runs)
    for pair, truth in (("final/ar", 2.0), ("stock/ar", 1.5), ("final/stock", 2.0 / 1.5)):
        for dataset in ("gsm8k", "mbpp", "overall"):
            s = report["speedups"][pair][dataset]
            assert s["ci95"][0] <= s["speedup"] <= s["ci95"][1]
            assert not s["ci95"][0] <= truth * 1.25 <= s["ci95"][1]


def test_c16_uses_throughput_for_the_point_estimate():
    rng = np.random.default_rng(4)
    runs = {
        arm: synthetic_run(arm, rng, concurrency=16, slowdown=f)
        for arm, f in (("ar", 1.0), ("stock", 1.0), ("final", 1.0))
    }
    runs["final"]["per_dataset"]["gsm8k"]["wall_s"] = runs["ar"]["per_dataset"]["gsm8k"]["wall_s"] / 3
    s = cmp.speed_report(runs)["speedups"]["final/ar"]["gsm8k"]
    assert s["speedup"] == pytest.approx(3.0)
    assert s["ci95"][0] < 3.0 < s["ci95"][1]


def test_identity_counts_and_locates_the_first_difference():
    rng = np.random.default_rng(5)
    runs = {arm: synthetic_run(arm, rng) for arm in ("ar", "stock", "final")}
    runs["final"]["requests"][7]["output_ids"][3] += 1000
    report = cmp.speed_report(runs)
    assert report["identity"]["stock/ar"]["overall"]["fraction"] == 1.0
    ident = report["identity"]["final/ar"]["overall"]
    assert (ident["identical"], ident["requests"]) == (119, 120)
    assert ident["first_difference"] == {"dataset": "gsm8k", "item_id": "7", "position": 3}


def _write(tmp_path, runs):
    paths = {}
    for arm, data in runs.items():
        paths[arm] = tmp_path / f"{arm}.json"
        paths[arm].write_text(json.dumps(data))
    return paths


def test_compare_writes_json_and_chart(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    rng = np.random.default_rng(6)
    paths = _write(tmp_path, {arm: synthetic_run(arm, rng) for arm in ("ar", "stock", "final")})
    report = cmp.compare(str(paths["ar"]), str(paths["stock"]), str(paths["final"]), name="cmp")
    written = json.loads((tmp_path / "data/results/cmp.json").read_text())
    assert written["runs"]["final"]["engine_id"] == manifest_digest(synthetic_manifest("final"))
    assert (tmp_path / "data/results/cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["speedups"]["final/ar"]["overall"]["n"] == 120


def test_refuses_runs_of_different_targets(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    rng = np.random.default_rng(6)
    runs = {arm: synthetic_run(arm, rng) for arm in ("ar", "stock", "final")}
    runs["final"]["target_pin"] = {"repo": "Qwen/Qwen3-8B", "revision": "b968826d9c46dd6066d109eabc6255188de91218"}
    paths = _write(tmp_path, runs)
    with pytest.raises(SpecPilotError, match="Qwen/Qwen3-8B@b968826d9c46.*only runs of one target"):
        cmp.compare(str(paths["ar"]), str(paths["stock"]), str(paths["final"]))


def test_refuses_runs_with_different_prompts(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    rng = np.random.default_rng(6)
    runs = {arm: synthetic_run(arm, rng) for arm in ("ar", "stock", "final")}
    request = runs["stock"]["requests"][61]
    request["prompt_ids"] = [2, 1]  # a different prompt, consistently digested
    request["prompt_digest"] = prompt_digest(request["prompt_ids"])
    runs["stock"]["prompts_digest"] = prompts_digest(runs["stock"]["requests"])
    paths = _write(tmp_path, runs)
    with pytest.raises(SpecPilotError, match=r"different prompts \(first difference: mbpp item 1\)"):
        cmp.compare(str(paths["ar"]), str(paths["stock"]), str(paths["final"]))
