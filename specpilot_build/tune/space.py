"""Search spaces (conf/tune/<space>.yaml): mechanism keys with their choices or ranges, checked like a mechanism.

A space is composed with Hydra (its own file as the primary config, merged into the `TuneSpace` schema, so an
unknown top-level key fails), then each of its values is composed into the setting as the final arm's only
mechanism (`tuned`) through the real compose: the schema's own checks (unknown or misspelt key, wrong type, a
value out of range, runtime options on SGLang or launch arguments on the reference runtime) refuse it, and the
error names the space file and key.

`only_with` makes a key conditional: `drafter.recipe: drafter.fallback` searches (and sets) drafter.recipe only in
the trials where drafter.fallback is not null, since a key that does nothing is an error (the hybrid's head keys
without a fallback)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot_build.errors import ConfigError
from specpilot_build.locations import conf_dir

GROUP = "tune"
MECHANISM = "tuned"  # the candidate's name under final.mechanisms (and the winner's)
RANGE_KEYS = {"low", "high", "step"}


@dataclass
class TuneSpace:
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)  # section -> key -> choices | range; or key -> choices
    only_with: dict[str, str] = field(default_factory=dict)  # "section.key" -> the "section.key" it needs non-null


@dataclass(frozen=True)
class Space:
    name: str
    file: Path
    params: dict[str, list[Any] | dict[str, Any]]  # "section.key" -> choices or {low, high, step}; "key" -> choices
    only_with: dict[str, str] = field(default_factory=dict)  # key -> the key whose non-null value it needs

    @property
    def shown(self) -> str:
        from specpilot_build.config.schema import shown

        return shown(self.file)

    def canonical(self) -> str:
        """What a study records of its space, compared when the study is resumed."""
        if not self.only_with:  # as before conditional keys existed, so earlier studies resume
            return json.dumps(self.params, sort_keys=True)
        return json.dumps({"params": self.params, "only_with": self.only_with}, sort_keys=True)

    def active(self, key: str, values: dict[str, Any]) -> bool:
        """Whether `key` is searched in a trial that has `values` so far (its gate, if any, chosen non-null)."""
        gate = self.only_with.get(key)
        return gate is None or values.get(gate) is not None

    def context(self, key: str, value: Any) -> dict[str, Any]:
        """{key: value} with what makes it a valid candidate alone: a gated key with its gate's first non-null
        choice, and a gate (or gated key) with the first value of every other key the gate opens; keys with a single
        choice (in every trial: a corpus drafter's shared cache) are always set."""
        fixed = {k: v[0] for k, v in self.params.items() if isinstance(v, list) and len(v) == 1}
        fixed = {k: v for k, v in fixed.items() if k != key and k not in self.only_with}
        gate = self.only_with.get(key, key)
        if key == gate and (value is None or key not in self.only_with.values()):
            return {**fixed, key: value}
        first = self.grid()
        values = {**fixed, gate: value if key == gate else next(v for v in first[gate] if v is not None)}
        for gated, its_gate in self.only_with.items():
            if its_gate == gate:
                values[gated] = value if gated == key else first[gated][0]
        return values

    def grid(self) -> dict[str, list[Any]]:
        """Every value of every key: ranges expanded by their step."""
        out = {}
        for key, spec in self.params.items():
            if isinstance(spec, list):
                out[key] = list(spec)
            else:
                step = spec.get("step", 1)
                values, v = [], spec["low"]
                while v <= spec["high"]:
                    values.append(v)
                    v += step
                out[key] = values
        return out

    def distributions(self) -> dict:
        import optuna.distributions as od

        out: dict[str, Any] = {}
        # gates before the keys they open: a trial suggests a gated key only once its gate is chosen
        for key, spec in sorted(self.params.items(), key=lambda item: item[0] in self.only_with):
            if isinstance(spec, list):
                out[key] = od.CategoricalDistribution(spec)
            elif all(isinstance(spec[k], int) for k in spec):
                out[key] = od.IntDistribution(spec["low"], spec["high"], step=spec.get("step", 1))
            else:
                out[key] = od.FloatDistribution(spec["low"], spec["high"], step=spec.get("step"))
        return out


def list_spaces() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / GROUP).glob("*.yaml"))


def load_space(name: str) -> Space:
    """The space conf/tune/<name>.yaml, its shape checked (not yet against a setting: `check_space`)."""
    file = conf_dir() / GROUP / f"{name}.yaml"
    if name not in list_spaces():
        raise ConfigError(f"unknown space '{name}' (no conf/{GROUP}/{name}.yaml); known: {', '.join(list_spaces())}")
    from specpilot_build.config.schema import shown

    where = shown(file)
    raw = _compose_file(name, where)
    params: dict[str, list[Any] | dict[str, Any]] = {}
    for section, keys in (raw.get("params") or {}).items():
        if isinstance(keys, list):  # a key of the mechanism itself (e.g. overlay), with its choices
            params[section] = _checked_spec(keys, f"{where}: params.{section}")
            continue
        if not isinstance(keys, dict) or not keys:
            raise ConfigError(f"{where}: params.{section} must map mechanism keys to choices or a range")
        for key, spec in keys.items():
            params[f"{section}.{key}"] = _checked_spec(spec, f"{where}: params.{section}.{key}")
    if not params:
        raise ConfigError(f"{where}: the space is empty (no params); give at least one key with its choices")
    only_with = dict(raw.get("only_with") or {})
    for key, gate in only_with.items():
        for name_ in (key, gate):
            if name_ not in params:
                raise ConfigError(f"{where}: only_with.{key}: {name_} is not a key of params")
        if gate in only_with:
            raise ConfigError(f"{where}: only_with.{key}: its gate {gate} is itself conditional (one level only)")
        choices = params[gate]
        if not isinstance(choices, list) or None not in choices or all(v is None for v in choices):
            raise ConfigError(
                f"{where}: only_with.{key}: {gate} must list null and at least one other choice, else the "
                "condition does nothing"
            )
    return Space(name=name, file=file, params=params, only_with=only_with)


