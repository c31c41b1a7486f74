"""`make demo`: the whole measurement loop of one setting in one command.

Build the ar, stock and final engines; serve each in turn, bench it, stop it; compare the three runs (table,
JSON, chart); score the final run; verify the final run against the ar engine by token forcing; print the
verdict. The default is the embedded CPU setting with a small split, so it runs in minutes on 2 cores.
"""
from __future__ import annotations

import time

from rich.console import Console

from specpilot_build.defaults import ARMS, DEFAULT_PORT, DEFAULT_SETTING


def demo(setting: str = DEFAULT_SETTING, limit: int = 3, max_new_tokens: int = 128,
         port: int = DEFAULT_PORT, datasets: list[str] | None = None, console: Console | None = None) -> dict:
    from specpilot_build.measure.bench import bench
    from specpilot_build.build.builder import build_engine
    from specpilot_build.measure.compare import compare
    from specpilot_build.measure.score import print_table as print_score, score_run
    from specpilot_build.run.serve import serve, stop
    from specpilot_build.measure.verify import verify

    console = console or Console()
    started = time.perf_counter()
    engines = {}
    for arm in ARMS:
        engines[arm] = build_engine(setting, arm).engine
        console.print(f"engine {arm:5s} {engines[arm].id}")
    runs = {}
    for arm in ARMS:
        serve(engines[arm].id, port)
        try:
            runs[arm] = bench(engines[arm].id, f"demo_{setting}_{arm}", limit=limit,
                              max_new_tokens=max_new_tokens, port=port, datasets=datasets, overwrite=True,
                              oracle_engine_id=engines["ar"].id)
        finally:
            stop(port)
        console.print(f"bench {arm:5s} → {runs[arm]} ({time.perf_counter() - started:.0f} s)")
    report = compare(str(runs["ar"]), str(runs["stock"]), str(runs["final"]), name=f"demo_{setting}_compare",
                     console=console, overwrite=True)
    console.print(f"chart → {report['chart']} ({time.perf_counter() - started:.0f} s)")
    score = score_run(runs["final"])
    print_score(score)
    console.print(f"scored ({time.perf_counter() - started:.0f} s)")
    verification = verify(str(runs["final"]), oracle=engines["ar"].id, port=port, console=console)
    seconds = time.perf_counter() - started
    console.print(f"demo done in {seconds:.0f} s: verdict {verification['verdict']}")
    return {"engines": {arm: e.id for arm, e in engines.items()}, "runs": {a: str(p) for a, p in runs.items()},
            "compare": report, "score": score, "verify": verification, "seconds": seconds}
