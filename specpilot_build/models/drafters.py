"""Drafters `make draft` made, as checkpoints: where the store keeps them (<data>/drafters/<id hex>/), their pins
(lockfiles/drafters.toml, keyed <model name>-<recipe>), and the proof an engine's drafter is the one it pinned.

A setting's drafter with `recipe:` (conf/drafter or a mechanism) instead of `repo:` is found here: the engine
records the locked id and files as its drafter checkpoint (repo specpilot-drafter/<key>, revision the id's hex,
`converted` the files), and serve re-hashes the stored directory against that record (docs/drafters.md)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.errors import IntegrityError, PinError, SpecPilotError
from specpilot_build.locations import data_dir, lockfiles_dir
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile, _pinned_files, _read_toml

DRAFT_VOCAB = "draft_vocab.safetensors"  # a reduced head: draft_to_target, the target ids it scores
RECORD = "drafter.json"  # what it was made from and the loss of each step (deterministic, like the weights)
LOCKFILE = "drafters.toml"
REPO_PREFIX = "specpilot-drafter/"
ID = re.compile(r"^blake3:[0-9a-f]{64}$")


@dataclass(frozen=True)
class DrafterPin:
    name: str  # the lock key: <model name>-<recipe name>
    id: str
    recipe: str
    target: str  # the target's repo
    files: tuple[PinnedFile, ...]


def lock_key(model_name: str, recipe_name: str) -> str:
    return f"{model_name}-{recipe_name}"


def drafter_dir(drafter: str) -> Path:
    """The store directory of a drafter id (blake3:<hex> or the bare hex)."""
    return data_dir() / "drafters" / drafter.removeprefix("blake3:")


def lock_path() -> Path:
    return lockfiles_dir() / LOCKFILE


def load_drafter_pins(path: Path | None = None) -> dict[str, DrafterPin]:
    path = path or lock_path()
    pins = {}
    for name, table in _read_toml(path).items():
        where = f'{path.name} ["{name}"]'
        if not isinstance(table, dict) or not ID.match(str(table.get("id", ""))):
            raise PinError(f"{where}: id must be blake3:<64 hex>")
        for key in ("recipe", "target"):
            if not isinstance(table.get(key), str):
                raise PinError(f"{where}: `{key}` must be a string")
        pins[name] = DrafterPin(
            name=name,
            id=table["id"],
            recipe=table["recipe"],
            target=table["target"],
            files=_pinned_files(table.get("files", []), f"{where}.files"),
        )
    return pins


def drafter_checkpoint_pin(config: dict, setting: str, lockfiles: Path | None = None) -> CheckpointPin:
    """The pin an engine records for its recipe drafter (`drafter.recipe`; the lock key is the model's name, or
    `drafter.made_for`, and the recipe's). Not locked, or made for another checkpoint than the model's: one line."""
    recipe, made_for = config["drafter"]["recipe"], config["drafter"].get("made_for")
    name = lock_key(made_for or config["model"]["name"], recipe)
    path = (lockfiles or lockfiles_dir()) / LOCKFILE
    pin = load_drafter_pins(path).get(name)
    if pin is None:
        raise PinError(f"drafter {name} ({setting}): not in {path.name}; {_make_hint(config, setting)}")
    if pin.target != config["model"]["repo"]:
        raise PinError(
            f'drafter {name} ({setting}): {path.name} ["{name}"] was made for {pin.target}, '
            f"but the model is {config['model']['repo']}"
        )
    return CheckpointPin(repo=REPO_PREFIX + name, revision=pin.id.removeprefix("blake3:"), converted=pin.files)


def locked_drafter(name: str, setting: str, recipe: str) -> Path:
    """The store directory of the drafter lockfiles/drafters.toml pins as `name`, every file re-hashed."""
    pins = load_drafter_pins()
    if name not in pins:
        raise PinError(
            f"drafter {name}: not in lockfiles/{LOCKFILE}; run `make draft SETTING={setting} RECIPE={recipe}`"
        )
    pin = pins[name]
    record = {
        "repo": REPO_PREFIX + name,
        "revision": pin.id.removeprefix("blake3:"),
        "converted": [vars(f) for f in pin.files],
    }
    return stored_drafter(record, {"setting": setting, "drafter": {"recipe": recipe}})


def stored_drafter(record: dict, config: dict) -> Path:
    """The store directory of the drafter a pin record names, every file re-hashed against it. Absent: one line
    saying how to make it."""
    from specpilot_build.models.proof import verified

    name = record["repo"].removeprefix(REPO_PREFIX)
    hint = _make_hint(config, config.get("setting", "<setting>"))
    directory = drafter_dir(record["revision"])
    if not directory.is_dir():
        raise PinError(f"drafter {name} (blake3:{record['revision'][:12]}…): not in the store ({directory}); {hint}")
    files = [PinnedFile(**f) for f in record.get("converted", [])]
    names = sorted(p.name for p in directory.iterdir())
    if names != sorted(f.path for f in files):
        raise IntegrityError(f"{directory}: files {names} differ from the pinned drafter {name}; delete it and {hint}")
    for f in files:
        if not verified(directory / f.path, f):
            raise IntegrityError(
                f"{directory / f.path}: differs from the pinned drafter {name} (sha256 {f.sha256[:16]}…); "
                f"delete {directory} and {hint}"
            )
    made_as = _recorded_id(directory / RECORD)
    if made_as != "blake3:" + record["revision"]:  # hashes match a lock entry whose id names another drafter
        raise IntegrityError(
            f"{directory / RECORD}: the drafter's id is {made_as}, not the pinned blake3:{record['revision'][:12]}… "
            f"of {name}; {hint}"
        )
    return directory


def _recorded_id(path: Path) -> str | None:
    try:
        made = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return made.get("id") if isinstance(made, dict) else None


def _make_hint(config: dict, setting: str) -> str:
    drafter = config["drafter"]
    made_for = drafter.get("made_for")
    where = f"SETTING={setting}" if not made_for else f"SETTING=<a setting whose model is {made_for}>"
    return f"run `make draft {where} RECIPE={drafter['recipe']}`"


def corpus_rows(directory: Path, vocab_size: int) -> list[list[int]]:
    """A corpus drafter's rows (recipe (d)), read and checked by the very reader the reference runtime seeds its
    n-gram cache with: one line naming the file otherwise."""
    from specpilot_runtime.config import RuntimeConfigError
    from specpilot_runtime.corpus import read_corpus

    try:
        return read_corpus(str(directory), vocab_size)
    except RuntimeConfigError as exc:
        raise SpecPilotError(str(exc)) from None
