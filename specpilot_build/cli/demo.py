"""`make demo`: the whole measurement loop of one setting in one command.

Build the ar, stock and final engines; serve the three at once (ports PORT, PORT+1, PORT+2) and bench them
side by side (measure/sidebyside.py: each request goes to all three arms in rotating order, so load on a
shared machine hits them alike); stop them; compare the three runs (wall-time speedups: table, JSON, chart)
and print the speedups in tokens per server CPU-second beside them; score the final run; verify the final run
against the ar engine by token forcing; print the verdict. `repeat=n` (`--repeat`, `make demo REPEAT=n`)
benches n times, each time on freshly started servers (the final arm's shared n-gram cache starts empty
again), and prints the run-to-run spread of final/ar; the last repetition is scored and verified. The default
is the embedded CPU setting with a small split, so it runs in minutes on 2 cores.

A final that drafts with a drafter `make draft` makes (drafter.recipe: the embedded default's corpus) needs it in
the data dir's drafter store before it serves; the demo makes it first where it is missing (`make draft
SETTING=<setting>`, the same id and pin), so a fresh clone stays one command. Made here, in cli/, because only
cli/ may import draft/ (models/ and serve/ find a drafter by its pin, never make one).
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console

from specpilot_build.defaults import ARMS, DEFAULT_PORT, DEFAULT_SETTING


def demo(
    setting: str = DEFAULT_SETTING,
    limit: int = 3,
    max_new_tokens: int = 128,
    port: int = DEFAULT_PORT,
    datasets: list[str] | None = None,
    console: Console | None = None,
    repeat: int = 1,
) -> dict:
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.errors import SpecPilotError
    from specpilot_build.measure.compare import OVERALL, compare
    from specpilot_build.measure.score import print_table as print_score
    from specpilot_build.measure.score import score_run
    from specpilot_build.measure.sidebyside import bench_side_by_side, cpu_speedups, print_cpu_table
    from specpilot_build.measure.verify import verify
    from specpilot_build.serve.process import serve, stop

    if repeat < 1:
        raise SpecPilotError(f"--repeat {repeat}: give at least 1")
    console = console or Console()
    started = time.perf_counter()
    made = make_missing_drafter(setting)
    if made is not None:
        console.print(f"drafter {made.name} {made.id} made in {made.seconds:.0f} s (the final drafts with it)")
    engines = {}
    for arm in ARMS:
        engines[arm] = build_engine(setting, arm).engine
        console.print(f"engine {arm:5s} {engines[arm].id}")
    ports = {arm: port + i for i, arm in enumerate(ARMS)}
    repetitions = []
    for r in range(1, repeat + 1):
        suffix = f"_r{r}" if repeat > 1 else ""
        names = {arm: f"demo_{setting}_{arm}{suffix}" for arm in ARMS}
        pids = {}
        try:
            for arm in ARMS:
                pids[arm] = serve(engines[arm].id, ports[arm])["pid"]
            runs = bench_side_by_side(
                engines,
                names,
                ports,
                limit=limit,
                max_new_tokens=max_new_tokens,
                datasets=datasets,
                pids=pids,
                overwrite=True,
            )
        finally:
            for arm in ARMS:
                stop(ports[arm])
        console.print(
            f"bench ar|stock|final side by side{f' (repetition {r}/{repeat})' if repeat > 1 else ''} → "
            f"{', '.join(str(runs[a]) for a in ARMS)} ({time.perf_counter() - started:.0f} s)"
        )
        report = compare(
            str(runs["ar"]),
            str(runs["stock"]),
            str(runs["final"]),
            name=f"demo_{setting}_compare{suffix}",
            console=console,
            overwrite=True,
        )
        cpu = cpu_speedups(runs["ar"], runs["stock"], runs["final"])
        print_cpu_table(cpu, console)
        repetitions.append(
            {
                "runs": {a: str(p) for a, p in runs.items()},
                "compare": report,
                "cpu": cpu,
                "final/ar": {
                    "wall": report["speedups"]["final/ar"][OVERALL]["speedup"],
                    "cpu": cpu["speedups"]["final/ar"][OVERALL]["speedup"],
                    "engine_cpu": (cpu["by_measure"].get("cpu_s") or {})
                    .get("final/ar", {})
                    .get(OVERALL, {})
                    .get("speedup"),
                },
            }
        )
    console.print(f"chart → {report['chart']} ({time.perf_counter() - started:.0f} s)")
    spread = print_spread(repetitions, console) if repeat > 1 else None
    score = score_run(runs["final"])
    print_score(score)
    console.print(f"scored ({time.perf_counter() - started:.0f} s)")
    verification = verify(str(runs["final"]), oracle=engines["ar"].id, port=port, console=console)
    seconds = time.perf_counter() - started
    console.print(f"demo done in {seconds:.0f} s: verdict {verification['verdict']}")
    return {
        "engines": {arm: e.id for arm, e in engines.items()},
        "runs": {a: str(p) for a, p in runs.items()},
        "compare": report,
        "cpu": cpu,
        "repetitions": repetitions,
        "spread": spread,
        "score": score,
        "verify": verification,
        "seconds": seconds,
    }


def make_missing_drafter(setting: str):
    """The setting's final arm's recipe drafter, made (and pinned) where the drafter store lacks it; None when the
    final has no recipe drafter, it is stored already, or it is made for another model (serving then says how)."""
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.draft.recipe import load_recipe
    from specpilot_build.errors import PinError
    from specpilot_build.models.drafters import drafter_checkpoint_pin, drafter_dir

    config = effective_config(compose_setting(setting, "final").config)
    drafter = config["drafter"]
    if not drafter.get("recipe") or drafter.get("made_for"):
        return None
    try:
        if drafter_dir(drafter_checkpoint_pin(config, setting).revision).is_dir():
            return None
    except PinError:  # not pinned yet: made and pinned below
        pass
    recipe = load_recipe(drafter["recipe"])
    if recipe["kind"] == "corpus":  # recipe (d): tokens, no training (draft/corpus.py)
        from specpilot_build.draft.corpus import make_corpus

        return make_corpus(setting, recipe)
    from specpilot_build.draft.make import make_drafter

    return make_drafter(setting, drafter["recipe"], [])


def spread_of(values: list[float]) -> dict:
    """Median, range, and the largest relative distance of a value from the median."""
    median = statistics.median(values)
    return {
        "median": median,
        "min": min(values),
        "max": max(values),
        "max_deviation": max(abs(v / median - 1) for v in values) if median else None,
    }


def print_spread(repetitions: list[dict], console: Console) -> dict:
    from rich.table import Table

    table = Table(title="final/ar, run to run (overall point estimates)")
    for column in (
        "repetition",
        "per wall second",
        f"per server CPU-second ({repetitions[0]['cpu']['measure_label']})",
        "per engine-thread CPU-second",
    ):
        table.add_column(column, justify="right")
    for i, rep in enumerate(repetitions, 1):
        s = rep["final/ar"]
        table.add_row(
            str(i), f"{s['wall']:.3f}×", f"{s['cpu']:.3f}×", f"{s['engine_cpu']:.3f}×" if s["engine_cpu"] else "-"
        )
    spread = {key: spread_of([rep["final/ar"][key] for rep in repetitions]) for key in ("wall", "cpu")}
    console.print(table)
    for key, label in (("wall", "per wall second"), ("cpu", "per server CPU-second")):
        s = spread[key]
        console.print(
            f"final/ar {label}: median {s['median']:.3f}× [{s['min']:.3f}–{s['max']:.3f}], every "
            f"repetition within ±{s['max_deviation']:.1%} of the median"
        )
    return spread
