"""A lean Llama forward over weights loaded by transformers, with a preallocated, slotted KV cache.

transformers loads and validates the checkpoint; decoding then runs this forward, which does per layer only
the handful of tensor ops the maths needs. On a model as small as stories260K the per-op overhead of a
module tree dominates the arithmetic, so this is what makes plain greedy decoding fast:
- activations are 2-D [tokens, hidden] and weights are stored transposed ([in, out]), so every projection
  is one plain `mm` (measurably faster than F.linear for a few rows);
- q/k/v (plus rotate_half of q and k, for RoPE: an exact permutation of rows) and gate/up projections are
  fused; in float32, RMSNorm weights are folded into the projection that follows and the attention scale
  into the q rows (both linear, so the maths is unchanged up to float rounding);
- K is cached pre-transposed ([kv_heads, head_dim, position]) so attention is two batched matmuls;
- in float32 on CPU the products run on rowgemm (rowgemm.py), whose rows do not depend on the rows beside
  them, so a decode step multiplies one row: one pass over the weights, where MKL's padded 16-row products
  cost ~16 passes on this AMD EPYC (SmolLM2-135M: benchmarks/reference_runtime.md).
With `w12=True` (model.quantization w12, bf16 only) the projections are held in W12 form instead (kernels/w12,
lossless 12-bit, [out, in] as encoded) and `self.mm` runs W12's GEMM (see _w12_projection); `dense_fallback`
(runtime_options.w12_dense_fallback) keeps each one's bf16 matrix beside it where cuBLAS beats that GEMM.
Logits match transformers' within float tolerance (tested); greedy tokens match llama2.c's (tested).

The cache holds `num_slots` sequences. A forward scores a batch of B sequences, each with T new tokens
starting at its own position. Padded query rows may write past a sequence's end; that is harmless because
a query only reads keys at or before its own position, and those were all written by real tokens.

Batch invariance (what SGLang calls deterministic inference): a position's logits do not depend on how many
tokens are scored with it, so the prefill that scores a whole sequence at once (the oracle that verify forces
tokens through) gives, bit for bit, the logits that prefill and verify steps gave chunk by chunk, whatever the
drafter proposed and whatever else was in the batch. On CPU, MKL runs a product of few rows through other kernels
than a larger one: on an Intel CPU a single row (GEMV) differed, which alone made a position's float32 logits
differ by up to 1.4e-5 (benchmarks/tolerance.md); on an AMD EPYC with AVX2 products of 1-3, 5-7
and 9-11 rows differed and every product of 12 rows or more gave each row the same result. rowgemm needs no
padding: it sums each output element in one order whatever the rows and threads. Where rowgemm is not used
(bf16, or no compiler) every product here has at least MIN_ROWS rows, padded with zero rows that are dropped
again (`rows_padded`). The attention's probs @ values product also reduced in another order over more keys (a
short prefill against a whole sequence, or past 256 keys), so attention spans whole blocks of KEY_BLOCK keys,
the keys past a query masked to exact zeros; MKL's product runs block by block with the partial results added
in a fixed order (`_attend`), rowgemm's is one product over all keys, summed in order, where the masked keys add
exact zeros. Softmax gives the same result over more masked keys (measured). tests/test_batch_invariance.py
checks all of it on stories260K (verify chunks of 1..k tokens, rejected drafts, short prompts, sequences past
256 tokens, a second sequence in the batch) and on SmolLM2-135M past 512 keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot_runtime import rowgemm

KEY_BLOCK = 512  # attention runs in whole blocks of this many keys (batch invariance, see the docstring)
MIN_ROWS = 16  # on CPU every product has at least this many rows (batch invariance, see the docstring)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float


def llama_shape(cfg) -> LlamaShape:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {rope_scaling} is not supported by the reference runtime")
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:  # transformers 5 may keep it only under rope_parameters
        rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return LlamaShape(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        context_length=cfg.max_position_embeddings,
        rope_theta=float(rope_theta),
        rms_norm_eps=cfg.rms_norm_eps,
    )


class LeanLlama:
    """Greedy-decoding forward of a Llama checkpoint over a slotted KV cache."""

    def __init__(
        self,
        hf_model,
        num_slots: int,
        max_tokens_per_step: int,
        device: torch.device | str,
        w12: bool = False,
        dense_fallback: bool = False,
        use_rowgemm: bool = True,
    ):
        self.shape = s = llama_shape(hf_model.config)
        self.device = torch.device(device)
        self.dtype = next(hf_model.parameters()).dtype
        # float32 on CPU: rowgemm's products, one pass over the weights whatever the rows (see rowgemm.py).
        # use_rowgemm=False keeps MKL with padded rows (benchmarks/reference_runtime.py compares the two).
        self.rowgemm = use_rowgemm and self.device.type == "cpu" and self.dtype == torch.float32 and rowgemm.available()
        self.mm = rowgemm.mm if self.rowgemm else rows_padded(torch.mm)
        self.scores = rowgemm.bmm if self.rowgemm else rows_padded(torch.matmul)
        # probs @ values: rowgemm sums each output over the keys in order, so masked keys after a query add
        # exact zeros and one product over all keys is invariant; it needs head_dim a multiple of its tile.
        self.attend = rowgemm.bmm if self.rowgemm and s.head_dim % rowgemm.TILE == 0 else _attend
        self._take_weights(hf_model)
        self.w12_layers: dict | None = None
        if w12:
            self._encode_w12(dense_fallback)
        # Whole key blocks (batch invariance), with room past the context for padded query rows of a verify step.
        self.cache_length = -(-(s.context_length + max_tokens_per_step + 1) // KEY_BLOCK) * KEY_BLOCK
        self.k_cache = torch.zeros(
            s.num_layers, num_slots, s.num_kv_heads, s.head_dim, self.cache_length, dtype=self.dtype, device=self.device
        )
        self.v_cache = torch.zeros(
            s.num_layers, num_slots, s.num_kv_heads, self.cache_length, s.head_dim, dtype=self.dtype, device=self.device
        )
        self.cos, self.sin = self._rope_tables()
        # EAGLE-3 drafting: the outputs of these layers (the residual stream after each), concatenated, are kept
        # as `last_aux` ([B, T, len * hidden]) by every forward; empty (the default) keeps nothing.
        self.capture: tuple[int, ...] = ()
        self.last_aux: torch.Tensor | None = None
        # Per layer and slot views, so a single-sequence step does no indexing to find its cache.
        self.slot_views = [
            [(self.k_cache[i, slot], self.v_cache[i, slot]) for i in range(s.num_layers)] for slot in range(num_slots)
        ]

    @property
    def num_slots(self) -> int:
        return self.k_cache.shape[1]

    def _take_weights(self, hf_model) -> None:
        s = self.shape
        m = hf_model.model

        # Folding is exact enough in float32; in 16-bit it would round the weights a second time, so there
        # the norm weights and the attention scale are applied as separate ops, as transformers does.
        self.folded = self.dtype == torch.float32
        self.q_scale = 1.0 / math.sqrt(s.head_dim)

        def fold(weight, norm):  # W @ (norm * x) == (W * norm) @ x; sqrt(hidden): see _normalise
            w = weight.detach().float()
            if self.folded:
                w = w * (norm.detach().float() * math.sqrt(s.hidden_size))[None, :]
            return self._stored(w.to(self.dtype).t())

        def rotated(weight, heads):  # rows giving rotate_half(W @ x) per head: exact (a permutation and signs)
            w = weight.view(heads, 2, s.head_dim // 2, -1)
            return torch.cat([-w[:, 1], w[:, 0]], dim=1).reshape(heads * s.head_dim, -1)

        self.embed = m.embed_tokens.weight.detach()
        self.final_norm = m.norm.weight.detach()
        self.lm_head = fold(hf_model.lm_head.weight, m.norm.weight)
        self.layers = []
        self.norms = []
        for layer in m.layers:
            att, mlp = layer.self_attn, layer.mlp
            wq = att.q_proj.weight.detach().float() * (self.q_scale if self.folded else 1.0)
            wk, wv = att.k_proj.weight.detach().float(), att.v_proj.weight.detach().float()
            # One projection gives q, k, v and the rotate_half of q and k that RoPE needs.
            wqkv = torch.cat([wq, wk, wv, rotated(wq, s.num_heads), rotated(wk, s.num_kv_heads)])
            self.layers.append(
                (
                    fold(wqkv, layer.input_layernorm.weight),
                    self._stored(att.o_proj.weight.detach().t()),
                    fold(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), layer.post_attention_layernorm.weight),
                    self._stored(mlp.down_proj.weight.detach().t()),
                )
            )
            self.norms.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()))

    def _stored(self, weight: torch.Tensor):
        """A projection's [in, out] weight as `self.mm` takes it."""
        return rowgemm.Packed(weight) if self.rowgemm else weight.contiguous()

    def cut_head(self, columns: torch.Tensor) -> None:
        """Score only these vocabulary entries from now on (a drafter's reduced head): logit i is columns[i]'s."""
        head = self.lm_head.unpacked() if isinstance(self.lm_head, rowgemm.Packed) else self.lm_head
        if not isinstance(head, torch.Tensor):
            raise TypeError(f"cannot cut a {type(head).__name__} head (a W12 drafter has no reduced vocabulary)")
        self.lm_head = self._stored(head[:, columns.to(head.device)])

    def _encode_w12(self, dense_fallback: bool = False) -> None:
        """Replace each projection by its W12 encoding (of the [out, in] weight) where the engine's W12 plan stores
        its shape in W12 (w12.plan: chosen at build time from the GPU's tables); the others stay bf16, with no second
        copy. The bf16 copies of encoded weights are freed, unless `dense_fallback` keeps one as the encoding's
        `dense` where its shape runs faster on cuBLAS (w12.keep_dense). `self.w12_layers` says what was chosen."""
        import w12  # kernels/w12, on PYTHONPATH from <engine>/kernels
        import w12.plan

        if self.dtype != torch.bfloat16:
            raise TypeError(f"W12 stores bf16 weights; this model runs in {self.dtype}")
        choices: dict[str, str] = {}

        def encode(name: str, w: torch.Tensor):
            weight = w.t().contiguous()  # stored [in, out] for torch.mm
            packed = w12.plan.encode_planned(weight)
            choices[name] = "bf16" if packed is None else "w12"
            if packed is None:
                return w
            if dense_fallback:
                w12.keep_dense(packed, weight)
            return packed

        self.lm_head = encode("lm_head", self.lm_head)
        self.layers = [
            tuple(encode(f"layers.{i}.{j}", w) for j, w in enumerate(weights)) for i, weights in enumerate(self.layers)
        ]
        self.w12_layers = w12.plan.summary(choices)
        self.mm = _w12_projection(w12, self.mm)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [position, 1, head_dim], for x*cos + rotate_half(x)*sin."""
        s = self.shape
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim))
        freqs = torch.outer(torch.arange(self.cache_length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        as_table = lambda t: t.to(self.dtype).to(self.device)[:, None, :]  # noqa: E731
        return as_table(emb.cos()), as_table(emb.sin())

    def _normalise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm, computed in float32 like HF.

        Folded (float32): x / sqrt(mean(x^2) + eps) == sqrt(h) * x / sqrt(sum(x^2) + h*eps), with the
        constant sqrt(h) and the norm weight folded into the next projection: three cheap ops instead of six.
        """
        eps = self.shape.rms_norm_eps
        if self.folded:
            return x * (x * x).sum(-1, keepdim=True).add_(x.shape[-1] * eps).rsqrt_()
        xf = x.float()
        xf = xf * (xf * xf).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return weight * xf.to(self.dtype)

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return torch.softmax(scores, dim=-1)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)

    def forward(
        self, tokens: torch.Tensor, slots: list[int], starts: list[int], logit_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run B sequences of T new tokens (tokens [B, T]) from positions `starts` in cache `slots`.

        Returns float32 logits [B, T, V], or [B, R, V] for the token rows `logit_rows` ([R] indices into T).
        """
        batch, steps = tokens.shape
        if batch == 1:
            x = self._layers_one(tokens[0], slots[0], starts[0])[None]
        else:
            x = self._layers_batch(tokens, slots, starts)
        if logit_rows is not None:
            x = x[:, logit_rows]
        flat = self._normalise(x.reshape(-1, x.shape[-1]), self.final_norm)
        return self.mm(flat, self.lm_head).view(*x.shape[:-1], -1).float()

    def _key_length(self, end: int) -> int:
        """Keys an attention step spans: `end` rounded up to whole blocks of KEY_BLOCK, the rest masked."""
        return -(-end // KEY_BLOCK) * KEY_BLOCK

    def _layers_one(self, tokens: torch.Tensor, slot: int, start: int) -> torch.Tensor:
        s = self.shape
        steps = tokens.shape[0]
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        group = nh // nkv
        end = start + steps
        cos, sin = self.cos[start:end], self.sin[start:end]
        keys = self._key_length(end)
        if steps == 1:  # the query sees keys 0 .. start, of `keys`
            mask = torch.zeros(keys, dtype=self.dtype, device=self.device)
            mask[end:] = float("-inf")
        else:  # query row (t, g) sees keys 0 .. start + t
            mask = torch.ones(steps, keys, dtype=torch.bool, device=self.device).tril(start)
            mask = torch.zeros(steps * group, keys, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask.repeat_interleave(group, dim=0), float("-inf")
            )
        caches = self.slot_views[slot]
        x = F.embedding(tokens, self.embed)
        caught = []
        for i, (weights, (attn_norm, mlp_norm)) in enumerate(zip(self.layers, self.norms)):
            wqkv, wo, w_gate_up, w_down = weights
            qkv = self.mm(self._normalise(x, attn_norm), wqkv).view(steps, 2 * nh + 3 * nkv, hd)
            qk = qkv[:, : nh + nkv] * cos + qkv[:, nh + 2 * nkv :] * sin
            kc, vc = caches[i]
            kc[:, :, start:end] = qk[:, nh:].permute(1, 2, 0)
            vc[:, start:end] = qkv[:, nh + nkv : nh + 2 * nkv].transpose(0, 1)
            q = qk[:, :nh].reshape(steps, nkv, group, hd).transpose(0, 1).reshape(nkv, steps * group, hd)
            scores = self.scores(q, kc[:, :, :keys])
            if not self.folded:
                scores = scores * self.q_scale
            scores += mask
            o = self.attend(self._softmax(scores), vc[:, :keys])
            o = o.view(nkv, steps, group * hd).transpose(0, 1).reshape(steps, nh * hd)
            x = x + self.mm(o, wo)
            gate, up = self.mm(self._normalise(x, mlp_norm), w_gate_up).chunk(2, dim=-1)
            x = x + self.mm(F.silu(gate) * up, w_down)
            if i in self.capture:
                caught.append(x)
        self.last_aux = torch.cat(caught, dim=-1)[None] if caught else None
        return x

    def _layers_batch(self, tokens: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        s = self.shape
        batch, steps = tokens.shape
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        group = nh // nkv
        slot_t = torch.tensor(slots, device=self.device)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(steps, device=self.device)
        flat_positions = positions.reshape(-1)
        cos, sin = self.cos[flat_positions], self.sin[flat_positions]
        key_len = self._key_length(max(starts) + steps)
        keys = torch.arange(key_len, device=self.device)
        visible = (keys[None, None, :] <= positions[:, :, None]).repeat_interleave(group, dim=1)[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        # Slots lo..lo+B-1 in batch order (the engine keeps them so when it can): the caches are plain views;
        # otherwise the rows are gathered, a copy of every sequence's whole cache per layer.
        lo = min(slots)
        contiguous = slots == list(range(lo, lo + batch))
        x = F.embedding(tokens.reshape(-1), self.embed)
        caught = []
        for i, (weights, (attn_norm, mlp_norm)) in enumerate(zip(self.layers, self.norms)):
            wqkv, wo, w_gate_up, w_down = weights
            qkv = self.mm(self._normalise(x, attn_norm), wqkv).view(batch * steps, 2 * nh + 3 * nkv, hd)
            qk = qkv[:, : nh + nkv] * cos + qkv[:, nh + 2 * nkv :] * sin
            k = qk[:, nh:].reshape(batch, steps, nkv, hd)
            v = qkv[:, nh + nkv : nh + 2 * nkv].reshape(batch, steps, nkv, hd)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.permute(0, 3, 1, 2)[slot_t[:, None], positions] = k  # kc: [slot, kv, hd, pos]
            vc.permute(0, 2, 1, 3)[slot_t[:, None], positions] = v  # vc: [slot, kv, pos, hd]
            q = qk[:, :nh].reshape(batch, steps, nkv, group, hd).transpose(1, 2).reshape(batch, nkv, steps * group, hd)
            if contiguous:
                keys_i, values_i = kc[lo : lo + batch, :, :, :key_len], vc[lo : lo + batch, :, :key_len]
            else:
                keys_i, values_i = kc[slot_t, :, :, :key_len], vc[slot_t, :, :key_len]
            scores = self.scores(q, keys_i)
            if not self.folded:
                scores = scores * self.q_scale
            scores += mask
            o = self.attend(self._softmax(scores), values_i)  # [B, kv, T*group, hd]
            o = o.view(batch, nkv, steps, group * hd).transpose(1, 2).reshape(batch * steps, nh * hd)
            x = x + self.mm(o, wo)
            gate, up = self.mm(self._normalise(x, mlp_norm), w_gate_up).chunk(2, dim=-1)
            x = x + self.mm(F.silu(gate) * up, w_down)
            if i in self.capture:
                caught.append(x)
        self.last_aux = torch.cat(caught, dim=-1).view(batch, steps, -1) if caught else None
        return x.view(batch, steps, -1)


def _attend(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [..., R, L] @ values [..., L, hd], L whole blocks of KEY_BLOCK keys, reduced block by block in
    order: one product of fixed shape per block, then the partial results added first to last. A single
    product over all L keys would let the BLAS split the reduction where it likes (it does, somewhere past 256
    keys), so a query's output would change with the number of masked keys after it. A block of KEY_BLOCK keys
    is always the same shape, so however the BLAS splits it, it splits it the same way; masked blocks add exact
    zeros. 512 keeps stories260K (512-token context) to one block per step, the cheapest invariant choice."""
    matmul = rows_padded(torch.matmul)
    out = matmul(probs[..., :KEY_BLOCK], values[..., :KEY_BLOCK, :])
    for lo in range(KEY_BLOCK, probs.shape[-1], KEY_BLOCK):
        out = out + matmul(probs[..., lo : lo + KEY_BLOCK], values[..., lo : lo + KEY_BLOCK, :])
    return out


def rows_padded(product):
    """`product(a, b)` computed, on CPU, with `a` padded by zero rows to at least MIN_ROWS rows (its dim -2), and
    the padding's rows dropped: MKL gives a row the same result in every product of MIN_ROWS rows or more, not in
    smaller ones (see the module docstring)."""

    def padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = a.shape[-2]
        if rows >= MIN_ROWS or a.device.type != "cpu":
            return product(a, b)
        pad = a.new_zeros(*a.shape[:-2], MIN_ROWS - rows, a.shape[-1])
        return product(torch.cat([a, pad], dim=-2), b)[..., :rows, :]

    return padded


def _w12_projection(w12, bf16_mm):
    """x @ W.T for W in W12 form (a weight the plan kept bf16 runs `bf16_mm`, the model's own product). On CUDA:
    W12's GEMM (fused decode-in-GEMM for <= 64 rows, cuBLAS on the kept bf16 copy in the M buckets it falls back
    in, decode + cuBLAS above 64 rows). On CPU: the kept bf16 copy, or else the decoded weight, then the very
    torch.mm the bf16 path runs on the [in, out] weight, so results equal it bit for bit."""
    decode = w12.decode
    linear = w12.linear if torch.cuda.is_available() else None  # w12.linear needs Triton

    def mm(x: torch.Tensor, packed) -> torch.Tensor:
        if not isinstance(packed, w12.W12Tensor):
            return bf16_mm(x, packed)
        if x.is_cuda:
            return linear(x, packed)
        weight = packed.dense if packed.dense is not None else decode(packed)
        return rows_padded(torch.mm)(x, weight.t().contiguous())

    return mm


def load_hf_model(model_dir: str | Path, dtype: str, device: str):
    """Load a causal LM with transformers, in `dtype`, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    return model.to(device).eval()
