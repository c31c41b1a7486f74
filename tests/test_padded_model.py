"""The padded stories260K (source_format `llama2c-padded`): the shapes SGLang's GPU kernels accept (head_dim 8 → 16,
intermediate 172 → 176), deterministic, pinned in the lock (`converted_padded`), and the same function as the
unpadded conversion — checked with transformers on CPU against the unpadded logits (float64; greedy tokens in
float32) and llama2.c's golden greedy continuation — and the h200 SGLang settings that use it compose, build and
pass SGLang's own argument check."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from fake_hub import FakeHub
from huggingface_hub import constants as hub_constants

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.models.checkpoints import PADDED_KEY, converted_files, materialize, padded_pins
from specpilot_build.models.llama2c import OUTPUT_FILES, ROPE_THETA, convert, spread_head_rows
from specpilot_build.models.lock import lock_repos, write_lockfile
from specpilot_build.pins.lockfile import CheckpointPin, load_checkpoint_pins, load_lock

TINY = "karpathy/tinyllamas"
BIN, TOK = "stories260K/stories260K.bin", "stories260K/tok512.bin"
SETTINGS = ("h200_c1_stories260k-padded_ngram", "h200_c1_stories260k-padded-bf16_ngram")


@pytest.fixture(scope="module")
def padded(tmp_path_factory, llama2c_dir) -> Path:
    out = tmp_path_factory.mktemp("padded") / "stories260K-padded"
    convert(llama2c_dir / "stories260K.bin", llama2c_dir / "tok512.bin", out, padded=True)
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory, llama2c_dir) -> Path:
    out = tmp_path_factory.mktemp("plain") / "stories260K"
    convert(llama2c_dir / "stories260K.bin", llama2c_dir / "tok512.bin", out)
    return out


@pytest.fixture(scope="module")
def models(plain, padded):
    import torch
    from transformers import AutoModelForCausalLM

    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return load(plain), load(padded)


# --- the conversion -------------------------------------------------------------------------------------------


def test_padded_conversion_is_byte_identical_across_runs(padded, tmp_path, llama2c_dir):
    again = tmp_path / "again"
    convert(llama2c_dir / "stories260K.bin", llama2c_dir / "tok512.bin", again, padded=True)
    assert sorted(p.name for p in padded.iterdir()) == sorted(OUTPUT_FILES)
    for name in OUTPUT_FILES:
        assert (again / name).read_bytes() == (padded / name).read_bytes(), name


def test_padded_files_match_the_locks_converted_padded_hashes(padded):
    revision, files = padded_pins(REPO_ROOT / "lockfiles" / "checkpoints.toml")[TINY]
    pin = load_lock(REPO_ROOT / "lockfiles").checkpoints[TINY]
    assert revision == pin.revision
    assert files == tuple(converted_files(padded))
    # the unpadded pin (what every existing stories260K engine records) does not carry them
    assert {f.sha256 for f in files if f.path == "model.safetensors"}.isdisjoint(f.sha256 for f in pin.converted)


def test_padded_config_differs_from_the_plain_one_in_the_two_sizes_only(plain, padded):
    a, b = (json.loads((d / "config.json").read_text()) for d in (plain, padded))
    assert (a["head_dim"], a["intermediate_size"]) == (8, 172)
    assert (b["head_dim"], b["intermediate_size"]) == (16, 176)
    assert {k: v for k, v in a.items() if k not in ("head_dim", "intermediate_size")} == {
        k: v for k, v in b.items() if k not in ("head_dim", "intermediate_size")
    }
    for name in OUTPUT_FILES:
        if name not in ("config.json", "model.safetensors"):
            assert (plain / name).read_bytes() == (padded / name).read_bytes(), name


def test_padded_tensors_hold_the_plain_ones_and_zeros_elsewhere(plain, padded):
    from safetensors.numpy import load_file

    a, b = load_file(plain / "model.safetensors"), load_file(padded / "model.safetensors")
    assert sorted(a) == sorted(b)
    layer = "model.layers.0."
    q, k = (
        b[layer + "self_attn.q_proj.weight"].reshape(8, 16, 64),
        b[layer + "self_attn.k_proj.weight"].reshape(4, 16, 64),
    )
    assert not q[:, 1::2].any() and not k[:, 1::2].any()  # odd dims of every head are zero
    assert np.array_equal(k[:, ::2].reshape(32, 64), a[layer + "self_attn.k_proj.weight"])
    scaled = (a[layer + "self_attn.q_proj.weight"].astype(np.float64) * math.sqrt(2)).astype(np.float32)
    assert np.array_equal(q[:, ::2].reshape(64, 64), scaled)
    assert np.array_equal(b[layer + "mlp.gate_proj.weight"][:172], a[layer + "mlp.gate_proj.weight"])
    assert not b[layer + "mlp.gate_proj.weight"][172:].any() and not b[layer + "mlp.up_proj.weight"][172:].any()
    assert not b[layer + "mlp.down_proj.weight"][:, 172:].any()
    for name in ("model.embed_tokens.weight", "model.norm.weight", layer + "input_layernorm.weight"):
        assert np.array_equal(a[name], b[name]), name


def test_spreading_head_dims_keeps_hf_rotary_scores():
    """HF's rotate_half pairs dim i with i + d/2 at angle pos·θ^(−2i/d). Moving dim i to 2i in a head of 2d and
    scaling q by √2 keeps q·k/√head_dim after rotary: the pair lands on (2i, 2i + d) with θ^(−2·2i/2d)."""
    rng = np.random.default_rng(0)
    heads, d, width = 2, 8, 16

    def hf_rope(v, pos, head_dim):
        inv = ROPE_THETA ** (-np.arange(0, head_dim, 2) / head_dim)
        angles = np.concatenate([pos * inv, pos * inv])
        v = v.reshape(heads, head_dim)
        rotated = np.concatenate([-v[:, head_dim // 2 :], v[:, : head_dim // 2]], -1)
        return v * np.cos(angles) + rotated * np.sin(angles)

    wq, wk = rng.normal(size=(heads * d, width)), rng.normal(size=(heads * d, width))
    x_q, x_k = rng.normal(size=width), rng.normal(size=width)
    for pos_q, pos_k in ((3, 7), (0, 0), (411, 17)):
        scores = (hf_rope(wq @ x_q, pos_q, d) * hf_rope(wk @ x_k, pos_k, d)).sum(-1) / math.sqrt(d)
        pq, pk = spread_head_rows(wq * math.sqrt(2), heads, 2), spread_head_rows(wk, heads, 2)
        padded = (hf_rope(pq @ x_q, pos_q, 2 * d) * hf_rope(pk @ x_k, pos_k, 2 * d)).sum(-1) / math.sqrt(2 * d)
        assert np.allclose(scores, padded, rtol=1e-12, atol=1e-12)
    # the other natural placement, (i, i + d/2) → (i, i + d), would change the frequencies
    wrong = np.zeros((heads, 2 * d, width))
    wrong[:, list(range(d // 2)) + list(range(d, d + d // 2))] = (wq * math.sqrt(2)).reshape(heads, d, width)
    pk = spread_head_rows(wk, heads, 2)
    assert not np.allclose(
        (hf_rope(wq @ x_q, 3, d) * hf_rope(wk @ x_k, 7, d)).sum(-1) / math.sqrt(d),
        (hf_rope(wrong.reshape(-1, width) @ x_q, 3, 2 * d) * hf_rope(pk @ x_k, 7, 2 * d)).sum(-1) / 4,
    )


# --- equivalence with transformers on CPU: float64 logits, float32 greedy tokens ------------------------------


def test_padded_logits_equal_the_unpadded_ones(models, golden):
    import torch

    plain, padded = models
    ids = torch.tensor([golden["sequence_ids"]])
    with torch.no_grad():
        a, b = plain(ids).logits, padded(ids).logits
        a64, b64 = copy.deepcopy(plain).double()(ids).logits, copy.deepcopy(padded).double()(ids).logits
    # The same function: in float64 the only difference left is the padded checkpoint's √2·q rounded to float32
    # (3.2e-6 at logits up to ~22), whatever the CPU. In float32 each model also rounds its products in an order
    # its shapes and the BLAS choose (1.5e-5 apart on Intel, 2.6e-5 on an AMD EPYC), so float32 is held to the
    # greedy tokens only.
    torch.testing.assert_close(b64, a64, rtol=0, atol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_padded_model_predicts_the_golden_continuation_at_every_position(models, golden):
    """Teacher-forced greedy: the argmax after each prefix of the golden sequence is its next token."""
    import torch

    _, padded = models
    ids, start = golden["sequence_ids"], len(golden["prompt_ids"])
    with torch.no_grad():
        logits = padded(torch.tensor([ids])).logits[0]
    assert logits[start - 1 : -1].argmax(-1).tolist() == ids[start:]


@pytest.mark.slow
def test_padded_model_generates_llama2cs_golden_greedy_output(models, padded, golden):
    import torch
    from transformers import AutoTokenizer

    _, model = models
    tokenizer = AutoTokenizer.from_pretrained(padded)
    assert tokenizer(golden["prompt"])["input_ids"] == golden["prompt_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([golden["prompt_ids"]]),
            max_length=len(golden["sequence_ids"]),
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    assert out[0].tolist() == golden["sequence_ids"]


# --- fetch and lock -------------------------------------------------------------------------------------------


def _offline(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("SPECPILOT_DATA", str(root / "data"))
    mp.setenv("HF_HUB_CACHE", str(root / "hub"))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.delenv("HF_HOME", raising=False)


def test_materialize_padded_from_the_mirror_is_checked_against_the_lock(monkeypatch, tmp_path, llama2c_dir, padded):
    _offline(monkeypatch, tmp_path)
    pin = load_lock(REPO_ROOT / "lockfiles").checkpoints[TINY]
    out = materialize(TINY, pin, source_format="llama2c-padded", mirror=llama2c_dir)
    assert out.name == "stories260K-padded"
    assert out != materialize(TINY, pin, source_format="llama2c", mirror=llama2c_dir)
    for name in OUTPUT_FILES:
        assert (out / name).read_bytes() == (padded / name).read_bytes(), name
    # a lock whose padded hash differs is refused, naming the file and the key
    lock = tmp_path / "lock"
    lock.mkdir()
    text = (REPO_ROOT / "lockfiles" / "checkpoints.toml").read_text()
    [entry] = [
        f for f in padded_pins(REPO_ROOT / "lockfiles" / "checkpoints.toml")[TINY][1] if f.path == "model.safetensors"
    ]
    (lock / "checkpoints.toml").write_text(text.replace(entry.sha256, "0" * 64))
    assert text.count(entry.sha256) == 1
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(lock))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data2"))
    with pytest.raises(SpecPilotError, match=f"model.safetensors differs from the lock's `{PADDED_KEY}`"):
        materialize(TINY, pin, source_format="llama2c-padded", mirror=llama2c_dir)


def test_lock_records_and_keeps_the_padded_conversion(monkeypatch, tmp_path, llama2c_dir):
    files = {BIN: (llama2c_dir / "stories260K.bin").read_bytes(), TOK: (llama2c_dir / "tok512.bin").read_bytes()}
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    lockfile = tmp_path / "lockfiles" / "checkpoints.toml"
    write_lockfile({"other/model": CheckpointPin(repo="other/model", revision="f" * 40)}, lockfile)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add("tester/tiny", "1" * 40, files, lfs={BIN, TOK})
        fake.add("tester/other", "2" * 40, {"README.md": b"# other\n"})
        lock_repos({"tester/tiny": [BIN, TOK]}, lockfile, source_formats={"tester/tiny": "llama2c-padded"})
        real = padded_pins(REPO_ROOT / "lockfiles" / "checkpoints.toml")[TINY][1]
        assert padded_pins(lockfile)["tester/tiny"] == ("1" * 40, real)  # same bytes in, same converter
        assert (
            load_checkpoint_pins(lockfile)["tester/tiny"].converted
            == load_checkpoint_pins(REPO_ROOT / "lockfiles" / "checkpoints.toml")[TINY].converted
        )
        lock_repos({"tester/other": []}, lockfile)  # locking another repo keeps the padded hashes
    assert padded_pins(lockfile)["tester/tiny"] == ("1" * 40, real)


# --- the h200 settings ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def padded_engines(session_data):
    from specpilot_build.assemble.builder import build_engine

    return {(s, arm): build_engine(s, arm).engine for s in SETTINGS for arm in ("ar", "stock", "final")}


def _argv(engine) -> list[str]:
    return json.loads((engine.path / "launch.json").read_bytes())["argv"]


def _flag(argv: list[str], flag: str):
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.sglang
@pytest.mark.slow
def test_padded_h200_settings_build_with_sglangs_ngram(padded_engines):
    for setting in SETTINGS:
        ar, stock, final = (padded_engines[setting, arm] for arm in ("ar", "stock", "final"))
        dtype = "bfloat16" if "-bf16" in setting else "float16"
        for engine in (ar, stock, final):
            argv = _argv(engine)
            assert engine.manifest["config"]["model"]["source_format"] == "llama2c-padded"
            assert (_flag(argv, "--dtype"), _flag(argv, "--attention-backend"), _flag(argv, "--sampling-backend")) == (
                dtype,
                "triton",
                "pytorch",
            )
            # the engine-id patch cut for the engine's SGLang (0.5.17: its own cut)
            runtime = engine.manifest["config"]["runtime"]["name"]
            assert runtime == "sglang-0.5.17"
            assert engine.manifest["base"]["overlays"][0]["name"] == "engine-id-0.5.17"
            assert "python/sglang/srt/models/llama.py" in {f["path"] for f in engine.manifest["files"]}
        assert "--speculative-algorithm" not in _argv(ar)
        assert _flag(_argv(stock), "--speculative-algorithm") == "NGRAM"
        assert "--speculative-num-draft-tokens" not in _argv(stock)  # SGLang's defaults
        assert "python/sglang/srt/speculative/ngram_worker.py" in {f["path"] for f in stock.manifest["files"]}
        final_argv = _argv(final)
        assert (
            _flag(final_argv, "--speculative-algorithm"),
            _flag(final_argv, "--speculative-num-draft-tokens"),
            _flag(final_argv, "--speculative-ngram-max-bfs-breadth"),
        ) == ("NGRAM", "10", "1")
        assert (_flag(final_argv, "--quantization") == "w12") == ("-bf16" in setting)
        assert (final.path / "kernels" / "w12").is_dir() == ("-bf16" in setting)
    ids = {e.id for e in padded_engines.values()}
    assert len(ids) == 6


@pytest.mark.sglang
@pytest.mark.slow
def test_padded_engines_launch_arguments_pass_sglangs_own_check(padded_engines, monkeypatch, tmp_path, llama2c_dir):
    from specpilot_build.assemble.launch_check import check_launch_args
    from specpilot_build.models.checkpoints import model_dirs

    _offline(monkeypatch, tmp_path)
    monkeypatch.setenv("SPECPILOT_MIRROR", str(llama2c_dir))
    engine = padded_engines[SETTINGS[0], "final"]
    model_dir = model_dirs(engine.manifest["inputs"]["checkpoints"], engine.manifest["config"])["model"]
    assert (
        model_dir.name == "stories260K-padded" and json.loads((model_dir / "config.json").read_text())["head_dim"] == 16
    )
    results = check_launch_args(list(padded_engines.values()), model_dir)
    assert results == {e.id: None for e in padded_engines.values()}
