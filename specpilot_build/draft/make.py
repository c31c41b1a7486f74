"""`specpilot draft`: a setting's target and a recipe become a drafter in the store, then a pin in the lock.

The steps, each its own module: recipe (load and check), target (fetch and prove), data (the self-distillation
set, cached), train (weights), store (id, atomic commit, lock)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot_build.draft import data as data_step
from specpilot_build.draft import eagle3, platform, store, train
from specpilot_build.draft.recipe import TRAINED, id_material, load_recipe, recipe_path
from specpilot_build.draft.target import WEIGHTS, Target, setting_target, tokenizer_files
from specpilot_build.errors import ConfigError


@dataclass(frozen=True)
class Made:
    name: str  # lock key
    id: str
    directory: Path
    built: bool  # False: it was already in the store
    seconds: float
    final_loss: float | None


def recipe_of_setting(setting: str) -> str:
    """The recipe the setting's final arm drafts with (drafter.recipe), for `make draft SETTING=...` alone."""
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config

    drafter = effective_config(compose_setting(setting, "final").config)["drafter"]
    if not drafter.get("recipe"):
        raise ConfigError(f"setting {setting}: its final arm's drafter has no recipe; name one with RECIPE=<name>")
    if drafter.get("made_for"):  # this setting serves a drafter made with another model's settings
        raise ConfigError(
            f"setting {setting}: its final arm serves the drafter made for model {drafter['made_for']}; make it with "
            f"a setting whose model is {drafter['made_for']} (RECIPE={drafter['recipe']}), or name RECIPE=<name> "
            f"to make one for this setting's model"
        )
    return str(drafter["recipe"])


def make_drafter(
    setting: str,
    recipe_name: str | None = None,
    overrides: Sequence[str] = (),
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> Made:
    recipe = load_recipe(recipe_name or recipe_of_setting(setting), overrides)
    device = "cpu"
    if recipe["kind"] in TRAINED:
        device = platform.prepare(recipe["train"]["device"], recipe_path(recipe["name"]))
    target = setting_target(setting)
    rows: list[dict[str, Any]] = []
    data_digest = None
    if recipe["kind"] in TRAINED:
        record = data_step.distillation_set(target, recipe["data"], recipe["train"]["threads"], device)
        rows, data_digest = record["rows"], record["digest"]
    material = id_material_of(recipe, target.identity, data_digest)
    drafter = store.drafter_id(material)
    name = store.lock_key(target.name, recipe["name"])
    losses: list[float] = []
    started = time.monotonic()
    built = not store.drafter_dir(drafter).is_dir()

    def write(out: Path, work: Path) -> None:
        nonlocal losses
        _write(out, work, target, recipe, rows, material, drafter, losses, device, on_step)

    directory = store.commit(drafter, target.directory, write)
    if not built:
        losses = json.loads((directory / store.RECORD).read_text()).get("losses") or []
    store.write_pin(
        store.DrafterPin(
            name=name,
            id=drafter,
            recipe=recipe["name"],
            target=target.identity["repo"],
            files=store.pin_files(directory),
        )
    )
    return Made(name, drafter, directory, built, time.monotonic() - started, losses[-1] if losses else None)


def id_material_of(recipe: dict[str, Any], target: dict[str, Any] | None, data_digest: str | None) -> dict[str, Any]:
    """What a drafter's id hashes (store.drafter_id): the recipe (train.device cpu left out), the target's
    identity, the training data's digest and the trainer's source digest. draft-import recomputes it the same way."""
    return {
        "recipe": id_material(recipe),
        "target": target,
        "data": data_digest,
        "trainer": store.source_digest(*_trainer_sources(recipe["kind"])),
    }


def _trainer_sources(kind: str) -> tuple[Path, ...]:
    """The modules whose source makes a drafter of this kind (part of its id)."""
    sources = (Path(train.__file__), Path(__file__), Path(platform.__file__))
    return (*sources, Path(eagle3.__file__)) if kind == "eagle3" else sources


def _write(
    out: Path,
    work: Path,
    target: Target,
    recipe: dict[str, Any],
    rows: list[dict[str, Any]],
    material: dict[str, Any],
    drafter: str,
    losses: list[float],
    device: str,
    on_step: Callable[[int, float], None] | None,
) -> None:
    import torch
    from safetensors.torch import save_file

    if recipe["kind"] == "eagle3":
        config, weights, trained = eagle3.train_head(
            target.directory, target.identity, target.dtype, recipe, rows, work, device=device, on_step=on_step
        )
        losses += trained
    else:
        config = train.draft_config(target.directory, recipe["num_layers"])
    if recipe["kind"] == "truncated":
        weights = train.target_weights(target.directory, recipe["num_layers"])
    elif recipe["kind"] == "standalone":
        weights, vocab, trained = train.standalone(target.directory, recipe, rows, work, device=device, on_step=on_step)
        losses += trained
        save_file({"draft_to_target": vocab}, str(out / store.DRAFT_VOCAB), metadata={"format": "pt"})
    save_file(
        {k: v.to(torch.float32).contiguous() if v.is_floating_point() else v for k, v in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in [*tokenizer_files(target.directory), *(n for n in WEIGHTS if n == "generation_config.json")]:
        if (target.directory / name).is_file():
            shutil.copyfile(target.directory / name, out / name)
    # the platform that made it (not part of the id: the same id may be made on another GPU, with other bytes)
    record = {"id": drafter, **material, "losses": losses, "platform": platform.describe(device)}
    (out / store.RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
