"""The Optuna study of a tune: in SQLite under SPECPILOT_DATA, bound to its setting, space and tuning slice.

Optuna is driven directly (ask/tell), not through hydra-optuna-sweeper: that plugin (1.3.0) needs optuna<3 and
SQLAlchemy 1.x. Each trial still composes its candidate through Hydra's compose API (tune/trial.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir

SAMPLERS = ("tpe", "grid", "random")
TPE_STARTUP = 3  # random trials before TPE models the results (Optuna's default of 10 is a whole short tune)
INTERRUPTED = "interrupted"  # a trial's reason when the tune stopped under it (Ctrl-C, a killed process)


def storage_path() -> Path:
    return data_dir() / "tune" / "studies.sqlite3"


def make_sampler(name: str, seed: int, grid: dict[str, list[Any]]):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=TPE_STARTUP)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(grid, seed=seed)
    raise SpecPilotError(f"unknown sampler '{name}'; choose one of {', '.join(SAMPLERS)}")


def open_study(name: str, binding: dict[str, Any], sampler):
    """Create the study `name`, or load it when it exists and was made for the same `binding` (setting, space,
    tuning slice); a study name reused for another binding fails naming the first difference."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = storage_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{path}"
    study = optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, direction="maximize", load_if_exists=True
    )
    recorded = study.user_attrs.get("binding")
    if recorded is None:
        study.set_user_attr("binding", binding)
        return study
    for key in sorted(set(recorded) | set(binding)):
        was, now = recorded.get(key), binding.get(key)
        if was != now:
            if isinstance(was, dict) and isinstance(now, dict):  # name the first entry that differs
                inner = next(k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
                key, was, now = f"{key} {inner}", was.get(inner, "(absent)"), now.get(inner, "(absent)")
            raise SpecPilotError(
                f"study '{name}' ({path}) was made with {key} {_shown(was)}, this tune has "
                f"{_shown(now)}; give another STUDY or the same {key.split()[0]}"
            )
    return study


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def mark_stale(study) -> int:
    """Trials left running by a tune that stopped (killed, or the machine went down) are failed as interrupted."""
    import optuna

    stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for trial in stale:
        study._storage.set_trial_user_attr(trial._trial_id, "reason", INTERRUPTED)
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    return len(stale)


def counted(study) -> list:
    """The trials that count toward TRIALS: finished, and not cut short by a stopped tune."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and t.user_attrs.get("reason") != INTERRUPTED
    ]


def same_point(study, values: dict[str, Any], number: int):
    """The first counted trial before `number` that ran exactly `values`, or None: a sampler that proposes a point
    again gets that trial's recorded result, not a second bench."""
    for trial in counted(study):
        if trial.number < number and trial.params == values:
            return trial
    return None
