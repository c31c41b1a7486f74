"""A Qwen3 decoder over a static KV cache: the reference runtime's forward for Qwen3-shaped models.

What Qwen3 has that the llama2.c-style Llama of model.py does not use: head_dim decoupled from
hidden / heads (5120 hidden, 64 heads of 128 in the 27B shapes), an RMSNorm over each query and key head
before the rotary embedding (q_norm, k_norm), rotary theta 1e6, and an lm_head not tied to the embedding;
grouped-query attention as there. The maths is transformers' Qwen3ForCausalLM (its logits are matched in
tests/test_qwen3_runtime.py); norms take their statistics in float32 and apply the weight in the model dtype,
as transformers does.

Projections are plain [out, in] `nn.Linear` layers, q/k/v and gate/up each fused into one (one weight read
per step each), so W12 can replace them in place (`w12.module.apply_w12`, layer by layer: `to_w12`). Everything
between the projections is fused.py's, one kernel each on CUDA (those before a projection let a W12 ws GEMM after
them start early): a residual add with the norm after it (the last layer's add inside the final norm), the q/k
norm with the rotary embedding and the cache writes, the attention, the SiLU product.

The cache is static: [layers, batch, kv_heads, length, head_dim], allocated once per batch. A forward writes
its tokens' keys and values at their positions (no host sync), and each query attends to the keys at or before
its position, so a decode step has fixed shapes and no host work and can be captured in a CUDA graph
(decode.py). Attention is grouped per KV head, with no copy of the cache per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import fused


@dataclass(frozen=True)
class Qwen3Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int = 4096
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {self.head_dim}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def qwen3_shape(config) -> Qwen3Shape:
    """The shape of a transformers Qwen3Config."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias is not supported by the reference runtime's Qwen3")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope {rope} is not supported by the reference runtime")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return Qwen3Shape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_positions=config.max_position_embeddings,
        rope_theta=float(theta),
        rms_norm_eps=config.rms_norm_eps,
    )


class StaticCache:
    """Keys and values of `batch` sequences, up to `length` positions each."""

    def __init__(self, shape: Qwen3Shape, batch: int, length: int, dtype: torch.dtype, device):
        size = (shape.num_layers, batch, shape.num_kv_heads, length, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]


def _projection(rows: int, cols: int, dtype, device) -> nn.Linear:
    return nn.utils.skip_init(nn.Linear, cols, rows, bias=False, dtype=dtype, device=device)


