"""Recipes (conf/recipe/<name>.yaml): how a drafter is made from a target, checked key by key against a schema.

A recipe is loaded through OmegaConf's structured configs (the schema Hydra's groups use), so an unknown key or a
wrong type fails naming the key and the file; a key the recipe's kind does not use is refused too (a key that does
nothing is an error). Overrides are dotted `key=value` pairs, checked the same way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, List, Optional  # noqa: UP035  (OmegaConf 2.3 reads typing's forms, as in schema.py)

from omegaconf import MISSING

from specpilot_build.errors import ConfigError
from specpilot_build.locations import conf_dir

KINDS = ("truncated", "standalone", "eagle3", "corpus")
DEVICES = ("cpu", "cuda")
TRAINED = ("standalone", "eagle3")  # kinds distilled on the self-distillation set (data: and train: sections)
# corpus (recipe (d)): the self-distillation set itself, stored as the tokens that seed the shared n-gram cache;
# no weights, so the keys of a model (and the seed: nothing is random) do nothing for it
CORPUS_UNUSED = ("num_layers", "draft_vocab", "seed", "train", "eagle3")
GROUP = "recipe"


@dataclass
class RecipeData:
    """The self-distillation set: the target's own greedy continuations of the `train` split's prompts."""

    datasets: List[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "math500", "mbpp", "mt-bench"])  # noqa: UP006, UP045
    limit: Optional[int] = 32  # noqa: UP045  prompts per dataset, the first of its train split; null: all of it
    max_new_tokens: int = 64
    batch_size: int = 8  # sequences the target decodes together


@dataclass
class RecipeTrain:
    steps: int = 200
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    checkpoint_every: int = 50  # steps between resumable checkpoints
    threads: int = 1  # torch CPU threads: part of the id (a product's rounding may depend on it)
    # where the target's greedy, its features and the training run: cpu | cuda (one GPU; see platform.py)
    device: str = "cpu"


@dataclass
class RecipeEagle3:
    """An EAGLE-3 head on the target's hidden states (specpilot_build/draft/eagle3.py)."""

    # the target layers whose outputs feed the head (low, mid, high); None: SGLang's default for an N-layer
    # target, the outputs of layers 1, N//2 - 1 and N - 4
    aux_layers: Optional[List[int]] = None  # noqa: UP006, UP045
    ttt_steps: int = 1  # training-time test: steps unrolled on the head's own output feature (1: none)
    # the loss on the rows that predict the target's output only (chains starting there); the prompt's rows still
    # feed attention. False: every row, the prompt's too
    output_only: bool = False


@dataclass
class Recipe:
    name: str = MISSING
    kind: str = MISSING  # truncated | standalone | eagle3 | corpus
    num_layers: int = 1  # the target's first layers the drafter keeps (eagle3: the head's decoder layers, 1)
    # standalone: the head scores only the N tokens most frequent in the training outputs (draft_vocab.safetensors
    # maps them to the target's ids); None: the full vocabulary
    draft_vocab: Optional[int] = None  # noqa: UP006, UP045
    seed: int = 0
    data: Optional[RecipeData] = None  # noqa: UP006, UP045  standalone, eagle3 and corpus only
    train: Optional[RecipeTrain] = None  # noqa: UP006, UP045  standalone and eagle3 only
    eagle3: Optional[RecipeEagle3] = None  # noqa: UP006, UP045  eagle3 only


POSITIVE = {
    "num_layers": 1,
    "draft_vocab": 2,
    "data.limit": 1,
    "data.max_new_tokens": 1,
    "data.batch_size": 1,
    "train.steps": 1,
    "train.batch_size": 1,
    "train.checkpoint_every": 1,
    "train.threads": 1,
    "train.warmup_steps": 0,
    "seed": 0,
    "eagle3.ttt_steps": 1,
}


def recipe_path(name: str) -> str:
    """conf/recipe/<name>.yaml as errors name it."""
    from specpilot_build.config.schema import shown

    return shown(conf_dir() / GROUP / f"{name}.yaml")


def list_recipes() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / GROUP).glob("*.yaml"))


