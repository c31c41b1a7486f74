"""Arms side by side (issue 16, item 5): the rotation, the server's CPU time per request, the CPU-time speedups,
and, end to end on the embedded setting, three results files that bench, compare and verify read unchanged."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from reference_runtime_helpers import STORY_PROMPTS, free_port

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import sidebyside as sbs
from specpilot_build.measure.results import SCHEMA, results_dir, write_json

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
SETTING = "cpu_c1_stories260k_handwritten"
ARMS = ("ar", "stock", "final")


def test_rotation_puts_every_arm_first_second_and_third_equally_often():
    orders = [sbs.rotation(i) for i in range(6)]
    assert orders[:3] == [("ar", "stock", "final"), ("stock", "final", "ar"), ("final", "ar", "stock")]
    assert orders[3:] == orders[:3]
    for place in range(3):
        assert sorted(order[place] for order in orders[:3]) == sorted(ARMS)


def test_process_cpu_time_is_read_from_proc():
    before = sbs.process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = sbs.process_cpu_s(os.getpid())
    assert before is not None and after >= before
    assert sbs.process_cpu_s(None) is None and sbs.process_cpu_s(2**22 + 12345) is None


def _run(arm: str, cpu: list[float], tokens: list[int], process: list[float] | None = None) -> str:
    requests = [
        {
            "dataset": d,
            "item_id": str(i),
            "prompt_ids": [1, i],
            "completion_tokens": n,
            "cpu_s": c,
            "process_cpu_s": process[i] if process else None,
            "output_ids": [5] * n,
            "latency_s": c,
        }
        for i, (c, n, d) in enumerate(zip(cpu, tokens, ["gsm8k", "gsm8k", "mbpp", "mbpp"]))
    ]
    name = f"sbs_{arm}"
    write_json(results_dir() / f"{name}.json", {"schema": SCHEMA, "name": name, "arm": arm, "requests": requests})
    return name


def test_cpu_speedups_are_ratios_of_tokens_per_server_cpu_second():
    tokens = [100, 50, 80, 20]
    report = sbs.cpu_speedups(
        _run("ar", [1.0, 0.5, 0.8, 0.2], tokens, [1.2, 0.6, 1.0, 0.2]),
        _run("stock", [0.8, 0.4, 0.6, 0.2], tokens, [1.0, 0.5, 0.8, 0.2]),
        _run("final", [0.5, 0.25, 0.4, 0.1], tokens, [0.8, 0.4, 0.6, 0.2]),
    )
    assert report["measure"] == "process_cpu_s"  # the whole process is the primary figure
    overall = report["speedups"]["final/ar"]["overall"]
    assert overall["speedup"] == pytest.approx(3.0 / 2.0) and overall["ci95"][0] <= 1.5 <= overall["ci95"][1]
    engine = report["by_measure"]["cpu_s"]["final/ar"]["overall"]
    assert engine["speedup"] == pytest.approx(2.0) and engine["ci95"] == pytest.approx([2.0, 2.0])
    assert report["by_measure"]["cpu_s"]["stock/ar"]["gsm8k"]["speedup"] == pytest.approx(1.5 / 1.2)
    assert report["cpu_s"]["cpu_s"]["ar"] == pytest.approx(2.5)
    engine_only = sbs.cpu_speedups(
        _run("ar", [1.0, 0.5, 0.8, 0.2], tokens),
        _run("stock", [1.0] * 4, tokens),
        _run("final", [0.5, 0.25, 0.4, 0.1], tokens),
    )
    assert engine_only["measure"] == "cpu_s" and list(engine_only["by_measure"]) == ["cpu_s"]


def test_cpu_speedups_refuse_runs_without_server_cpu_times():
    tokens = [10, 10, 10, 10]
    ar = _run("ar", [1.0, 1.0, 1.0, None], tokens)
    with pytest.raises(SpecPilotError, match=r"mbpp/3 record no server CPU time"):
        sbs.cpu_speedups(ar, _run("stock", [1.0] * 4, tokens), _run("final", [1.0] * 4, tokens))


def test_engine_charges_cpu_time_to_each_request(stories_dir):
    """meta_info.cpu_s: positive, and over concurrent requests the shares add up to no more than the engine
    thread's own CPU time."""
    import torch
    from reference_runtime_helpers import hf_model
    from transformers import AutoTokenizer

    from specpilot_runtime.drafters import PromptLookup
    from specpilot_runtime.engine import Engine
    from specpilot_runtime.model import LeanLlama

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    engine = Engine(LeanLlama(hf_model(stories_dir), 3, 5, "cpu"), tokenizer, PromptLookup(1, 3), 4, 3)
    engine_cpu = {}
    run = engine._run

    def timed_run():  # the engine thread's CPU clock, read after each step
        step = engine._step

        def stepped(running):
            step(running)
            engine_cpu["total"] = time.thread_time()

        engine._step = stepped
        run()

    engine._run = timed_run
    engine.thread = threading.Thread(target=engine._run, daemon=True)
    engine.start()
    results = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, engine.generate(tokenizer(STORY_PROMPTS[i])["input_ids"], 60, timeout=120)
            )
        )
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = [results[i]["meta_info"]["cpu_s"] for i in range(3)]
    assert all(c > 0 for c in cpu)
    assert sum(cpu) <= engine_cpu["total"] + 1e-3


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """The embedded setting's three arms served at once and benched side by side; plus a plain bench of ar."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    root = tmp_path_factory.mktemp("sidebyside")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECPILOT_ENGINES", str(root / "engines"))
        env.setenv("SPECPILOT_DATA", str(root / "data"))
        engines = {arm: build_engine(SETTING, arm).engine for arm in ARMS}
        ports = {arm: free_port() for arm in ARMS}
        pids = {}
        try:
            for arm in ARMS:
                pids[arm] = serve(engines[arm], ports[arm], quiet=True)["pid"]
            paths = sbs.bench_side_by_side(
                engines,
                {arm: f"sbs_{arm}" for arm in ARMS},
                ports,
                limit=2,
                max_new_tokens=24,
                datasets=["gsm8k", "mbpp"],
                pids=pids,
                progress=False,
            )
            plain = bench(
                engines["ar"].id,
                "plain_ar",
                limit=2,
                max_new_tokens=24,
                port=ports["ar"],
                datasets=["gsm8k", "mbpp"],
                progress=False,
            )
        finally:
            for arm in ARMS:
                stop(ports[arm])
        yield {"engines": engines, "paths": paths, "plain": plain, "oracle_port": free_port()}


@pytest.mark.slow
def test_side_by_side_files_are_bench_records_plus_cpu_times(side_by_side):
    plain = json.loads(side_by_side["plain"].read_text())
    for arm, path in side_by_side["paths"].items():
        run = json.loads(path.read_text())
        assert run["arm"] == arm and run["engine_id"] == side_by_side["engines"][arm].id
        assert run["oracle_engine_id"] == side_by_side["engines"]["ar"].id
        assert set(run) - {"side_by_side"} == set(plain), "side-by-side records drifted from bench's format"
        for mine, theirs in zip(run["requests"], plain["requests"]):
            assert set(mine) - {"cpu_s", "process_cpu_s"} == set(theirs)
            assert mine["prompt_ids"] == theirs["prompt_ids"] and mine["cpu_s"] > 0
        rounds = run["side_by_side"]["rounds"]
        assert len(rounds) == 4 and [r["order"][0] for r in rounds] == ["ar", "stock", "final", "ar"]
        assert run["side_by_side"]["process_cpu_s"] > 0
        assert all(r["process_cpu_s"] >= r["cpu_s"] * 0.9 for r in run["requests"])  # the whole process
    outputs = {
        arm: [r["output_ids"] for r in json.loads(p.read_text())["requests"]]
        for arm, p in side_by_side["paths"].items()
    }
    assert outputs["ar"] == outputs["stock"] == outputs["final"] == [r["output_ids"] for r in plain["requests"]]


@pytest.mark.slow
def test_compare_and_verify_read_side_by_side_runs_unchanged(side_by_side):
    from specpilot_build.measure.compare import compare
    from specpilot_build.measure.verify import verify

    paths = side_by_side["paths"]
    report = compare(str(paths["ar"]), str(paths["stock"]), str(paths["final"]), name="sbs_compare", chart=False)
    assert report["identity"]["final/ar"]["overall"]["fraction"] == 1.0
    cpu = sbs.cpu_speedups(paths["ar"], paths["stock"], paths["final"])
    assert cpu["speedups"]["final/ar"]["overall"]["speedup"] > 0
    checked = verify(
        str(paths["final"]), oracle=side_by_side["engines"]["ar"].id, port=side_by_side["oracle_port"], progress=False
    )
    assert checked["verdict"] == "lossless" and checked["near_ties"] == 0 and checked["real_mismatches"] == 0
