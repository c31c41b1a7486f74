"""Compose a named setting and arm into a validated config with Hydra's compose API."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpilot_build.defaults import ARMS  # noqa: F401  (re-exported: the arms a setting composes as)
from specpilot_build.errors import ConfigError
from specpilot_build.locations import conf_dir, data_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig

GROUPS = ("hardware", "model", "drafter", "batching", "runtime", "arm")


@dataclass(frozen=True)
class Composed:
    setting: str
    arm: str
    config: dict[str, Any]  # the whole composed config, resolved to plain containers
    choices: dict[str, str]  # Hydra's group choices (setting, hardware, model, ...)


def list_settings() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "setting").glob("*.yaml"))


def compose_setting(setting: str, arm: str = "final", overrides: Sequence[str] = ()) -> Composed:
    """Compose `setting` as `arm`; unknown settings, options, keys and wrong types fail naming them."""
    if setting not in list_settings():
        raise ConfigError(
            f"unknown setting '{setting}' (no conf/setting/{setting}.yaml); known: {', '.join(list_settings())}"
        )
    if arm not in ARMS:
        raise ConfigError(f"unknown arm '{arm}'; choose one of {', '.join(ARMS)}")
    args = [f"setting@_global_={setting}", f"arm={arm}", *overrides]
    cache = data_dir() / "cache" / "compose" / f"{_compose_key(args)}.json"
    try:
        known = json.loads(cache.read_text())
        return Composed(setting=setting, arm=arm, config=known["config"], choices=known["choices"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        pass
    cfg, choices = _compose(args)
    composed = Composed(setting=setting, arm=arm, config=plain_config(cfg), choices=choices)
    _store(cache, {"config": composed.config, "choices": composed.choices})
    return composed


def _compose_key(args: list[str]) -> str:
    """Composition is a pure function of the config tree, the schema and the overrides: digest those."""
    import blake3

    hasher = blake3.blake3(json.dumps(args).encode())
    root = conf_dir()
    for path in sorted(root.rglob("*.yaml")):
        hasher.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for module in ("schema.py", "compose.py"):
        hasher.update((Path(__file__).parent / module).read_bytes())
    import specpilot_runtime.config  # its RUNTIME_OPTIONS are what a mechanism's runtime_options are checked against

    hasher.update(Path(specpilot_runtime.config.__file__).read_bytes())
    return hasher.hexdigest()


def _store(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only data dir only costs the next compose its speed


def from_hydra_config(cfg: DictConfig, choices: dict[str, str], overrides: list[str] | None = None) -> Composed:
    """Wrap a config Hydra already composed (inside @hydra.main, e.g. a multirun job), checked as
    compose_setting checks it; `overrides` default to the job's own (HydraConfig's overrides.task)."""
    from specpilot_build.config.schema import check_composed

    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    _name_setting(cfg, choices)
    config = plain_config(cfg)
    check_composed(config, choices, overrides)
    return Composed(setting=config["setting"], arm=config["arm"]["name"], config=config, choices=_recorded(choices))


def plain_config(cfg: DictConfig, throw_on_missing: bool = False) -> dict[str, Any]:
    """A composed config as plain containers, interpolations resolved (a config's root is always a mapping)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=throw_on_missing)
    if not isinstance(container, dict):
        raise ConfigError(f"config: the composed config is a {type(container).__name__}, not a mapping")
    return {str(key): value for key, value in container.items()}


def _recorded(choices: dict[str, str]) -> dict[str, str]:
    """The choices a manifest records: the setting and the six groups. Mechanism choices are left out on
    purpose: what each one sets is in the effective config (its name, overlay and every value it changes),
    so recording its file name too would only let renaming a mechanism file change engine ids."""
    return {k.split("@")[0]: v for k, v in choices.items() if k.split("@")[0] in ("setting", *GROUPS)}


def _name_setting(cfg: DictConfig, choices: dict[str, str]) -> None:
    """A preset is named by its file: `setting` is Hydra's choice for setting@_global_, never a key in it."""
    from omegaconf import OmegaConf

    name = next((v for k, v in choices.items() if k.split("@")[0] == "setting"), None)
    if name is None:
        raise ConfigError("config: no setting chosen (setting@_global_=<name>)")
    if not OmegaConf.is_missing(cfg, "setting"):
        raise ConfigError(
            f"{_shown(conf_dir() / 'setting' / f'{name}.yaml')}: drop the `setting:` key; "
            f"a setting's name is its file name"
        )
    cfg.setting = name


def _shown(path: Path) -> str:
    from specpilot_build.config.schema import shown

    return shown(path)


def _compose(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from specpilot_build.config.schema import check_composed, register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
            choices = dict(cfg.hydra.runtime.choices)
            with open_dict(cfg):
                del cfg["hydra"]
            _name_setting(cfg, choices)
            container = plain_config(cfg, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"config: {_one_line(exc)}") from exc
    finally:
        GlobalHydra.instance().clear()
    del HydraConfig
    check_composed(container, choices, overrides)
    return cfg, _recorded(choices)


def _one_line(exc: Exception) -> str:
    text = str(exc) if exc.__cause__ is None else f"{exc}\n{exc.__cause__}"
    text = re.sub(r"\w+ raised while composing config:", "", text)
    text = re.sub(r"\nConfig search path:(\n\t.*)*", "", text)
    # "Available options in 'g':\n\ta\n\tb" → one clause
    text = re.sub(
        r"Available options in '([^']+)':((?:\n\t.*)*)",
        lambda m: f"available in {m.group(1)}: {', '.join(_options(m.group(2)))}",
        text,
    )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    text = "; ".join(keep[:2]) if keep else type(exc).__name__
    text = re.sub(r"In '([^']+)':;?", _in_file, text).replace(": ;", ":")
    full = next((ln for ln in lines if ln.startswith("full_key:")), "")
    text = f"{text} ({full})" if full and full.split(":", 1)[1].strip() not in text else text
    return text + _nearest_field(text)


def _options(listing: str) -> list[str]:
    """A group's options as Hydra lists them, without the schema nodes SpecPilot registers (internal names)."""
    return [name for name in listing.split() if not name.endswith("_schema")]


def _in_file(match: re.Match[str]) -> str:
    """Hydra's "In 'group/option':" as the file it means."""
    path = conf_dir() / f"{match.group(1)}.yaml"
    return f"{_shown(path)}:" if path.is_file() else match.group(0)


def _nearest_field(text: str) -> str:
    """For OmegaConf's "Key 'k' not in 'Schema'", the schema field nearest to k."""
    import difflib
    from dataclasses import fields, is_dataclass

    from specpilot_build.config import schema

    m = re.search(r"Key '([^']+)' not in '(\w+)'", text)
    if m is None:
        return ""
    node = getattr(schema, m.group(2), None)
    if not is_dataclass(node):
        return ""
    close = difflib.get_close_matches(m.group(1), [f.name for f in fields(node)], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
