"""The winner of a study as a mechanism file, conf/mechanism/tuned/<setting>.yaml, its provenance in its header.

The file is checked before the tune reports it: composed into the setting as the final arm's only mechanism and
built, it must give exactly the winning trial's engine id (a cache hit); otherwise the previous file is put back."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import conf_dir
from specpilot_build.tune.space import MECHANISM, nest

FOLDER = "tuned"


def winner_path(setting: str) -> Path:
    return conf_dir() / "mechanism" / FOLDER / f"{setting}.yaml"


def winner_overrides(setting: str, mechanisms: list[str]) -> list[str]:
    """Overrides that compose the setting with the winner file as its final arm's only mechanism."""
    if MECHANISM in mechanisms:  # a promoted preset names its final `tuned` already: choose the winner there
        drop = [f"~mechanism@final.mechanisms.{name}" for name in mechanisms if name != MECHANISM]
        return [*drop, f"mechanism@final.mechanisms.{MECHANISM}={FOLDER}/{setting}"]
    drop = [f"~mechanism@final.mechanisms.{name}" for name in mechanisms]
    return [*drop, f"+mechanism@final.mechanisms.{MECHANISM}={FOLDER}/{setting}"]


def mechanism_text(setting: str, study, number: int, remeasured: dict | None = None) -> str:
    trial = study.trials[number]
    attrs = trial.user_attrs
    nested = nest(dict(trial.params))
    fs = attrs["final_stock"]
    header = [
        f"# Mechanism (tuned by `make tune SETTING={setting}`): the best lossless trial of study '{study.study_name}'.",
        f"# Compose it: {' '.join(winner_overrides(setting, ['<each mechanism of the setting>']))}",
        f"# study: {study.study_name}; trial: {number}; engine: {attrs['engine_id']}",
        f"# objective (tune split, lower bound of the 95% CI of final/stock tokens/s): {fs['ci95'][0]:.4f}"
        f" (point {fs['speedup']:.4f}, n {fs['n']})",
        f"# tune prompts: {attrs['prompts_digest']}",
    ]
    header += [f"# results {arm}: {digest}" for arm, digest in sorted(attrs["results_digests"].items())]
    header.append(f"# verify statement: {attrs['verify_digest']} ({attrs['verdict']})")
    record = study.user_attrs.get("leaders")
    if remeasured is not None and record:
        again = remeasured["final_stock"]
        header.append(
            f"# chosen among the re-measured leaders (trials {', '.join(map(str, record['leaders']))}, side by side"
            f" on the tune split): lower bound {again['ci95'][0]:.4f} (point {again['speedup']:.4f}, n {again['n']})"
        )
        header += [f"# re-measured results {s}: {d}" for s, d in sorted(record["results_digests"].items())]
        header.append(f"# re-measured verify statement: {remeasured['verify_digest']} ({remeasured['verdict']})")
    return "\n".join(header) + "\n" + yaml.safe_dump(nested, sort_keys=False)


def write_winner(setting: str, study, number: int, mechanisms: list[str], remeasured: dict | None = None) -> Path:
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.config.compose import compose_setting

    path = winner_path(setting)
    text = mechanism_text(setting, study, number, remeasured)
    expected = study.trials[number].user_attrs["engine_id"]
    previous = path.read_bytes() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)
    try:
        built = build_composed(compose_setting(setting, "final", winner_overrides(setting, mechanisms)))
        if built.engine.id != expected:
            raise SpecPilotError(
                f"{path} composes to engine {built.engine.id[:16]}, not the winning trial's {expected[:16]}; "
                "not written"
            )
    except BaseException:
        if previous is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(previous)
        raise
    return path
