"""bench and verify: classification of oracle answers, and (once a reference runtime exists) end to end."""

import math

import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import verify as vf


def oracle_answer(prompt, emitted, top_per_position):
    """An answer in SGLang's shape: one entry per position from len(prompt)-1; the first predicts the
    last prompt token, entry j+1 the emitted token j."""
    tops = [[[-0.5, prompt[-1], None], [-2.0, 0, None]]] + top_per_position
    token_lps = [[-0.5, prompt[-1], None]] + [
        [next((lp for lp, tid, _ in top if tid == e), -9.0), e, None] for e, top in zip(emitted, top_per_position)
    ]
    return {"meta_info": {"input_top_logprobs": tops, "input_token_logprobs": token_lps}}


REQUEST = {"dataset": "gsm8k", "item_id": "12", "prompt_ids": [1, 2, 3], "output_ids": [5, 6, 7, 8]}


def test_all_top1_is_verified():
    tops = [
        [[-0.1, 5, None], [-3, 9, None]],
        [[-0.2, 6, None], [-2, 9, None]],
        [[-0.3, 7, None], [-1, 9, None]],
        [[-0.1, 8, None], [-4, 9, None]],
    ]
    check = vf.check_request(REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops), tolerance=0.25)
    assert (check["verified"], check["tokens"], check["first_mismatch"], check["near_ties"]) == (4, 4, None, [])


def test_near_tie_within_tolerance_and_real_mismatch_beyond():
    tops = [
        [[-0.1, 5, None], [-3, 9, None]],
        [[-0.60, 9, None], [-0.75, 6, None]],  # emitted 6 is top-2, 0.15 below: a near tie at bf16
        [[-0.1, 9, None], [-3.0, 7, None]],  # emitted 7, 2.9 below: a real mismatch
        [[-0.1, 9, None], [-3.0, 8, None]],
    ]  # after the first real mismatch: reported, not verified
    check = vf.check_request(REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops), tolerance=0.25)
    assert [(n["position"], n["emitted_id"], n["oracle_id"]) for n in check["near_ties"]] == [(1, 6, 9)]
    assert math.isclose(check["near_ties"][0]["margin"], 0.15)
    first = check["first_mismatch"]
    assert (first["position"], first["emitted_id"], first["oracle_id"]) == (2, 7, 9)
    assert math.isclose(first["margin"], 2.9)
    assert (check["verified"], check["mismatches_after"]) == (2, 1)
    # The same near tie is real under float32's much tighter tolerance.
    strict = vf.check_request(
        REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops), tolerance=vf.dtype_tolerance("float32")
    )
    assert strict["first_mismatch"]["position"] == 1 and strict["verified"] == 1


def test_emitted_token_outside_top2_uses_its_forced_logprob():
    tops = [
        [[-0.1, 9, None], [-0.2, 4, None]],
        [[-0.1, 6, None], [-3, 9, None]],
        [[-0.1, 7, None], [-3, 9, None]],
        [[-0.1, 8, None], [-3, 9, None]],
    ]
    answer = oracle_answer([1, 2, 3], [5, 6, 7, 8], tops)
    answer["meta_info"]["input_token_logprobs"][1][0] = -0.3  # emitted 5 ranks third, 0.2 below top-1
    check = vf.check_request(REQUEST, answer, tolerance=0.25)
    assert check["first_mismatch"] is None and check["near_ties"][0]["margin"] == pytest.approx(0.2)


def test_tolerances_follow_the_dtype_rounding_step():
    assert vf.dtype_tolerance("bfloat16") == 0.25
    assert vf.dtype_tolerance("float16") == 2.0**-5
    assert vf.dtype_tolerance("float32") == 2.0**-18
    assert vf.dtype_tolerance("float32", "bfloat16") == 0.25  # the coarser engine decides


def test_an_answer_without_forcing_logprobs_is_refused():
    with pytest.raises(SpecPilotError, match="gsm8k item 12, expected 5"):
        vf.check_request(REQUEST, {"meta_info": {"input_top_logprobs": [[]]}}, tolerance=0.25)


# --- end to end: the real reference runtime serving the real stories260K on loopback ----------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from reference_runtime_helpers import free_port  # noqa: E402

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
SETTING = "cpu_c1_stories260k_handwritten"
E2E_DATASETS = ["gsm8k", "mt-bench"]


