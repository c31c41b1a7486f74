"""The command line: one parser home, no tracebacks, output that a pipe or a file receives whole."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specpilot_build.assemble.builder import build_engine
from specpilot_build.locations import REPO_ROOT

VERBS = ("engine", "sweep", "lock", "models", "serve", "stop", "bench", "compare", "score", "verify", "diff", "demo")


def cli(*args, stdout=subprocess.PIPE, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_verb_with_a_line_each():
    out = cli("--help")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    for verb in VERBS:
        assert any(line.split()[:1] == [verb] and len(line.split()) > 1 for line in lines), verb


def test_piped_output_keeps_whole_ids_and_paths():
    engine = build_engine("cpu_c1_stories260k_ngram", "final").engine
    listing = cli("engine", "ls")
    assert listing.returncode == 0 and engine.id in listing.stdout  # the whole id, not 12 characters
    shown = cli("engine", "show", engine.id[:8])
    assert shown.returncode == 0 and str(engine.path) in shown.stdout and "…" not in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) > 80


def test_a_closed_pipe_ends_quietly(tmp_path):
    a = build_engine("cpu_c1_stories260k_ngram", "ar").engine
    b = build_engine("cpu_c1_stories260k_ngram", "final").engine
    # `specpilot diff A B | head -1`: the reader leaves after one line
    proc = subprocess.run(
        f"{sys.executable} -m specpilot_build.cli diff --files {a.id} {b.id} | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_a_bug_is_one_line_without_debug_and_a_traceback_with_it(tmp_path):
    bad = tmp_path / "not-json.json"
    bad.write_text("{")
    quiet = cli("score", str(bad))
    assert quiet.returncode != 0 and "Traceback" not in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) <= 2 and quiet.stderr.startswith("error: ")


@pytest.mark.slow
def test_a_sweep_with_a_failed_job_exits_non_zero_naming_it():
    # The seed's settings are not pinned in lockfiles/: their builds fail, every job still composes.
    out = cli("sweep", "--settings", "cpu_c1_stories260k_ngram,h100_c1_qwen38-27b_dflash2", "--arms", "ar")
    assert out.returncode == 2, out.stderr
    assert "1 of 2 sweep jobs failed" in out.stderr and "h100_c1_qwen38-27b_dflash2/ar" in out.stderr


def test_a_sweep_with_a_config_typo_is_one_line_before_any_job_runs():
    out = cli("sweep", "--settings", "cpu_c1_stories260k_ngram", "--arms", "ar", "drafter.num_draft_tokenz=3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2 and "num_draft_tokenz" in out.stderr


def test_a_slurm_launcher_off_a_slurm_cluster_says_so_in_one_line():
    # the test extra installs the slurm extra (submitit); this machine has no srun
    out = cli("sweep", "--settings", "cpu_c1_stories260k_ngram", "--arms", "ar", "--launcher", "slurm")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "LAUNCHER=slurm" in out.stderr and "srun is not on PATH" in out.stderr and "submitit_local" in out.stderr
    tune = cli("tune", "--launcher", "submitit_slurm", "--trials", "1")
    assert tune.returncode == 2 and len(tune.stderr.strip().splitlines()) == 1, tune.stderr
    assert "LAUNCHER=submitit_slurm" in tune.stderr and "srun is not on PATH" in tune.stderr
    unknown = cli("sweep", "--settings", "cpu_c1_stories260k_ngram", "--arms", "ar", "--launcher", "k8s")
    assert unknown.returncode == 2 and "local" in unknown.stderr and "slurm" in unknown.stderr


def test_a_wrong_group_option_lists_the_valid_ones_without_internal_schema_names():
    for override, group, valid in (
        ("hardware=h101", "hardware", ("cpu", "h100", "h200", "rtx-pro-6000")),
        ("arm=fianl", "arm", ("ar", "stock", "final")),
    ):
        out = cli("engine", "build", override)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) <= 2
        listed = out.stderr.split(f"available in {group}:")[1].strip()
        assert sorted(name.strip() for name in listed.split(",")) == sorted(valid)
        assert "_schema" not in out.stderr


@pytest.mark.slow
def test_a_sweep_override_with_several_values_builds_one_engine_per_value():
    out = cli("sweep", "--settings", "cpu_c1_stories260k_ngram", "--arms", "stock", "drafter.num_draft_tokens=4,6")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│ cpu_c1_stories260k_ngram")]
    assert len(rows) == 2 and len({row.split()[5] for row in rows}) == 2  # two different engine ids
    bad = cli("sweep", "--settings", "cpu_c1_stories260k_ngram", "--arms", "stock", "drafter.num_draft_tokens=4,-6")
    assert bad.returncode == 2 and "drafter.num_draft_tokens" in bad.stderr and "-6" in bad.stderr


def test_bench_takes_its_oracle_by_id_where_no_builder_runs(session_data):
    """An installed bundle has engines but no builder: `bench --oracle <ar id>` names the ar engine in the store,
    checked to be the ar arm of the engine's own setting (seen on the H200: bench of a stock arm tried to build its
    oracle and failed on the missing runtime package)."""
    from specpilot_build.cli.main import _oracle_of
    from specpilot_build.errors import SpecPilotError

    ar = build_engine("cpu_c1_stories260k_ngram", "ar").engine
    final = build_engine("cpu_c1_stories260k_ngram", "final").engine
    other_ar = build_engine("cpu_c16_stories260k_ngram", "ar").engine
    assert _oracle_of(final, ar.id[:12]).id == ar.id
    assert _oracle_of(ar).id == ar.id
    with pytest.raises(
        SpecPilotError,
        match=r"is cpu_c1_stories260k_ngram/final, not the ar arm of "
        r"cpu_c1_stories260k_ngram",
    ):
        _oracle_of(final, final.id)
    with pytest.raises(
        SpecPilotError,
        match=r"is cpu_c16_stories260k_ngram/ar, not the ar arm of "
        r"cpu_c1_stories260k_ngram",
    ):
        _oracle_of(final, other_ar.id)
    with pytest.raises(SpecPilotError, match=r"is an ar arm: it is its own oracle"):
        _oracle_of(ar, final.id)
