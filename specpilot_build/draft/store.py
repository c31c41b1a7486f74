"""Drafters in the store and the lock: ids, the atomic commit into <data>/drafters/<hex>/, lockfiles/drafters.toml.

A drafter's id is `blake3:` of the canonical JSON of {the resolved recipe, the target's identity, the training
data's digest, the trainer's source digest} (the seed is in the recipe). Its directory is a plain transformers
LlamaForCausalLM checkpoint (config.json, model.safetensors, the target's tokenizer files, generation_config.json)
plus, for a reduced head, draft_vocab.safetensors (`draft_to_target`, int64, sorted target ids). It is written in
<data>/drafters/.<hex>.work/ (where training also keeps its resumable checkpoint), proven against the target's
tokenizer and vocabulary, and renamed into place in one step; the lock entry is written only after that."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specpilot_build.errors import SpecPilotError
from specpilot_build.models.drafters import (  # noqa: F401  (re-exported: the store's names, in one place)
    DRAFT_VOCAB,
    LOCKFILE,
    RECORD,
    DrafterPin,
    drafter_dir,
    load_drafter_pins,
    lock_key,
    lock_path,
    locked_drafter,
)
from specpilot_build.pins.lockfile import PinnedFile

HEADER = (
    "# Drafter pins (`make draft SETTING=... RECIPE=...`): lock key <model>-<recipe> -> the drafter's id (blake3 of\n"
    "# recipe, target identity, training data digest, trainer source), the recipe and target it was made from, and\n"
    "# every file of <data>/drafters/<id hex>/ with size and sha256. docs/drafters.md.\n"
)


def drafter_id(material: dict[str, Any]) -> str:
    import blake3

    return "blake3:" + blake3.blake3(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_digest(*modules: Path) -> str:
    digest = hashlib.sha256()
    for path in modules:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def commit(drafter: str, target_dir: Path, write: Callable[[Path, Path], None]) -> Path:
    """Make <data>/drafters/<hex>/ unless it is there: `write(out, work)` fills `out` (work: a directory that
    outlives an interruption, for checkpoints), the result is checked against the target and renamed into place."""
    from filelock import FileLock

    final = drafter_dir(drafter)
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if final.is_dir():  # made before: re-hashed against every lock entry of this id, then checked
            for pin in load_drafter_pins().values():
                if pin.id == drafter:
                    locked_drafter(pin.name, "<setting>", pin.recipe)
            check_against_target(final, target_dir)
            return final
        work = final.parent / f".{final.name}.work"
        work.mkdir(exist_ok=True)
        out = Path(tempfile.mkdtemp(dir=work, prefix="out."))
        try:
            write(out, work)
            check_against_target(out, target_dir)
            out.chmod(0o755)
            for path in out.iterdir():
                path.chmod(0o644)
            os.replace(out, final)
        finally:
            if out.exists():
                shutil.rmtree(out)
        shutil.rmtree(work)  # only once the drafter is in place: an interrupted run resumes from work/
    return final


CORPUS = "corpus.safetensors"  # recipe (d)'s file (draft/corpus.py writes it)


def check_corpus(path: Path, vocab_size: int) -> None:
    """A corpus file's shape and ids (recipe (d), draft/corpus.py writes it): one line naming the file otherwise."""
    from specpilot_build.models.drafters import corpus_rows

    corpus_rows(path.parent, vocab_size)


def check_against_target(directory: Path, target_dir: Path) -> None:
    """A drafter must share the target's tokenizer (every tokenizer file byte-identical) and vocabulary (config
    vocab_size; a corpus (recipe (d)): every token id below it), and its draft_to_target map (if any) must be sorted,
    unique target ids. One line naming the file."""
    from specpilot_build.draft.target import tokenizer_files

    wanted = tokenizer_files(target_dir)
    have = [n for n in tokenizer_files(directory) if n not in (DRAFT_VOCAB, RECORD, CORPUS)]
    if have != wanted:
        raise SpecPilotError(f"{directory}: tokenizer files {have} differ from the target's {wanted} ({target_dir})")
    for name in wanted:
        if (directory / name).read_bytes() != (target_dir / name).read_bytes():
            raise SpecPilotError(f"{directory / name}: differs from the target's tokenizer ({target_dir / name})")
    target_vocab = _json(target_dir / "config.json").get("vocab_size")
    if (directory / CORPUS).is_file():  # recipe (d): tokens, no model
        check_corpus(directory / CORPUS, int(target_vocab or 0))
        return
    draft_vocab = _json(directory / "config.json").get("vocab_size")
    if draft_vocab != target_vocab:
        raise SpecPilotError(
            f"{directory / 'config.json'}: vocab_size {draft_vocab} differs from the target's {target_vocab}"
        )
    if (directory / DRAFT_VOCAB).is_file():
        read_draft_vocab(directory / DRAFT_VOCAB, int(target_vocab or 0))


def read_draft_vocab(path: Path, vocab_size: int):
    """draft_to_target of a drafter: a sorted int64 vector of unique target ids below vocab_size."""
    import torch
    from safetensors.torch import load_file

    try:
        ids = load_file(str(path))["draft_to_target"]
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types for a bad file)
        raise SpecPilotError(f"{path}: no readable draft_to_target tensor ({type(exc).__name__})") from None
    ok = (
        ids.dtype == torch.int64
        and ids.dim() == 1
        and len(ids) > 0
        and bool((ids[1:] > ids[:-1]).all())
        and int(ids[0]) >= 0
        and int(ids[-1]) < vocab_size
    )
    if not ok:
        raise SpecPilotError(f"{path}: draft_to_target must be sorted, unique int64 target ids below {vocab_size}")
    return ids


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecPilotError(f"{path}: unreadable ({exc})") from None


# --- the lock ---------------------------------------------------------------------------------------------------


def pin_files(directory: Path) -> tuple[PinnedFile, ...]:
    from specpilot_build.models.proof import sha256_of

    return tuple(
        PinnedFile(path=p.name, size=p.stat().st_size, sha256=sha256_of(p))
        for p in sorted(directory.iterdir(), key=lambda p: p.name.encode())
    )


def write_pin(pin: DrafterPin, path: Path | None = None) -> None:
    """Add or replace one entry; the file is rewritten in one atomic step (other entries kept as they are)."""
    path = path or lock_path()
    pins = load_drafter_pins(path)
    pins[pin.name] = pin
    lines = [HEADER]
    for name in sorted(pins):
        p = pins[name]
        lines.append(f'\n["{name}"]\nid = "{p.id}"\nrecipe = "{p.recipe}"\ntarget = "{p.target}"\nfiles = [\n')
        lines += [f'  {{ path = "{f.path}", size = {f.size}, sha256 = "{f.sha256}" }},\n' for f in p.files]
        lines.append("]\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(lines))
    os.replace(tmp, path)
