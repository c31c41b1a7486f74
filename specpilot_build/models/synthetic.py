"""Synthetic checkpoints: model directories SpecPilot writes itself, with no weights to download.

A repo under the `specpilot-synthetic/` namespace names one of SPECS: a config.json (plus generation_config.json)
written from the spec below, and the tokenizer files of a pinned, verified source checkpoint (stories260K's,
vocabulary 512). No weights: SGLang serves them with `--load-format dummy` (and the drafter with
`--speculative-draft-load-format dummy`), which fills every tensor from a fixed seed, so two engines of the same
target get the same weights. Deterministic like the llama2.c conversion (sorted JSON), so the files are pinned in
lockfiles/checkpoints.toml like a conversion: `revision` is the digest of the spec (SPECS and the source pin)
and `converted` lists the files' sizes and sha256. A spec that changes without its pin is refused by name."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TypedDict

from specpilot_build.errors import PinError, SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile

NAMESPACE = "specpilot-synthetic"


class _TokenizerSource(TypedDict):
    repo: str
    files: list[str]
    source_format: str


TOKENIZER_SOURCE: _TokenizerSource = {
    "repo": "karpathy/tinyllamas",
    "files": ["stories260K/stories260K.bin", "stories260K/tok512.bin"],
    "source_format": "llama2c",
}
TOKENIZER_FILES = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")

# A small Qwen3 target whose shapes SGLang's GPU kernels accept (head_dim 64, intermediate a multiple of 16) and
# whose vocabulary is the stories260K tokenizer's, so prompts and golden ids of that tokenizer work unchanged.
_QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# Its DFlash drafter: one layer of the target's width reading hidden states after target layers 1 and 2; the
# drafter's dtype equals the target's (a float16 draft config beside a bf16 target failed in SGLang's drafter).
_DFLASH_QWEN3_TINY = dict(
    copy.deepcopy(_QWEN3_TINY),
    architectures=["DFlashDraftModel"],
    num_hidden_layers=1,
    num_target_layers=4,
    dflash_config={"block_size": 4, "target_layer_ids": [1, 2], "mask_token_id": 0},
)

SPECS = {f"{NAMESPACE}/qwen3-tiny": _QWEN3_TINY, f"{NAMESPACE}/dflash-qwen3-tiny": _DFLASH_QWEN3_TINY}
OUTPUT_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def is_synthetic(repo: str) -> bool:
    return repo.startswith(NAMESPACE + "/")


def spec_revision(repo: str) -> str:
    """The 40-hex revision a synthetic repo is pinned at: sha256 of its spec and its tokenizer source, cut to 40."""
    spec = _spec(repo)
    text = json.dumps({"config": spec, "tokenizer": TOKENIZER_SOURCE}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def synthetic_dir(repo: str, revision: str) -> Path:
    return data_dir() / "synthetic" / repo.replace("/", "--") / revision


def synthetic_model(repo: str, pin: CheckpointPin | None, tokenizer_dir: Path) -> Path:
    """The generated directory of `repo`, written once and checked file by file against the pin's `converted`
    (`tokenizer_dir`: the verified TOKENIZER_SOURCE checkpoint, models/checkpoints.py synthetic_tokenizer_dir)."""
    from filelock import FileLock

    revision = spec_revision(repo)
    if pin is None or not pin.converted:
        raise PinError(
            f"{repo}: not pinned in lockfiles/checkpoints.toml (revision {revision} and its generated "
            f"files' hashes: specpilot_build/models/synthetic.py pin_entry)"
        )
    if pin.revision != revision:
        raise PinError(
            f"{repo}: lockfiles/checkpoints.toml pins revision {pin.revision}, but its spec in "
            f"specpilot_build/models/synthetic.py is {revision}; re-pin it (pin_entry) or restore the spec"
        )
    expected = {f.path: f for f in pin.converted}
    if sorted(expected) != sorted(OUTPUT_FILES):
        raise PinError(
            f"{repo}: checkpoints.toml `converted` lists {sorted(expected)}, the generator writes "
            f"{sorted(OUTPUT_FILES)}"
        )
    out = synthetic_dir(repo, revision)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if (
            out.is_dir()
            and sorted(os.listdir(out)) == sorted(OUTPUT_FILES)
            and all(_matches(out / name, expected[name]) for name in OUTPUT_FILES)
        ):
            return out
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".incomplete"))
        try:
            generate(repo, tmp, tokenizer_dir)
            for name in OUTPUT_FILES:
                if not _matches(tmp / name, expected[name]):
                    raise SpecPilotError(
                        f"{repo}: generated {name} differs from the lock's sha256 "
                        f"{expected[name].sha256[:16]}… (the generator or its tokenizer source "
                        f"changed)"
                    )
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return out


def generate(repo: str, out: Path, tokenizer_dir: Path) -> list[Path]:
    """Write the synthetic model's files into `out` (an existing directory)."""
    spec = _spec(repo)
    _write_json(out / "config.json", spec)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": spec["bos_token_id"], "do_sample": False, "eos_token_id": spec["eos_token_id"]},
    )
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    return [out / name for name in OUTPUT_FILES]


def pin_entry(repo: str, directory: Path) -> str:
    """The checkpoints.toml table for a generated directory (what to append when a spec is added or changed)."""
    rows = [
        PinnedFile(path=name, size=(directory / name).stat().st_size, sha256=_sha256(directory / name))
        for name in sorted(OUTPUT_FILES, key=str.encode)
    ]
    lines = [f'["{repo}"]', f'revision = "{spec_revision(repo)}"', "converted = ["]
    lines += [f'  {{ path = "{f.path}", size = {f.size}, sha256 = "{f.sha256}" }},' for f in rows]
    return "\n".join(lines + ["]"]) + "\n"


def _spec(repo: str) -> dict:
    if repo not in SPECS:
        raise SpecPilotError(f"{repo}: no synthetic checkpoint of that name; known: {', '.join(sorted(SPECS))}")
    return SPECS[repo]


def _matches(path: Path, pinned: PinnedFile) -> bool:
    return path.is_file() and path.stat().st_size == pinned.size and _sha256(path) == pinned.sha256


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a few KiB each


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
