"""The self-distillation set: the target's own greedy continuations of the `train` split's prompts.

Prompts are rendered as bench renders them (measure/prompts.py: the chat template for chat models), so the
drafter learns the very token streams it will be asked to predict when served. The target decodes them in
process with the reference runtime's LeanLlama, many sequences per forward (its products are batch invariant, so
these are the tokens a served `ar` engine emits). Stored content-addressed under <data>/draft-data/<key>/data.json
with each prompt's and each output's digest; a second `make draft` reuses it after re-checking every digest."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from specpilot_build.draft.target import Target
from specpilot_build.errors import IntegrityError
from specpilot_build.locations import data_dir


def ids_digest(ids: list[int]) -> str:
    """sha256 of comma-separated decimals, as prompts.prompt_digest writes a prompt's."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def distillation_set(target: Target, spec: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    """{"digest", "rows": [{dataset, item_id, prompt, output, prompt_digest, output_digest}]} for recipe `data`,
    the target decoding on `device` (a torch device; a GPU's greedy may differ from the CPU's in near ties, so a
    device other than cpu is part of the set's key)."""
    import blake3

    key_material = key_of(target, spec, threads, device)
    key = blake3.blake3(json.dumps(key_material, sort_keys=True).encode()).hexdigest()
    path = data_dir() / "draft-data" / key / "data.json"
    if path.is_file():
        return checked(path)
    rows = _generate(target, spec, threads, device)
    record = {"key_material": key_material, "digest": rows_digest(rows), "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".data.", suffix=".incomplete")
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)
    return record


def rows_digest(rows: list[dict[str, Any]]) -> str:
    """One digest over the set: each row's dataset, item id, prompt digest and output digest, in order."""
    triples = [[r["dataset"], r["item_id"], r["prompt_digest"], r["output_digest"]] for r in rows]
    return hashlib.sha256(json.dumps(triples, separators=(",", ":")).encode()).hexdigest()


def key_of(target: Target, spec: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    """What a set's cache key hashes: the target, the recipe's `data:`, this module's source, the threads and,
    unless cpu, the device."""
    material = {"target": target.identity, "data": spec, "generator": _source_digest(), "threads": threads}
    return material if device == "cpu" else {**material, "device": device.split(":")[0]}


def checked(path: Path) -> dict[str, Any]:
    """A stored set, every digest recomputed from the ids read back."""
    try:
        record = json.loads(path.read_text())
        rows = record["rows"]
        for row in rows:
            if ids_digest(row["prompt"]) != row["prompt_digest"] or ids_digest(row["output"]) != row["output_digest"]:
                raise IntegrityError(f"{path}: {row['dataset']}/{row['item_id']}: ids differ from their digest")
        if rows_digest(rows) != record["digest"]:
            raise IntegrityError(f"{path}: rows differ from the set's digest; delete the file to regenerate it")
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{path}: not a distillation set ({type(exc).__name__}: {exc}); delete it") from None
    return record


def _source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _generate(target: Target, spec: dict[str, Any], threads: int, device: str) -> list[dict[str, Any]]:
    import torch
    from tqdm.auto import tqdm

    from specpilot_build.measure.datasets import load_split
    from specpilot_build.measure.prompts import PromptRenderer
    from specpilot_runtime.model import LeanLlama, load_hf_model

    renderer = PromptRenderer(target.directory, target.chat_template)
    context = renderer.context_length or 2048
    budget = spec["max_new_tokens"]
    prompts = []
    for dataset in spec["datasets"]:
        for item in load_split(dataset, spec["limit"], split="train"):
            ids = renderer.render(item.prompt)
            if len(ids) + budget + 1 <= context:  # longer prompts would run past the target's context
                prompts.append((dataset, item.id, ids))
    eos = _eos_ids(target.directory, renderer.tokenizer)
    torch.set_num_threads(threads)
    batch = spec["batch_size"]
    hf = load_hf_model(target.directory, target.dtype, device)
    model = LeanLlama(hf, num_slots=batch, max_tokens_per_step=1, device=device)
    rows = []
    with torch.inference_mode(), tqdm(total=len(prompts), desc="target greedy (train split)", unit="prompt") as bar:
        for lo in range(0, len(prompts), batch):
            chunk = prompts[lo : lo + batch]
            outputs = greedy(model, [ids for _, _, ids in chunk], budget, eos)
            for (dataset, item_id, ids), out in zip(chunk, outputs):
                rows.append(
                    {
                        "dataset": dataset,
                        "item_id": item_id,
                        "prompt": ids,
                        "output": out,
                        "prompt_digest": ids_digest(ids),
                        "output_digest": ids_digest(out),
                    }
                )
            bar.update(len(chunk))
    return rows


def greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int]) -> list[list[int]]:
    """Greedy continuations of up to model.num_slots prompts: each prefilled alone, then decoded together, one
    token per sequence per forward; a sequence stops at an EOS token (kept) or after max_new_tokens."""
    import torch

    outputs: list[list[int]] = []
    for slot, ids in enumerate(prompts):
        logits = model.forward(
            torch.tensor([ids], device=model.device),
            [slot],
            [0],
            logit_rows=torch.tensor([len(ids) - 1], device=model.device),
        )
        outputs.append([int(logits[0, -1].argmax())])
    while True:
        active = [s for s, out in enumerate(outputs) if out[-1] not in eos and len(out) < max_new_tokens]
        if not active:
            return outputs
        tokens = torch.tensor([[outputs[s][-1]] for s in active], device=model.device)
        starts = [len(prompts[s]) + len(outputs[s]) - 1 for s in active]
        logits = model.forward(tokens, active, starts)
        for row, s in enumerate(active):
            outputs[s].append(int(logits[row, -1].argmax()))


def _eos_ids(directory: Path, tokenizer) -> frozenset[int]:
    ids = set()
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
