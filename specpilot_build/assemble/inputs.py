"""Resolve a composed setting's inputs once: the effective config, the runtime pin, the checkpoint pins, the
overlays and the kernels, each with its digest. Hashing (the manifest's `inputs`, the no-op index key) and
assembly both read this one object, so nothing is looked up or digested twice."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.assemble.base import local_runtime_dir
from specpilot_build.assemble.overlays import overlay_inputs
from specpilot_build.config.compose import Composed
from specpilot_build.config.effective import effective_config, overlays_in_order
from specpilot_build.errors import PinError, SpecPilotError
from specpilot_build.locations import KERNELS_DIR
from specpilot_build.pins.lockfile import CheckpointPin, LocalRuntimePin, Lock, WheelPin
from specpilot_build.store.manifest import (
    files_digest,
    source_dir_digest,
    source_files,
)
from specpilot_build.store.names import plain_name


@dataclass(frozen=True)
class Kernel:
    name: str
    files: tuple[tuple[str, Path], ...]  # (path inside the kernel, source file)
    digest: str


@dataclass(frozen=True)
class BuildInputs:
    composed: Composed
    config: dict  # the effective config: what this arm executes
    lock: Lock
    runtime: WheelPin | LocalRuntimePin
    runtime_record: dict
    checkpoints: dict[str, CheckpointPin | None]  # role -> pin
    overlays: tuple[dict, ...]  # {"name", "digest"} in application order
    kernels: tuple[Kernel, ...]
    environment: dict | None = None  # an SGLang engine on a hardware with a host profile: see environment_record
    corpus: dict | None = None  # an SGLang engine with a corpus drafter: its tree path and decoder (assemble/corpus.py)

    def record(self) -> dict:
        """The manifest's `inputs` section."""
        record = {
            "checkpoints": {k: (p.as_record() if p else None) for k, p in self.checkpoints.items()},
            "runtime": self.runtime_record,
            "overlays": [dict(o) for o in self.overlays],
            "kernels": [{"name": k.name, "digest": k.digest} for k in self.kernels],
        }
        if self.environment is not None:
            record["environment"] = self.environment
        if self.corpus is not None:
            record["corpus"] = self.corpus
        return record


def resolve_inputs(composed: Composed, lock: Lock) -> BuildInputs:
    plain_name(composed.setting, "setting")
    cfg = effective_config(composed.config)
    # The host is recorded with its profile's and lock's digests in inputs.environment, not in the config: hardware
    # without a host (CPU) keeps the config, and so the engine ids, it had before hosts existed.
    host = cfg["hardware"].pop("host", None)
    for mech in cfg.get("mechanisms", []):
        plain_name(mech.get("name"), "mechanism name")
    runtime = runtime_pin(cfg, lock)
    if isinstance(runtime, WheelPin):  # the lockfile's filename becomes <data>/wheels/<filename>
        plain_name(
            runtime.filename, f"runtime '{runtime.name}': wheel filename (lockfiles/runtimes.toml)", error=PinError
        )
        runtime_record = {
            "name": runtime.name,
            "kind": "wheel",
            "version": runtime.version,
            "filename": runtime.filename,
            "sha256": runtime.sha256,
        }
    else:
        runtime_record = {
            "name": runtime.name,
            "kind": "directory",
            "dir": runtime.dir,
            "digest": source_dir_digest(local_runtime_dir(runtime)),
        }
    kernels = []
    for name in kernels_of(cfg):
        files = tuple(kernel_files(name))
        kernels.append(Kernel(name, files, files_digest(list(files))))
    return BuildInputs(
        composed=composed,
        config=cfg,
        lock=lock,
        runtime=runtime,
        runtime_record=runtime_record,
        checkpoints=resolve_checkpoints(composed.setting, cfg, lock),
        overlays=tuple(overlay_inputs(overlays_in_order(cfg), cfg)),
        kernels=tuple(kernels),
        environment=environment_record(cfg, runtime, host, lock),
        corpus=corpus_record(cfg),
    )


