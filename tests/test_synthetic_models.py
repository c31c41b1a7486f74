"""Synthetic checkpoints (specpilot_build/models/synthetic.py): the small Qwen3 target and its DFlash drafter that
SpecPilot writes itself for h200_c1_qwen3-tiny_dflash — deterministic bytes pinned in lockfiles/checkpoints.toml,
configs transformers reads with the intended shapes, the stories260K tokenizer, and SGLang launched with dummy
weights for exactly those checkpoints."""

from __future__ import annotations

import json

import pytest

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.launch import launch_spec
from specpilot_build.config.compose import compose_setting
from specpilot_build.errors import PinError
from specpilot_build.models import synthetic
from specpilot_build.models.checkpoints import model_dirs, sha256_of, synthetic_tokenizer_dir
from specpilot_build.pins.lockfile import load_lock

SETTING = "h200_c1_qwen3-tiny_dflash"
TARGET, DRAFTER = "specpilot-synthetic/qwen3-tiny", "specpilot-synthetic/dflash-qwen3-tiny"


@pytest.mark.parametrize("repo", [TARGET, DRAFTER])
def test_generation_is_deterministic_and_matches_the_lock(repo, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        out.mkdir()
        synthetic.generate(repo, out, synthetic_tokenizer_dir())
    pin = load_lock().checkpoints[repo]
    assert pin.revision == synthetic.spec_revision(repo)
    assert sorted(p.name for p in first.iterdir()) == sorted(f.path for f in pin.converted)
    for f in pin.converted:
        assert (first / f.path).read_bytes() == (second / f.path).read_bytes()
        assert ((first / f.path).stat().st_size, sha256_of(first / f.path)) == (f.size, f.sha256)


def test_the_configs_load_in_transformers_as_qwen3_with_the_intended_shapes(tmp_path):
    from transformers import AutoConfig, Qwen3Config

    dirs = {}
    for repo in (TARGET, DRAFTER):
        dirs[repo] = tmp_path / repo.split("/")[1]
        dirs[repo].mkdir()
        synthetic.generate(repo, dirs[repo], synthetic_tokenizer_dir())
    target, draft = AutoConfig.from_pretrained(dirs[TARGET]), AutoConfig.from_pretrained(dirs[DRAFTER])
    assert type(target) is Qwen3Config and type(draft) is Qwen3Config
    assert (
        target.hidden_size,
        target.num_hidden_layers,
        target.num_attention_heads,
        target.num_key_value_heads,
        target.head_dim,
        target.intermediate_size,
        target.vocab_size,
    ) == (256, 4, 4, 2, 64, 688, 512)
    assert target.architectures == ["Qwen3ForCausalLM"] and draft.architectures == ["DFlashDraftModel"]
    assert (
        draft.hidden_size,
        draft.num_attention_heads,
        draft.num_key_value_heads,
        draft.head_dim,
        draft.num_hidden_layers,
        draft.num_target_layers,
    ) == (256, 4, 2, 64, 1, 4)
    assert draft.dflash_config == {"block_size": 4, "target_layer_ids": [1, 2], "mask_token_id": 0}
    assert all(0 <= i < target.num_hidden_layers for i in draft.dflash_config["target_layer_ids"])
    # the drafter's dtype is the target's (a float16 draft beside a bf16 target failed in SGLang's drafter)
    raw = {repo: json.loads((dirs[repo] / "config.json").read_text()) for repo in dirs}
    assert raw[TARGET]["torch_dtype"] == raw[DRAFTER]["torch_dtype"] == "bfloat16"
    assert compose_setting(SETTING, "ar").config["model"]["dtype"] == "bfloat16"


def test_the_stories260k_tokenizer_works_for_the_synthetic_target(tmp_path, stories_dir, golden):
    from transformers import AutoTokenizer

    synthetic.generate(TARGET, tmp_path, synthetic_tokenizer_dir())
    ours, theirs = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(stories_dir)
    text = theirs.decode(golden["sequence_ids"])
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert max(golden["sequence_ids"]) < json.loads((tmp_path / "config.json").read_text())["vocab_size"]


def test_serve_gets_verified_directories_and_a_changed_spec_is_refused(monkeypatch):
    inputs = resolve_inputs(compose_setting(SETTING, "stock"), load_lock())
    checkpoints = inputs.record()["checkpoints"]  # as the engine's manifest records them
    dirs = model_dirs(checkpoints, inputs.config)
    assert set(dirs) == {"model", "drafter"}
    assert json.loads((dirs["drafter"] / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert dirs == model_dirs(checkpoints, inputs.config, fetch=False)  # what --dry-run prints
    (dirs["model"] / "config.json").chmod(0o644)
    (dirs["model"] / "config.json").write_text("{}\n")  # damaged in the data dir: regenerated, then checked
    assert model_dirs(checkpoints, inputs.config)["model"] == dirs["model"]
    assert sha256_of(dirs["model"] / "config.json") == next(
        f.sha256 for f in load_lock().checkpoints[TARGET].converted if f.path == "config.json"
    )
    changed = dict(synthetic.SPECS[TARGET], num_hidden_layers=5)
    monkeypatch.setitem(synthetic.SPECS, TARGET, changed)
    with pytest.raises(
        PinError,
        match=r"specpilot-synthetic/qwen3-tiny: lockfiles/checkpoints.toml pins revision "
        r"3143e505d36b.*re-pin it",
    ):
        model_dirs(checkpoints, inputs.config)


@pytest.mark.parametrize("arm", ["ar", "stock", "final"])
def test_the_setting_serves_dummy_weights_for_exactly_its_synthetic_checkpoints(arm):
    inputs = resolve_inputs(compose_setting(SETTING, arm), load_lock())
    assert inputs.runtime_record["version"] == "0.5.17"
    assert inputs.checkpoints["model"].repo == TARGET
    argv = launch_spec(inputs.config)["argv"]
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--load-format"] == "dummy"
    assert flags["--attention-backend"] == "triton" and flags["--mem-fraction-static"] == "0.3"
    if arm == "ar":
        assert inputs.checkpoints["drafter"] is None and "--speculative-algorithm" not in flags
        assert "--speculative-draft-load-format" not in flags
    else:
        assert flags["--speculative-algorithm"] == "DFLASH"
        assert flags["--speculative-draft-load-format"] == "dummy"
        assert inputs.checkpoints["drafter"].repo == DRAFTER
    assert flags.get("--speculative-dflash-block-size") == {"ar": None, "stock": None, "final": "8"}[arm]


@pytest.mark.sglang
@pytest.mark.slow
def test_the_setting_builds_pruned_with_the_dflash_worker_on_sglang_0523(session_data):
    """Every arm builds through the pruning rules and SGLang's own argument check (on 0.5.23, whose parser this
    builder can import; 0.5.17's is the environment helper's check)."""
    from specpilot_build.assemble.builder import build_engine

    for arm in ("ar", "stock", "final"):
        engine = build_engine(SETTING, arm, ["runtime=sglang"]).engine
        files = {f["path"] for f in engine.manifest["files"]}
        assert "python/sglang/srt/models/qwen3.py" in files
        assert (
            arm == "ar"
            or {"python/sglang/srt/speculative/dflash_worker_v2.py", "python/sglang/srt/models/dflash.py"} <= files
        )
        argv = json.loads((engine.path / "launch.json").read_text())["argv"]
        assert argv[argv.index("--load-format") + 1] == "dummy"
