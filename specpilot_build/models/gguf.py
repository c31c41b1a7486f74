"""Convert a Llama GGUF file (llama.cpp's format) into a Hugging Face `transformers` model directory.

The dequantized tensors are the model: Q4_1 and Q8_0 blocks are expanded exactly as the GGUF spec defines
them (Q4_1: 32 weights per block, w = d * q + m with fp16 d and m and 4-bit q, low nibbles first; Q8_0: 32
weights per block, w = d * q with fp16 d and int8 q), computed in float32 by `gguf.quants.dequantize`; F32
is copied and F16 widened exactly. `dtype="bfloat16"` then rounds each float32 to nearest-even bf16.

llama.cpp's converter permutes the rows of q and k per head (it rotates adjacent pairs, HF rotates the halves
of each head); the inverse permutation is applied here. A file without `output.weight` ties the head to the
embedding. The tokenizer (byte-level BPE, `tokenizer.ggml.model = gpt2`) is rebuilt from the file's tokens,
merges and token types, its chat template kept in tokenizer_config.json.

Deterministic: the same GGUF bytes give the same output bytes on every run and machine (sorted JSON, fixed
safetensors metadata, no timestamps)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from specpilot_build.errors import SpecPilotError

DTYPES = ("float32", "bfloat16")
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
READ_TYPES = ("F32", "F16", "Q4_1", "Q8_0")
CONTROL = 3  # llama.cpp's token type of special tokens (1 is a normal token)

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def converter_sha256() -> str:
    """sha256 of this converter's source: pinned beside the conversion's hashes, so a model's digest names it."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def convert(gguf_path: Path, out_dir: Path, *, dtype: str = "float32") -> list[Path]:
    """Write the HF model directory for `gguf_path` into `out_dir` (created, must be empty)."""
    if dtype not in DTYPES:
        raise SpecPilotError(f"{gguf_path}: dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    reader = read_gguf(gguf_path)
    config = model_config(reader, gguf_path, dtype=dtype)
    state = state_dict(reader, gguf_path, config)
    tokenizer = tokenizer_json(reader, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise SpecPilotError(f"{out_dir}: conversion target is not empty")
    special = _special_tokens(reader, gguf_path)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "do_sample": False, "eos_token_id": config["eos_token_id"]},
    )
    _write_safetensors(out_dir / "model.safetensors", state, dtype)
    _write_json(out_dir / "tokenizer.json", tokenizer)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(reader, gguf_path, special, config))
    _write_json(out_dir / "special_tokens_map.json", {k: v for k, v in special.items() if v is not None})
    written = [out_dir / name for name in OUTPUT_FILES]
    for path in written:
        path.chmod(0o644)
    return written


# --- reading ----------------------------------------------------------------------------------------


def read_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise SpecPilotError(f"{path}: not a readable GGUF file ({exc})") from None


def field(reader: Any, path: Path, key: str, default: Any = ...) -> Any:
    """The value of metadata `key` (a scalar, a string or a list)."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is ...:
            raise SpecPilotError(f"{path}: GGUF metadata {key} is missing")
        return default
    return entry.contents()


def model_config(reader: Any, path: Path, *, dtype: str = "float32") -> dict:
    arch = field(reader, path, "general.architecture")
    if arch != "llama":
        raise SpecPilotError(f"{path}: general.architecture is {arch!r}; this converter reads llama only")
    hidden = int(field(reader, path, "llama.embedding_length"))
    heads = int(field(reader, path, "llama.attention.head_count"))
    kv_heads = int(field(reader, path, "llama.attention.head_count_kv", heads))
    head_dim = int(field(reader, path, "llama.rope.dimension_count", hidden // heads))
    if head_dim * heads != hidden or heads % kv_heads:
        raise SpecPilotError(f"{path}: {heads} heads / {kv_heads} kv heads of {head_dim} do not fit hidden {hidden}")
    if "llama.rope.scaling.type" in reader.fields:
        raise SpecPilotError(f"{path}: llama.rope.scaling.type is set; this converter reads plain RoPE only")
    tokens = field(reader, path, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(field(reader, path, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, path, "tokenizer.ggml.eos_token_id")),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(field(reader, path, "llama.feed_forward_length")),
        "max_position_embeddings": int(field(reader, path, "llama.context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": int(field(reader, path, "llama.block_count")),
        "num_key_value_heads": kv_heads,
        "pad_token_id": _optional_int(field(reader, path, "tokenizer.ggml.padding_token_id", None)),
        "pretraining_tp": 1,
        "rms_norm_eps": _float32_value(field(reader, path, "llama.attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": _float32_value(field(reader, path, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": int(field(reader, path, "llama.vocab_size", len(tokens))),
    }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float32_value(value: Any) -> float:
    """A float32 read from the file as the shortest decimal that round-trips it (1e-05, not 9.99999974e-06)."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def hf_name(name: str, path: Path) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = BLOCK_TENSOR.match(name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"model.layers.{int(match.group(1))}.{BLOCK_NAMES[match.group(2)]}.weight"
    raise SpecPilotError(f"{path}: tensor {name} has no counterpart in a transformers Llama")


