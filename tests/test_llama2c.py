"""The llama2.c converter against the independent reference conversion in ../shared/models/stories260K/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from specpilot_build.errors import SpecPilotError
from specpilot_build.models.llama2c import OUTPUT_FILES, convert, rotate_half_rows


@pytest.fixture(scope="module")
def converted(tmp_path_factory, llama2c_dir) -> Path:
    out = tmp_path_factory.mktemp("conv") / "stories260K"
    convert(llama2c_dir / "stories260K.bin", llama2c_dir / "tok512.bin", out)
    return out


def test_writes_exactly_the_hf_files(converted):
    assert sorted(p.name for p in converted.iterdir()) == sorted(OUTPUT_FILES)


def test_tensors_equal_the_reference_conversion(converted, stories_dir):
    ours, reference = load_file(converted / "model.safetensors"), load_file(stories_dir / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and np.array_equal(ours[name], tensor), name


def test_config_agrees_with_the_reference(converted, stories_dir):
    ours, reference = (json.loads((d / "config.json").read_text()) for d in (converted, stories_dir))
    assert ours == reference
    for name in ("generation_config.json", "special_tokens_map.json"):
        assert json.loads((converted / name).read_text()) == json.loads((stories_dir / name).read_text())


def test_conversion_is_byte_identical_across_runs(converted, tmp_path, llama2c_dir):
    again = tmp_path / "again"
    convert(llama2c_dir / "stories260K.bin", llama2c_dir / "tok512.bin", again)
    for name in OUTPUT_FILES:
        assert (again / name).read_bytes() == (converted / name).read_bytes(), name


def _texts(shared: Path) -> list[str]:
    texts = [
        "Once upon a time",
        " Once upon a time",
        "Lily's mom said, \"Lily, let's go to the park.\"",
        "line one\nline two\n\n\ttabbed",
        "café naïve — “quotes” … 日本語 🙂",
        "x" * 50,
        "a  b",
        "12345 + 67 = 890",
    ]
    for line in (shared / "datasets" / "mt-bench" / "question.jsonl").read_text().splitlines()[:40]:
        texts.extend(json.loads(line)["turns"])
    for line in (shared / "datasets" / "gsm8k" / "test.jsonl").read_text().splitlines()[:40]:
        row = json.loads(line)
        texts.extend([row["question"], row["answer"]])
    with gzip.open(shared / "datasets" / "humaneval" / "HumanEval.jsonl.gz", "rt") as fh:
        texts.extend(json.loads(line)["prompt"] for line in list(fh)[:10])
    return texts


def test_tokenizer_behaves_like_the_reference(converted, stories_dir, shared):
    from transformers import AutoTokenizer

    ours, reference = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(stories_dir)
    texts = _texts(shared)
    assert len(texts) > 150
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2 and ours.unk_token_id == 0


def test_golden_prompt_ids(converted, golden):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(converted)(golden["prompt"])["input_ids"] == golden["prompt_ids"]


def test_rotate_half_rows_preserves_attention_scores():
    """llama2.c rotates pairs (2i, 2i+1) by angle_i; HF rotates (i, i + d/2). After reordering the rows of
    q and k, rotated q·k must be the same in both layouts."""
    rng = np.random.default_rng(0)
    heads, head_dim, width = 2, 8, 16
    wq, x_q, x_k = rng.normal(size=(heads * head_dim, width)), rng.normal(size=width), rng.normal(size=width)
    wk = rng.normal(size=(heads * head_dim, width))
    angles_q, angles_k = (
        3 * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim),
        7 * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim),
    )

    def llama2c_rope(v, angles):
        v = v.reshape(heads, head_dim // 2, 2)
        c, s = np.cos(angles), np.sin(angles)
        return np.stack([v[..., 0] * c - v[..., 1] * s, v[..., 0] * s + v[..., 1] * c], -1).reshape(heads, head_dim)

    def hf_rope(v, angles):
        v = v.reshape(heads, head_dim)
        c, s = np.cos(np.concatenate([angles, angles])), np.sin(np.concatenate([angles, angles]))
        rotated = np.concatenate([-v[:, head_dim // 2 :], v[:, : head_dim // 2]], -1)
        return v * c + rotated * s

    scores_llama2c = (llama2c_rope(wq @ x_q, angles_q) * llama2c_rope(wk @ x_k, angles_k)).sum(-1)
    hq, hk = rotate_half_rows(wq, heads, heads * head_dim), rotate_half_rows(wk, heads, heads * head_dim)
    scores_hf = (hf_rope(hq @ x_q, angles_q) * hf_rope(hk @ x_k, angles_k)).sum(-1)
    assert np.allclose(scores_llama2c, scores_hf)
    assert not np.allclose(scores_llama2c, (hf_rope(wq @ x_q, angles_q) * hf_rope(wk @ x_k, angles_k)).sum(-1))


def test_truncated_checkpoint_is_refused_naming_it(tmp_path, llama2c_dir):
    bad = tmp_path / "short.bin"
    bad.write_bytes((llama2c_dir / "stories260K.bin").read_bytes()[:-4])
    with pytest.raises(SpecPilotError, match="short.bin"):
        convert(bad, llama2c_dir / "tok512.bin", tmp_path / "out")


def test_tokenizer_of_another_vocab_is_refused(tmp_path, llama2c_dir):
    raw = (llama2c_dir / "tok512.bin").read_bytes()
    cut = tmp_path / "tok_cut.bin"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(SpecPilotError, match="tok_cut.bin"):
        convert(llama2c_dir / "stories260K.bin", cut, tmp_path / "out")
