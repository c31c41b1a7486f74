"""`make tune`: the loop. Build and serve ar and stock once, then per trial ask Optuna for a candidate, run it
(tune/trial.py), tell Optuna the objective or the failure; print a row per trial; re-measure the best few distinct
points side by side and choose the winner by that (tune/leaders.py); write the winner (tune/winner.py). A point
proposed again takes its earlier trial's result. With LAUNCHER, each trial and the re-measurement is instead one
Hydra job through that launcher, serving its own ar and stock (tune/launched.py); PROMOTE still runs here.

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
from specpilot_build.tune.leaders import LEADERS
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
    leaders: int = LEADERS,
    launcher: str | None = None,
) -> dict[str, Any]:
    """`enqueue`: candidates ("section.key" -> value) a new study runs first, e.g. today's final. `promote`: confirm
    the winner on `eval_limit` dev items per dataset against the current final (tune/promote.py). `leaders`: how
    many distinct best points are re-measured side by side before the winner is chosen (tune/leaders.py; 0: the
    winner is the best trial's objective). `launcher`: a Hydra launcher config; each trial then runs as one job
    through it (tune/launched.py) on free ports of wherever it runs, and no server is started here."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.serve.process import serve, stop

    console = console or Console()
    if leaders < 0:
        raise SpecPilotError(f"LEADERS={leaders}: re-measure 0 (off) or more leaders")
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
    if launcher:
        from specpilot_build.config.launchers import check_launcher

        check_launcher(launcher)
    space = load_space(space_name)
    if not launcher:
        _check_gpu(setting)
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
    baseline = {} if launcher else {arm: build_engine(setting, arm).engine for arm in ("ar", "stock")}
    table = _table()
    started = time.perf_counter()
    pids: dict[str, int] = {}
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers and the trial as Ctrl-C does
    try:
        if launcher:
            console.print(f"trials run as Hydra jobs through LAUNCHER={launcher}, each serving on its own free ports")
            runner = _launched_runner(launcher, setting, mechanisms, slice_, name, timeout_s)
            remeasurer = _launched_remeasurer(launcher, setting, slice_, name)
        else:
            for arm, engine in baseline.items():
                pids[arm] = serve(engine.id, ports[arm], quiet=True)["pid"]

            def runner(number: int, values: dict[str, Any]):
                return run_trial(
                    setting=setting,
                    mechanisms=mechanisms,
                    values=values,
                    baseline=baseline,
                    ports=ports,
                    pids=pids,
                    slice_=slice_,
                    run_prefix=f"tune_{name}_t{number}",
                    timeout_s=timeout_s,
                )

            def remeasurer(chosen: list[dict[str, Any]]) -> dict[str, Any]:
                from specpilot_build.tune.leaders import remeasure

                return remeasure(
                    setting=setting,
                    leaders=chosen,
                    baseline=baseline,
                    ports={arm: ports[arm] for arm in ("ar", "stock")},
                    pids=dict(pids),
                    slice_=slice_,
                    prefix=f"tune_{name}_leaders",
                )

        distributions = space.distributions()

        def objective(trial) -> float:
            values = suggest_point(trial, space, distributions)
            same = studies.same_point(study, values, trial.number)
            if same is not None:
                return _reuse(trial, same, values, table, console)
            try:
                outcome = runner(trial.number, values)
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
        if leaders:
            _remeasure_leaders(study, leaders, remeasurer, name, console)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for arm in pids:
            stop(ports[arm])
    console.print(table)
    summary = summarize(study, name)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    if write_winner and summary["best"] is not None:
        from specpilot_build.tune.winner import write_winner as write

        summary["winner"] = str(
            write(setting, study, summary["best"]["number"], mechanisms, summary["best"].get("remeasured"))
        )
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


def _check_gpu(setting: str) -> None:
    """A setting served on a GPU (SGLang's, or the reference runtime's CUDA path) is tuned where that GPU is: here,
    or through LAUNCHER= on nodes that have it. Refused before the study or any server is started."""
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.serve.process import check_hardware

    try:
        check_hardware(compose_setting(setting, "final").config, 0, False)
    except SpecPilotError as exc:
        why = str(exc).split("; pass --ignore-hardware")[0]
        raise SpecPilotError(
            f"make tune SETTING={setting}: {why}; tune it on such a machine, or give LAUNCHER= (e.g. submitit_slurm) "
            "to run its trials there"
        ) from None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def suggest_point(trial, space, distributions: dict) -> dict[str, Any]:
    """The trial's candidate ("section.key" -> value): every key of the space, but a conditional key (`only_with`)
    only where its gate came out non-null, so that no candidate sets a key that does nothing."""
    values: dict[str, Any] = {}
    for key, dist in distributions.items():
        if space.active(key, values):
            values[key] = _suggest(trial, key, dist)
    return values


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
                "overrides": t.user_attrs.get("overrides"),
                "duplicate_of": t.user_attrs.get("duplicate_of"),
            }
        )
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    by_trial = max(complete, key=lambda r: (r["objective"], -r["number"])) if complete else None
    best = by_trial
    record = current_leaders(study, rows)
    if record is not None:
        chosen = record["chosen"]
        best = None if chosen is None else {**rows[chosen], "remeasured": record["trials"][str(chosen)]}
    return {
        "study": name,
        "storage": str(studies.storage_path()),
        "trials": rows,
        "complete": len(complete),
        "failed": sum(r["state"] == "FAIL" for r in rows),
        "cache_hits": sum(bool(r["cache_hit"]) and r["duplicate_of"] is None for r in rows),
        "duplicates": sum(r["duplicate_of"] is not None for r in rows),
        "best_by_trial": by_trial,
        "leaders": record,
        "best": best,
    }


