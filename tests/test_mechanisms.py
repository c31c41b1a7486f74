"""Mechanisms as a Hydra group (conf/mechanism/): presets list them, in order; every key a mechanism or an
override sets is checked at compose time, and each mistake is one line naming the key and the file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from specpilot_build.config.compose import compose_setting, list_settings
from specpilot_build.config.effective import effective_config
from specpilot_build.config.schema import RUNTIME_OPTION_RANGES
from specpilot_build.errors import ConfigError
from specpilot_build.locations import REPO_ROOT, conf_dir

CPU = "cpu_c1_stories260k_handwritten"  # the hand-written final: the worked example of mechanisms and overrides
EMBEDDED = "cpu_c1_stories260k_ngram"  # its final is the one `make tune` promoted (conf/mechanism/promoted/)
SGLANG = "h100_c1_qwen3-8b_dflash"
ENTRY = re.compile(r"^\s*- /mechanism@final\.mechanisms\.([\w-]+): ([\w/-]+)\s*$")


def listed(setting: str) -> list[tuple[str, str]]:
    """(name, file) of each mechanism the preset's defaults list names, in its order."""
    text = (conf_dir() / "setting" / f"{setting}.yaml").read_text()
    return [m.groups() for m in map(ENTRY.match, text.splitlines()) if m]


