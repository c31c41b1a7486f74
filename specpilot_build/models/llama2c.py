"""Convert a llama2.c checkpoint and tokenizer into a Hugging Face `transformers` model directory.

Deterministic: the same input bytes give the same output bytes on every run (sorted JSON, fixed
safetensors metadata), so the conversion's output can be pinned by sha256 like any downloaded file.

Input formats (llama2.c, karpathy):
- model: the "legacy" checkpoint: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len; a negative vocab_size means an unshared classifier), then float32 tensors in a fixed order,
  the RoPE tables included.
- tokenizer: uint32 max_token_length, then per piece: float32 score, uint32 length, the piece's bytes
  (SentencePiece pieces with "▁" written as " ", BOS/EOS written as "\\n<s>\\n" / "\\n</s>\\n").

The padded form (`convert(..., padded=True)`, source_format `llama2c-padded`): the same function with the shapes
SGLang's GPU kernels accept (its Triton attention needs head_dim >= 16, cuBLAS failed on intermediate 172).
head_dim d is widened by an integer factor k to D = k*d >= 16: dim i of every head of q, k and v moves to k*i,
the others are zero. HF rotates pairs (i, i + d/2) by position * theta^(-2i/d); the pair lands on
(k*i, k*i + D/2) and rotates by theta^(-2*k*i/D), the same angle. q is scaled by sqrt(k), so q.k / sqrt(D) is
unchanged; o_proj's columns follow v's dims. The MLP's intermediate size is rounded up to a multiple of 16
with zero rows of gate/up and zero columns of down (silu(0) * 0 = 0). Exact up to float32 rounding of
sqrt(k) * q."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot_build.errors import SpecPilotError

SPIECE_SPACE = "\u2581"
ROPE_THETA = 10000.0  # llama2.c's run.c; checked against the checkpoint's own RoPE tables
RMS_NORM_EPS = 1e-5
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c export versions 1+, not the legacy layout

OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def convert(model_bin: Path, tokenizer_bin: Path, out_dir: Path, *, padded: bool = False) -> list[Path]:
    """Write the HF model directory for `model_bin` + `tokenizer_bin` into `out_dir` (created, must be empty);
    `padded`: the padded, equivalent form (module docstring)."""
    header, tensors = read_checkpoint(model_bin)
    pieces, scores = read_tokenizer(tokenizer_bin)
    if len(pieces) != header.vocab_size:
        raise SpecPilotError(
            f"{tokenizer_bin}: {len(pieces)} pieces, but {model_bin} has vocab_size {header.vocab_size}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise SpecPilotError(f"{out_dir}: conversion target is not empty")
    state = hf_state_dict(header, tensors)
    if padded:
        state = pad_state_dict(header, state)
    _write_json(out_dir / "config.json", model_config(header, padded=padded))
    _write_json(out_dir / "generation_config.json", {"bos_token_id": 1, "do_sample": False, "eos_token_id": 2})
    _write_safetensors(out_dir / "model.safetensors", state)
    _write_json(out_dir / "tokenizer.json", tokenizer_json(pieces, scores))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(header))
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    written = [out_dir / name for name in OUTPUT_FILES]
    for path in written:
        path.chmod(0o644)  # safetensors writes 0600; the model directory is shared like any cache file
    return written


# --- the checkpoint ---------------------------------------------------------------------------------


def read_checkpoint(path: Path) -> tuple[Llama2cHeader, dict[str, np.ndarray]]:
    raw = path.read_bytes()
    if len(raw) < 28:
        raise SpecPilotError(f"{path}: too short for a llama2.c checkpoint ({len(raw)} bytes)")
    if struct.unpack_from("<I", raw, 0)[0] == VERSIONED_MAGIC:
        raise SpecPilotError(f"{path}: a versioned llama2.c export (magic 'ak42'); only the legacy layout is supported")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
    if min(dim, hidden, layers, heads, kv_heads, seq_len) <= 0 or dim % heads or heads % kv_heads:
        raise SpecPilotError(
            f"{path}: not a llama2.c checkpoint header {[dim, hidden, layers, heads, kv_heads, vocab, seq_len]}"
        )
    header = Llama2cHeader(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, shared_classifier=vocab > 0)
    kv_dim = header.n_kv_heads * header.head_dim
    half_head = header.head_dim // 2
    shapes = [
        ("tok_embeddings", (header.vocab_size, dim)),
        ("rms_att", (layers, dim)),
        ("wq", (layers, dim, dim)),
        ("wk", (layers, kv_dim, dim)),
        ("wv", (layers, kv_dim, dim)),
        ("wo", (layers, dim, dim)),
        ("rms_ffn", (layers, dim)),
        ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)),
        ("w3", (layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, half_head)),
        ("freq_cis_imag", (seq_len, half_head)),
    ]
    if not header.shared_classifier:
        shapes.append(("wcls", (header.vocab_size, dim)))
    expected = 28 + 4 * sum(math.prod(shape) for _, shape in shapes)
    if len(raw) != expected:
        raise SpecPilotError(f"{path}: {len(raw)} bytes, but its header implies {expected}")
    tensors, offset = {}, 28
    for name, shape in shapes:
        count = math.prod(shape)
        tensors[name] = np.frombuffer(raw, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += 4 * count
    _check_rope_tables(path, header, tensors["freq_cis_real"], tensors["freq_cis_imag"])
    return header, tensors


def _check_rope_tables(path: Path, header: Llama2cHeader, real: np.ndarray, imag: np.ndarray) -> None:
    """HF recomputes RoPE from rope_theta; refuse a checkpoint whose stored tables use another theta."""
    inv_freq = ROPE_THETA ** (-np.arange(0, header.head_dim, 2, dtype=np.float64) / header.head_dim)
    angles = np.arange(header.seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    if not (np.allclose(real, np.cos(angles), atol=1e-4) and np.allclose(imag, np.sin(angles), atol=1e-4)):
        raise SpecPilotError(f"{path}: its RoPE tables do not match rope_theta {ROPE_THETA}")


def hf_state_dict(header: Llama2cHeader, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    kv_dim = header.n_kv_heads * header.head_dim
    state = {"model.embed_tokens.weight": tensors["tok_embeddings"], "model.norm.weight": tensors["rms_final"]}
    for i in range(header.n_layers):
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = tensors["rms_att"][i]
        state[prefix + "self_attn.q_proj.weight"] = rotate_half_rows(tensors["wq"][i], header.n_heads, header.dim)
        state[prefix + "self_attn.k_proj.weight"] = rotate_half_rows(tensors["wk"][i], header.n_kv_heads, kv_dim)
        state[prefix + "self_attn.v_proj.weight"] = tensors["wv"][i]
        state[prefix + "self_attn.o_proj.weight"] = tensors["wo"][i]
        state[prefix + "post_attention_layernorm.weight"] = tensors["rms_ffn"][i]
        state[prefix + "mlp.gate_proj.weight"] = tensors["w1"][i]
        state[prefix + "mlp.down_proj.weight"] = tensors["w2"][i]
        state[prefix + "mlp.up_proj.weight"] = tensors["w3"][i]
    if not header.shared_classifier:
        state["lm_head.weight"] = tensors["wcls"]
    return {name: np.ascontiguousarray(value, dtype="<f4") for name, value in state.items()}


def rotate_half_rows(weight: np.ndarray, n_heads: int, rows: int) -> np.ndarray:
    """llama2.c rotates adjacent pairs (x0,x1),(x2,x3)…; HF rotates the two halves of each head.

    Reorder each head's output rows from [p0a, p0b, p1a, p1b, …] to [p0a, p1a, …, p0b, p1b, …]."""
    cols = weight.shape[1]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


