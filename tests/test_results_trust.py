"""Results are bound to the hashes that produced them: a tampered results file fails verify (naming the request
and the field or position), compare refuses what is not three honest arms of one setting, and an edited
results file fails `specpilot attest check`. End to end on the reference runtime serving the real stories260K:
two bench runs (final and ar, each cut at the model's context), one ar oracle server for every verify; those
tests are `slow`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reference_runtime_helpers import free_port

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import compare as cmp
from specpilot_build.measure import verify as vf
from specpilot_build.measure.prompts import prompt_digest, prompts_digest
from specpilot_build.measure.results import manifest_record
from specpilot_build.store.manifest import engine_id as manifest_digest

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
SETTING = "cpu_c1_stories260k_handwritten"
BF16_SETTING = "cpu_c1_stories260k-bf16_ngram"
DATASETS = ["gsm8k", "mt-bench"]
MAX_NEW = 600  # above stories260K's 512-token context: every request's budget is cut at the context


@pytest.fixture(scope="module")
def trust(tmp_path_factory, shared):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    root = tmp_path_factory.mktemp("trust")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECPILOT_ENGINES", str(root / "engines"))
        env.setenv("SPECPILOT_DATA", str(root / "data"))
        engines = {arm: build_engine(SETTING, arm).engine for arm in ("ar", "stock", "final")}
        engines["bf16_final"] = build_engine(BF16_SETTING, "final").engine
        bench_port, oracle_port = free_port(), free_port()
        serve(engines["final"], bench_port, quiet=True)
        try:
            final_run = bench(
                engines["final"].id,
                "trust_final",
                limit=1,
                max_new_tokens=MAX_NEW,
                port=bench_port,
                datasets=DATASETS,
                progress=False,
                oracle_engine_id=engines["ar"].id,
            )
        finally:
            stop(bench_port)
        serve(engines["ar"], oracle_port, quiet=True)
        try:
            ar_run = bench(
                engines["ar"].id,
                "trust_ar",
                limit=1,
                max_new_tokens=MAX_NEW,
                port=oracle_port,
                datasets=DATASETS,
                progress=False,
            )
            first = vf.verify(str(final_run), oracle=engines["ar"].id, port=oracle_port, progress=False)
            yield {
                "engines": engines,
                "final_run": final_run,
                "ar_run": ar_run,
                "first_verify": first,
                "oracle_port": oracle_port,
                "results": final_run.parent,
                "env": {"SPECPILOT_ENGINES": str(root / "engines"), "SPECPILOT_DATA": str(root / "data")},
            }
        finally:
            stop(oracle_port)


def _load(path):
    return json.loads(path.read_text())


def _tampered(trust, name, edit, base="final_run"):
    data = _load(trust[base])
    edit(data)
    path = trust["results"] / f"{name}.json"
    path.write_text(json.dumps(data))
    return path, data


def _verify(trust, path):
    return vf.verify(str(path), oracle=trust["engines"]["ar"].id, port=trust["oracle_port"], progress=False)


def _failures(report, dataset=None, field=None):
    return [
        f
        for f in report["failures"]
        if (dataset is None or f["dataset"] == dataset) and (field is None or f["field"] == field)
    ]


def _run_cli(trust, *args):
    import os

    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **trust["env"]},
        timeout=300,
    )


# --- what a run records ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_records_server_manifest_oracle_and_every_request_field(trust):
    run, engines = _load(trust["final_run"]), trust["engines"]
    final, ar = engines["final"], engines["ar"]
    assert run["server_info"]["engine_id"] == run["served"]["engine_id"] == run["engine_id"] == final.id
    assert run["served"]["version"] == run["server_info"]["version"] and run["served"]["runtime"]
    assert run["manifest_digest"] == f"blake3:{final.id}" == manifest_record(final)["digest"]
    assert manifest_digest(run["engine_manifest"]) == final.id
    assert run["oracle_engine_id"] == run["oracle"]["engine_id"] == ar.id
    assert manifest_digest(run["oracle"]["manifest"]) == ar.id
    assert run["skipped"] == [] and run["context_length"] == 512
    for r in run["requests"]:
        assert {"prompt_ids", "output_ids", "output_text", "finish_reason", "completion_tokens"} <= set(r)
        # cut at the context: prompt + output fill it but for the one position the server needs free
        assert len(r["prompt_ids"]) + len(r["output_ids"]) == 511 and r["finish_reason"] == "length"
    report = trust["first_verify"]
    assert report["verdict"] == "lossless" and report["failures"] == [] and report["oracle_is_recorded"]
    assert report["verified"] == report["tokens"] == sum(r["completion_tokens"] for r in run["requests"])


def test_prompts_too_long_for_the_context_are_listed_with_the_reason(shared):
    from specpilot_build.measure.bench import plan_requests
    from specpilot_build.measure.prompts import Prompt

    class LongFirst:
        def __init__(self):
            self.calls = 0

        def prompt(self, dataset, item_id, text):
            self.calls += 1
            ids = [1] * (600 if self.calls == 1 else 10)
            return Prompt(dataset, item_id, ids, prompt_digest(ids))

    plan, skipped = plan_requests(LongFirst(), ["gsm8k"], 2, 100, 512)
    assert len(plan["gsm8k"]) == 1 and len(skipped["gsm8k"]) == 1
    entry = skipped["gsm8k"][0]
    assert entry["prompt_tokens"] == 600 and "too long for the context" in entry["reason"]
    assert entry["item_id"] != plan["gsm8k"][0]["item_id"]


# --- verify: every field it can recompute -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_changed_output_text_fails_verify_naming_request_and_field(trust):
    def edit(data):
        data["requests"][0]["output_text"] = data["requests"][0]["output_text"].replace("He", "She", 1)

    path, data = _tampered(trust, "t_text", edit)
    report = _verify(trust, path)
    assert vf.exit_status(report) == 1 and report["verdict"] == "not verified"
    [failure] = _failures(report, field="output_text")
    assert (failure["dataset"], failure["item_id"]) == ("gsm8k", data["requests"][0]["item_id"])
    assert report["real_mismatches"] == 0  # the ids are fine: only the text lies


@pytest.mark.slow
def test_a_dropped_last_token_fails_verify_naming_the_position(trust):
    def edit(data):
        data["requests"][1]["output_ids"].pop()

    path, data = _tampered(trust, "t_drop", edit)
    report = _verify(trust, path)
    assert vf.exit_status(report) == 1
    count = _failures(report, "mt-bench", "completion_tokens")
    assert [f["position"] for f in count] == [len(data["requests"][1]["output_ids"])]
    assert _failures(report, "mt-bench", "finish_reason")  # 'length' but the budget is not used up
    assert not _failures(report, "gsm8k")


@pytest.mark.slow
def test_a_rewritten_engine_id_fails_verify(trust):
    ar = trust["engines"]["ar"].id

    def edit(data):
        data["engine_id"] = ar  # claim the ar engine produced the final run

    path, _ = _tampered(trust, "t_engine", edit)
    report = _verify(trust, path)
    assert vf.exit_status(report) == 1
    [failure] = _failures(report, field="engine_id")
    assert failure["dataset"] is None and trust["engines"]["final"].id in failure["message"]  # its server said so
    assert _failures(report, field="manifest_digest") and _failures(report, field="engine_manifest")


@pytest.mark.slow
def test_a_rewritten_prompt_digest_fails_verify_naming_the_request(trust):
    def edit(data):
        data["requests"][0]["prompt_digest"] = prompt_digest([1, 2, 3])

    path, data = _tampered(trust, "t_digest", edit)
    report = _verify(trust, path)
    assert vf.exit_status(report) == 1
    [failure] = _failures(report, field="prompt_digest")
    assert (failure["dataset"], failure["item_id"]) == ("gsm8k", data["requests"][0]["item_id"])


@pytest.mark.slow
def test_a_changed_prompt_token_fails_the_re_rendering_check(trust):
    def edit(data):
        r = data["requests"][1]
        r["prompt_ids"][5] += 1  # digests recomputed: only the dataset item rendered again tells
        r["prompt_digest"] = prompt_digest(r["prompt_ids"])
        data["prompts_digest"] = prompts_digest(data["requests"])

    path, _ = _tampered(trust, "t_prompt", edit)
    report = _verify(trust, path)
    [failure] = _failures(report, "mt-bench", "prompt_ids")
    assert failure["position"] == 5 and vf.exit_status(report) == 1


@pytest.mark.slow
def test_a_token_appended_at_the_context_limit_fails_that_request_only(trust):
    def edit(data):
        r = data["requests"][0]
        r["output_ids"].append(r["output_ids"][-1])
        r["completion_tokens"] += 1  # even with the count kept consistent

    path, data = _tampered(trust, "t_append", edit)
    request = data["requests"][0]
    budget = request["max_new_tokens"]
    # the CLI, with its default oracle: the recorded id, found in the store, already served on the port
    proc = _run_cli(trust, "verify", str(path), "--port", str(trust["oracle_port"]))
    assert proc.returncode == 1, proc.stderr
    report = _load(path.with_name("t_append.verify.json"))
    assert report["oracle_engine_id"] == data["oracle_engine_id"] and report["oracle_is_recorded"]
    positions = {f["position"] for f in _failures(report, "gsm8k", "output_ids")}
    assert positions == {budget}  # past the budget, at the context limit
    assert f"gsm8k item {request['item_id']}: output_ids position {budget}" in proc.stdout
    # the run was not aborted: the other request was forced and verified token by token
    other = next(c for c in report["requests"] if c["dataset"] == "mt-bench")
    assert other["verified"] == other["tokens"] == len(data["requests"][1]["output_ids"])


@pytest.mark.slow
def test_a_request_the_oracle_refuses_fails_alone(trust):
    data = _load(trust["final_run"])
    data["requests"][0]["output_ids"].append(1)  # 512 ids: the oracle answers 400
    url = f"http://127.0.0.1:{trust['oracle_port']}"
    report = vf.force_tokens(data, url, vf.dtype_tolerance("float32"), 1, progress=False, context=None)
    [failure] = report["failures"]
    assert (failure["dataset"], failure["field"]) == ("gsm8k", "oracle") and "400" in failure["message"]
    other = next(c for c in report["requests"] if c["dataset"] == "mt-bench")
    assert other["verified"] == other["tokens"] > 0 and report["verdict"] == "not verified"


@pytest.mark.slow
def test_the_default_oracle_is_the_recorded_id_or_names_the_pin_that_differs(trust):
    from specpilot_build.cli.main import _default_oracle

    def edit(data):
        data["oracle"]["manifest"]["inputs"]["checkpoints"]["model"]["revision"] = "f" * 40
        data["oracle_engine_id"] = data["oracle"]["engine_id"] = manifest_digest(data["oracle"]["manifest"])

    path, _ = _tampered(trust, "t_oracle", edit)
    assert _default_oracle(str(trust["final_run"])).id == trust["engines"]["ar"].id
    with pytest.raises(SpecPilotError, match=r"not in the store.*pin checkpoint\.model: karpathy/tinyllamas@f{12}"):
        _default_oracle(str(path))


# --- compare: arms checked against their manifests --------------------------------------------------------------


def _as_engine(data, engine, name):
    """A results record re-labelled as another engine's (what compare must judge by the manifest)."""
    record = manifest_record(engine)
    data.update(
        name=name,
        engine_id=engine.id,
        manifest_digest=record["digest"],
        engine_manifest=record["manifest"],
        arm=record["manifest"]["arm"],
        setting=record["manifest"]["setting"],
        server_info=dict(data["server_info"], engine_id=engine.id),
        served=dict(data["served"], engine_id=engine.id),
    )
    return data


