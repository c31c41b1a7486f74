"""An EAGLE-3 head (the directory `make draft` recipe eagle3 writes, in the layout SGLang's LlamaForCausalLMEagle3
loads): read and checked against the target, then run one step at a time over its own slotted KV cache.

A row at position p pairs the target's features at p (the outputs of its `aux_layers`, concatenated, mapped by
`fc`) or the head's own output feature of the step before, with the target's embedding of token p + 1; it
predicts the token after p + 1 over the draft vocabulary, mapped to a target id by d2t (target id = draft id +
d2t). The layer: attention over [RMSNorm(embedding) ; RMSNorm(feature)] with the feature as residual, an MLP,
a final norm and the draft head; its pre-norm output is the next step's feature (SGLang's `norm_output` false)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import RuntimeConfigError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"


class Eagle3Head:
    def __init__(self, directory: str | Path, target, num_slots: int):
        directory = Path(directory)
        config = _config(directory)
        s = target.shape
        if ARCHITECTURE not in (config.get("architectures") or []):
            raise RuntimeConfigError(
                f"--draft-model {directory}: not an EAGLE-3 head (architectures lacks {ARCHITECTURE})"
            )
        layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        mismatch = [
            (key, got, want)
            for key, got, want in (
                ("target_hidden_size", config.get("target_hidden_size", config.get("hidden_size")), s.hidden_size),
                ("hidden_size", config.get("hidden_size"), s.hidden_size),  # the embedding is the target's
                ("vocab_size", config.get("vocab_size"), s.vocab_size),
            )
            if got != want
        ]
        if mismatch:
            key, got, want = mismatch[0]
            raise RuntimeConfigError(f"--draft-model {directory}: {key} {got} differs from the target's {want}")
        if not layers or not all(isinstance(i, int) and 0 <= i < s.num_layers for i in layers):
            raise RuntimeConfigError(
                f"--draft-model {directory}: eagle_aux_hidden_state_layer_ids {layers} are not layers of the "
                f"target's {s.num_layers}"
            )
        self.aux_layers = tuple(layers)
        self.device, self.eps = target.device, float(config["rms_norm_eps"])
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.num_heads
        w = _weights(directory, config, len(layers) * s.hidden_size)
        self.fc = w["fc.weight"].t().contiguous()
        attn = "midlayer.self_attn."
        self.wqkv = torch.cat([w[attn + n + "_proj.weight"] for n in "qkv"]).t().contiguous()
        self.wo = w[attn + "o_proj.weight"].t().contiguous()
        mlp = "midlayer.mlp."
        self.w_gate_up = torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]).t().contiguous()
        self.w_down = w[mlp + "down_proj.weight"].t().contiguous()
        self.n_in, self.n_hidden, self.n_post = (
            w[f"midlayer.{n}.weight"] for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        )
        self.n_final = w["norm.weight"]
        self.lm_head = w["lm_head.weight"].t().contiguous()
        self.to_target = (w["d2t"] + torch.arange(len(w["d2t"]))).tolist()
        if min(self.to_target) < 0 or max(self.to_target) >= s.vocab_size:
            raise RuntimeConfigError(f"--draft-model {directory}: d2t maps outside the target's vocabulary")
        self.embed = target.embed.float()
        length = target.cache_length
        shape = (num_slots, self.num_kv_heads, length, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device)
        self.v_cache = torch.zeros(shape, device=self.device)
        theta = float(config.get("rope_theta", 10000.0))
        d = self.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.cat([torch.outer(torch.arange(length, dtype=torch.float32), inv)] * 2, dim=-1)
        self.cos, self.sin = freqs.cos()[:, None].to(self.device), freqs.sin()[:, None].to(self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def step(
        self, slot: int, start: int, tokens: list[int], feature: torch.Tensor, from_target: bool
    ) -> tuple[int, torch.Tensor]:
        """Rows at positions start.. (one per token): returns the target id the last row proposes and its output
        feature. `feature` is the target's aux rows ([T, 3h]; from_target) or the head's own ([T, h])."""
        feature = feature.float()
        if from_target:
            feature = feature @ self.fc
        steps, end = len(tokens), start + len(tokens)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        emb = F.embedding(torch.tensor(tokens, device=self.device), self.embed)
        x = torch.cat([self._norm(emb, self.n_in), self._norm(feature, self.n_hidden)], dim=-1)
        qkv = (x @ self.wqkv).view(steps, nh + 2 * nkv, d)
        cos, sin = self.cos[start:end], self.sin[start:end]
        q = _rope(qkv[:, :nh], cos, sin)
        self.k_cache[slot, :, start:end] = _rope(qkv[:, nh : nh + nkv], cos, sin).transpose(0, 1)
        self.v_cache[slot, :, start:end] = qkv[:, nh + nkv :].transpose(0, 1)
        visible = torch.arange(end, device=self.device)[None] <= torch.arange(start, end, device=self.device)[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            self.k_cache[slot, :, :end][None],
            self.v_cache[slot, :, :end][None],
            attn_mask=visible,
            scale=1.0 / math.sqrt(d),
            enable_gqa=True,
        )[0]
        hidden = o.transpose(0, 1).reshape(steps, nh * d) @ self.wo + feature
        gate, up = (self._norm(hidden, self.n_post) @ self.w_gate_up).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ self.w_down + hidden
        logits = self._norm(out[-1], self.n_final) @ self.lm_head
        return self.to_target[int(logits.argmax())], out[-1:]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeConfigError(f"--draft-model: {path} is missing; expected an EAGLE-3 head directory") from None
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"--draft-model: {path} is not valid JSON ({exc})") from None


def _weights(directory: Path, config: dict, fc_in: int) -> dict[str, torch.Tensor]:
    """The head's tensors, each of the shape its config gives (one line naming the first that is not)."""
    from safetensors.torch import load_file

    path = directory / WEIGHTS
    try:
        w = load_file(str(path))
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types for a damaged file)
        raise RuntimeConfigError(f"{path}: not a readable safetensors file ({type(exc).__name__})") from None
    h, i, d = config["hidden_size"], config["intermediate_size"], config.get("head_dim") or 0
    d = d or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    n = config.get("draft_vocab_size") or config["vocab_size"]
    shapes = {
        "fc.weight": (h, fc_in),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (n, h),
        "d2t": (n,),
    }
    for name, shape in shapes.items():
        if name not in w or tuple(w[name].shape) != shape:
            got = tuple(w[name].shape) if name in w else "missing"
            raise RuntimeConfigError(f"{path}: {name} is {got}, expected {shape}")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}
