"""Compose a named setting and arm into a validated config with Hydra's compose API."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot_build.errors import ConfigError
from specpilot_build.locations import conf_dir, data_dir

from specpilot_build.defaults import ARMS  # noqa: F401  (re-exported: the arms a setting composes as)
GROUPS = ("hardware", "model", "drafter", "batching", "runtime", "arm")


@dataclass(frozen=True)
class Composed:
    setting: str
    arm: str
    config: dict[str, Any]  # the whole composed config, resolved to plain containers
    choices: dict[str, str]  # Hydra's group choices (setting, hardware, model, ...)


def list_settings() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "setting").glob("*.yaml"))


def compose_setting(setting: str, arm: str = "final", overrides: list[str] = ()) -> Composed:
    """Compose `setting` as `arm`; unknown settings, options, keys and wrong types fail naming them."""
    if setting not in list_settings():
        raise ConfigError(f"unknown setting '{setting}' (no conf/setting/{setting}.yaml); "
                             f"known: {', '.join(list_settings())}")
    if arm not in ARMS:
        raise ConfigError(f"unknown arm '{arm}'; choose one of {', '.join(ARMS)}")
    args = [f"setting@_global_={setting}", f"arm={arm}", *overrides]
    cache = data_dir() / "cache" / "compose" / f"{_compose_key(args)}.json"
    try:
        known = json.loads(cache.read_text())
        return Composed(setting=setting, arm=arm, config=known["config"], choices=known["choices"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        pass
    from omegaconf import OmegaConf

    cfg, choices = _compose(args)
    composed = Composed(setting=setting, arm=arm, config=OmegaConf.to_container(cfg, resolve=True), choices=choices)
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
    return hasher.hexdigest()


def _store(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only data dir only costs the next compose its speed


def from_hydra_config(cfg, choices: dict[str, str]) -> Composed:
    """Wrap a config Hydra already composed (inside @hydra.main, e.g. a multirun job)."""
    from omegaconf import OmegaConf

    picked = {k.split("@")[0]: v for k, v in choices.items() if k.split("@")[0] in ("setting", *GROUPS)}
    return Composed(setting=cfg.setting, arm=cfg.arm.name,
                    config=OmegaConf.to_container(cfg, resolve=True), choices=picked)


def _compose(overrides: list[str]):
    import yaml
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specpilot_build.config.schema import register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
            choices = dict(cfg.hydra.runtime.choices)
            with _open_struct(cfg):
                del cfg["hydra"]
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"config: {_one_line(exc)}") from exc
    finally:
        GlobalHydra.instance().clear()
    del HydraConfig
    picked = {k.split("@")[0]: v for k, v in choices.items() if k.split("@")[0] in ("setting", *GROUPS)}
    return cfg, picked


def _open_struct(cfg):
    from omegaconf import open_dict
    return open_dict(cfg)


def _one_line(exc: Exception) -> str:
    text = str(exc) if exc.__cause__ is None else f"{exc}\n{exc.__cause__}"
    text = re.sub(r"\w+ raised while composing config:", "", text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    text = "; ".join(keep[:2]) if keep else type(exc).__name__
    full = next((ln for ln in lines if ln.startswith("full_key:")), "")
    return f"{text} ({full})" if full and full.split(":", 1)[1].strip() not in text else text
