"""A corpus drafter (`make draft RECIPE=corpus`, recipe (d)): token streams that seed the shared n-gram cache.

`corpus.safetensors` holds `tokens` (int32, every row's prompt then the target's greedy output) and `offsets`
(int64, row i is tokens[offsets[i]:offsets[i + 1]]). Read and checked once at start-up: a damaged file, or an id
outside the target's vocabulary (a corpus made with another tokenizer), is refused in one line."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import RuntimeConfigError

CORPUS = "corpus.safetensors"


def read_corpus(directory: str, vocab_size: int) -> list[list[int]]:
    path = Path(directory) / CORPUS
    if not path.is_file():
        raise RuntimeConfigError(
            f"--draft-model {directory}: no {CORPUS}; the ngram drafter takes a corpus drafter (recipe kind corpus)"
        )
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        tokens, offsets = tensors["tokens"], tensors["offsets"]
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types for a damaged file)
        raise RuntimeConfigError(f"{path}: no readable tokens and offsets tensors ({type(exc).__name__})") from None
    if not (
        tokens.dtype == torch.int32
        and offsets.dtype == torch.int64
        and tokens.dim() == 1
        and offsets.dim() == 1
        and len(offsets) >= 2
        and int(offsets[0]) == 0
        and int(offsets[-1]) == len(tokens)
        and bool((offsets[1:] > offsets[:-1]).all())
    ):
        raise RuntimeConfigError(f"{path}: tokens must be int32 and offsets increasing int64 from 0 to len(tokens)")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise RuntimeConfigError(
            f"{path}: token id {int(tokens.max())} is outside the target's vocabulary of {vocab_size} "
            "(a corpus made with another tokenizer?)"
        )
    flat, bounds = tokens.tolist(), offsets.tolist()
    return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