@pytest.fixture(scope="module")
def arms(trust):
    """ar and final as benched, stock as the final run re-labelled (compare reads no server)."""
    paths = {}
    for arm, base in (("ar", "ar_run"), ("final", "final_run")):
        paths[arm] = trust["results"] / f"c_{arm}.json"
        paths[arm].write_bytes(trust[base].read_bytes())
    paths["stock"], _ = _tampered(trust, "c_stock", lambda d: _as_engine(d, trust["engines"]["stock"], "c_stock"))
    return {arm: str(p) for arm, p in paths.items()}


@pytest.mark.slow
def test_compare_accepts_three_honest_arms_and_never_overwrites(trust, arms):
    report = cmp.compare(arms["ar"], arms["stock"], arms["final"], name="c_ok", chart=False)
    assert report["identity"]["final/ar"]["overall"]["identical"] == len(DATASETS)
    with pytest.raises(SpecPilotError, match="c_ok.json exists.*--overwrite"):
        cmp.compare(arms["ar"], arms["stock"], arms["final"], name="c_ok", chart=False)
    cmp.compare(arms["ar"], arms["stock"], arms["final"], name="c_ok", chart=False, overwrite=True)


@pytest.mark.slow
def test_compare_refuses_a_changed_prompt_token(trust, arms):
    def edit(data):
        _as_engine(data, trust["engines"]["stock"], "c_stock_prompt")
        data["requests"][0]["prompt_ids"][3] += 1

    path, _ = _tampered(trust, "c_stock_prompt", edit)
    with pytest.raises(SpecPilotError, match=r"gsm8k item .*: prompt_digest .* is not the sha256 of its prompt_ids"):
        cmp.compare(arms["ar"], str(path), arms["final"], name="c_prompt", chart=False)