def corpus_record(cfg: dict) -> dict | None:
    """An SGLang engine whose drafter is a corpus: where the tree holds its JSONL and what decodes it (the tokens
    are the drafter's pin, in `checkpoints`), so a new decoder moves the build key."""
    from specpilot_build.assemble.corpus import decoder_record, external_corpus_path

    path = external_corpus_path(cfg)
    return None if path is None else {"path": path, **decoder_record()}


def environment_record(cfg: dict, runtime, host: str | None, lock: Lock) -> dict | None:
    """An SGLang engine whose hardware names a host: its environment lock (lockfiles/envs/<runtime>@<host>.toml,
    checked against the host profile) and the native prune rules that apply, so a changed lock, profile or rule
    changes the id. Distribution rules are checked against the lock here; file rules when the environment is
    installed (hosts/install.py)."""
    if host is None or not isinstance(runtime, WheelPin):
        return None
    from specpilot_build.config.effective import rule_applies
    from specpilot_build.hosts.install import native_rules, select_distributions
    from specpilot_build.hosts.profiles import load_env_lock

    env_lock = load_env_lock(runtime.name, host, lock.directory)
    rules = native_rules(cfg)
    kept, _dropped = select_distributions(env_lock, rules, cfg)
    return {
        "host": host,
        **env_lock.record(),
        "native_prune": [r["why"] for r in rules if rule_applies(r, cfg)],
        "wheels": len(kept),
        "wheel_bytes": sum(w.size for w in kept),
    }


def runtime_pin(cfg: dict, lock: Lock) -> WheelPin | LocalRuntimePin:
    name = cfg["runtime"]["name"]
    if name not in lock.runtimes:
        raise SpecPilotError(f"runtime '{name}' is not pinned in {lock.directory / 'runtimes.toml'}")
    return lock.runtimes[name]


def resolve_checkpoints(setting: str, cfg: dict, lock: Lock) -> dict[str, CheckpointPin | None]:
    """The model's pin and, when the arm runs a drafter checkpoint, the drafter's. Unpinned → one-line error."""
    wanted = {"model": cfg["model"]["repo"], "drafter": cfg["drafter"].get("repo")}
    pins: dict[str, CheckpointPin | None] = {}
    if cfg["drafter"].get("recipe"):  # a drafter SpecPilot made: its pin in lockfiles/drafters.toml
        from specpilot_build.models.drafters import drafter_checkpoint_pin

        pins["drafter"] = drafter_checkpoint_pin(cfg, setting, lock.directory)
        wanted.pop("drafter")
    for role, repo in wanted.items():
        if repo is None:
            pins[role] = None
            continue
        if repo not in lock.checkpoints:
            raise SpecPilotError(
                f"checkpoint {repo} ({role} of {setting}) is not pinned in {lock.directory / 'checkpoints.toml'}; "
                f"run `make lock SETTING={setting}` where the Hugging Face hub is reachable"
            )
        pins[role] = lock.checkpoints[repo]
    return pins


def kernels_of(cfg: dict) -> list[str]:
    """Kernels the engine ships: those its mechanisms name, and W12 when the model runs quantized with it."""
    names = list(cfg.get("kernels", []))
    if cfg["model"].get("quantization") == "w12" and "w12" not in names:
        names.append("w12")
    return names


def kernel_files(name: str) -> list[tuple[str, Path]]:
    """Every file of kernels/<name>/ (caches and bytecode left out): the package is exactly what an engine ships.
    Benchmarks, their drivers and their results live outside it (lab/, benchmarks/), so they move no engine id."""
    src = KERNELS_DIR / plain_name(name, "kernel name")
    if not os.path.lexists(src):
        raise SpecPilotError(f"kernel '{name}': kernels/{name}/ does not exist")
    return source_files(src, f"kernel '{name}'")
