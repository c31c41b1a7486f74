"""`make tune`: the loop. Build and serve ar and stock once, then per trial ask Optuna for a candidate, run it
(tune/trial.py), tell Optuna the objective or the failure; print a row per trial; write the winner (tune/winner.py).

TRIALS is the study's size: a stopped tune run again with the same command continues with the next trial until
the study holds that many. Every server started here is stopped on the way out, Ctrl-C included."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from specpilot_build.defaults import DEFAULT_PORT
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.measure.results import write_json
from specpilot_build.tune import study as studies
from specpilot_build.tune.space import check_space, load_space
from specpilot_build.tune.trial import SPLIT, Slice, run_trial

TRIAL_TIMEOUT_S = 900.0


class TrialFailed(Exception):
    """A trial that failed, timed out or was not lossless: recorded failed (its reason is a user attribute)."""


def tune(
    setting: str,
    space_name: str = "ngram",
    trials: int = 8,
    sampler: str = "tpe",
    seed: int = 0,
    study_name: str | None = None,
    limit: int | None = 2,
    max_new_tokens: int = 128,
    datasets: list[str] | None = None,
    port: int = DEFAULT_PORT,
    timeout_s: float = TRIAL_TIMEOUT_S,
    write_winner: bool = True,
    console: Console | None = None,
    enqueue: list[dict[str, Any]] | None = None,
    promote: bool = False,
    eval_limit: int | None = 2,
) -> dict[str, Any]:
    """`enqueue`: candidates ("section.key" -> value) a new study runs first, e.g. today's final. `promote`: confirm
    the winner on `eval_limit` dev items per dataset against the current final (tune/promote.py)."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.serve.process import serve, stop

    console = console or Console()
    if trials < 1:
        raise SpecPilotError(f"TRIALS={trials}: a tune needs at least 1 trial")
    if sampler not in studies.SAMPLERS:
        raise SpecPilotError(f"SAMPLER={sampler}: choose one of {', '.join(studies.SAMPLERS)}")
    if limit is not None and limit < 1:
        raise SpecPilotError(f"LIMIT={limit}: the tuning slice needs at least 1 prompt per dataset")
    if promote and not write_winner:
        raise SpecPilotError("PROMOTE=1 confirms the winner file the tune writes; it cannot run without it")
    if promote and eval_limit is not None and eval_limit < 1:
        raise SpecPilotError(f"EVAL_LIMIT={eval_limit}: the confirmation needs at least 1 dev prompt per dataset")
    space = load_space(space_name)
    mechanisms = check_space(space, setting)
    slice_ = Slice(limit=limit, max_new_tokens=max_new_tokens, datasets=datasets)
    name = study_name or f"{setting}-{space_name}"
    binding = {
        "setting": setting,
        "space": json.loads(space.canonical()),
        "split": SPLIT,
        "slice": {"limit": limit, "max_new_tokens": max_new_tokens, "datasets": datasets},
    }
    grid = space.grid()
    study = studies.open_study(name, binding, studies.make_sampler(sampler, seed, grid))
    if enqueue and not study.get_trials(deepcopy=False):
        for values in enqueue:
            study.enqueue_trial(values)
    stale = studies.mark_stale(study)
    if stale:
        console.print(f"study {name}: {stale} trial(s) left running by a stopped tune recorded as interrupted")
    target = trials
    if sampler == "grid":
        points = 1
        for choices in grid.values():
            points *= len(choices)
        if trials > points:
            console.print(f"the grid has {points} points; TRIALS={trials} runs each once")
            target = points
    done = len(studies.counted(study))
    console.print(
        f"study {name} ({studies.storage_path()}): {done} trial(s) done, {max(0, target - done)} to run; "
        f"space {space.shown}, sampler {sampler}, seed {seed}, tune split limit {limit}"
    )
    ports = {"ar": port, "stock": port + 1, "final": port + 2}
    baseline = {arm: build_engine(setting, arm).engine for arm in ("ar", "stock")}
    table = _table()
    started = time.perf_counter()
    pids: dict[str, int] = {}
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers and the trial as Ctrl-C does
    try:
        for arm, engine in baseline.items():
            pids[arm] = serve(engine.id, ports[arm], quiet=True)["pid"]
        distributions = space.distributions()

        def objective(trial) -> float:
            values = {key: _suggest(trial, key, dist) for key, dist in distributions.items()}
            try:
                outcome = run_trial(
                    setting=setting,
                    mechanisms=mechanisms,
                    values=values,
                    baseline=baseline,
                    ports=ports,
                    pids=pids,
                    slice_=slice_,
                    run_prefix=f"tune_{name}_t{trial.number}",
                    timeout_s=timeout_s,
                )
            except KeyboardInterrupt:
                trial.set_user_attr("reason", studies.INTERRUPTED)
                raise  # Optuna records the trial failed and re-raises
            for key, value in outcome.attrs.items():
                trial.set_user_attr(key, value)
            _add_row(table, trial.number, values, outcome.attrs)
            console.print(_row_line(trial.number, values, outcome.attrs))
            if not outcome.ok:
                raise TrialFailed(outcome.attrs["reason"])
            assert outcome.objective is not None
            return outcome.objective

        remaining = target - len(studies.counted(study))
        if remaining > 0:
            # optimize, not ask/tell: the grid sampler stops the study from inside the loop when it is exhausted
            study.optimize(objective, n_trials=remaining, catch=(TrialFailed,))
    finally:
        signal.signal(signal.SIGTERM, previous)
        for arm in pids:
            stop(ports[arm])
    console.print(table)
    summary = summarize(study, name)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    if write_winner and summary["best"] is not None:
        from specpilot_build.tune.winner import write_winner as write

        summary["winner"] = str(write(setting, study, summary["best"]["number"], mechanisms))
    from specpilot_build.tune.report import write_report

    out = data_dir() / "tune" / f"{name}.summary.json"
    summary["report"] = write_report(summary, out.parent)
    summary["json"] = str(out)
    write_json(out, summary)
    _print_summary(summary, console)
    if promote and summary.get("winner"):
        from specpilot_build.tune.promote import promote as confirm

        confirmed = confirm(setting, mechanisms, name, port, eval_limit, max_new_tokens, datasets, console)
        summary["promote"] = {k: confirmed.get(k) for k in ("promoted", "reason", "speedups", "verdict", "json")}
        summary["report"] = write_report(summary, out.parent)
        write_json(out, summary)
    elif promote:
        console.print("PROMOTE: no trial completed lossless; nothing to confirm, conf/ unchanged")
    return summary


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _suggest(trial, key: str, dist) -> Any:
    import optuna.distributions as od

    if isinstance(dist, od.CategoricalDistribution):
        return trial.suggest_categorical(key, dist.choices)
    if isinstance(dist, od.IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, step=dist.step)
    return trial.suggest_float(key, dist.low, dist.high, step=dist.step)