def edit(path, old, new):
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def refused(setting, arm, overrides=(), *words):
    with pytest.raises(ConfigError) as err:
        compose_setting(setting, arm, list(overrides))
    message = str(err.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


# the group ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list_settings())
def test_presets_list_mechanisms_from_the_group_and_are_named_by_their_file(setting):
    raw = yaml.safe_load((conf_dir() / "setting" / f"{setting}.yaml").read_text())
    assert "setting" not in raw and "final" not in raw, "a preset lists mechanisms; its name is its file name"
    entries = listed(setting)
    assert entries and all((conf_dir() / "mechanism" / f"{file}.yaml").is_file() for _, file in entries)
    composed = compose_setting(setting, "final")
    assert composed.config["setting"] == setting == composed.choices["setting"]
    # the order the preset lists them is the order they apply in
    assert [m["name"] for m in effective_config(composed.config)["mechanisms"]] == [n for n, _ in entries]
    # mechanism choices are not recorded: the effective config carries what each one sets
    assert set(composed.choices) == {"setting", "hardware", "model", "drafter", "batching", "runtime", "arm"}


# mechanisms no preset lists, added from the command line (tested below; ngram-corpus in test_corpus_drafter.py,
# ngram-corpus-sglang in test_sglang_corpus.py)
ADD_ONS = {"w12-dense-fallback", "ngram-corpus", "ngram-corpus-sglang"}


def test_every_mechanism_file_is_used_and_every_group_file_opens_with_a_comment():
    used = {file for s in list_settings() for _, file in listed(s)}
    group = conf_dir() / "mechanism"
    # tuned/ holds the latest tune's winner, named by no preset until PROMOTE copies it to promoted/
    files = {p.relative_to(group).with_suffix("").as_posix() for p in group.rglob("*.yaml") if p.parent.name != "tuned"}
    assert used | ADD_ONS == files and not used & ADD_ONS
    for path in sorted(conf_dir().rglob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) > 10, f"{path} opens without a comment saying what it is"


def test_a_mechanism_shared_by_every_sglang_preset_is_one_file_and_sets_the_same_values():
    users = [s for s in list_settings() if ("cuda-graph-bs", "cuda-graph-bs") in listed(s)]
    sglang = [s for s in list_settings() if compose_setting(s, "final").config["runtime"]["name"].startswith("sglang")]
    assert sorted(users) == sorted(sglang) and len(users) >= 10
    for setting in users:
        cfg = effective_config(compose_setting(setting, "final").config)
        assert cfg["runtime"]["launch_args"]["cuda-graph-max-bs-decode"] == cfg["batching"]["concurrency"]


def test_the_hand_written_final_composes_as_before():
    cfg = effective_config(compose_setting(CPU, "final").config)
    assert cfg["mechanisms"] == [
        {"name": "shared-ngram-cache", "overlay": None},
        {"name": "tuned-ngram", "overlay": None},
    ]
    assert cfg["drafter"] == {
        "name": "ngram",
        "algorithm": "ngram",
        "repo": None,
        "files": [],
        "num_draft_tokens": 10,
        "ngram_max_n": 8,
        "ngram_min_n": 1,
        "block_size": None,
        "num_steps": None,
        "eagle_topk": None,
    }
    assert cfg["runtime_options"] == {"shared_ngram_cache": True} and cfg["kernels"] == []


def test_the_embedded_default_composes_to_the_final_make_tune_promoted():
    assert listed(EMBEDDED) == [("tuned", f"promoted/{EMBEDDED}")]
    promoted = (conf_dir() / "mechanism" / "promoted" / f"{EMBEDDED}.yaml").read_text()
    assert (
        promoted.startswith(f"# Promoted by `make tune SETTING={EMBEDDED} PROMOTE=1`") and "verify lossless" in promoted
    )
    cfg = effective_config(compose_setting(EMBEDDED, "final").config)
    assert cfg["mechanisms"] == [{"name": "tuned", "overlay": None}]
    drafter = {k: cfg["drafter"][k] for k in ("num_draft_tokens", "ngram_max_n", "ngram_min_n", "recipe")}
    assert drafter == {"num_draft_tokens": 8, "ngram_max_n": 8, "ngram_min_n": 2, "recipe": "corpus"}
    assert cfg["runtime_options"] == {"shared_ngram_cache": True} and cfg["kernels"] == []
    for arm in ("ar", "stock"):  # the promotion moved the final arm only
        ours, theirs = (effective_config(compose_setting(s, arm).config) for s in (EMBEDDED, CPU))
        assert {**ours, "setting": None, "description": None} == {**theirs, "setting": None, "description": None}


def test_the_w12_dense_fallback_is_a_mechanism_added_from_the_command_line_to_reference_engines_only():
    add = ["+mechanism@final.mechanisms.w12-dense-fallback=w12-dense-fallback"]
    cfg = effective_config(compose_setting("cpu_c1_stories260k-bf16_ngram", "final", add).config)
    assert cfg["runtime_options"] == {"shared_ngram_cache": True, "w12_dense_fallback": True}
    assert cfg["model"]["quantization"] == "w12" and cfg["kernels"] == ["w12"]
    plain = effective_config(compose_setting("cpu_c1_stories260k-bf16_ngram", "final").config)
    assert "w12_dense_fallback" not in plain["runtime_options"]
    refused(SGLANG, "final", add, "runtime_options", "w12-dense-fallback.yaml", "sglang")


def test_a_typo_in_the_w12_dense_fallback_mechanism_is_refused_where_it_is_added(conf):
    edit(conf / "mechanism" / "w12-dense-fallback.yaml", "w12_dense_fallback: true", "w12_dense_fallbak: true")
    refused(
        "cpu_c1_stories260k-bf16_ngram",
        "final",
        ["+mechanism@final.mechanisms.w12-dense-fallback=w12-dense-fallback"],
        "mechanism/w12-dense-fallback.yaml",
        "'runtime_options.w12_dense_fallbak'",
        "runtime_options.w12_dense_fallback",
    )


def test_later_mechanisms_win_and_a_mechanism_can_be_swapped_or_dropped_from_the_command_line():
    def launch(overrides):
        return effective_config(compose_setting(SGLANG, "final", overrides).config)["runtime"]["launch_args"]

    assert launch([])["speculative-dflash-block-size"] == 16
    late = launch(["+mechanism@final.mechanisms.late=tuned-dflash-block-8"])
    assert late["speculative-dflash-block-size"] == 8
    swapped = compose_setting(SGLANG, "final", ["mechanism@final.mechanisms.tuned-dflash-block=tuned-dflash-block-8"])
    names = [m["name"] for m in effective_config(swapped.config)["mechanisms"]]
    assert names == [n for n, _ in listed(SGLANG)]  # same place in the order, other values
    assert effective_config(swapped.config)["runtime"]["launch_args"]["speculative-dflash-block-size"] == 8
    dropped = effective_config(compose_setting(SGLANG, "final", ["~mechanism@final.mechanisms.w12-weights"]).config)
    assert "w12-weights" not in [m["name"] for m in dropped["mechanisms"]] and dropped["kernels"] == []


def test_a_setting_is_named_by_its_file(conf):
    shutil.copyfile(conf / "setting" / f"{CPU}.yaml", conf / "setting" / "cpu_c1_renamed.yaml")
    composed = compose_setting("cpu_c1_renamed", "final")
    assert composed.setting == composed.config["setting"] == "cpu_c1_renamed"
    edit(conf / "setting" / f"{CPU}.yaml", "description:", f"setting: {CPU}\ndescription:")
    refused(CPU, "final", (), f"setting/{CPU}.yaml", "setting:", "file name")


# typos and ranges: each refused in one line naming the key and the file ------------------------------------


@pytest.mark.parametrize(
    "file, old, new, words",
    [
        ("tuned-ngram-k10-n8", "ngram_max_n: 8", "ngram_max_m: 8", ["'drafter.ngram_max_m'", "drafter.ngram_max_n"]),
        (
            "tuned-ngram-k10-n8",
            "num_draft_tokens: 10",
            "num_draft_tokns: 10",
            ["'drafter.num_draft_tokns'", "drafter.num_draft_tokens"],
        ),
        (
            "shared-ngram-cache",
            "shared_ngram_cache:",
            "shared_ngram_cach:",
            ["'runtime_options.shared_ngram_cach'", "runtime_options.shared_ngram_cache"],
        ),
        ("tuned-ngram-k10-n8", "drafter:", "drafterz:", ["drafterz", "Mechanism", "did you mean 'drafter'"]),
        ("tuned-ngram-k10-n8", "num_draft_tokens: 10", "num_draft_tokens: 0", ["num_draft_tokens", ">= 1"]),
        ("tuned-ngram-k10-n8", "num_draft_tokens: 10", "num_draft_tokens: ten", ["num_draft_tokens", "'ten'", "int"]),
        ("tuned-ngram-k10-n8", "ngram_max_n: 8", "quantization: w12", ["drafter.quantization"]),
        ("shared-ngram-cache", "shared_ngram_cache: true", "shared_ngram_cache: 1", ["shared_ngram_cache", "bool"]),
        ("shared-ngram-cache", "shared_ngram_cache: true", "num_threads: 0", ["num_threads", ">= 1"]),
    ],
)
def test_a_typo_or_bad_value_in_a_mechanism_file_is_refused_naming_key_and_file(conf, file, old, new, words):
    edit(conf / "mechanism" / f"{file}.yaml", old, new)
    refused(CPU, "final", (), f"mechanism/{file}.yaml", *words)


def test_a_mechanism_is_checked_on_every_arm_and_against_its_runtime(conf):
    edit(conf / "mechanism" / "tuned-ngram-k10-n8.yaml", "ngram_max_n: 8", "ngram_max_m: 8")
    refused(CPU, "ar", (), "ngram_max_m", "tuned-ngram-k10-n8.yaml")  # a broken preset is broken for every arm
    edit(conf / "mechanism" / "tuned-ngram-k10-n8.yaml", "ngram_max_m: 8", "ngram_max_n: 8")
    refused(
        SGLANG,
        "final",
        ["+mechanism@final.mechanisms.x=shared-ngram-cache"],
        "runtime_options",
        "shared-ngram-cache.yaml",
        "sglang",
    )
    refused(
        CPU, "final", ["+mechanism@final.mechanisms.x=cuda-graph-bs"], "launch_args", "cuda-graph-bs.yaml", "reference"
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["+foo=1"], ["unknown key 'foo'", "+foo=1", "nearest valid key"]),
        (["+drafter.num_draft_tokenz=6"], ["'drafter.num_draft_tokenz'", "did you mean 'drafter.num_draft_tokens'"]),
        (["+model.quantisation=w12"], ["'model.quantisation'", "did you mean 'model.quantization'"]),
        (
            ["+final.mechanisms.tuned-ngram.drafter.ngram_max_m=4"],
            ["ngram_max_m", "did you mean", "final.mechanisms.tuned-ngram.drafter.ngram_max_n"],
        ),
        (["drafter.num_draft_tokens=-3"], ["drafter.num_draft_tokens", "-3", ">= 1", "override"]),
        (["drafter.ngram_max_n=0"], ["drafter.ngram_max_n", ">= 1"]),
        (["batching.concurrency=0"], ["batching.concurrency", ">= 1"]),
        (["final.mechanisms.tuned-ngram.drafter.num_draft_tokens=abc"], ["num_draft_tokens", "'abc'", "override"]),
    ],
)
def test_a_bad_override_is_refused_naming_the_key(overrides, words):
    for arm in ("stock", "final"):
        refused(CPU, arm, overrides, *words)


