"""Arms side by side: bench ar, stock and final interleaved, so that load on a shared machine hits them alike.

The three engines are served at once, one port each (the caller serves them: cli/demo.py). The requests are
those bench sends (same plan, same budgets, same warm-up per arm), cut into rounds of `concurrency` requests
(one request at c1). Each round goes to all three arms, one arm after another, in rotating order: round 0
ar, stock, final; round 1 stock, final, ar; round 2 final, ar, stock; ... So every arm runs each prompt
within a few seconds of the others, and each arm is first, second and third equally often. An arm runs alone
while it is measured (the other two servers idle); with concurrency c, a round ends when its c requests are
answered, and the round's wall time (including its tail) counts for every arm alike.

Each arm gets one results file in bench's format (bench.py), so compare, score and verify read it unchanged;
a request's `latency_s` and a dataset's `wall_s` are measured as bench measures them. Added:
- per request `process_cpu_s`: the CPU time the whole server process spent while the arm served the request,
  every thread (engine, HTTP and JSON, garbage collection wherever it runs): the sum over the server's
  threads of /proc/<pid>/task/<tid>/schedstat's run time (nanoseconds), read before and after the round.
  Exact per request when rounds hold one request (c1) and the server runs on this machine; otherwise null
  (then `side_by_side.rounds` holds it per round).
- per request `cpu_s`: the server's CPU time for the request as the server reports it (the reference
  runtime: engine-thread CPU time, `meta_info.cpu_s`, see runtimes/reference/specpilot_runtime/engine.py);
  null when the server does not report it (SGLang). It leaves out the HTTP thread and garbage collection
  that runs there.
- `side_by_side`: the arms and ports, the rotation, and per round the order, wall time and process CPU time.
`cpu_speedups` gives the CPU-time speedups beside compare's wall-time ones: the ratio of tokens per server
CPU-second, with compare's paired bootstrap (same resamples and seed), for the whole process (the primary
figure, where every request has it) and for the engine thread.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from specpilot_build.defaults import ARMS
from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import bench as bench_mod
from specpilot_build.measure.compare import OVERALL, PAIRS, RESAMPLES, SEED, _aligned, ratio_of_sums_ci
from specpilot_build.measure.datasets import BENCHMARKS
from specpilot_build.measure.prompts import PromptRenderer
from specpilot_build.measure.results import load_results, results_path, write_json
from specpilot_build.models.checkpoints import model_dirs
from specpilot_build.serve import client
from specpilot_build.store.engines import Engine, resolve_engine

SCHEMA_SIDE_BY_SIDE = "specpilot.side_by_side/1"


def rotation(round_index: int, arms=ARMS) -> tuple[str, ...]:
    """The order of the arms in round i: ar, stock, final; then stock, final, ar; then final, ar, stock; ..."""
    k = round_index % len(arms)
    return tuple(arms[k:]) + tuple(arms[:k])


def process_cpu_s(pid: int | None) -> float | None:
    """CPU time of a process's live threads, in seconds (nanosecond run times from /proc/<pid>/task/*/schedstat);
    None when it cannot be read here (no pid, another machine, no schedstat)."""
    if not pid:
        return None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            if not Path(f"/proc/{pid}/task/{tid}").exists():
                continue  # a thread that ended meanwhile
            return None
    return total / 1e9


def bench_side_by_side(
    arm_engines: Mapping[str, Engine | str],
    names: dict[str, str],
    ports: dict[str, int],
    limit: int | None = None,
    max_new_tokens: int = 2048,
    datasets: list[str] | None = None,
    host: str = "127.0.0.1",
    pids: dict[str, int] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    split: str = "dev",
) -> dict[str, Path]:
    """Bench the arms served on host:ports[arm] interleaved; returns {arm: results path}. The arms are ar, stock
    and final, or any slots beside ar (e.g. a tune's leaders and stock); each results file is its engine's arm.

    `pids`: the server processes (serve()'s run records), for the process-CPU cross-check; optional.
    `split`: the datasets' split benched (bench.bench's), recorded in each results file."""
    engines = {arm: resolve_engine(e) if isinstance(e, str) else e for arm, e in arm_engines.items()}
    # the slots: ar, stock, final in that order; or any others beside ar (a tune's leaders), in the order given
    arms = ARMS if set(engines) == set(ARMS) else tuple(engines)
    if "ar" not in arms or len(arms) < 2 or set(names) != set(arms) or set(ports) != set(arms):
        raise SpecPilotError(
            f"side-by-side bench needs the ar arm and one name and port per arm, got arms {', '.join(engines)}"
        )
    if len(set(ports.values())) != len(arms):
        raise SpecPilotError(f"side-by-side bench needs {len(arms)} different ports, got {ports}")
    pids = pids or {}
    oracle = engines["ar"]
    outs = {arm: results_path(names[arm]) for arm in arms}
    for out in outs.values():
        if out.exists() and not overwrite:
            raise SpecPilotError(f"{out} exists; choose another NAME or remove it")
    urls = {arm: f"http://{host}:{ports[arm]}" for arm in arms}
    infos = {}
    for arm in arms:
        infos[arm] = client.server_info(urls[arm])
        served = client.served_engine_id(infos[arm])
        if served != engines[arm].id:
            raise SpecPilotError(
                f"the server on port {ports[arm]} serves engine {served or '(unnamed)'}, not the "
                f"{arm} engine {engines[arm].id[:16]}"
            )

    concurrencies = {arm: int(engines[arm].config["batching"]["concurrency"]) for arm in arms}
    if len(set(concurrencies.values())) != 1:
        raise SpecPilotError(f"the arms' concurrencies differ ({concurrencies}); side by side needs one")
    concurrency = concurrencies["ar"]
    plans = {}
    for arm in arms:
        config = engines[arm].config
        names_ = list(datasets or config.get("datasets") or BENCHMARKS)
        renderer = PromptRenderer(
            model_dirs(engines[arm].manifest["inputs"]["checkpoints"], config)["model"],
            config["model"].get("chat_template"),
        )
        context = config["model"].get("context_length") or renderer.context_length
        plan, skipped = bench_mod.plan_requests(renderer, names_, limit, max_new_tokens, context, split)
        plans[arm] = (names_, renderer, context, plan, skipped)
    reference = plans["ar"]
    for arm in arms:
        if plans[arm][3] != reference[3]:
            raise SpecPilotError(
                f"the {arm} engine renders other prompts or budgets than the ar engine "
                "(tokenizer, chat template or context differ); the arms are not comparable"
            )
    names_, _, _, plan, skipped = reference
    for entry in (e for entries in skipped.values() for e in entries):
        print(f"skipped {entry['dataset']} item {entry['item_id']}: {entry['reason']}", file=sys.stderr)
    if not any(plan.values()):
        raise SpecPilotError("no prompt fits the model's context; nothing to bench")

    date = dt.datetime.now(dt.UTC)
    warmups = {arm: bench_mod._warm_up(urls[arm], plan, concurrency) for arm in arms}
    rounds = [
        (dataset, entries[i : i + concurrency])
        for dataset, entries in plan.items()
        for i in range(0, len(entries), concurrency)
    ]
    answers: dict[str, dict[tuple[str, str], Any]] = {arm: {} for arm in arms}  # arm -> (dataset, item_id) -> Answer
    walls: dict[str, dict[tuple[str, str], float]] = {arm: {} for arm in arms}
    gaps: dict[str, dict[tuple[str, str], Any]] = {arm: {} for arm in arms}
    client_cpu = {arm: 0.0 for arm in arms}
    round_log = []
    total = sum(len(entries) for _, entries in rounds) * len(arms)
    with client.progress_bar(progress, total, label="bench " + "|".join(arms)) as advance:
        for index, (dataset, entries) in enumerate(rounds):
            order = rotation(index, arms)
            bodies = [bench_mod.generate_body(e["prompt_ids"], e["max_new_tokens"]) for e in entries]
            record = {
                "round": index,
                "dataset": dataset,
                "items": [e["item_id"] for e in entries],
                "order": list(order),
                "wall_s": {},
                "process_cpu_s": {},
            }
            for arm in order:
                before = process_cpu_s(pids.get(arm))
                done = client.post_all(urls[arm], bodies, concurrency, on_answer=advance)
                after = process_cpu_s(pids.get(arm))
                for entry, answer in zip(entries, done.answers):
                    answers[arm][(dataset, entry["item_id"])] = answer
                walls[arm][dataset] = walls[arm].get(dataset, 0.0) + done.wall_s
                gaps[arm][dataset] = gaps[arm].get(dataset, 0.0) + done.client_gap_s
                client_cpu[arm] += done.client_cpu_s
                record["wall_s"][arm] = done.wall_s
                record["process_cpu_s"][arm] = None if before is None or after is None else after - before
            round_log.append(record)

    per_request_process: dict[str, dict[Any, Any]] = {arm: {} for arm in arms}
    for record in round_log:
        if len(record["items"]) == 1:
            for arm in arms:
                per_request_process[arm][(record["dataset"], record["items"][0])] = record["process_cpu_s"][arm]
    paths = {}
    for arm in arms:
        engine = engines[arm]
        info = infos[arm]
        requests = []
        for dataset, entries in plan.items():
            for entry in entries:
                answer = answers[arm][(dataset, entry["item_id"])]
                row = bench_mod.request_record(entry, answer)
                cpu = (answer.body.get("meta_info") or {}).get("cpu_s")
                row["cpu_s"] = float(cpu) if isinstance(cpu, (int, float)) else None
                row["process_cpu_s"] = per_request_process[arm].get((dataset, entry["item_id"]))
                requests.append(row)
        results = _results(
            engine,
            oracle,
            info,
            names[arm],
            names_,
            plans[arm],
            limit,
            max_new_tokens,
            concurrency,
            date,
            warmups[arm],
            requests,
            walls[arm],
            gaps[arm],
            client_cpu[arm],
            split,
        )
        process = [r["process_cpu_s"][arm] for r in round_log]
        results["side_by_side"] = {
            "schema": SCHEMA_SIDE_BY_SIDE,
            "method": __doc__.strip().split("\n\n")[1].replace("\n", " "),
            "arms": {a: {"name": names[a], "engine_id": engines[a].id, "port": ports[a]} for a in arms},
            "round_size": concurrency,
            "rounds": round_log,
            "server_cpu_s": _sum_or_none([r["cpu_s"] for r in requests]),
            "process_cpu_s": _sum_or_none(process),
            "process_cpu_method": "sum of /proc/<server pid>/task/*/schedstat run times, after minus before each round",
        }
        paths[arm] = write_json(results_path(names[arm]), results)
    return paths


def _results(
    engine: Engine,
    oracle: Engine,
    info: dict,
    name: str,
    names: list[str],
    planned: tuple,
    limit,
    max_new_tokens: int,
    concurrency: int,
    date,
    warmup: dict,
    requests: list[dict],
    walls: dict,
    gaps: dict,
    client_cpu_s: float,
    split: str,
) -> dict:
    """A results record in bench's format (bench.results_record), per dataset from this arm's share."""
    _, renderer, context, plan, skipped = planned
    per_dataset = {
        d: {
            "requests": len(plan[d]),
            "wall_s": walls[d],
            "completion_tokens": sum(r["completion_tokens"] for r in requests if r["dataset"] == d),
            "client_gap_s": gaps[d],
        }
        for d in plan
        if plan[d]
    }
    return bench_mod.results_record(
        engine,
        oracle,
        info,
        name=name,
        renderer=renderer,
        context=context,
        names=names,
        plan=plan,
        skipped=skipped,
        limit=limit,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        date=date,
        warmup=warmup,
        requests=requests,
        per_dataset=per_dataset,
        wall_s=sum(walls.values()),
        gap_s=sum(gaps.values()),
        client_cpu_s=client_cpu_s,
        split=split,
    )


def _sum_or_none(values):
    return None if not values or any(v is None for v in values) else float(sum(values))


# --- CPU-time speedups ----------------------------------------------------------------------------------------

MEASURES = {"process_cpu_s": "whole server process", "cpu_s": "engine thread"}


def cpu_speedups(ar: str | Path, stock: str | Path, final: str | Path) -> dict:
    """Speedups in tokens per server CPU-second, per dataset and overall, with compare's paired bootstrap CI
    (ratio of sums over the same prompts, 2000 resamples, seed 20261129), for each measure every request has:
    `process_cpu_s` (the whole server process; the primary figure, `speedups`) and `cpu_s` (engine thread).
    Refuses runs where neither is on every request (not benched side by side, or a server that reports
    nothing and runs elsewhere)."""
    loaded = {arm: load_results(ref) for arm, ref in (("ar", ar), ("stock", stock), ("final", final))}
    measures = [
        m for m in MEASURES if all(r.get(m) is not None for _, data in loaded.values() for r in data["requests"])
    ]
    if not measures:
        path, data = next((p, d) for p, d in loaded.values() if any(r.get("cpu_s") is None for r in d["requests"]))
        missing = [f"{r['dataset']}/{r['item_id']}" for r in data["requests"] if r.get("cpu_s") is None]
        raise SpecPilotError(
            f"{path}: requests {', '.join(missing[:5])} record no server CPU time (cpu_s, "
            "process_cpu_s); bench the arms side by side on a server that reports it"
        )
    runs = {arm: data for arm, (_, data) in loaded.items()}
    datasets = sorted({r["dataset"] for r in runs["ar"]["requests"]})
    aligned = {arm: _aligned(data, runs["ar"]) for arm, data in runs.items()}
    for arm in runs:
        for d in datasets:
            if [r["prompt_ids"] for r in aligned[arm][d]] != [r["prompt_ids"] for r in aligned["ar"][d]]:
                raise SpecPilotError(f"the {arm} run holds other prompts than the ar run in {d}")
    rng = np.random.default_rng(SEED)
    draws = {d: rng.integers(0, len(aligned["ar"][d]), size=(RESAMPLES, len(aligned["ar"][d]))) for d in datasets}
    by_measure: dict[str, dict[str, dict[str, Any]]] = {}
    for measure in measures:
        speedups = by_measure[measure] = {}
        for num, den in PAIRS:
            key = f"{num}/{den}"
            speedups[key] = {}
            for dataset in datasets + [OVERALL]:
                parts = datasets if dataset == OVERALL else [dataset]

                def column(arm, field):
                    return [np.array([r[field] for r in aligned[arm][d]], dtype=float) for d in parts]

                point, low, high = ratio_of_sums_ci(
                    column(num, measure),
                    column(num, "completion_tokens"),
                    column(den, measure),
                    column(den, "completion_tokens"),
                    [draws[d] for d in parts],
                )
                speedups[key][dataset] = {
                    "n": sum(len(aligned[num][d]) for d in parts),
                    "speedup": point,
                    "ci95": [low, high],
                }
    totals = {
        measure: {arm: float(sum(r[measure] for r in data["requests"])) for arm, data in runs.items()}
        for measure in measures
    }
    return {
        "schema": "specpilot.cpu_speedups/2",
        "datasets": datasets,
        "measure": measures[0],
        "measure_label": MEASURES[measures[0]],
        "speedups": by_measure[measures[0]],
        "by_measure": by_measure,
        "cpu_s": totals,
        "resamples": RESAMPLES,
        "seed": SEED,
        "tokens": {arm: sum(r["completion_tokens"] for r in data["requests"]) for arm, data in runs.items()},
    }


def print_cpu_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    labels = list(report["by_measure"])
    table = Table(
        title="speedup in tokens per server CPU-second [95% paired bootstrap CI]: "
        + "; ".join(f"{'top' if i == 0 else 'bottom'} {MEASURES[m]}" for i, m in enumerate(labels))
    )
    table.add_column("dataset", no_wrap=True)
    for pair in report["speedups"]:
        table.add_column(pair, justify="right", no_wrap=True)
    for dataset in report["datasets"] + [OVERALL]:
        row = [dataset]
        for pair in report["speedups"]:
            cells = [report["by_measure"][m][pair][dataset] for m in labels]
            row.append("\n".join(f"{s['speedup']:.2f}× [{s['ci95'][0]:.2f}–{s['ci95'][1]:.2f}]" for s in cells))
        table.add_row(*row, end_section=True)
    console.print(table)
