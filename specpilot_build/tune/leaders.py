"""Leaders re-measured: before a winner is chosen, the best few distinct points of a study are benched again,
interleaved with each other, stock and ar on the same tuning slice (never the dev split), and the winner is the
leader with the highest lower bound of that re-measurement's 95% CI of final/stock.

One trial's objective is a selection among noisy measurements: the same point measured twice in one study differed
by more than the gap between the first few points. Re-benching the leaders side by side puts them under the same
load, on the same prompts, in rotating order, so the choice between them is a paired comparison. Each leader is
rebuilt from its trial's overrides (a cache hit, checked to be the trial's engine) and its re-run forced through ar
again; a leader that is not lossless here cannot win. The record is the study's user attribute `leaders`."""

from __future__ import annotations

import io
import json
import time
from typing import Any

from rich.console import Console

from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import Engine
from specpilot_build.tune.trial import LOSSLESS, SPLIT, Slice

SCHEMA = "specpilot.tune_leaders/1"
LEADERS = 3  # distinct points re-measured


def pick(rows: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The `k` best completed trials by objective (earlier first on ties), one per parameter point."""
    seen: set[str] = set()
    out = []
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    for row in sorted(complete, key=lambda r: (-r["objective"], r["number"])):
        point = json.dumps(row["params"], sort_keys=True)
        if point not in seen:
            seen.add(point)
            out.append(row)
    return out[:k]


def slot(number: int) -> str:
    return f"t{number}"


def remeasure(
    *,
    setting: str,
    leaders: list[dict[str, Any]],  # pick()'s rows, each with its trial's overrides and engine id
    baseline: dict[str, Engine],
    ports: dict[str, int],  # ar and stock, served by the caller; each leader is served here on a free port
    pids: dict[str, int],
    slice_: Slice,
    prefix: str,
) -> dict[str, Any]:
    """Serve the leaders, bench them with ar and stock side by side on the tune split, verify each leader's run;
    returns the record (every leader's final/stock and final/ar with CIs, verdicts, digests, the chosen trial)."""
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.measure.attest import file_digests
    from specpilot_build.measure.sidebyside import bench_side_by_side
    from specpilot_build.measure.verify import verify
    from specpilot_build.serve.process import stop
    from specpilot_build.tune.ports import serve_free
    from specpilot_build.tune.promote import paired_speedups

    started = time.perf_counter()
    engines: dict[str, Engine] = dict(baseline)
    for row in leaders:
        built = build_composed(compose_setting(setting, "final", row["overrides"]))
        if built.engine.id != row["engine_id"]:
            raise SpecPilotError(
                f"trial {row['number']}'s overrides now build engine {built.engine.id[:16]}, not the "
                f"{row['engine_id'][:16]} it measured; re-measuring it would measure another engine"
            )
        engines[slot(row["number"])] = built.engine
    served: list[str] = []
    ports = dict(ports)
    quiet = Console(file=io.StringIO())
    try:
        for row in leaders:
            name = slot(row["number"])
            ports[name], pid = serve_free(engines[name].id)
            pids = {**pids, name: pid}
            served.append(name)
        order = ["ar", "stock", *served]
        runs = bench_side_by_side(
            {s: engines[s] for s in order},
            {s: f"{prefix}_{s}" for s in order},
            {s: ports[s] for s in order},
            limit=slice_.limit,
            max_new_tokens=slice_.max_new_tokens,
            datasets=slice_.datasets,
            pids=pids,
            overwrite=True,
            progress=False,
            split=SPLIT,
        )
        checks = {
            s: verify(str(runs[s]), oracle=engines["ar"], port=ports["ar"], progress=False, console=quiet)
            for s in served
        }
    finally:
        for name in served:
            stop(ports[name])
    pairs = [(s, den) for s in served for den in ("stock", "ar")]
    speedups = paired_speedups(dict(runs), pairs, SPLIT)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "split": SPLIT,
        "slice": {"limit": slice_.limit, "max_new_tokens": slice_.max_new_tokens, "datasets": slice_.datasets},
        "leaders": [row["number"] for row in leaders],
        "runs": {s: str(runs[s]) for s in order},
        "results_digests": {s: "sha256:" + file_digests(runs[s])["sha256"] for s in order},
        "trials": {},
    }
    for row in leaders:
        s = slot(row["number"])
        record["trials"][str(row["number"])] = {
            "params": row["params"],
            "engine_id": row["engine_id"],
            "final_stock": _pair(speedups[f"{s}/stock"]),
            "final_ar": _pair(speedups[f"{s}/ar"]),
            "verdict": checks[s]["verdict"],
            "verify_digest": "sha256:" + file_digests(checks[s]["statement"])["sha256"],
        }
    record["chosen"] = choose(record)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def _pair(s: dict[str, Any]) -> dict[str, Any]:
    return {"speedup": s["speedup"], "ci95": s["ci95"], "n": s["n"]}


def choose(record: dict[str, Any]) -> int | None:
    """The leader with the highest re-measured lower bound of final/stock among the lossless ones."""
    lossless = [(int(n), t) for n, t in record["trials"].items() if t["verdict"] == LOSSLESS]
    if not lossless:
        return None
    return max(lossless, key=lambda nt: (nt[1]["final_stock"]["ci95"][0], -nt[0]))[0]