def test_a_bad_value_in_a_drafter_group_file_names_the_file(conf):
    edit(conf / "drafter" / "ngram.yaml", "num_draft_tokens: 4", "num_draft_tokens: -3")
    refused(CPU, "stock", (), "drafter.num_draft_tokens", "drafter/ngram.yaml", ">= 1")
    edit(conf / "drafter" / "dflash-qwen3-8b.yaml", "block_size: 16", "block_size: 0")
    refused(SGLANG, "stock", (), "drafter.block_size", "drafter/dflash-qwen3-8b.yaml")


# an override of what a final-arm mechanism sets ---------------------------------------------------------


@pytest.mark.parametrize(
    "setting, override, mechanism, file",
    [
        (CPU, "drafter.num_draft_tokens=6", "tuned-ngram", "tuned-ngram-k10-n8.yaml"),
        (CPU, "drafter.ngram_max_n=5", "tuned-ngram", "tuned-ngram-k10-n8.yaml"),
        (SGLANG, "model.quantization=fp8", "w12-weights", "w12-weights-sglang.yaml"),
        (
            SGLANG,
            "+runtime.launch_args.speculative-dflash-block-size=4",
            "tuned-dflash-block",
            "tuned-dflash-block-16.yaml",
        ),
    ],
)
def test_an_override_a_final_mechanism_also_sets_is_an_error_naming_both(setting, override, mechanism, file):
    refused(
        setting,
        "final",
        [override],
        f"override {override}",
        f"mechanism '{mechanism}'",
        file,
        f"final.mechanisms.{mechanism}.",
    )
    compose_setting(setting, "stock", [override])  # stock applies no mechanisms: nothing to collide with


