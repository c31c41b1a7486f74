"""Recipe (c): an EAGLE-3 head on the target's hidden states, trained on the self-distillation set, saved in the
layout SGLang's `LlamaForCausalLMEagle3` (sglang/srt/models/llama_eagle3.py) loads.

The head: `fc` maps the outputs of three target layers (low, mid, high; concatenated, 3 x hidden) to the hidden
size; one Llama decoder layer (`midlayer`) whose attention input is [RMSNorm(token embedding) ; RMSNorm(feature)]
(2 x hidden) and whose residual is the feature; a final norm and an untied head over the draft vocabulary
(`lm_head`, draft_vocab rows), mapped to target ids by `d2t` (target id - draft id) and `t2d` (a bool per target
id). The embedding is the target's, frozen and not saved (SGLang takes it from the target, set_embed).

Row t of a sequence pairs the target's feature at position t with the embedding of token t + 1 and predicts the
target's next token after it (position t + 1). Features come from one prefill forward of the target (the
reference runtime's LeanLlama, capturing the layers) over prompt + greedy output, cached per sequence under
<data>/draft-features/<key>.safetensors with the target's log-probabilities over the draft vocabulary at every
next position: the loss is the cross-entropy to that distribution (KL up to a constant), not the greedy token
alone. Training-time test (EAGLE-3): with `eagle3.ttt_steps` = n > 1 the head is unrolled n steps, step j feeding
at position t its own output feature of step j - 1 at t - 1 and attending to step 0's keys up to t - j plus the
chain's own keys (the diagonal), as chained drafting does; step j's loss weighs 0.8^j. With `eagle3.output_only`
the loss is on the rows that predict the target's output (and chains starting there) only: the prompt's rows still
feed attention, and the head's product is computed on the loss rows alone.

Determinism, checkpoints and batches are as recipe (b)'s (train.py): the head starts from a seeded init, the data
order depends on (seed, step) alone, and a run resumed from work/checkpoint.pt gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specpilot_build.draft import train

ARCHITECTURE = "LlamaForCausalLMEagle3"
FEATURES = "draft-features"
FEATURES_VERSION = 1  # bump when what a feature file holds changes (its key covers model.py's source too)
STEP_WEIGHT = 0.8


def aux_layers(recipe: dict[str, Any], num_layers: int) -> list[int]:
    """The target layers whose outputs feed the head: the recipe's, else SGLang's default for the target (its
    LlamaForCausalLM.set_eagle3_layers_to_capture captures the inputs of layers 2, N//2, N-3)."""
    from specpilot_build.errors import ConfigError

    layers = recipe["eagle3"]["aux_layers"] or [1, num_layers // 2 - 1, num_layers - 4]
    if max(layers) >= num_layers:
        raise ConfigError(f"eagle3.aux_layers {layers}: the target has only {num_layers} layers")
    return [int(i) for i in layers]


def head_config(target_dir: Path, layers: list[int], draft_vocab_size: int) -> dict[str, Any]:
    """config.json of the head, in the keys SGLang's LlamaForCausalLMEagle3 and its EAGLE worker read."""
    target = json.loads((target_dir / "config.json").read_text())
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "hidden_act",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = {k: target[k] for k in keep if k in target}
    config.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    config.update(
        architectures=[ARCHITECTURE],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,  # the head is its own (draft_vocab_size rows), not the embedding
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target["hidden_size"],
        torch_dtype="float32",
        eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
    )
    return config


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.q_proj = nn.Linear(2 * h, c["num_attention_heads"] * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c["num_key_value_heads"] * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c["num_key_value_heads"] * d, bias=False)
        self.o_proj = nn.Linear(c["num_attention_heads"] * d, h, bias=False)


class _Mlp(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        eps = c["rms_norm_eps"]
        self.input_layernorm = _Norm(c["hidden_size"], eps)  # the token embedding's
        self.hidden_norm = _Norm(c["hidden_size"], eps)  # the feature's
        self.post_attention_layernorm = _Norm(c["hidden_size"], eps)
        self.self_attn = _Attention(c)
        self.mlp = _Mlp(c)


class Eagle3Head(nn.Module):
    """The head's trainable tensors, named as SpecForge saves them and SGLang's loader maps them (`midlayer` ->
    `layers.0`, q/k/v and gate/up stacked on load, the rest under `model.`)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = c
        h = c["hidden_size"]
        self.fc = nn.Linear(
            len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * c["target_hidden_size"], h, bias=False
        )
        self.midlayer = _Layer(c)
        self.norm = _Norm(h, c["rms_norm_eps"])
        self.lm_head = nn.Linear(h, c["draft_vocab_size"], bias=False)
        d = c["head_dim"]
        inv = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.outer(torch.arange(c["max_position_embeddings"], dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def unroll(
        self, aux: torch.Tensor, embeds: torch.Tensor, steps: int, rows: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Logits [B, T, draft_vocab] of each of `steps` unrolled steps, for features aux [B, T, 3h] and next-token
        embeddings [B, T, h]. Step j at row t: feature = step j-1's output at t-1 (step 0: fc(aux[t])), keys =
        step 0's up to t - j and steps 1..j's on the chain's diagonal. With `rows` (a [B, T] mask per step), step
        j's logits are those of its rows only, [N_j, draft_vocab] (the head's product is most of a step's cost)."""
        c, layer = self.c, self.midlayer
        batch, length, _ = embeds.shape
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        cos, sin = self.cos[:length, None, :], self.sin[:length, None, :]
        emb = layer.input_layernorm(embeds)
        feature = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out_logits = []
        for j in range(steps):
            x = torch.cat([emb, layer.hidden_norm(feature)], dim=-1)
            att = layer.self_attn
            q = _rope(att.q_proj(x).view(batch, length, nh, d), cos, sin)
            k = _rope(att.k_proj(x).view(batch, length, nkv, d), cos, sin)
            v = att.v_proj(x).view(batch, length, nkv, d)
            keys.append(k.repeat_interleave(nh // nkv, dim=2))
            values.append(v.repeat_interleave(nh // nkv, dim=2))
            hidden = att.o_proj(_attend(q, keys, values).reshape(batch, length, nh * d)) + feature
            mlp = layer.mlp
            normed = layer.post_attention_layernorm(hidden)
            out = mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)) + hidden
            out_logits.append(self.lm_head(self.norm(out if rows is None else out[rows[j]])))
            feature = torch.cat([out.new_zeros(batch, 1, out.shape[-1]), out[:, :-1]], dim=1)
        return out_logits


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step j = len(keys) - 1: row t attends to keys[0] at rows <= t - j and to keys[i] at row t - (j - i)."""
    j = len(keys) - 1
    length, d = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    qh = q.transpose(1, 2)  # [B, H, T, d]
    scores = [qh @ keys[0].permute(0, 2, 3, 1) * scale]  # [B, H, T, T]
    visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-j)
    scores[0] = scores[0].masked_fill(~visible, float("-inf"))
    shifted_values = []
    for i in range(1, j + 1):
        shift = j - i
        k = _shift(keys[i], shift).transpose(1, 2)  # [B, H, T, d]: row t holds keys[i][t - shift]
        diag = (qh * k).sum(-1, keepdim=True) * scale
        if shift:
            diag[:, :, :shift] = float("-inf")
        scores.append(diag)
        shifted_values.append(_shift(values[i], shift).transpose(1, 2))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :length] @ values[0].transpose(1, 2)
    for i, v in enumerate(shifted_values):
        out = out + probs[..., length + i : length + i + 1] * v
    return out.transpose(1, 2)  # [B, T, H, d]


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, T, ...] moved `by` rows later (row t holds x[t - by]; the first rows zeros)."""
    if by == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], by, *x.shape[2:]), x[:, :-by]], dim=1)


# --- features: one prefill of the target per sequence, cached by digest -------------------------------------------


def features(
    target_dir: Path,
    identity: dict[str, Any],
    dtype: str,
    rows: list[dict[str, Any]],
    layers: list[int],
    vocab: torch.Tensor,
    device: str = "cpu",
) -> list[dict[str, torch.Tensor]]:
    """Per sequence {aux [L-1, 3h] float32, next [L-1] int64, logp [L-1, N] float16}: row t's features at
    position t, the token at t + 1 and the target's log-probabilities over the draft vocabulary at t + 1, the
    target running on `device` (other than cpu, part of the cache key: a GPU rounds otherwise)."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from specpilot_build.locations import data_dir

    folder = data_dir() / FEATURES
    folder.mkdir(parents=True, exist_ok=True)
    common = {
        "target": identity,
        "layers": layers,
        "vocab": hashlib.sha256(vocab.numpy().tobytes()).hexdigest(),
        "version": FEATURES_VERSION,
        "model_source": _model_source_digest(),
    }
    if device != "cpu":
        common["device"] = device.split(":")[0]
    model = None
    out = []
    for row in tqdm(rows, desc="target features (one prefill each)", unit="seq"):
        key = hashlib.sha256(
            json.dumps(
                {**common, "prompt": row["prompt_digest"], "output": row["output_digest"]}, sort_keys=True
            ).encode()
        ).hexdigest()
        path = folder / f"{key}.safetensors"
        length = len(row["prompt"]) + len(row["output"]) - 1
        if path.is_file():
            record = load_file(str(path))
            if _feature_ok(record, length, len(layers), vocab, row):
                out.append({**record, "first": torch.tensor(len(row["prompt"]) - 1)})
                continue
        if model is None:
            longest = max(len(r["prompt"]) + len(r["output"]) for r in rows)
            model = _target(target_dir, dtype, longest, layers, device)
        record = _prefill(model, row, vocab)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        save_file(record, str(tmp), metadata={"key": key})
        os.replace(tmp, path)
        out.append({**record, "first": torch.tensor(len(row["prompt"]) - 1)})
    return out


def _model_source_digest() -> str:
    import specpilot_runtime.model as model_module

    return hashlib.sha256(Path(model_module.__file__).read_bytes()).hexdigest()


def _feature_ok(record: dict[str, torch.Tensor], length: int, num_aux: int, vocab, row) -> bool:
    """A cached file read back: every tensor of the expected shape and type, the tokens the row's ids."""
    try:
        ids = torch.tensor(row["prompt"] + row["output"], dtype=torch.int64)
        return (
            record["aux"].shape[0] == length
            and record["aux"].shape[1] % num_aux == 0
            and record["logp"].shape == (length, len(vocab))
            and record["logp"].dtype == torch.float16
            and torch.equal(record["next"], ids[1:])
        )
    except KeyError:
        return False


def _target(target_dir: Path, dtype: str, longest: int, layers: list[int], device: str):
    from specpilot_runtime.model import LeanLlama, load_hf_model

    model = LeanLlama(load_hf_model(target_dir, dtype, device), num_slots=1, max_tokens_per_step=1, device=device)
    if longest > model.shape.context_length:
        from specpilot_build.errors import ConfigError

        raise ConfigError(f"a training sequence of {longest} tokens exceeds the target's context")
    model.capture = tuple(layers)
    return model


@torch.inference_mode()
def _prefill(model, row: dict[str, Any], vocab: torch.Tensor) -> dict[str, torch.Tensor]:
    ids = torch.tensor(row["prompt"] + row["output"], dtype=torch.int64)
    logits = model.forward(ids[None].to(model.device), [0], [0])[0]
    aux = model.last_aux[0].float()
    logp = torch.log_softmax(logits[1:, vocab.to(logits.device)].float(), dim=-1)
    return {
        "aux": aux[:-1].cpu().contiguous(),
        "next": ids[1:].contiguous(),
        "logp": logp.to(torch.float16).cpu().contiguous(),
    }


# --- training ------------------------------------------------------------------------------------------------------


def train_head(
    target_dir: Path,
    identity: dict[str, Any],
    dtype: str,
    recipe: dict[str, Any],
    rows: list[dict[str, Any]],
    work: Path,
    *,
    device: str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[float]]:
    """Train recipe (c) on `device`; returns (config.json, the tensors of model.safetensors with d2t and t2d, the
    loss of every step). Resumes from work/checkpoint.pt when a previous run left one. On a GPU the cached features
    are held in its memory (platform.py: `train.device`; the recipe's comment sizes them)."""
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    tcfg = recipe["train"]
    target = json.loads((target_dir / "config.json").read_text())
    vocab_size = target["vocab_size"]
    vocab = train.draft_vocabulary(rows, recipe["draft_vocab"] or vocab_size, vocab_size)
    layers = aux_layers(recipe, target["num_hidden_layers"])
    train._deterministic(tcfg["threads"])
    cached = features(target_dir, identity, dtype, rows, layers, vocab, device)
    if device != "cpu":
        cached = [{k: v.to(device) for k, v in c.items()} for c in cached]
    config = head_config(target_dir, layers, len(vocab))
    head = Eagle3Head(config)
    _init(head, recipe["seed"], load_file(str(target_dir / "model.safetensors")), vocab)
    head.to(device)
    embed = _target_embedding(target_dir).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=tcfg["lr"], weight_decay=tcfg["weight_decay"])
    step, losses = _resume(work, head, optimizer)
    steps, ttt = tcfg["steps"], recipe["eagle3"]["ttt_steps"]
    output_only = recipe["eagle3"]["output_only"]
    head.train()
    bar = tqdm(total=steps, initial=step, desc=f"train {recipe['name']}", unit="step")
    while step < steps:
        aux, nxt, logp, valid, starts = _batch(cached, recipe["seed"], step, tcfg["batch_size"], output_only)
        for group in optimizer.param_groups:
            group["lr"] = train._lr(tcfg, step)
        loss_rows = _step_rows(starts, valid, ttt)
        loss = _loss(head.unroll(aux, F.embedding(nxt, embed), ttt, loss_rows), logp, loss_rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        bar.update(1)
        if step % tcfg["checkpoint_every"] == 0 and step < steps:
            _checkpoint(work, step, head, optimizer, losses)
        if on_step is not None:
            on_step(step, losses[-1])
    bar.close()
    tensors = {name: t.detach().cpu().clone().contiguous() for name, t in head.state_dict().items()}
    tensors["d2t"] = vocab - torch.arange(len(vocab), dtype=torch.int64)  # SGLang: hot id = d2t + arange
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    tensors["t2d"] = t2d
    return config, dict(sorted(tensors.items())), losses


def _target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"].float()


def _init(head: Eagle3Head, seed: int, target: dict[str, torch.Tensor], vocab: torch.Tensor) -> None:
    """Seeded normal(0, 0.02) projections, norms at one, the final norm and the head's rows from the target's."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        head.norm.weight.copy_(target["model.norm.weight"].float())
        full = target.get("lm_head.weight", target["model.embed_tokens.weight"]).float()
        head.lm_head.weight.copy_(full[vocab])


def _step_rows(starts: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Step j's loss rows: t inside the sequence where a chain starting at row t - j (a row of `starts`) is."""
    return [_shift(starts, j) & valid for j in range(steps)]


def _loss(logits: list[torch.Tensor], logp: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of each step's draft distribution (logits of its `rows`) to the target's over the draft
    vocabulary, steps weighted 0.8^j."""
    total = logits[0].new_zeros(())
    weights = 0.0
    for j, (step_logits, mask) in enumerate(zip(logits, rows)):
        target = logp[mask].float().exp()
        ce = -(target * torch.log_softmax(step_logits, dim=-1)).sum(-1)
        total = total + STEP_WEIGHT**j * ce.mean()
        weights += STEP_WEIGHT**j
    return total / weights


def _batch(cached: list[dict[str, torch.Tensor]], seed: int, step: int, size: int, output_only: bool = False):
    """The batch of `step` (a seeded permutation per epoch, as train._batch): right-padded, with a validity mask and
    the mask of the rows a chain may start at (every valid row, or with `output_only` those predicting the output)."""
    per_epoch = max(1, len(cached) // size)
    epoch, at = divmod(step, per_epoch)
    order = torch.randperm(len(cached), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    chosen = [cached[int(i)] for i in order[at * size : (at + 1) * size]]
    length = max(len(c["next"]) for c in chosen)
    width, vocab = chosen[0]["aux"].shape[1], chosen[0]["logp"].shape[1]
    on = chosen[0]["aux"].device  # where the cached features are held
    aux = torch.zeros(len(chosen), length, width, device=on)
    nxt = torch.zeros(len(chosen), length, dtype=torch.int64, device=on)
    logp = torch.zeros(len(chosen), length, vocab, dtype=torch.float16, device=on)
    valid = torch.zeros(len(chosen), length, dtype=torch.bool, device=on)
    starts = torch.zeros(len(chosen), length, dtype=torch.bool, device=on)
    for b, c in enumerate(chosen):
        n = len(c["next"])
        aux[b, :n], nxt[b, :n], logp[b, :n], valid[b, :n] = c["aux"], c["next"], c["logp"], True
        starts[b, int(c["first"]) if output_only else 0 : n] = True
    return aux, nxt, logp, valid, starts


def _checkpoint(work: Path, step: int, head: Eagle3Head, optimizer, losses: list[float]) -> None:
    state = {"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(), "losses": list(losses)}
    tmp = work / f".{train.CHECKPOINT}.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, work / train.CHECKPOINT)


def _resume(work: Path, head: Eagle3Head, optimizer) -> tuple[int, list[float]]:
    path = work / train.CHECKPOINT
    if not path.is_file():
        return 0, []
    state = torch.load(path, weights_only=True, map_location="cpu")
    head.load_state_dict(state["head"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    print(f"resuming from {path} at step {state['step']}")
    return int(state["step"]), list(state["losses"])