@pytest.mark.slow
def test_compare_refuses_a_record_relabelled_without_its_server(trust, arms):
    def edit(data):
        record = manifest_record(trust["engines"]["stock"])  # manifest and id swapped in, server_info left
        data.update(
            engine_id=trust["engines"]["stock"].id,
            manifest_digest=record["digest"],
            engine_manifest=record["manifest"],
            arm="stock",
        )

    path, _ = _tampered(trust, "c_relabel", edit)
    with pytest.raises(SpecPilotError, match="its server reported .* in server_info; the record was altered"):
        cmp.compare(arms["ar"], str(path), arms["final"], name="c_relabel", chart=False)


@pytest.mark.slow
def test_compare_refuses_swapped_arms(arms):
    with pytest.raises(SpecPilotError, match=r"passed as the ar arm, but its engine \w+ is the final arm.*swapped"):
        cmp.compare(arms["final"], arms["stock"], arms["ar"], name="c_swap", chart=False)


@pytest.mark.slow
def test_compare_refuses_one_run_passed_thrice(arms):
    with pytest.raises(SpecPilotError, match="is passed as both ar and stock"):
        cmp.compare(arms["final"], arms["final"], arms["final"], name="c_thrice", chart=False)


@pytest.mark.slow
def test_compare_refuses_mixed_dtypes(trust, arms):
    path, _ = _tampered(trust, "c_bf16", lambda d: _as_engine(d, trust["engines"]["bf16_final"], "c_bf16"))
    with pytest.raises(SpecPilotError, match=r"differ in dtype \(ar float32, stock float32, final bfloat16\)"):
        cmp.compare(arms["ar"], arms["stock"], str(path), name="c_bf16", chart=False)