def test_the_mechanism_itself_is_the_place_to_change_its_value():
    composed = compose_setting(CPU, "final", ["final.mechanisms.tuned-ngram.drafter.num_draft_tokens=6"])
    assert effective_config(composed.config)["drafter"]["num_draft_tokens"] == 6


# the command line: one line, no traceback -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override, words",
    [
        ("+drafter.num_draft_tokenz=6", ["drafter.num_draft_tokens"]),
        ("drafter.num_draft_tokens=6", ["tuned-ngram", "tuned-ngram-k10-n8.yaml"]),
    ],
)
def test_the_cli_prints_one_line_and_exits_2(tmp_path, override, words):
    out = subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", CPU, "--arm", "final", override],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        env={**os.environ, "SPECPILOT_ENGINES": str(tmp_path / "engines")},
    )
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and out.stderr.startswith("error: ")
    for word in words:
        assert word in out.stderr
    assert not (tmp_path / "engines").exists() or not any(
        p for p in (tmp_path / "engines").iterdir() if len(p.name) == 64
    )


def test_runtime_option_ranges_name_real_reference_runtime_options():
    from specpilot_runtime.config import RUNTIME_OPTIONS

    assert set(RUNTIME_OPTION_RANGES) <= set(RUNTIME_OPTIONS)


def test_a_sweep_job_is_checked_as_compose_setting_checks_it():
    """from_hydra_config (a multirun job's path) names the setting from its file and runs the same checks."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from specpilot_build.config.compose import from_hydra_config
    from specpilot_build.config.schema import register

    def job(overrides):
        register()
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(
                config_name="config",
                overrides=[f"setting@_global_={CPU}", "arm=final", *overrides],
                return_hydra_config=True,
            )
        GlobalHydra.instance().clear()
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        return from_hydra_config(cfg, choices, overrides)

    composed = job([])
    assert composed.setting == CPU and composed.config == compose_setting(CPU, "final").config
    assert composed.choices == compose_setting(CPU, "final").choices
    with pytest.raises(ConfigError, match="tuned-ngram-k10-n8.yaml"):
        job(["drafter.num_draft_tokens=6"])
    with pytest.raises(ConfigError, match="did you mean 'drafter.num_draft_tokens'"):
        job(["+drafter.num_draft_tokenz=6"])