def dequantized(tensor: Any, path: Path) -> np.ndarray:
    """The float32 values of one GGUF tensor, in row-major (transformers) shape."""
    from gguf import GGMLQuantizationType, dequantize

    kind = GGMLQuantizationType(tensor.tensor_type).name
    if kind not in READ_TYPES:
        raise SpecPilotError(
            f"{path}: tensor {tensor.name} has type {kind}; this converter reads {', '.join(READ_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if kind == "F32":
        values = np.asarray(tensor.data, dtype="<f4")
    elif kind == "F16":
        values = np.asarray(tensor.data, dtype="<f2").astype(np.float32)
    else:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    if values.size != int(np.prod(shape)):
        raise SpecPilotError(f"{path}: tensor {tensor.name} holds {values.size} values, its shape says {shape}")
    return np.ascontiguousarray(values.reshape(shape), dtype="<f4")


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows [p0a, p0b, p1a, p1b, ...] -> [p0a, p1a, ..., p0b, p1b, ...]."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def state_dict(reader: Any, path: Path, config: dict) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32 and renamed; q and k rows put back in HF order."""
    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, path)
        values = dequantized(tensor, path)
        if name.endswith("self_attn.q_proj.weight"):
            values = unpermute_rows(values, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            values = unpermute_rows(values, config["num_key_value_heads"])
        state[name] = np.ascontiguousarray(values)
    layers = config["num_hidden_layers"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{part}.weight" for i in range(layers) for part in BLOCK_NAMES.values()
    }
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    missing = sorted(expected - set(state))
    extra = sorted(set(state) - expected)
    if missing or extra:
        raise SpecPilotError(
            f"{path}: tensors do not make a {layers}-layer Llama (missing {missing[:3]}, extra {extra[:3]})"
        )
    return state


# --- the tokenizer ----------------------------------------------------------------------------------


def _special_tokens(reader: Any, path: Path) -> dict[str, str | None]:
    tokens = field(reader, path, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = field(reader, path, key, None)
        return None if index is None else str(tokens[int(index)])

    return {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
    }


def tokenizer_json(reader: Any, path: Path) -> dict:
    """A `tokenizers` byte-level BPE with the file's vocabulary, merges and control tokens. Pre-tokenizer
    `smollm` (llama.cpp): every digit alone, then GPT-2's split; checked by loading it with `tokenizers`."""
    from tokenizers import Tokenizer

    model = field(reader, path, "tokenizer.ggml.model")
    pre = field(reader, path, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in ("smollm", "gpt2", "default"):
        raise SpecPilotError(
            f"{path}: tokenizer.ggml.model {model!r} / pre {pre!r}; this converter builds gpt2 (byte-level BPE) "
            "tokenizers with the smollm, gpt2 or default pre-tokenizer"
        )
    tokens = [str(t) for t in field(reader, path, "tokenizer.ggml.tokens")]
    types = [int(t) for t in field(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [str(m).split(" ") for m in field(reader, path, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise SpecPilotError(f"{path}: tokenizer.ggml.merges holds an entry that is not two tokens")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre_tokenizers: list[dict] = [byte_level]
    if pre == "smollm":
        pre_tokenizers.insert(0, {"type": "Digits", "individual_digits": True})
    spec = {
        "added_tokens": [
            {
                "content": token,
                "id": i,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, (token, kind) in enumerate(zip(tokens, types))
            if kind == CONTROL
        ],
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "byte_fallback": False,
            "continuing_subword_prefix": None,
            "dropout": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "ignore_merges": False,
            "unk_token": None,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": merges,
        },
        "normalizer": None,
        "padding": None,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "truncation": None,
        "version": "1.0",
    }
    if len(set(tokens)) != len(tokens):
        raise SpecPilotError(f"{path}: tokenizer.ggml.tokens holds duplicate tokens")
    Tokenizer.from_str(json.dumps(spec))
    return spec


def tokenizer_config(reader: Any, path: Path, special: dict[str, str | None], config: dict) -> dict:
    out: dict[str, Any] = {
        "add_bos_token": bool(field(reader, path, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field(reader, path, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
    }
    template = field(reader, path, "tokenizer.chat_template", None)
    if template is not None:
        out["chat_template"] = str(template)
    return out


# --- deterministic writers --------------------------------------------------------------------------


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, state: dict[str, np.ndarray], dtype: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        import torch
        from safetensors.torch import save_file as save_torch

        save_torch(
            {name: torch.from_numpy(value.copy()).to(torch.bfloat16) for name, value in state.items()},
            str(tmp),
            metadata={"format": "pt"},
        )
    os.replace(tmp, path)
