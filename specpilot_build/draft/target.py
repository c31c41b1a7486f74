"""The target a drafter is made for: a setting's model, fetched and proven against its pin, and its identity (what
a drafter's id depends on: the repo, the revision, the source format and the pinned digests of what it loads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot_build.errors import SpecPilotError

WEIGHTS = ("config.json", "model.safetensors", "generation_config.json")  # every other file is the tokenizer's


@dataclass(frozen=True)
class Target:
    setting: str
    name: str  # the model config's name (conf/model/<name>.yaml), the first part of a drafter's lock key
    directory: Path
    dtype: str  # what the served target runs in: its greedy tokens are the training labels
    chat_template: Any
    identity: dict[str, Any]


def setting_target(setting: str) -> Target:
    """The model of `setting`, materialized and verified like `make models` does."""
    from specpilot_build.config.compose import compose_setting

    return model_target(compose_setting(setting, "ar").config["model"], setting)


def model_target(model: dict[str, Any], setting: str) -> Target:
    """A model config's checkpoint (conf/model/<name>.yaml), materialized and verified against the lock."""
    from specpilot_build.models.checkpoints import materialize
    from specpilot_build.pins.lockfile import load_lock

    pin = load_lock().checkpoints.get(model["repo"])
    if pin is None:
        raise SpecPilotError(
            f"{model['repo']} (model of {setting}): not pinned in lockfiles/checkpoints.toml; "
            f"run `make lock SETTING={setting}`"
        )
    source_format = model.get("source_format") or "hf"
    directory = materialize(
        model["repo"], pin, source_format=source_format, files=model.get("files") or (), setting=setting
    )
    return Target(
        setting=setting,
        name=model["name"],
        directory=directory,
        dtype=model["dtype"],
        chat_template=model.get("chat_template"),
        identity={
            "repo": model["repo"],
            "source_format": source_format,
            "dtype": model["dtype"],
            "pin": pin.as_record(),
        },
    )


def tokenizer_files(directory: Path) -> list[str]:
    """The files of a converted model directory that make its tokenizer (all but the weights and configs)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in WEIGHTS)
