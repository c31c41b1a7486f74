"""Make a drafter's weights from the target: (a) truncated, a copy of its first layers; (b) standalone, those layers
distilled on the target's greedy tokens with a head over a reduced draft vocabulary.

Deterministic on one platform: torch's deterministic algorithms, a fixed thread count (the recipe's), the target
as the only initialisation and the data order a function of (seed, step) alone. So a run resumed from a checkpoint
(every `train.checkpoint_every` steps, written atomically into the drafter's work directory) takes exactly the
steps an uninterrupted run takes, and gives the same bytes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"
IGNORE = -100


def draft_config(target_dir: Path, num_layers: int) -> dict[str, Any]:
    """The target's config.json with fewer layers and an untied head (the drafter's head is its own)."""
    config = json.loads((target_dir / "config.json").read_text())
    if num_layers > config["num_hidden_layers"]:
        from specpilot_build.errors import ConfigError

        raise ConfigError(f"num_layers {num_layers}: the target has only {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = num_layers
    config["tie_word_embeddings"] = False
    return config


def target_weights(target_dir: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """The drafter's tensors as the target holds them (float32): embedding, first layers, final norm, head."""
    from safetensors.torch import load_file

    weights = load_file(str(target_dir / "model.safetensors"))
    keep = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        elif name not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            continue
        keep[name] = tensor.float().contiguous()
    keep.setdefault("lm_head.weight", keep["model.embed_tokens.weight"].clone())  # a tied target's head
    return dict(sorted(keep.items()))


def draft_vocabulary(rows: list[dict[str, Any]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent among the training outputs (ties: the lower id), sorted: int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row in rows:
        counts += torch.bincount(torch.tensor(row["output"], dtype=torch.int64), minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def standalone(
    target_dir: Path,
    recipe: dict[str, Any],
    rows: list[dict[str, Any]],
    work: Path,
    *,
    device: str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[float]]:
    """Train recipe (b) on `device`; returns (the drafter's tensors, draft_to_target, the loss of every step). Resumes from
    work/checkpoint.pt when a previous run left one. `on_step(step, loss)` runs after each step."""
    from tqdm.auto import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    train = recipe["train"]
    _deterministic(train["threads"])
    config = draft_config(target_dir, recipe["num_layers"])
    weights = target_weights(target_dir, recipe["num_layers"])
    vocab = draft_vocabulary(rows, recipe["draft_vocab"] or config["vocab_size"], config["vocab_size"])
    llama = LlamaConfig(**{**config, "attn_implementation": "eager"})
    model = LlamaForCausalLM(llama)
    model.load_state_dict(weights, strict=True)
    torch.nn.Module.to(model, device)  # (transformers types its .to for dtypes only)
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)  # shared with the target: a frozen copy
    head = torch.nn.Parameter(weights["lm_head.weight"][vocab].clone().to(device))
    params = [p for n, p in model.model.named_parameters() if p.requires_grad] + [head]
    optimizer = torch.optim.AdamW(params, lr=train["lr"], weight_decay=train["weight_decay"])
    index = torch.full((config["vocab_size"],), IGNORE, dtype=torch.int64)
    index[vocab] = torch.arange(len(vocab))
    sequences = [_example(row, index) for row in rows]
    step, losses = _resume(work, model, head, optimizer)
    steps = train["steps"]
    bar = tqdm(total=steps, initial=step, desc=f"train {recipe['name']}", unit="step")
    while step < steps:
        inputs, labels, mask = (t.to(device) for t in _batch(sequences, recipe["seed"], step, train["batch_size"]))
        for group in optimizer.param_groups:
            group["lr"] = _lr(train, step)
        hidden = model.model(input_ids=inputs, attention_mask=mask).last_hidden_state
        logits = hidden @ head.t()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, len(vocab)), labels.view(-1), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        bar.update(1)
        if step % train["checkpoint_every"] == 0 and step < steps:
            _checkpoint(work, step, model, head, optimizer, losses)
        if on_step is not None:
            on_step(step, losses[-1])
    bar.close()
    out = {name: t.detach().cpu().clone().contiguous() for name, t in model.state_dict().items()}
    full_head = weights["lm_head.weight"].clone()
    full_head[vocab] = head.detach().cpu()
    out["lm_head.weight"] = full_head
    return dict(sorted(out.items())), vocab, losses


def _deterministic(threads: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def _example(row: dict[str, Any], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels: each output token is the label of the position before it (the target's greedy choice
    there); prompt positions and tokens outside the draft vocabulary are ignored."""
    ids = torch.tensor(row["prompt"] + row["output"], dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE)
    first = len(row["prompt"]) - 1
    labels[first:-1] = index[ids[first + 1 :]]
    return ids[:-1], labels[:-1]


def _batch(sequences, seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of `step`: a seeded permutation per epoch, so it depends on (seed, step) only; right-padded."""
    per_epoch = max(1, len(sequences) // size)
    epoch, at = divmod(step, per_epoch)
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    chosen = [sequences[int(i)] for i in order[at * size : (at + 1) * size]]
    length = max(len(ids) for ids, _ in chosen)
    inputs = torch.zeros(len(chosen), length, dtype=torch.int64)
    labels = torch.full((len(chosen), length), IGNORE, dtype=torch.int64)
    mask = torch.zeros(len(chosen), length, dtype=torch.int64)
    for row, (ids, lab) in enumerate(chosen):
        inputs[row, : len(ids)], labels[row, : len(ids)], mask[row, : len(ids)] = ids, lab, 1
    return inputs, labels, mask


def _lr(train: dict[str, Any], step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    import math

    if step < train["warmup_steps"]:
        return train["lr"] * (step + 1) / train["warmup_steps"]
    span = max(1, train["steps"] - train["warmup_steps"])
    progress = (step - train["warmup_steps"]) / span
    return train["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _checkpoint(work: Path, step: int, model, head, optimizer, losses: list[float]) -> None:
    state = {
        "step": step,
        "model": {n: t for n, t in model.state_dict().items()},
        "head": head.detach(),
        "optimizer": optimizer.state_dict(),
        "losses": list(losses),
    }
    tmp = work / f".{CHECKPOINT}.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, work / CHECKPOINT)


def _resume(work: Path, model, head, optimizer) -> tuple[int, list[float]]:
    path = work / CHECKPOINT
    if not path.is_file():
        return 0, []
    state = torch.load(path, weights_only=True, map_location="cpu")
    model.load_state_dict(state["model"], strict=True)
    with torch.no_grad():
        head.copy_(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resuming from {path} at step {state['step']}")
    return int(state["step"]), list(state["losses"])