def _compose_file(name: str, where: str) -> dict:
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name=f"{GROUP}/{name}")[GROUP]  # a file under conf/tune/ lands at `tune`
        merged = OmegaConf.merge(OmegaConf.structured(TuneSpace), cfg)
        container = OmegaConf.to_container(merged, resolve=True)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: {first}") from None
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(container, dict)
    return container


def _checked_spec(spec: Any, where: str) -> list[Any] | dict[str, Any]:
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where}: no choices")
        if len({json.dumps(v, sort_keys=True) for v in spec}) != len(spec):
            raise ConfigError(f"{where}: a choice is listed twice ({spec})")
        return spec
    if isinstance(spec, dict):
        unknown = set(spec) - RANGE_KEYS
        if unknown or not {"low", "high"} <= set(spec):
            raise ConfigError(f"{where}: a range is {{low, high[, step]}}, got keys {sorted(spec)}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in spec.values()):
            raise ConfigError(f"{where}: a range's low, high and step are numbers, got {spec}")
        if spec["low"] > spec["high"]:
            raise ConfigError(f"{where}: low {spec['low']} is above high {spec['high']}")
        if "step" in spec and not spec["step"] > 0:
            raise ConfigError(f"{where}: step must be > 0, got {spec['step']}")
        return dict(spec)
    raise ConfigError(f"{where}: give a list of choices or a range {{low, high[, step]}}, got {spec!r}")


def candidate_overrides(setting_mechanisms: list[str], values: dict[str, Any]) -> list[str]:
    """Hydra overrides that make `values` ("section.key" -> value) the final arm's only mechanism."""
    nested = nest(values)
    drop = [f"~mechanism@final.mechanisms.{name}" for name in setting_mechanisms]
    return [*drop, f"+final.mechanisms={{{MECHANISM}:{_hydra_value(nested)}}}"]


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"section.key": value, "key": value} as the mechanism's nesting {section: {key: value}, key: value}."""
    nested: dict[str, Any] = {}
    for path, value in values.items():
        if "." in path:
            section, key = path.split(".", 1)
            nested.setdefault(section, {})[key] = value
        else:
            nested[path] = value
    return nested


def _hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar (json covers numbers, booleans, null and quoted strings)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return json.dumps(value)


def setting_mechanisms(setting: str) -> list[str]:
    """The mechanisms the setting's final arm applies today (what a candidate replaces)."""
    from specpilot_build.config.compose import compose_setting

    return list((compose_setting(setting, "final").config.get("final") or {}).get("mechanisms") or {})


def check_space(space: Space, setting: str) -> list[str]:
    """Compose every value of the space into `setting` as the final arm's mechanism; the first the schema refuses
    fails naming the space file and key. Returns the setting's mechanisms (what a candidate drops)."""
    from specpilot_build.config.compose import compose_setting

    mechanisms = setting_mechanisms(setting)
    grid = {k: (v if isinstance(space.params[k], list) else [v[0], v[-1]]) for k, v in space.grid().items()}
    for key, values in grid.items():
        for value in values:
            try:
                candidate = candidate_overrides(mechanisms, space.context(key, value))
                composed = compose_setting(setting, "final", candidate)
                check_sglang_flags(composed)
            except ConfigError as exc:
                raise ConfigError(
                    f"{space.shown}: params.{key} = {value!r} is refused for setting {setting}: {_without_override(exc)}"
                ) from None
    return mechanisms


def check_sglang_flags(composed) -> None:
    """On an SGLang setting, the candidate's launch flags and values against the pinned SGLang's own flag table
    (assemble/sglang_flags.py), the one its build would check them against. The table is the one a build of the
    same wheel and overlays cached; where none did yet, the candidate is built (content-addressed: the tune's
    first trial of it is then a cache hit), which reads and caches the table and refuses a bad flag itself."""
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.assemble.inputs import resolve_inputs
    from specpilot_build.assemble.launch import flag_origins, sglang_flags
    from specpilot_build.assemble.sglang_flags import cached_flag_table, check_launch_args
    from specpilot_build.pins.lockfile import WheelPin, load_lock

    inputs = resolve_inputs(composed, load_lock())
    if not isinstance(inputs.runtime, WheelPin):
        return
    flag_check = inputs.config["runtime"].get("flag_check")
    table = cached_flag_table(inputs.runtime.sha256, list(inputs.overlays), flag_check)
    if table is None:
        build_composed(composed)
        table = cached_flag_table(inputs.runtime.sha256, list(inputs.overlays), flag_check)
    if table is None:
        raise ConfigError(f"no flag table of SGLang {inputs.runtime.version} was cached by the build; cannot check")
    origins = flag_origins(inputs.config, composed.config.get("final"))
    check_launch_args(sglang_flags(inputs.config), table, origins, inputs.runtime.version)


def _without_override(exc: ConfigError) -> str:
    """The schema's message without the generated override it names (the space file and key say where)."""
    text = re.sub(r" \(override [^()]*\)", "", str(exc))
    text = re.sub(r"Error merging override \S+; ", "", text)
    text = re.sub(rf" \(set by mechanism '{MECHANISM}' \(final\.mechanisms\.{MECHANISM}\.launch_args\)\)", "", text)
    return text.removeprefix("config: ")