def load_recipe(name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The recipe `name` with `overrides` applied, resolved to plain containers and checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    from specpilot_build.config.schema import shown

    path = conf_dir() / GROUP / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown recipe '{name}' (no {shown(path)}); known: {', '.join(list_recipes())}")
    where = shown(path)
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:  # a YAML error: one line naming the file
        raise ConfigError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    node = OmegaConf.structured(Recipe)
    for source, layer in ((where, loaded), *((f"override {o}", _override(o)) for o in overrides)):
        try:
            node = OmegaConf.merge(node, layer)
        except ConfigKeyError as exc:
            raise ConfigError(f"unknown key '{exc.full_key}' in {source}{_valid_keys(str(exc.full_key))}") from None
        except (ValidationError, OmegaConfBaseException) as exc:
            raise ConfigError(f"{source}: {str(exc).splitlines()[0]} (key '{exc.full_key}')") from None
    if OmegaConf.select(node, "name") != name:
        raise ConfigError(f"{where}: name must be '{name}', the file's name")
    try:
        recipe = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: {str(exc).splitlines()[0]}") from None
    assert isinstance(recipe, dict)
    checked = {str(k): v for k, v in recipe.items()}
    _check(checked, where)
    if checked["kind"] == "corpus":
        given = {str(k) for k in loaded} | {o.split("=", 1)[0].split(".", 1)[0] for o in overrides}
        for key in CORPUS_UNUSED:
            if key in given:
                raise ConfigError(f"{where}: key '{key}' does nothing for kind corpus (no model, no training); drop it")
            checked.pop(key)  # not part of the id either
    return checked


def id_material(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe as a drafter's id (and drafter.json) names it: `train.device` is left out when it is the default
    `cpu`, so the key's arrival moved no id made before it; `cuda` is part of the id."""
    train = recipe.get("train")
    if train is None or train.get("device") != "cpu":
        return recipe
    return {**recipe, "train": {k: v for k, v in train.items() if k != "device"}}


def _override(text: str):
    from omegaconf import OmegaConf

    if "=" not in text:
        raise ConfigError(f"recipe override {text!r}: expected key=value")
    return OmegaConf.from_dotlist([text])


def _valid_keys(full_key: str) -> str:
    from dataclasses import fields

    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    schema = {"": Recipe, "data": RecipeData, "train": RecipeTrain, "eagle3": RecipeEagle3}.get(parent)
    if schema is None:
        return ""
    return f" (valid keys{' of ' + parent if parent else ''}: {', '.join(f.name for f in fields(schema))})"


def _check(recipe: dict[str, Any], where: str) -> None:
    kind = recipe["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{where}: kind '{kind}' is not one of {', '.join(KINDS)}")
    if kind == "truncated":
        for key in ("draft_vocab", "data", "train", "eagle3"):
            if recipe[key] is not None:
                raise ConfigError(f"{where}: key '{key}' does nothing for kind truncated (no training); drop it")
    else:
        for key in ("data", "train") if kind in TRAINED else ("data",):
            if recipe[key] is None:
                raise ConfigError(f"{where}: kind {kind} needs a `{key}:` section")
        from specpilot_build.measure.datasets import BENCHMARKS

        for name in recipe["data"]["datasets"]:
            if name not in BENCHMARKS:
                raise ConfigError(f"{where}: data.datasets names {name!r}; known: {', '.join(BENCHMARKS)}")
        if kind in TRAINED and recipe["train"]["device"] not in DEVICES:
            raise ConfigError(f"{where}: train.device '{recipe['train']['device']}' is not one of {', '.join(DEVICES)}")
        if kind in TRAINED and recipe["train"]["lr"] <= 0:
            raise ConfigError(f"{where}: train.lr must be > 0, got {recipe['train']['lr']}")
    if kind == "eagle3":
        if recipe["eagle3"] is None:
            raise ConfigError(f"{where}: kind eagle3 needs an `eagle3:` section")
        if recipe["num_layers"] != 1:
            raise ConfigError(f"{where}: num_layers {recipe['num_layers']}: an EAGLE-3 head has 1 decoder layer here")
        layers = recipe["eagle3"]["aux_layers"]
        if layers is not None and (len(layers) != 3 or min(layers) < 0):
            raise ConfigError(
                f"{where}: eagle3.aux_layers must be 3 target layer indices (low, mid, high), got {layers}"
            )
    elif recipe["eagle3"] is not None:
        raise ConfigError(f"{where}: key 'eagle3' does nothing for kind {kind}; drop it")
    for key, low in POSITIVE.items():
        value = _lookup(recipe, key)
        if value is not None and value < low:
            raise ConfigError(f"{where}: {key} must be >= {low}, got {value}")


def _lookup(recipe: dict[str, Any], dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node