def summarize(study, name: str) -> dict[str, Any]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "params": dict(t.params),
                "objective": t.value,
                "engine_id": t.user_attrs.get("engine_id"),
                "cache_hit": t.user_attrs.get("cache_hit"),
                "final_stock": t.user_attrs.get("final_stock"),
                "final_ar": t.user_attrs.get("final_ar"),
                "reason": t.user_attrs.get("reason"),
            }
        )
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    best = max(complete, key=lambda r: r["objective"]) if complete else None
    return {
        "study": name,
        "storage": str(studies.storage_path()),
        "trials": rows,
        "complete": len(complete),
        "failed": sum(r["state"] == "FAIL" for r in rows),
        "cache_hits": sum(bool(r["cache_hit"]) for r in rows),
        "best": best,
    }


def _table() -> Table:
    table = Table(title="tune: objective = lower bound of the 95% CI of final/stock tokens/s (tune split)")
    for column in ("trial", "params", "final/stock [95% CI]", "final/ar", "accept", "engine", "s", "state"):
        table.add_column(column)
    return table


def _add_row(table: Table, number: int, values: dict, attrs: dict) -> None:
    fs = attrs.get("final_stock")
    table.add_row(
        str(number),
        _params(values),
        f"{fs['speedup']:.3f}× [{fs['ci95'][0]:.3f}–{fs['ci95'][1]:.3f}]" if fs else "",
        f"{attrs['final_ar']:.3f}×" if attrs.get("final_ar") else "",
        f"{attrs['accept_length']:.2f}" if attrs.get("accept_length") else "",
        (attrs.get("engine_id") or "")[:12] + (" (cached)" if attrs.get("cache_hit") else ""),
        f"{attrs.get('seconds', 0):.0f}",
        f"[red]{attrs['reason']}[/]" if attrs.get("reason") else "complete",
    )


def _row_line(number: int, values: dict, attrs: dict) -> str:
    fs = attrs.get("final_stock")
    result = f"final/stock {fs['speedup']:.3f}× [{fs['ci95'][0]:.3f}–{fs['ci95'][1]:.3f}]" if fs else ""
    state = f"FAILED: {attrs['reason']}" if attrs.get("reason") else "complete"
    cached = ", cache hit" if attrs.get("cache_hit") else ""
    return f"trial {number}: {_params(values)} → {result} ({state}{cached}, {attrs.get('seconds', 0):.0f} s)"


def _params(values: dict) -> str:
    return " ".join(f"{k.split('.', 1)[-1]}={json.dumps(v)}" for k, v in values.items())


def _print_summary(summary: dict, console: Console) -> None:
    best = summary["best"]
    console.print(
        f"study {summary['study']}: {summary['complete']} complete, {summary['failed']} failed, "
        f"{summary['cache_hits']} cache hit(s); {summary['seconds']:.0f} s; summary {summary['json']}"
    )
    console.print(f"report {summary['report']['markdown']} (chart {summary['report']['chart']})")
    if best is None:
        console.print("no trial completed lossless; nothing written")
        return
    console.print(
        f"best: trial {best['number']} {_params(best['params'])}: lower bound {best['objective']:.3f}× "
        f"(final/stock {best['final_stock']['speedup']:.3f}×), engine {best['engine_id'][:16]}"
        + (f" → {summary['winner']}" if summary.get("winner") else "")
    )