@pytest.fixture(scope="module")
def loop(tmp_path_factory, shared):
    """Engines of the embedded setting, a final run benched on the real runtime, and a running ar oracle."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    root = tmp_path_factory.mktemp("loop")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECPILOT_ENGINES", str(root / "engines"))
        env.setenv("SPECPILOT_DATA", str(root / "data"))
        engines = {arm: build_engine(SETTING, arm).engine for arm in ("ar", "final")}
        bench_port, oracle_port = free_port(), free_port()
        serve(engines["final"], bench_port, quiet=True)
        try:
            final_run = bench(
                engines["final"].id,
                "final",
                limit=1,
                max_new_tokens=48,
                port=bench_port,
                datasets=E2E_DATASETS,
                progress=False,
                oracle_engine_id=engines["ar"].id,
            )
        finally:
            stop(bench_port)
        # verify serves the oracle itself here (and stops it afterwards)
        first = vf.verify(str(final_run), oracle=engines["ar"].id, port=oracle_port, progress=False)
        serve(engines["ar"], oracle_port, quiet=True)
        try:
            ar_run = bench(
                engines["ar"].id,
                "ar",
                limit=1,
                max_new_tokens=48,
                port=oracle_port,
                datasets=E2E_DATASETS,
                progress=False,
            )
            yield {
                "ar_run": ar_run,
                "engines": engines,
                "final_run": final_run,
                "first_verify": first,
                "oracle_port": oracle_port,
                "root": root,
                "env": dict(SPECPILOT_ENGINES=str(root / "engines"), SPECPILOT_DATA=str(root / "data")),
            }
        finally:
            stop(oracle_port)


@pytest.mark.slow
def test_bench_records_what_compare_score_and_verify_need(loop):
    run = json.loads(loop["final_run"].read_text())
    assert run["engine_id"] == loop["engines"]["final"].id and run["arm"] == "final"
    assert run["target_pin"] == loop["engines"]["ar"].model_pin
    assert [r["dataset"] for r in run["requests"]] == E2E_DATASETS
    for r in run["requests"]:
        assert r["prompt_ids"][0] == 1  # stories260K has no chat template: plain text after BOS
        assert len(r["output_ids"]) == r["completion_tokens"] > 0
        assert r["latency_s"] > 0 and r["finish_reason"] in ("length", "stop")
        assert r["accept_length"] is not None and r["accept_length"] >= 1.0
    assert run["per_dataset"]["gsm8k"]["wall_s"] > 0 and 0 <= run["client"]["overhead_fraction"] < 1
    assert run["oracle_engine_id"] == loop["engines"]["ar"].id  # the recorded oracle


@pytest.mark.slow
def test_embedded_final_and_ar_outputs_are_token_identical(loop):
    from specpilot_build.measure import compare as cmp

    # compare() refuses a run passed as two arms; identity needs only the ar and final runs
    ar, final = (json.loads(loop[key].read_text()) for key in ("ar_run", "final_run"))
    report = cmp.speed_report({"ar": ar, "stock": ar, "final": final})
    ident = report["identity"]["final/ar"]["overall"]
    assert ident["identical"] == ident["requests"] == len(E2E_DATASETS)
    assert ident["first_difference"] is None


@pytest.mark.slow
def test_final_run_verifies_lossless_with_every_token_checked(loop):
    report = loop["first_verify"]
    run = json.loads(loop["final_run"].read_text())
    assert report["verdict"] == "lossless" and report["real_mismatches"] == 0
    assert report["verified"] == report["tokens"] == sum(r["completion_tokens"] for r in run["requests"])
    assert report["checked_engine_id"] == loop["engines"]["final"].id
    assert report["oracle_engine_id"] == loop["engines"]["ar"].id
    written = json.loads(loop["final_run"].with_name("final.verify.json").read_text())
    assert written["verdict"] == "lossless"


@pytest.mark.slow
def test_one_changed_token_is_a_real_mismatch_at_exactly_that_place(loop):
    run = json.loads(loop["final_run"].read_text())
    request, position = 1, 17
    original = run["requests"][request]["output_ids"][position]
    run["requests"][request]["output_ids"][position] = (original + 1) % 512
    tampered = loop["final_run"].with_name("tampered.json")
    tampered.write_text(json.dumps(run))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specpilot_build.cli",
            "verify",
            str(tampered),
            "--oracle",
            loop["engines"]["ar"].id,
            "--port",
            str(loop["oracle_port"]),
        ],
        capture_output=True,
        text=True,
        env={**_environ(), **loop["env"]},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(tampered.with_name("tampered.verify.json").read_text())
    assert report["verdict"] == "not lossless" and report["real_mismatches"] == 1
    bad = [c for c in report["requests"] if c["first_mismatch"]]
    assert [(c["dataset"], c["item_id"]) for c in bad] == [
        (run["requests"][request]["dataset"], run["requests"][request]["item_id"])
    ]
    mismatch = bad[0]["first_mismatch"]
    assert (mismatch["position"], mismatch["emitted_id"]) == (position, (original + 1) % 512)
    assert mismatch["oracle_id"] == original and mismatch["margin"] > report["tolerance"]
    assert bad[0]["verified"] == position
    assert f"position {position}" in proc.stdout


@pytest.mark.slow
def test_a_run_of_another_target_is_refused(loop):
    run = json.loads(loop["final_run"].read_text())
    run["target_pin"] = {"repo": "Qwen/Qwen3-8B", "revision": "b968826d9c46dd6066d109eabc6255188de91218"}
    other = loop["final_run"].with_name("other_target.json")
    other.write_text(json.dumps(run))
    with pytest.MonkeyPatch.context() as env:
        for key, value in loop["env"].items():
            env.setenv(key, value)
        with pytest.raises(SpecPilotError, match="Qwen/Qwen3-8B.*same target model"):
            vf.verify(str(other), oracle=loop["engines"]["ar"].id, port=loop["oracle_port"], progress=False)


@pytest.mark.slow
def test_bench_refuses_a_server_of_another_engine(loop):
    from specpilot_build.measure.bench import bench

    with pytest.MonkeyPatch.context() as env:
        for key, value in loop["env"].items():
            env.setenv(key, value)
        with pytest.raises(
            SpecPilotError, match=f"serves engine {loop['engines']['ar'].id}, not {loop['engines']['final'].id[:16]}"
        ):
            bench(
                loop["engines"]["final"].id,
                "wrong",
                limit=1,
                port=loop["oracle_port"],
                progress=False,
                oracle_engine_id=loop["engines"]["ar"].id,
            )


def _environ():
    import os

    return dict(os.environ)