class Qwen3Layer(nn.Module):
    def __init__(self, s: Qwen3Shape, dtype, device):
        super().__init__()
        self.shape = s
        self.qkv = _projection((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.hidden_size, dtype, device)
        self.o = _projection(s.hidden_size, s.num_heads * s.head_dim, dtype, device)
        self.gate_up = _projection(2 * s.intermediate_size, s.hidden_size, dtype, device)
        self.down = _projection(s.hidden_size, s.intermediate_size, dtype, device)

        def ones(*n: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)

        self.input_norm, self.post_norm = ones(s.hidden_size), ones(s.hidden_size)
        # q_norm for the query heads then k_norm for the key heads: one norm (and one rotary) for both
        self.qk_norm = ones(s.num_heads + s.num_kv_heads, s.head_dim)

    def forward(self, x, pending, cos, sin, positions, k_cache, v_cache):
        """(the residual stream, the down projection's output not yet added to it): the previous layer's
        output is added in this layer's first kernel, with the norm (fused.add_rms_norm)."""
        s = self.shape
        batch, steps, _ = x.shape
        eps = s.rms_norm_eps
        x, h = fused.add_rms_norm(x, pending, self.input_norm, eps)
        qkv = self.qkv(h).view(batch, steps, -1, s.head_dim)
        q = fused.attention_inputs(qkv, self.qk_norm, cos, sin, eps, positions, k_cache, v_cache, s.num_heads)
        o = fused.attention(q, k_cache, v_cache, positions)
        x, h = fused.add_rms_norm(x, self.o(o.reshape(batch, steps, s.num_heads * s.head_dim)), self.post_norm, eps)
        return x, self.down(fused.silu_mul(self.gate_up(h)))


class Qwen3(nn.Module):
    """Qwen3ForCausalLM's forward. Projection weights start uninitialised: load or draw them."""

    def __init__(self, shape: Qwen3Shape, dtype: torch.dtype = torch.bfloat16, device="cpu"):
        super().__init__()
        s = self.shape = shape
        self.dtype = dtype
        self.embed = nn.Parameter(
            torch.empty(s.vocab_size, s.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(Qwen3Layer(s, dtype, device) for _ in range(s.num_layers))
        self.norm = nn.Parameter(torch.ones(s.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = _projection(s.vocab_size, s.hidden_size, dtype, device)
        cos, sin = _rope_tables(s)
        sin[:, : s.head_dim // 2].neg_()
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("signed_sin", sin.to(dtype=dtype, device=device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self, batch: int, length: int) -> StaticCache:
        if length > self.shape.max_positions:
            raise ValueError(f"a cache of {length} positions exceeds max_positions {self.shape.max_positions}")
        return StaticCache(self.shape, batch, length, self.dtype, self.device)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache, last_only: bool = False
    ) -> torch.Tensor:
        """Logits [B, T, V] (model dtype) of tokens [B, T] at positions [B, T], writing their keys and
        values into `cache` (batch B); `last_only`: of the last token only ([B, 1, V])."""
        s = self.shape
        batch, steps = tokens.shape
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, :, None], self.signed_sin[positions][:, :, None]
        if positions.is_cuda:  # fused.attention_inputs writes no position outside the cache; torch's indexing raised
            torch._assert_async(
                ((positions >= 0) & (positions < cache.length)).all(), f"a position outside the cache of {cache.length}"
            )
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, cos, sin, positions, cache.k[i], cache.v[i])
        _, h = fused.add_rms_norm(x, pending, self.norm, s.rms_norm_eps)
        return self.lm_head(h[:, -1:] if last_only else h)

    def projections(self):
        """(name, nn.Linear) of every layer's four weights: what W12 replaces."""
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                yield f"layers.{i}.{name}", getattr(layer, name)

    def to_w12(
        self, lm_head: bool = False, progress=None, dense_fallback: bool = False, plan: dict | None = None
    ) -> None:
        """Every layer's projections (and the lm_head, if asked) in W12 form, layer by layer in place: each
        bf16 weight is freed once its encoding exists, so the peak is the bf16 model plus one layer's
        encodings, not both models. With `dense_fallback`, a weight whose shape runs faster on cuBLAS at some
        M is kept beside its encoding instead (w12.keep_dense: +2 bytes per such weight). With a `plan` (w12.plan),
        the shapes it keeps bf16 are not encoded."""
        from w12.module import W12Linear, apply_w12  # kernels/w12 (on PYTHONPATH from <engine>/kernels)

        for i, layer in enumerate(self.layers):
            apply_w12(layer, dense_fallback=dense_fallback, plan=plan)
            if progress:
                progress(i)
        if lm_head:
            self.lm_head = W12Linear.from_linear(self.lm_head, dense_fallback=dense_fallback)


def _rope_tables(s: Qwen3Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [position, head_dim] in float32, computed as transformers does."""
    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim))
    freqs = torch.outer(torch.arange(s.max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def from_transformers(hf_model, device=None) -> Qwen3:
    """A Qwen3 holding the weights of a transformers Qwen3ForCausalLM (q/k/v and gate/up concatenated)."""
    shape = qwen3_shape(hf_model.config)
    source = hf_model.model
    dtype = source.embed_tokens.weight.dtype
    model = Qwen3(shape, dtype, device or source.embed_tokens.weight.device)
    with torch.no_grad():
        model.embed.copy_(source.embed_tokens.weight)
        model.norm.copy_(source.norm.weight)
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
        for ours, theirs in zip(model.layers, source.layers):
            att, mlp = theirs.self_attn, theirs.mlp
            ours.qkv.weight.copy_(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
            ours.o.weight.copy_(att.o_proj.weight)
            ours.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            ours.down.weight.copy_(mlp.down_proj.weight)
            ours.input_norm.copy_(theirs.input_layernorm.weight)
            ours.post_norm.copy_(theirs.post_attention_layernorm.weight)
            ours.qk_norm[: shape.num_heads] = att.q_norm.weight
            ours.qk_norm[shape.num_heads :] = att.k_norm.weight
    return model