# --- the padded form ---------------------------------------------------------------------------------

PADDED_MIN_HEAD_DIM = 16  # SGLang's Triton attention: tl.dot needs K >= 16
PADDED_MULTIPLE = 16  # intermediate size rounded up to this (cuBLAS refused 172)


def head_dim_factor(header: Llama2cHeader) -> int:
    """k: the padded head_dim is k * head_dim, the smallest such multiple that is >= PADDED_MIN_HEAD_DIM."""
    return max(1, -(-PADDED_MIN_HEAD_DIM // header.head_dim))


def padded_intermediate(header: Llama2cHeader) -> int:
    return -(-header.hidden_dim // PADDED_MULTIPLE) * PADDED_MULTIPLE


def spread_head_rows(weight: np.ndarray, n_heads: int, factor: int) -> np.ndarray:
    """Rows [h*d + i] (HF rotate_half layout) → rows [h*k*d + k*i]; the rows between are zero."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    out = np.zeros((n_heads, head_dim * factor, cols), dtype=weight.dtype)
    out[:, ::factor, :] = weight.reshape(n_heads, head_dim, cols)
    return out.reshape(n_heads * head_dim * factor, cols)


def pad_state_dict(header: Llama2cHeader, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The padded form of an HF state dict from `hf_state_dict` (module docstring)."""
    k, hidden = head_dim_factor(header), padded_intermediate(header)
    q_scale = np.float64(math.sqrt(k))
    out = dict(state)
    for i in range(header.n_layers):
        prefix = f"model.layers.{i}."
        q = state[prefix + "self_attn.q_proj.weight"]
        out[prefix + "self_attn.q_proj.weight"] = spread_head_rows(
            (q.astype(np.float64) * q_scale).astype("<f4"), header.n_heads, k
        )
        for name in ("k_proj", "v_proj"):
            out[prefix + f"self_attn.{name}.weight"] = spread_head_rows(
                state[prefix + f"self_attn.{name}.weight"], header.n_kv_heads, k
            )
        wo = state[prefix + "self_attn.o_proj.weight"]  # columns are v's dims, head by head
        out[prefix + "self_attn.o_proj.weight"] = spread_head_rows(np.ascontiguousarray(wo.T), header.n_heads, k).T
        for name in ("gate_proj", "up_proj"):
            w = state[prefix + f"mlp.{name}.weight"]
            out[prefix + f"mlp.{name}.weight"] = np.concatenate(
                [w, np.zeros((hidden - w.shape[0], w.shape[1]), dtype=w.dtype)], axis=0
            )
        down = state[prefix + "mlp.down_proj.weight"]
        out[prefix + "mlp.down_proj.weight"] = np.concatenate(
            [down, np.zeros((down.shape[0], hidden - down.shape[1]), dtype=down.dtype)], axis=1
        )
    return {name: np.ascontiguousarray(value, dtype="<f4") for name, value in out.items()}


def model_config(header: Llama2cHeader, *, padded: bool = False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": header.head_dim * head_dim_factor(header) if padded else header.head_dim,
        "hidden_act": "silu",
        "hidden_size": header.dim,
        "initializer_range": 0.02,
        "intermediate_size": padded_intermediate(header) if padded else header.hidden_dim,
        "max_position_embeddings": header.seq_len,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": header.n_heads,
        "num_hidden_layers": header.n_layers,
        "num_key_value_heads": header.n_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": header.shared_classifier,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": header.vocab_size,
    }


# --- the tokenizer ----------------------------------------------------------------------------------


def read_tokenizer(path: Path) -> tuple[list[str], list[float]]:
    raw = path.read_bytes()
    offset, pieces, scores = 4, [], []
    try:
        while offset < len(raw):
            score, length = struct.unpack_from("<fI", raw, offset)
            offset += 8
            piece = raw[offset : offset + length].decode("utf-8")
            if len(piece.encode("utf-8")) != length:
                raise struct.error("truncated piece")
            offset += length
            pieces.append(piece)
            scores.append(score)
    except (struct.error, UnicodeDecodeError) as exc:
        raise SpecPilotError(f"{path}: not a llama2.c tokenizer file (piece {len(pieces)}: {exc})") from None
    if len(pieces) < 3 or pieces[1].strip() != "<s>" or pieces[2].strip() != "</s>":
        raise SpecPilotError(f"{path}: expected <unk>, <s>, </s> as pieces 0-2")
    pieces = ["<unk>", "<s>", "</s>"] + [p.replace(" ", SPIECE_SPACE) for p in pieces[3:]]
    return pieces, scores


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def bpe_merges(pieces: list[str], scores: list[float]) -> list[list[str]]:
    """SentencePiece BPE merges a pair when the joined piece is in the vocabulary; higher score first.

    A piece reachable by several splits gets one merge per split (shortest left part first); they share
    one priority in SentencePiece, and since they yield the same piece their relative order is moot."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    normal = {i for i, p in enumerate(pieces) if i > 2 and not _is_byte_piece(p)}
    merges: list[list[str]] = []
    for i in sorted(normal, key=lambda i: (-scores[i], i)):
        piece = pieces[i]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [s for s in splits if ids.get(s[0], 0) in normal and ids.get(s[1], 0) in normal]
        merges.extend([left, right] for left, right in splits)
    return merges


def tokenizer_json(pieces: list[str], scores: list[float]) -> dict:
    """A `tokenizers` BPE with byte fallback that segments like the SentencePiece model (add_dummy_prefix,
    no normalisation); checked by loading it with the `tokenizers` library before it is written."""
    from tokenizers import Tokenizer

    special = [
        {
            "content": piece,
            "id": i,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, piece in enumerate(pieces[:3])
    ]
    spec = {
        "added_tokens": special,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPIECE_SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "byte_fallback": True,
            "continuing_subword_prefix": None,
            "dropout": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "ignore_merges": False,
            "unk_token": "<unk>",
            "vocab": {piece: i for i, piece in enumerate(pieces)},
            "merges": bpe_merges(pieces, scores),
        },
        "normalizer": None,
        "padding": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<s>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPIECE_SPACE, "prepend_scheme": "always", "split": False},
        "truncation": None,
        "version": "1.0",
    }
    Tokenizer.from_str(json.dumps(spec))  # raises if this tokenizers version cannot read it
    return spec


def tokenizer_config(header: Llama2cHeader) -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": True,
        "model_max_length": header.seq_len,
        "pad_token": None,
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
    }


# --- deterministic writers --------------------------------------------------------------------------


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