def current_leaders(study, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The study's leaders re-measurement when it re-measured today's leaders (none since a resume added a
    better point), else None."""
    from specpilot_build.tune.leaders import SCHEMA, pick

    record = study.user_attrs.get("leaders")
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        return None
    picked = [r["number"] for r in pick(rows, len(record["leaders"]))]
    return record if picked == record["leaders"] else None


def _remeasure_leaders(study, k: int, remeasurer, name: str, console: Console) -> None:
    """Re-bench the study's `k` best distinct points side by side (tune/leaders.py), unless the study already
    holds that re-measurement; the record becomes the study's user attribute `leaders`."""
    from specpilot_build.tune.leaders import pick

    rows = summarize(study, name)["trials"]
    chosen = pick(rows, k)
    if not chosen or current_leaders(study, rows) is not None:
        return
    shown = ", ".join(str(r["number"]) for r in chosen)
    console.print(f"re-measuring the leaders (trials {shown}) side by side with stock and ar on the tune split")
    record = remeasurer(chosen)
    study.set_user_attr("leaders", record)
    console.print(_leaders_table(record, rows))


def _launched_runner(launcher: str, setting: str, mechanisms: list[str], slice_: Slice, name: str, timeout_s: float):
    """A trial as one Hydra job through `launcher` (tune/launched.py): its checked result as the trial's Outcome."""
    from specpilot_build.tune import launched
    from specpilot_build.tune.space import candidate_overrides
    from specpilot_build.tune.trial import Outcome

    def runner(number: int, values: dict[str, Any]) -> Outcome:
        spec = {
            "schema": launched.SPEC,
            "kind": "trial",
            "study": name,
            "trial": number,
            "setting": setting,
            "mechanisms": mechanisms,
            "values": values,
            "overrides": candidate_overrides(mechanisms, values),
            "slice": {"limit": slice_.limit, "max_new_tokens": slice_.max_new_tokens, "datasets": slice_.datasets},
            "run_prefix": f"tune_{name}_t{number}",
            "timeout_s": timeout_s,
        }
        (result,) = launched.launch(launcher, launched.batch_dir(name, f"t{number}"), [spec])
        return Outcome(ok=result["ok"], attrs=result["attrs"], objective=result["objective"])

    return runner


def _launched_remeasurer(launcher: str, setting: str, slice_: Slice, name: str):
    """The leaders' re-measurement as one Hydra job through `launcher`; its record checked (tune/launched.py)."""
    from specpilot_build.tune import launched
    from specpilot_build.tune.leaders import choose

    def remeasurer(chosen: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {
            "schema": launched.SPEC,
            "kind": "leaders",
            "study": name,
            "setting": setting,
            "leaders": chosen,
            "slice": {"limit": slice_.limit, "max_new_tokens": slice_.max_new_tokens, "datasets": slice_.datasets},
            "run_prefix": f"tune_{name}_leaders",
        }
        (result,) = launched.launch(launcher, launched.batch_dir(name, "leaders"), [spec])
        if not result["ok"]:
            raise SpecPilotError(f"re-measuring the leaders failed: {result['attrs']['reason']}")
        record = result["attrs"]["record"]
        if record.get("leaders") != [r["number"] for r in chosen] or record.get("chosen") != choose(record):
            raise SpecPilotError("the leaders' job measured other trials than asked, or chose unlike its numbers")
        return record

    return remeasurer


def _leaders_table(record: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    table = Table(title="leaders re-measured side by side (tune split): the winner is the highest lower bound")
    for column in ("trial", "params", "trial's final/stock", "re-measured final/stock [95% CI]", "final/ar", "verify"):
        table.add_column(column)
    for number in record["leaders"]:
        again = record["trials"][str(number)]
        fs, first = again["final_stock"], rows[number]["final_stock"]
        mark = " ← chosen" if number == record["chosen"] else ""
        table.add_row(
            f"{number}{mark}",
            _params(rows[number]["params"]),
            f"{first['speedup']:.3f}× [{first['ci95'][0]:.3f}–{first['ci95'][1]:.3f}]",
            f"{fs['speedup']:.3f}× [{fs['ci95'][0]:.3f}–{fs['ci95'][1]:.3f}]",
            f"{again['final_ar']['speedup']:.3f}×",
            again["verdict"],
        )
    return table


def _reuse(trial, same, values: dict, table: Table, console: Console) -> float:
    """Record trial `same`'s result on `trial` (the same point proposed again) without benching it again."""
    attrs = {**same.user_attrs, "duplicate_of": same.number, "seconds": 0.0}
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    _add_row(table, trial.number, values, attrs)
    console.print(_row_line(trial.number, values, attrs))
    if same.state.name != "COMPLETE":
        raise TrialFailed(attrs.get("reason") or "failed")
    return float(same.value)


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
    if attrs.get("duplicate_of") is not None:
        cached = f", the point of trial {attrs['duplicate_of']}: its result reused, not benched again"
    return f"trial {number}: {_params(values)} → {result} ({state}{cached}, {attrs.get('seconds', 0):.0f} s)"


def _params(values: dict) -> str:
    return " ".join(f"{k.split('.', 1)[-1]}={json.dumps(v)}" for k, v in values.items())


def _print_summary(summary: dict, console: Console) -> None:
    best = summary["best"]
    console.print(
        f"study {summary['study']}: {summary['complete']} complete, {summary['failed']} failed, "
        f"{summary['cache_hits']} cache hit(s), {summary['duplicates']} repeated point(s) reused; "
        f"{summary['seconds']:.0f} s; summary {summary['json']}"
    )
    console.print(f"report {summary['report']['markdown']} (chart {summary['report']['chart']})")
    if best is None:
        leaders = summary.get("leaders")
        why = "no leader's re-run was lossless" if leaders else "no trial completed lossless"
        console.print(f"{why}; nothing written")
        return
    again = best.get("remeasured")
    chosen_by = (
        f"re-measured lower bound {again['final_stock']['ci95'][0]:.3f}× (final/stock "
        f"{again['final_stock']['speedup']:.3f}×; its trial {best['objective']:.3f}×)"
        if again
        else f"lower bound {best['objective']:.3f}× (final/stock {best['final_stock']['speedup']:.3f}×)"
    )
    console.print(
        f"best: trial {best['number']} {_params(best['params'])}: {chosen_by}, engine {best['engine_id'][:16]}"
        + (f" → {summary['winner']}" if summary.get("winner") else "")
    )
