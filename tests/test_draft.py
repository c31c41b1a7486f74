"""`specpilot draft` on the stories260K target: recipes (a) truncated and (b) standalone, ids, the store, the lock,
determinism, resume after an interruption, and the one-line refusals (unknown recipe key, tokenizer or vocabulary
that differs from the target's), with nothing half-written in the store or the lock."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SETTING = "cpu_c1_stories260k_ngram"
# (b) cut to seconds: 3 prompts per dataset, 24 new tokens, 12 steps with a checkpoint every 4
SMALL = ["data.limit=3", "data.max_new_tokens=24", "train.steps=12", "train.checkpoint_every=4", "train.batch_size=4"]


@pytest.fixture(autouse=True)
def scratch_lock(drafter_scratch):
    """A scratch lock (drafters.toml is written) and a data dir per test (the store, the sets)."""
    return drafter_scratch


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stories_dir, repo):
    """The small standalone drafter made once, without interruption: (id, {file: sha256}, losses)."""
    from specpilot_build.draft.make import make_drafter

    base = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(repo / "lockfiles", base / "lockfiles")
    saved = {k: os.environ.get(k) for k in ("SPECPILOT_LOCKFILES", "SPECPILOT_DATA")}
    os.environ.update(SPECPILOT_LOCKFILES=str(base / "lockfiles"), SPECPILOT_DATA=str(base / "data"))
    try:
        made = make_drafter(SETTING, "standalone", SMALL)
        files = _hashes(made.directory)
        losses = json.loads((made.directory / "drafter.json").read_text())["losses"]
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return made.id, files, losses


def _hashes(directory: Path) -> dict[str, str]:
    from specpilot_build.models.proof import sha256_of

    return {p.name: sha256_of(p) for p in sorted(directory.iterdir())}


def _store_entries() -> list[str]:
    from specpilot_build.locations import data_dir

    root = data_dir() / "drafters"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.is_dir() else []


def test_truncated_drafter_is_the_targets_first_layers_pinned_by_id(scratch_lock, stories_dir):
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.draft.store import load_drafter_pins, locked_drafter

    made = make_drafter(SETTING, "truncated", ["num_layers=2"])
    pin = load_drafter_pins()["stories260k-truncated"]
    assert (pin.id, pin.recipe, pin.target) == (made.id, "truncated", "karpathy/tinyllamas")
    assert {f.path: f.sha256 for f in pin.files} == _hashes(made.directory)
    assert locked_drafter("stories260k-truncated", SETTING, "truncated") == made.directory
    draft, target = load_file(made.directory / "model.safetensors"), load_file(stories_dir / "model.safetensors")
    assert sorted(k for k in draft if k.startswith("model.layers.")) == sorted(
        k for k in target if k.startswith(("model.layers.0.", "model.layers.1."))
    )
    for name, tensor in draft.items():
        source = target.get(name, target["model.embed_tokens.weight"] if name == "lm_head.weight" else None)
        assert torch.equal(tensor, source), name
    config = json.loads((made.directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (2, 512)
    assert not (made.directory / "draft_vocab.safetensors").exists()  # (a) keeps the full head


@pytest.mark.slow
def test_same_recipe_and_target_give_the_same_id_and_bytes(scratch_lock, uninterrupted):
    from specpilot_build.draft.make import make_drafter

    made = make_drafter(SETTING, "standalone", SMALL)
    assert made.built and made.id == uninterrupted[0]
    assert _hashes(made.directory) == uninterrupted[1]
    again = make_drafter(SETTING, "standalone", SMALL)  # in the store: found, re-checked, not rebuilt
    assert (again.built, again.id) == (False, made.id)
    other = make_drafter(SETTING, "standalone", [*SMALL, "seed=1"])
    assert other.id != made.id


@pytest.mark.slow
def test_an_interrupted_training_resumes_to_the_bytes_of_an_uninterrupted_one(scratch_lock, uninterrupted):
    from specpilot_build.draft.make import make_drafter

    def interrupt(step: int, loss: float) -> None:
        if step == 6:  # after the checkpoint at step 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_drafter(SETTING, "standalone", SMALL, on_step=interrupt)
    assert [e for e in _store_entries() if not e.startswith(".")] == []  # nothing in the store
    assert not (scratch_lock / "drafters.toml").exists()  # nor in the lock
    resumed = make_drafter(SETTING, "standalone", SMALL)
    assert resumed.id == uninterrupted[0]
    assert _hashes(resumed.directory) == uninterrupted[1]
    assert _store_entries() == [resumed.id.removeprefix("blake3:")]  # the work directory is gone


def test_trained_drafter_with_a_reduced_head_serves_the_targets_exact_tokens(
    scratch_lock, uninterrupted, stories_dir, golden, tmp_path
):
    """The runtime loads the drafter with its draft_to_target map; output equals llama2.c's greedy golden, and
    the trained drafter's proposals are accepted (more than the untrained 1-layer copy's)."""
    from reference_runtime_helpers import engine_config, write_engine

    from specpilot_build.draft.make import make_drafter
    from specpilot_runtime.runtime import load_runtime

    trained = make_drafter(SETTING, "standalone", SMALL)
    baseline = make_drafter(SETTING, "truncated")
    vocab = load_file(trained.directory / "draft_vocab.safetensors")["draft_to_target"]
    assert vocab.dtype == torch.int64 and 0 < len(vocab) <= 256 and bool((vocab[1:] > vocab[:-1]).all())
    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="draft_model", k=3))
    accepted = {}
    for made in (trained, baseline):
        runtime = load_runtime(str(engine_dir), "id", str(stories_dir), str(made.directory), None)
        prompt = golden["prompt_ids"]
        result = runtime.engine.generate(prompt, len(golden["sequence_ids"]) - len(prompt), timeout=60)
        assert prompt + result["output_ids"] == golden["sequence_ids"]
        accepted[made.name] = runtime.server_info()["avg_spec_accept_length"]
        runtime.engine.stop() if hasattr(runtime.engine, "stop") else None
    if (trained.directory / "draft_vocab.safetensors").exists():
        drafter = load_runtime(str(engine_dir), "id", str(stories_dir), str(trained.directory), None).engine.drafter
        assert drafter.model.lm_head.shape[1] == len(vocab)  # the head scores only the draft vocabulary
    assert accepted["stories260k-standalone"] > 1.0


def test_an_unknown_recipe_key_is_one_line_naming_it_and_writes_nothing(
    scratch_lock, capsys, tmp_path, monkeypatch, repo
):
    from specpilot_build.cli.main import main

    assert main(["draft", "--setting", SETTING, "--recipe", "standalone", "train.stepz=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'train.stepz'" in err and "steps" in err
    conf = tmp_path / "conf"
    shutil.copytree(repo / "conf", conf)
    (conf / "recipe" / "bad.yaml").write_text("name: bad\nkind: truncated\nnum_layer: 1\n")
    monkeypatch.setenv("SPECPILOT_CONF", str(conf))
    assert main(["draft", "--setting", SETTING, "--recipe", "bad"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'num_layer'" in err and "recipe/bad.yaml" in err
    (conf / "recipe" / "bad.yaml").write_text("name: bad\nkind: truncated\nseed: 0\ntrain: {steps: 3}\n")
    assert main(["draft", "--setting", SETTING, "--recipe", "bad"]) == 2
    assert "'train' does nothing for kind truncated" in capsys.readouterr().err
    assert _store_entries() == [] and not (scratch_lock / "drafters.toml").exists()


def test_a_drafter_whose_tokenizer_or_vocabulary_differs_is_refused_naming_the_file(
    scratch_lock, stories_dir, tmp_path
):
    from reference_runtime_helpers import engine_config, write_engine

    from specpilot_build.draft.make import make_drafter
    from specpilot_build.draft.store import check_against_target
    from specpilot_build.draft.target import setting_target
    from specpilot_build.errors import SpecPilotError
    from specpilot_runtime.config import RuntimeConfigError
    from specpilot_runtime.runtime import load_runtime

    made = make_drafter(SETTING, "truncated")
    target = setting_target(SETTING).directory
    other = tmp_path / "other"
    shutil.copytree(made.directory, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swapped: same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SpecPilotError, match=r"other/tokenizer.json: differs from the target's tokenizer"):
        check_against_target(other, target)
    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="draft_model", k=3))
    with pytest.raises(RuntimeConfigError, match="tokenizer's vocabulary differs from the target's"):
        load_runtime(str(engine_dir), "x", str(target), str(other), None)
    shutil.copyfile(made.directory / "tokenizer.json", other / "tokenizer.json")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    with pytest.raises(SpecPilotError, match=r"other/config.json: vocab_size 1024 differs from the target's 512"):
        check_against_target(other, target)


def test_a_locked_drafter_is_rehashed_and_an_absent_one_names_the_make_draft_command(scratch_lock):
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.draft.store import locked_drafter
    from specpilot_build.errors import IntegrityError, PinError

    with pytest.raises(PinError, match=r"run `make draft SETTING=s RECIPE=truncated`"):
        locked_drafter("stories260k-truncated", "s", "truncated")
    made = make_drafter(SETTING, "truncated")
    weights = made.directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError, match="model.safetensors: differs from the pinned drafter stories260k-truncated"
    ):
        locked_drafter("stories260k-truncated", SETTING, "truncated")
    with pytest.raises(IntegrityError, match="model.safetensors: differs from the pinned drafter"):
        make_drafter(SETTING, "truncated")  # found in the store: re-hashed, not trusted
    shutil.rmtree(made.directory)
    with pytest.raises(PinError, match="not in the store"):
        locked_drafter("stories260k-truncated", SETTING, "truncated")


# --- the three-arm setting: the final arm switches to the trained drafter -----------------------------------------

STANDALONE_SETTING = "cpu_c1_stories260k_standalone"


def test_engines_of_a_recipe_drafter_need_it_made_first_and_pin_it(scratch_lock, tmp_path, monkeypatch):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.draft.make import make_drafter, recipe_of_setting
    from specpilot_build.errors import PinError

    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    with pytest.raises(PinError, match=rf"run `make draft SETTING={STANDALONE_SETTING} RECIPE=standalone`"):
        build_engine(STANDALONE_SETTING, "final")
    assert recipe_of_setting(STANDALONE_SETTING) == "standalone"
    made = make_drafter(STANDALONE_SETTING, None, SMALL)
    engines = {arm: build_engine(STANDALONE_SETTING, arm).engine for arm in ("ar", "stock", "final")}
    final = engines["final"].manifest["inputs"]["checkpoints"]["drafter"]
    assert final["revision"] == made.id.removeprefix("blake3:")
    assert engines["stock"].manifest["inputs"]["checkpoints"]["drafter"] is None  # n-gram: no checkpoint
    assert engines["final"].config["drafter"]["algorithm"] == "draft_model"
    assert engines["stock"].config["drafter"]["algorithm"] == "ngram"
    assert "recipe" not in engines["stock"].config["drafter"]  # None is left out: no other engine id moves


@pytest.mark.slow
def test_the_trained_drafter_setting_serves_and_verifies_lossless(scratch_lock, tmp_path, monkeypatch):
    from reference_runtime_helpers import free_port

    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.measure import verify as vf
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    make_drafter(STANDALONE_SETTING, None, SMALL)
    engines = {arm: build_engine(STANDALONE_SETTING, arm).engine for arm in ("ar", "final")}
    port, oracle_port = free_port(), free_port()
    serve(engines["final"], port, quiet=True)
    try:
        run = bench(
            engines["final"].id,
            "final",
            limit=1,
            max_new_tokens=48,
            port=port,
            datasets=["gsm8k", "mt-bench"],
            progress=False,
            oracle_engine_id=engines["ar"].id,
        )
    finally:
        stop(port)
    requests = json.loads(run.read_text())["requests"]
    assert all(r["accept_length"] > 1.0 for r in requests)  # the drafter's proposals are taken
    report = vf.verify(str(run), oracle=engines["ar"].id, port=oracle_port, progress=False)
    assert report["verdict"] == "lossless" and report["real_mismatches"] == 0
    assert report["verified"] == report["tokens"] == sum(r["completion_tokens"] for r in requests)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["tokenizer", "config", "vocab_size"])
def test_the_server_refuses_a_draft_model_of_another_vocabulary_in_one_line(
    scratch_lock, stories_dir, tmp_path, change
):
    """`specpilot_runtime.server --draft-model` (what serve runs) on a drafter whose tokenizer maps two tokens the
    other way, or whose config says another vocabulary size (with or without weights to match): exit 2, one error
    line naming the flag and what differs (after the weights' loading bars), no traceback."""
    import subprocess
    import sys

    from reference_runtime_helpers import engine_config, write_engine

    from specpilot_build.draft.make import make_drafter

    other = tmp_path / "other"
    shutil.copytree(make_drafter(SETTING, "truncated").directory, other)
    if change == "tokenizer":
        tokenizer = json.loads((other / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first, second = list(vocab)[300:302]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (other / "tokenizer.json").write_text(json.dumps(tokenizer))
        words = "its tokenizer's vocabulary differs from the target's"
    elif change == "config":  # config.json says 1024 tokens, the weights hold 512 (transformers: a traceback)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
        words = "holds model.embed_tokens.weight of shape [512, 64], but config.json says vocab_size 1024"
    else:  # a consistent drafter of a 1024-token vocabulary (embedding, head and config), the same tokenizer file
        from safetensors.torch import save_file

        weights = load_file(str(other / "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = torch.cat([weights[name], torch.zeros_like(weights[name])])
        save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
        words = "vocabulary 1024 differs from the target's 512"
    engine = write_engine(tmp_path / "eng", engine_config("stock", algorithm="draft_model", k=3))
    argv = ["--engine", str(engine), "--engine-id", "x", "--model", str(stories_dir), "--draft-model", str(other)]
    proc = subprocess.run(
        [sys.executable, "-m", "specpilot_runtime.server", *argv, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # beside loading bars
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr
    assert f"--draft-model {other}" in errors[0] and words in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
