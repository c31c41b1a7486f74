"""Every setting × arm composes and validates; bad configs fail at compose time naming the key."""

from __future__ import annotations

import shutil

import pytest

from specpilot_build.config.compose import ARMS, compose_setting, list_settings
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import conf_dir

SEED = [
    "h100_c1_qwen38-27b_dflash2",
    "h100_c1_qwen38-27b_dspark",
    "h100_c16_qwen38-27b-fp8_dflash2",
    "h100_c16_qwen38-27b-fp8_dspark",
    "rtx-pro-6000_c1_muse-glimmer-30b_dflash2",
    "rtx-pro-6000_c16_qwen38-27b-fp8_dflash2",
]


def test_the_seed_deployments_and_the_embedded_default_are_defined():
    settings = list_settings()
    assert set(SEED) <= set(settings)
    assert "cpu_c1_stories260k_ngram" in settings
    gpu_pinned = [s for s in settings if "qwen3-8b" in s]
    assert len(gpu_pinned) >= 3


@pytest.mark.parametrize("setting", list_settings())
@pytest.mark.parametrize("arm", ARMS)
def test_every_setting_and_arm_composes(setting, arm):
    composed = compose_setting(setting, arm)
    cfg = composed.config
    assert cfg["setting"] == setting and cfg["arm"]["name"] == arm
    assert composed.choices["setting"] == setting and composed.choices["arm"] == arm
    parts = setting.split("_")
    assert cfg["hardware"]["name"] == parts[0] and cfg["batching"]["name"] == parts[1]
    eff = effective_config(cfg)
    if arm == "ar":
        assert eff["drafter"]["algorithm"] == "none" and eff["mechanisms"] == []
    if arm == "final":
        assert eff["mechanisms"], f"{setting}: the final arm lists no mechanisms"


@pytest.mark.parametrize("setting", list_settings())
def test_setting_files_start_with_the_command_that_builds_them(setting):
    lines = (conf_dir() / "setting" / f"{setting}.yaml").read_text().splitlines()
    assert lines[0] == f"# make engine SETTING={setting} ARM=final"
    assert lines[1].startswith("# ") and len(lines[1]) > 20


def test_final_mechanisms_are_named_and_change_only_the_final_arm():
    stock = effective_config(compose_setting("cpu_c1_stories260k_handwritten", "stock").config)
    final = effective_config(compose_setting("cpu_c1_stories260k_handwritten", "final").config)
    assert [m["name"] for m in final["mechanisms"]] == ["shared-ngram-cache", "tuned-ngram"]
    assert final["runtime_options"] == {"shared_ngram_cache": True}
    assert stock["runtime_options"] == {} and stock["drafter"]["num_draft_tokens"] == 4
    assert final["drafter"]["num_draft_tokens"] == 10


@pytest.mark.parametrize("arm", ARMS)
def test_smollm2_at_c16_is_its_c1_setting_batched_16_wide(arm):
    """cpu_c16_smollm2-135m_ngram serves the same target, dtype, runtime and stock drafter as the c1 pair; it
    differs only in batching and, on final, in k (2, as stories260K's c16 final)."""
    c1 = effective_config(compose_setting("cpu_c1_smollm2-135m_ngram", arm).config)
    c16 = effective_config(compose_setting("cpu_c16_smollm2-135m_ngram", arm).config)
    assert c16["batching"]["concurrency"] == c16["batching"]["max_running_requests"] == 16
    assert c1["batching"]["concurrency"] == 1
    for key in ("model", "runtime", "hardware"):
        assert c16[key] == c1[key], key
    assert c16["model"]["name"] == "smollm2-135m" and c16["model"]["dtype"] == "float32"
    if arm == "final":
        assert [m["name"] for m in c16["mechanisms"]] == ["shared-ngram-cache", "tuned-ngram"]
        assert c16["runtime_options"] == {"shared_ngram_cache": True}
        assert (c16["drafter"]["num_draft_tokens"], c1["drafter"]["num_draft_tokens"]) == (2, 4)
    else:
        assert c16["drafter"] == c1["drafter"] and c16["mechanisms"] == c1["mechanisms"] == []


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.bogus=1"], ["model.bogus"]),
        (["batching.concurrency=abc"], ["batching.concurrency", "abc"]),
        (["hardware=tpu"], ["hardware/tpu"]),
    ],
)
def test_bad_overrides_fail_naming_the_key(overrides, words):
    with pytest.raises(SpecPilotError) as err:
        compose_setting("h100_c1_qwen3-8b_dflash", "stock", overrides)
    for word in words:
        assert word in str(err.value)


def test_unknown_setting_and_arm():
    with pytest.raises(SpecPilotError, match="unknown setting 'nope'"):
        compose_setting("nope")
    with pytest.raises(SpecPilotError, match="unknown arm 'fast'"):
        compose_setting("cpu_c1_stories260k_ngram", "fast")


@pytest.mark.parametrize(
    "old, new, words",
    [
        ("memory_gib: 80", "memory_gib: 80\nspeed: 3", ["speed", "Hardware", "hardware/h100"]),
        ("memory_gib: 80", "memory_gib: lots", ["memory_gib", "lots"]),
        ("memory_gib: 80", "memory_gib: [80", ["hardware/h100.yaml"]),
    ],
)
def test_a_group_file_with_an_unknown_key_or_wrong_type_fails_naming_file_and_key(
    tmp_path, monkeypatch, old, new, words
):
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    path = conf / "hardware" / "h100.yaml"
    path.write_text(path.read_text().replace(old, new))
    monkeypatch.setenv("SPECPILOT_CONF", str(conf))
    with pytest.raises(SpecPilotError) as err:
        compose_setting("h100_c1_qwen3-8b_dflash", "final")
    for word in words:
        assert word in str(err.value)
