"""`make tune`: spaces checked against the mechanism schema by name, the study bound to its space, and bounded tunes
on the embedded default with real Hydra, real reference servers on loopback and the real stories260K model."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
from reference_runtime_helpers import three_free_ports

from specpilot_build.cli.main import main
from specpilot_build.errors import ConfigError, SpecPilotError
from specpilot_build.locations import REPO_ROOT

SETTING = "cpu_c1_stories260k_ngram"
HANDWRITTEN = "cpu_c1_stories260k_handwritten"  # the hand-written final PROMOTE is confirmed against
DATASETS = ["gsm8k", "mbpp"]


@pytest.fixture
def test_overlays(monkeypatch):
    """The builder reads overlays from tests/overlays/ (lossy-accept, slow-steps: test-only, see its README)."""
    from specpilot_build import locations
    from specpilot_build.assemble import overlays

    root = REPO_ROOT / "tests" / "overlays"
    monkeypatch.setattr(overlays, "OVERLAYS_DIR", root)
    monkeypatch.setattr(locations, "OVERLAYS_DIR", root)
    return root


def _space(conf, name: str, text: str) -> str:
    (conf / "tune" / f"{name}.yaml").write_text(text)
    return name


def _refusal(name: str) -> str:
    from specpilot_build.tune.space import check_space, load_space

    with pytest.raises(ConfigError) as caught:
        check_space(load_space(name), SETTING)
    message = str(caught.value)
    assert "\n" not in message and f"{name}.yaml" in message
    return message


def test_the_shipped_space_composes_into_the_embedded_default():
    from specpilot_build.tune.space import check_space, load_space

    space = load_space("ngram")
    assert check_space(space, SETTING) == ["tuned"]  # the promoted final: a candidate replaces it
    assert check_space(space, HANDWRITTEN) == ["shared-ngram-cache", "tuned-ngram"]
    assert space.grid()["drafter.num_draft_tokens"] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert "drafter.tree_breadth" not in space.grid()


def test_the_tree_space_composes_and_searches_tree_breadth():
    from specpilot_build.tune.space import check_space, load_space

    space = load_space("ngram_tree")
    assert check_space(space, SETTING) == ["tuned"]
    assert check_space(space, HANDWRITTEN) == ["shared-ngram-cache", "tuned-ngram"]
    assert space.grid()["drafter.tree_breadth"] == [1, 2, 3, 4]


def test_the_pair_space_searches_the_hybrids_head_keys_only_where_a_fallback_is_chosen():
    import optuna

    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.tune.run import suggest_point
    from specpilot_build.tune.space import candidate_overrides, check_space, load_space

    setting = "cpu_c1_smollm2-135m_ngram"
    space = load_space("pair")
    mechanisms = check_space(space, setting)
    assert mechanisms == ["shared-ngram-cache", "tuned-ngram"]
    assert space.grid()["drafter.fallback"] == [None, "eagle3"]
    head_keys = {"drafter.fallback_num_draft_tokens", "drafter.recipe"}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    distributions = space.distributions()
    seen = set()
    for _ in range(16):
        trial = study.ask()
        values = suggest_point(trial, space, distributions)
        study.tell(trial, 1.0)
        hybrid = values["drafter.fallback"] is not None
        seen.add(hybrid)
        assert head_keys & set(values) == (head_keys if hybrid else set()), values
        assert trial.params == values  # what the study records is the candidate that ran
        composed = compose_setting(setting, "final", candidate_overrides(mechanisms, values))
        drafter = effective_config(composed.config)["drafter"]
        if hybrid:
            assert drafter["fallback"] == "eagle3" and drafter["recipe"] == "eagle3-135m"
            assert drafter["fallback_num_draft_tokens"] == values["drafter.fallback_num_draft_tokens"]
        else:
            assert "fallback" not in drafter and "recipe" not in drafter
    assert seen == {True, False}


def test_the_grid_over_a_conditional_space_reaches_every_candidate():
    import optuna

    from specpilot_build.tune.run import suggest_point
    from specpilot_build.tune.space import load_space
    from specpilot_build.tune.study import make_sampler

    space = load_space("pair")
    study = optuna.create_study(sampler=make_sampler("grid", 0, space.grid()), direction="maximize")
    candidates: list[tuple] = []

    def objective(trial) -> float:
        candidates.append(tuple(sorted(suggest_point(trial, space, space.distributions()).items(), key=str)))
        return 1.0

    study.optimize(objective, n_trials=1000)
    # k 2..8 x ngram_max_n 4 x ngram_min_n 2 x (no fallback, or eagle3 with k 1..4): the grid's points without a
    # fallback differ only in the head's unused keys, so each such candidate comes 4 times (a tune reuses its result)
    assert len(set(candidates)) == 7 * 4 * 2 * (1 + 4)
    without = [c for c in candidates if ("drafter.fallback", None) in c]
    assert len(without) == 4 * len(set(without)) == 4 * 7 * 4 * 2


def test_a_conditional_key_needs_a_gate_in_the_space_that_can_be_null(conf):
    from specpilot_build.tune.space import load_space

    base = "params:\n  drafter:\n    fallback: {gate}\n    recipe: [eagle3-135m]\nonly_with:\n  {key}: {on}\n"
    for name, gate, key, on, words in (
        ("nogate", "[null, eagle3]", "drafter.recipe", "drafter.fallbak", "drafter.fallbak is not a key of params"),
        ("nokey", "[null, eagle3]", "drafter.recipee", "drafter.fallback", "drafter.recipee is not a key of params"),
        ("nonull", "[eagle3]", "drafter.recipe", "drafter.fallback", "must list null"),
    ):
        _space(conf, name, base.format(gate=gate, key=key, on=on))
        with pytest.raises(ConfigError) as caught:
            load_space(name)
        message = str(caught.value)
        assert f"{name}.yaml" in message and f"only_with.{key}" in message and words in message, message
        assert "\n" not in message


def test_a_misspelt_key_is_refused_naming_file_key_and_the_nearest(conf):
    name = _space(conf, "typo", "params:\n  drafter:\n    num_draft_tokns: [2, 4]\n")
    message = _refusal(name)
    assert "num_draft_tokns" in message and "did you mean 'final.mechanisms.tuned.drafter.num_draft_tokens'" in message


def test_an_unknown_runtime_option_and_section_are_refused(conf):
    assert "shared_ngram_cach" in _refusal(
        _space(conf, "opt", "params:\n  runtime_options:\n    shared_ngram_cach: [true]\n")
    )
    assert "drafte" in _refusal(_space(conf, "sec", "params:\n  drafte:\n    num_draft_tokens: [2]\n"))


def test_a_range_the_schema_refuses_is_refused(conf):
    message = _refusal(_space(conf, "zero", "params:\n  drafter:\n    num_draft_tokens: {low: 0, high: 4}\n"))
    assert "params.drafter.num_draft_tokens = 0" in message and "must be >= 1" in message
    message = _refusal(_space(conf, "kind", "params:\n  runtime_options:\n    num_threads: [1.5]\n"))
    assert "num_threads" in message and "takes int" in message
    message = _refusal(_space(conf, "sglang", "params:\n  launch_args:\n    speculative-num-steps: [2]\n"))
    assert "launch arguments are SGLang's" in message


def test_empty_spaces_and_bad_shapes_are_refused(conf):
    from specpilot_build.tune.space import load_space

    for name, text, words in (
        ("empty", "description: nothing\n", "the space is empty"),
        ("nochoice", "params:\n  drafter:\n    ngram_max_n: []\n", "no choices"),
        ("backwards", "params:\n  drafter:\n    ngram_max_n: {low: 5, high: 2}\n", "low 5 is above high 2"),
        ("toplevel", "param:\n  drafter:\n    ngram_max_n: [2]\n", "param"),
    ):
        _space(conf, name, text)
        with pytest.raises(ConfigError) as caught:
            load_space(name)
        assert f"{name}.yaml" in str(caught.value) and words in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match="unknown space 'nosuch'"):
        load_space("nosuch")


def test_the_report_tracks_the_best_so_far_lists_failures_and_draws_a_chart(tmp_path):
    from PIL import Image

    from specpilot_build.tune.report import best_so_far, write_report

    def trial(number, state, objective, k, reason=None):
        fs = {"speedup": objective + 0.1, "ci95": [objective, objective + 0.2], "n": 4} if objective else None
        params = {"drafter.num_draft_tokens": k, "overlay": None}
        return {
            "number": number,
            "state": state,
            "params": params,
            "objective": objective,
            "engine_id": "e" * 64,
            "cache_hit": False,
            "final_stock": fs,
            "final_ar": 1.2 if objective else None,
            "reason": reason,
        }

    trials = [
        trial(0, "FAIL", None, 2, "not lossless: verify says diverged"),
        trial(1, "COMPLETE", 1.1, 4),
        trial(2, "COMPLETE", 0.9, 6),
        trial(3, "COMPLETE", 1.3, 8),
    ]
    assert best_so_far(trials) == [None, 1.1, 1.1, 1.3]
    summary = {
        "study": "s",
        "storage": "x.sqlite3",
        "trials": trials,
        "complete": 3,
        "failed": 1,
        "cache_hits": 0,
        "best": trials[3],
        "winner": "conf/mechanism/tuned/x.yaml",
    }
    paths = write_report(summary, tmp_path)
    text = open(paths["markdown"]).read()
    assert "| 0 | 2 | null |  |  |  |  | fail: not lossless: verify says diverged |" in text
    assert "| 2 | 6 | null | 0.900 | 1.100 | 1.000× [0.900–1.100] | 1.200× | complete |" in text
    assert "Best: trial 3, objective 1.300" in text and "![objective per trial" in text
    with Image.open(paths["chart"]) as image:
        assert image.format == "PNG" and image.size[0] > image.size[1]  # one panel per parameter, side by side


def test_trials_zero_is_refused_in_one_line(capsys):
    assert main(["tune", "--trials", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: TRIALS=0: a tune needs at least 1 trial"


def test_a_study_name_reused_with_another_space_is_refused_naming_the_difference():
    from specpilot_build.tune.study import open_study

    binding = {"setting": SETTING, "space": {"drafter.ngram_max_n": [2, 3], "drafter.ngram_min_n": [1]}}
    open_study("reused", binding, None)
    open_study("reused", json.loads(json.dumps(binding)), None)  # the same binding loads it
    with pytest.raises(SpecPilotError) as caught:
        open_study("reused", {**binding, "space": {"drafter.ngram_max_n": [2, 4], "drafter.ngram_min_n": [1]}}, None)
    message = str(caught.value)
    assert "study 'reused'" in message and "\n" not in message
    assert "space drafter.ngram_max_n [2, 3], this tune has [2, 4]" in message


@pytest.mark.parametrize(
    "space, text, argv, words",
    [
        ("typo", "params:\n  drafter:\n    num_draft_tokns: [2, 4]\n", [], ["typo.yaml", "num_draft_tokns"]),
        ("zero", "params:\n  drafter:\n    num_draft_tokens: {low: 0, high: 4}\n", [], ["zero.yaml", ">= 1"]),
        ("empty", "description: nothing\n", [], ["empty.yaml", "the space is empty"]),
        ("ok", "params:\n  drafter:\n    num_draft_tokens: [2]\n", ["--trials", "0"], ["TRIALS=0"]),
        (
            "ok",
            "params:\n  drafter:\n    num_draft_tokens: [2]\n",
            ["--launcher", "k8s"],
            ["LAUNCHER=k8s", "submitit_local"],
        ),
        ("ok", "params:\n  drafter:\n    num_draft_tokens: [2]\n", ["--leaders", "-1"], ["LEADERS=-1"]),
        ("ok", "params:\n  drafter:\n    num_draft_tokens: [2]\n", ["--study", "taken"], ["study 'taken'", "[3]"]),
        (
            "ok",
            "params:\n  drafter:\n    num_draft_tokens: [2]\n",
            ["--promote", "--eval-limit", "0"],
            ["EVAL_LIMIT=0"],
        ),
    ],
)
def test_bad_input_is_one_line_naming_it_and_leaves_conf_untouched(conf, capsys, space, text, argv, words):
    from specpilot_build.tune.study import open_study

    _space(conf, space, text)
    # a study of that name made for another space (what `tune --study taken` would bind to)
    binding = {"setting": SETTING, "space": {"drafter.num_draft_tokens": [3]}, "split": "tune"}
    open_study("taken", {**binding, "slice": {"limit": 2, "max_new_tokens": 128, "datasets": None}}, None)
    before = _conf_bytes(conf)
    assert main(["tune", "--space", space, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and all(w in err for w in words), err
    assert _conf_bytes(conf) == before


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tune(space: str, trials: int, sampler: str, study: str, setting: str = SETTING, **kw):
    from specpilot_build.tune.run import tune

    options = {"limit": 1, "max_new_tokens": 24, "datasets": DATASETS, "port": three_free_ports(), **kw}
    return tune(setting, space, trials, sampler, 0, study, **options)


@pytest.mark.slow
def test_a_bounded_tune_benches_the_tune_split_verifies_and_writes_a_winner_that_builds_it(conf):
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.measure.datasets import load_split
    from specpilot_build.measure.results import load_results
    from specpilot_build.tune.winner import winner_overrides, winner_path

    summary = _tune("ngram", 2, "random", "bounded")
    assert [t["number"] for t in summary["trials"]] == [0, 1]
    complete = [t for t in summary["trials"] if t["state"] == "COMPLETE"]
    assert complete and summary["best_by_trial"]["objective"] == max(t["objective"] for t in complete)
    # the leaders (both distinct points) were benched again side by side, and the winner is chosen by that
    leaders = summary["leaders"]
    assert leaders["split"] == "tune" and sorted(leaders["leaders"]) == sorted(t["number"] for t in complete)
    again = {int(n): t["final_stock"]["ci95"][0] for n, t in leaders["trials"].items()}
    assert summary["best"]["number"] == leaders["chosen"] == max(again, key=again.__getitem__)
    assert all(t["verdict"] == "lossless" for t in leaders["trials"].values())
    import optuna

    study = optuna.load_study(study_name="bounded", storage=f"sqlite:///{summary['storage']}")
    attrs = study.trials[summary["best"]["number"]].user_attrs
    _, rerun = load_results(leaders["runs"][f"t{summary['best']['number']}"])
    assert rerun["engine_id"] == attrs["engine_id"] and rerun["prompts_digest"] == attrs["prompts_digest"]
    assert {d["split"] for d in rerun["datasets"].values()} == {"tune"}
    _, final = load_results(attrs["runs"]["final"])
    # the trial benched the tune split's first item of each dataset, never a dev prompt
    assert {d["split"] for d in final["datasets"].values()} == {"tune"}
    tune_ids = {(d, item.id) for d in DATASETS for item in load_split(d, 1, "tune")}
    dev_ids = {(d, item.id) for d in DATASETS for item in load_split(d, 1, "dev")}
    assert {(r["dataset"], r["item_id"]) for r in final["requests"]} == tune_ids != dev_ids
    assert attrs["prompt_digests"] == [r["prompt_digest"] for r in final["requests"]]
    assert attrs["verdict"] == "lossless"
    report = json.loads(open(attrs["verify_json"]).read())
    assert report["checked_engine_id"] == attrs["engine_id"] and report["verdict"] == "lossless"
    # the winner composes and builds to exactly the winning engine, and carries its provenance
    path = winner_path(SETTING)
    assert path == conf / "mechanism" / "tuned" / f"{SETTING}.yaml" and summary["winner"] == str(path)
    text = path.read_text()
    remeasured = leaders["trials"][str(summary["best"]["number"])]
    for needle in (
        "study: bounded",
        f"engine: {attrs['engine_id']}",
        attrs["verify_digest"],
        attrs["prompts_digest"],
        "chosen among the re-measured leaders",
        remeasured["verify_digest"],
    ):
        assert needle in text
    assert "Leaders re-measured side by side" in open(summary["report"]["markdown"]).read()
    built = build_composed(compose_setting(SETTING, "final", winner_overrides(SETTING, ["tuned"])))
    assert built.engine.id == attrs["engine_id"] and not built.created


@pytest.mark.slow
def test_grid_visits_each_point_once_resumes_with_the_next_trial_and_counts_cache_hits(conf):
    space = _space(conf, "two", "params:\n  drafter:\n    num_draft_tokens: [2, 3]\n")
    first = _tune(space, 1, "grid", "grid", write_winner=False, leaders=0)
    assert [t["number"] for t in first["trials"]] == [0]
    resumed = _tune(space, 5, "grid", "grid", write_winner=False, leaders=0)  # TRIALS above the grid: each point once
    numbers = [t["number"] for t in resumed["trials"]]
    assert numbers == [0, 1]
    points = sorted(t["params"]["drafter.num_draft_tokens"] for t in resumed["trials"])
    assert points == [2, 3]
    again = _tune(space, 5, "grid", "grid", write_winner=False, leaders=0)  # nothing left: no new trial
    assert [t["number"] for t in again["trials"]] == [0, 1]
    # another study over the same points builds nothing new: every candidate is a cache hit
    other = _tune(space, 2, "grid", "grid-again", write_winner=False, leaders=0)
    assert other["cache_hits"] == 2 and first["cache_hits"] == 0


@pytest.mark.slow
def test_a_point_proposed_again_reuses_its_result_and_the_leaders_are_distinct_points(conf):
    space = _space(conf, "single", "params:\n  drafter:\n    num_draft_tokens: [3]\n")
    summary = _tune(space, 3, "random", "again", write_winner=False)  # the random sampler can only repeat it
    first, *repeats = summary["trials"]
    assert first["duplicate_of"] is None and [t["duplicate_of"] for t in repeats] == [0, 0]
    assert summary["duplicates"] == 2 and summary["complete"] == 3
    import optuna

    study = optuna.load_study(study_name="again", storage=f"sqlite:///{summary['storage']}")
    runs = [t.user_attrs["runs"]["final"] for t in study.trials]
    assert runs[1] == runs[2] == runs[0]  # the recorded run, not a second bench under another name
    assert [t.value for t in study.trials] == [study.trials[0].value] * 3
    assert [t.user_attrs["seconds"] for t in study.trials[1:]] == [0.0, 0.0]
    # one distinct point: one leader re-measured, once
    assert summary["leaders"]["leaders"] == [0] and summary["best"]["number"] == 0
    assert summary["best"]["remeasured"] == summary["leaders"]["trials"]["0"]


@pytest.mark.slow
def test_trials_through_submitit_local_serve_on_free_ports_and_their_results_are_checked(conf):
    import os

    import optuna

    from specpilot_build.tune import launched

    port = three_free_ports()
    summary = _tune("ngram", 2, "random", "launched", launcher="submitit_local", port=port)
    assert [t["number"] for t in summary["trials"]] == [0, 1]
    study = optuna.load_study(study_name="launched", storage=f"sqlite:///{summary['storage']}")
    specs = sorted((launched.batch_dir("launched", "x").parent).glob("t*/0.spec.json"))
    assert len(specs) == 2
    for trial, spec in zip(study.trials, specs):
        result = json.loads(spec.with_name("0.result.json").read_text())
        assert result["pid"] != os.getpid()  # the trial ran in submitit's process, not the tune's
        used = set(result["attrs"]["ports"].values())
        assert len(used) == 3 and port not in used  # its own free ports, not PORT
        for p in used:  # and stopped them when it ended
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
        assert trial.user_attrs["engine_id"] == result["attrs"]["engine_id"]
        if trial.state.name == "COMPLETE":
            assert trial.value == result["objective"] == trial.user_attrs["final_stock"]["ci95"][0]
            assert trial.user_attrs["verdict"] == "lossless"
    # the leaders were re-measured through the launcher too, and chose the winner
    assert summary["leaders"]["chosen"] == summary["best"]["number"]
    assert "chosen among the re-measured leaders" in open(summary["winner"]).read()
    # what the tune reads back is checked: a result altered, answering another spec, or over an altered run
    spec = specs[0]
    path = spec.with_name("0.result.json")
    good = path.read_text()
    assert launched.read_result(spec)["ok"] == (study.trials[0].state.name == "COMPLETE")
    raw = json.loads(good)
    path.write_text(json.dumps({**raw, "objective": 9.0}))
    assert "digest does not match" in launched.read_result(spec)["attrs"]["reason"]
    saved = spec.read_text()
    spec.write_text(saved.replace('"trial": 0', '"trial": 7'))
    path.write_text(good)
    assert "another job spec" in launched.read_result(spec)["attrs"]["reason"]
    spec.write_text(saved)
    final = raw["attrs"]["runs"]["final"]
    shutil.copy(final, final + ".bak")
    with open(final, "a") as fh:
        fh.write(" ")
    assert "does not have the sha256 it records" in launched.read_result(spec)["attrs"]["reason"]
    shutil.move(final + ".bak", final)
    path.unlink()
    assert "wrote no result" in launched.read_result(spec)["attrs"]["reason"]


@pytest.mark.slow
def test_a_failing_candidate_is_recorded_with_its_reason_and_cannot_win(conf):
    space = _space(conf, "bad", "params:\n  drafter:\n    ngram_min_n: [1, 6]\n    ngram_max_n: [3]\n")
    summary = _tune(space, 2, "grid", "failing", write_winner=False)
    by_min = {t["params"]["drafter.ngram_min_n"]: t for t in summary["trials"]}
    assert by_min[6]["state"] == "FAIL" and "ngram_min_n 6 > drafter.ngram_max_n 3" in by_min[6]["reason"]
    assert by_min[1]["state"] == "COMPLETE" and summary["best"]["number"] == by_min[1]["number"]


@pytest.mark.slow
def test_ctrl_c_stops_every_server_and_the_same_command_resumes_with_the_next_trial(conf, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import optuna

    from specpilot_build.tune.study import storage_path

    space = _space(conf, "one", "params:\n  drafter:\n    num_draft_tokens: [2, 3, 4]\n")
    port = three_free_ports()
    argv = [sys.executable, "-m", "specpilot_build.cli", "tune", "--space", space, "--trials", "1", "--study", "cut"]
    argv += ["--limit", "1", "--max-new-tokens", "24", "--datasets", ",".join(DATASETS), "--port", str(port)]
    argv += ["--sampler", "grid"]
    log = tmp_path / "tune.log"
    with open(log, "wb") as out:
        # as from a terminal: a runner that started us in the background (SIGINT ignored, inherited through exec)
        # must not make the tune deaf to Ctrl-C
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    deadline = time.monotonic() + 240
    # a trial is under way while its candidate is served on PORT+2 (ar and stock are served for the whole study);
    # not a line of the log: without a terminal rich prints a bench's bar when it ends, and a cached candidate's
    # trial can end before the buffered log shows it
    while not _accepts(port + 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, log.read_text()
    for p in (port, port + 1, port + 2):  # no server is left behind
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    study = optuna.load_study(study_name="cut", storage=f"sqlite:///{storage_path()}")
    assert [(t.number, t.state.name, t.user_attrs.get("reason")) for t in study.trials] == [(0, "FAIL", "interrupted")]
    assert subprocess.run(argv, capture_output=True, text=True, timeout=300).returncode == 0
    study = optuna.load_study(study_name="cut", storage=f"sqlite:///{storage_path()}")
    assert [(t.number, t.state.name) for t in study.trials] == [(0, "FAIL"), (1, "COMPLETE")]


def _conf_bytes(conf) -> dict[str, bytes]:
    return {str(p.relative_to(conf)): p.read_bytes() for p in sorted(conf.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_promote_switches_the_preset_to_a_confirmed_winner_that_composes_builds_and_verifies(conf, test_overlays):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.measure.results import load_results
    from specpilot_build.tune.promote import promoted_path, setting_path

    # today's final made slower on purpose (every step sleeps: tests/overlays/slow-steps), still lossless; the
    # space's one point is the hand-written final without it
    (conf / "mechanism" / "slow-steps.yaml").write_text("overlay: slow-steps\n")
    preset = setting_path(HANDWRITTEN)
    entries = (
        "  - /mechanism@final.mechanisms.shared-ngram-cache: shared-ngram-cache\n"
        "  - /mechanism@final.mechanisms.tuned-ngram: tuned-ngram-k10-n8\n"
    )
    slow = preset.read_text().replace(entries, entries + "  - /mechanism@final.mechanisms.slow: slow-steps\n")
    preset.write_text(slow)
    old_final = build_engine(HANDWRITTEN, "final").engine
    space = _space(
        conf,
        "fast",
        "params:\n  drafter:\n    num_draft_tokens: [10]\n    ngram_max_n: [8]\n"
        "  runtime_options:\n    shared_ngram_cache: [true]\n",
    )
    summary = _tune(space, 1, "grid", "promote-fast", HANDWRITTEN, promote=True, eval_limit=2)
    confirmed = json.loads(open(summary["promote"]["json"]).read())
    gain = confirmed["speedups"]["new/current"]
    assert confirmed["promoted"], confirmed.get("reason")
    assert gain["ci95"][0] > 1 and gain["n"] == 2 * len(DATASETS) and confirmed["verdict"] == "lossless"
    # the preset names the promoted mechanism in place of the old final's three entries; nothing else moved
    assert preset.read_text() == slow.replace(
        entries + "  - /mechanism@final.mechanisms.slow: slow-steps\n",
        f"  - /mechanism@final.mechanisms.tuned: promoted/{HANDWRITTEN}\n",
    )
    assert "new/current final" in promoted_path(HANDWRITTEN).read_text()
    final = compose_setting(HANDWRITTEN, "final").config["final"]["mechanisms"]
    assert list(final) == ["tuned"] and final["tuned"]["drafter"] == {"num_draft_tokens": 10, "ngram_max_n": 8}
    assert final["tuned"]["overlay"] is None and final["tuned"]["runtime_options"] == {"shared_ngram_cache": True}
    built = build_engine(HANDWRITTEN, "final")
    assert built.engine.id == confirmed["engine_ids"]["new"] == summary["best"]["engine_id"] != old_final.id
    assert not built.created
    # `make diff` of the old and new final: only the final's mechanisms moved (the slow overlay gone; drafter values equal), no pin
    from specpilot_build.store.diff import diff_engines

    moved = diff_engines(old_final, built.engine)
    assert moved["config"] and all(c["key"].startswith("config.mechanisms[") for c in moved["config"]), moved["config"]
    assert not moved["pins"] and "slow-steps" in json.dumps(moved["overlays"])
    # the confirmation benched the dev split and forced every token of the new final's run through ar
    _, run = load_results(confirmed["runs"]["new"])
    assert {d["split"] for d in run["datasets"].values()} == {"dev"} and run["engine_id"] == built.engine.id
    predicate = json.loads(open(confirmed["verify_statement"]).read())["predicate"]
    assert predicate["verdict"] == "lossless" and predicate["engine_id"] == built.engine.id


@pytest.mark.slow
def test_a_lossy_candidate_is_recorded_failed_not_lossless_and_cannot_win(conf, test_overlays):
    # the overlay makes the verify step accept every drafted token: fast, and not what ar emits
    space = _space(
        conf,
        "lossy",
        "params:\n  overlay: [lossy-accept, null]\n  drafter:\n    num_draft_tokens: [6]\n"
        "  runtime_options:\n    shared_ngram_cache: [true]\n",
    )
    summary = _tune(space, 2, "grid", "lossy")
    by_overlay = {t["params"]["overlay"]: t for t in summary["trials"]}
    lossy, lossless = by_overlay["lossy-accept"], by_overlay[None]
    assert lossy["state"] == "FAIL" and lossy["reason"].startswith("not lossless: verify says")
    assert lossy["final_stock"] is not None  # it was measured, then refused
    assert lossless["state"] == "COMPLETE" and summary["best"]["number"] == lossless["number"]
    assert "lossy-accept" not in open(summary["winner"]).read()
    # the report beside the study's summary lists both, the refused one with its reason
    report = open(summary["report"]["markdown"]).read()
    assert f'| {lossy["number"]} | 6 | "lossy-accept" | true |' in report and "| fail: not lossless" in report
    assert open(summary["report"]["chart"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_promote_that_does_not_clear_1_changes_nothing_in_conf(conf, capsys, test_overlays):
    # the space's one point is made slower than today's hand-written final on purpose (every step sleeps 5 ms:
    # tests/overlays/slow-steps): a weaker n-gram point alone once beat it on two prompts, after the runtime changed
    space = _space(
        conf,
        "weak",
        "params:\n  overlay: [slow-steps]\n  drafter:\n    num_draft_tokens: [2]\n",
    )
    _tune(space, 1, "grid", "promote-weak", HANDWRITTEN)  # the study and its winner file, as `make tune` leaves them
    before = _conf_bytes(conf)
    summary = _tune(
        space, 1, "grid", "promote-weak", HANDWRITTEN, promote=True, eval_limit=2
    )  # the same command, PROMOTE=1
    confirmed = json.loads(open(summary["promote"]["json"]).read())
    gain = confirmed["speedups"]["new/current"]
    assert not confirmed["promoted"] and gain["ci95"][0] <= 1
    assert confirmed["reason"].startswith("new/current") and "lower bound is not above 1" in confirmed["reason"]
    assert "not promoted" in capsys.readouterr().out
    assert "lower bound is not above 1" in open(summary["report"]["markdown"]).read()
    assert _conf_bytes(conf) == before


@pytest.mark.parametrize("name", ["lossy-accept", "slow-steps"])
def test_each_test_overlay_still_applies_to_the_reference_runtime(test_overlays, tmp_path, name):
    """The test overlays patch exact lines of the runtime's engine.py (no fuzz): an edit there that moves those
    lines must fail here, in the fast tier, rather than as a failed build inside a slow tune test."""

    from specpilot_build.assemble.overlays import apply_overlays, overlay_inputs

    cfg = {"runtime": {"name": "reference"}}
    shutil.copytree(
        REPO_ROOT / "runtimes" / "reference" / "specpilot_runtime", tmp_path / "runtime" / "specpilot_runtime"
    )
    before = (tmp_path / "runtime" / "specpilot_runtime" / "engine.py").read_text()
    apply_overlays(tmp_path, overlay_inputs([name], cfg), cfg)
    assert (tmp_path / "runtime" / "specpilot_runtime" / "engine.py").read_text() != before
