"""Recipe (d), `corpus`: the self-distillation set stored as the tokens that seed the shared n-gram cache.

corpus.safetensors holds `tokens` (int32, every row's prompt then its greedy output, the rows in the set's order)
and `offsets` (int64, len(rows) + 1, row i is tokens[offsets[i]:offsets[i + 1]]). The reference runtime adds every
row to its shared n-gram index at start-up (runtimes/reference/specpilot_runtime/corpus.py reads and checks it).

Made here rather than in make.py (whose source is part of every trained drafter's id, so editing it would move
them): the id is every drafter's (store.drafter_id of the recipe, the target's identity, the set's digest and this
module's source), committed to the store and pinned in the lock the same way."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from specpilot_build.draft.store import CORPUS

__all__ = ["CORPUS", "make_corpus", "write_corpus"]
THREADS = 1  # torch threads generating the set (part of its cache key, as a trained recipe's train.threads is)


def make_corpus(setting: str, recipe: dict[str, Any]):
    """Recipe (d) for the setting's target: the set (generated or read back from its cache), stored and pinned."""
    from specpilot_build.draft import data as data_step
    from specpilot_build.draft import store
    from specpilot_build.draft.make import Made
    from specpilot_build.draft.target import setting_target, tokenizer_files

    target = setting_target(setting)
    started = time.monotonic()
    record = data_step.distillation_set(target, recipe["data"], THREADS)
    material = {
        "recipe": recipe,
        "target": target.identity,
        "data": record["digest"],
        "trainer": store.source_digest(Path(__file__)),
    }
    drafter = store.drafter_id(material)
    name = store.lock_key(target.name, recipe["name"])
    built = not store.drafter_dir(drafter).is_dir()

    def write(out: Path, work: Path) -> None:
        write_corpus(record["rows"], out / CORPUS)
        for file in tokenizer_files(target.directory):
            shutil.copyfile(target.directory / file, out / file)
        (out / store.RECORD).write_text(json.dumps({"id": drafter, **material}, indent=2, sort_keys=True) + "\n")

    directory = store.commit(drafter, target.directory, write)
    store.write_pin(
        store.DrafterPin(
            name=name,
            id=drafter,
            recipe=recipe["name"],
            target=target.identity["repo"],
            files=store.pin_files(directory),
        )
    )
    return Made(name, drafter, directory, built, time.monotonic() - started, None)


def write_corpus(rows: list[dict[str, Any]], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    streams = [list(row["prompt"]) + list(row["output"]) for row in rows]
    offsets = [0]
    for stream in streams:
        offsets.append(offsets[-1] + len(stream))
    tokens = torch.tensor([t for stream in streams for t in stream], dtype=torch.int32)
    save_file(
        {"tokens": tokens, "offsets": torch.tensor(offsets, dtype=torch.int64)},
        str(path),
        metadata={"format": "pt"},
    )