# --- attestations -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_statements_bind_verdicts_and_speedups_to_the_files(trust, arms):
    from specpilot_build.cli.main import main
    from specpilot_build.measure.attest import STATEMENT_TYPE, check_statement

    verify_statement = trust["final_run"].with_name("trust_final.verify.intoto.json")
    statement, problems = check_statement(verify_statement)
    assert problems == [] and statement["_type"] == STATEMENT_TYPE
    assert statement["predicate"]["verdict"] == "lossless"
    assert statement["predicate"]["oracle_engine_id"] == trust["engines"]["ar"].id
    assert {s["name"] for s in statement["subject"]} == {"trust_final.json", "trust_final.verify.json"}

    copies = {}
    for arm, source in arms.items():  # copies: this test edits one
        copies[arm] = trust["results"] / f"a_{arm}.json"
        copies[arm].write_bytes(Path(source).read_bytes())
    report = cmp.compare(*(str(copies[arm]) for arm in ("ar", "stock", "final")), name="c_attest", chart=True)
    compare_statement = report["statement"]
    assert main(["attest", "check", compare_statement]) == 0
    statement = _load(Path(compare_statement))
    assert {s["name"] for s in statement["subject"]} == {
        "a_ar.json",
        "a_stock.json",
        "a_final.json",
        "c_attest.json",
        "c_attest.png",
    }
    predicate = statement["predicate"]
    assert predicate["engine_ids"]["final"] == trust["engines"]["final"].id
    assert predicate["speedups"]["final/ar"]["overall"]["speedup"] > 0

    edited = _load(copies["final"])
    edited["requests"][0]["latency_s"] /= 2  # a faster final
    copies["final"].write_text(json.dumps(edited))
    proc = _run_cli(trust, "attest", "check", compare_statement)
    assert proc.returncode == 1 and "a_final.json: sha256" in proc.stdout
