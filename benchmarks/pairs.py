"""Benchmark: a setting's three arms on the five dev splits, side by side, every arm verified (benchmarks/pairs.md).

    SPECPILOT_THREADS=2 python benchmarks/pairs.py --setting cpu_c1_smollm2-135m_ngram [--limit 3]
        [--max-new-tokens 128] [--port 18100]

`make demo`'s loop (cli/demo.py: build ar/stock/final, serve the three at once, bench them interleaved request by
request, compare with 95% paired bootstrap CIs, verify final) and then `verify` of the ar and stock runs too, each
against the ar engine by token forcing. Prints one markdown table per split: final/ar and final/stock per wall
second and per server CPU-second with their CIs, the acceptance length of stock and final, and per arm the tokens
verified, near ties and real mismatches. SPECPILOT_THREADS sets the reference runtime's torch threads.

`--one-at-a-time`: for engines whose three servers do not fit in memory together (SmolLM2 at c16 preallocates a
~6 GB KV cache per server): each arm served alone and benched in turn (ar, stock, final), then compare and verify
as above. The arms are not interleaved then: load that changes between them moves the ratios (say so)."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from datetime import UTC, datetime

from rich.console import Console

from specpilot_build.defaults import ARMS
from specpilot_build.measure.compare import OVERALL
from specpilot_build.measure.verify import verify


def cell(s: dict) -> str:
    return f"{s['speedup']:.2f}× [{s['ci95'][0]:.2f}–{s['ci95'][1]:.2f}]"


def main() -> None:
    from specpilot_build.cli.demo import demo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="cpu_c1_smollm2-135m_ngram")
    parser.add_argument("--limit", type=int, default=3, help="dev items per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=18100, help="the arms serve on PORT..PORT+2, verify on PORT")
    parser.add_argument("--one-at-a-time", action="store_true", help="serve and bench one arm at a time")
    args = parser.parse_args()
    console = Console(width=160)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    started = datetime.now(UTC)
    load = os.getloadavg()
    if args.one_at_a_time:
        result = one_at_a_time(args.setting, args.limit, args.max_new_tokens, args.port, console)
    else:
        result = demo(args.setting, args.limit, args.max_new_tokens, args.port, console=console)
    verified = {"final": result["verify"]}
    for arm in ("ar", "stock"):
        verified[arm] = verify(result["runs"][arm], oracle=result["engines"]["ar"], port=args.port, console=console)
    report, cpu = result["compare"], result["cpu"]
    order = "one arm at a time (ar, stock, final)" if args.one_at_a_time else "interleaved request by request"
    print(
        f"\n{args.setting}, {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, threads "
        f"{os.environ.get('SPECPILOT_THREADS', 'runtime default')}, commit {commit}, {started:%Y-%m-%d %H:%M} UTC, "
        f"load before {load[0]:.2f}, {args.limit} items x {args.max_new_tokens} new tokens per split, {order}\n"
    )
    print(
        "| split | final/ar (wall) | final/stock (wall) | final/ar (server CPU) | final/stock (server CPU) "
        "| accept stock | accept final |"
    )
    print("|---|---|---|---|---|---|---|")
    for d in report["datasets"] + [OVERALL]:
        w, a = report["speedups"], report["accept_length"]
        c = cpu["speedups"] if cpu else None
        on_cpu = f"{cell(c['final/ar'][d])} | {cell(c['final/stock'][d])}" if c else "- | -"
        print(
            f"| {d} | {cell(w['final/ar'][d])} | {cell(w['final/stock'][d])} | {on_cpu} "
            f"| {a['stock'][d]:.2f} | {a['final'][d]:.2f} |"
        )
    print("\n| arm | engine | verdict | tokens | verified | near ties | real mismatches |")
    print("|---|---|---|---|---|---|---|")
    for arm in ARMS:
        v = verified[arm]
        print(
            f"| {arm} | `{result['engines'][arm][:12]}` | {v['verdict']} | {v['tokens']} | {v['verified']} "
            f"| {v['near_ties']} | {v['real_mismatches']} |"
        )
    print(
        f"\nwall {result['seconds']:.0f} s (bench, compare, verify final); runs: {', '.join(result['runs'].values())}"
    )


def one_at_a_time(setting: str, limit: int, max_new_tokens: int, port: int, console: Console) -> dict:
    """demo's result for arms benched one after another, each on its own server (then stopped)."""
    import time

    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure.bench import bench
    from specpilot_build.measure.compare import compare
    from specpilot_build.serve.process import serve, stop

    started = time.perf_counter()
    engines = {arm: build_engine(setting, arm).engine for arm in ARMS}
    runs = {}
    for arm in ARMS:
        serve(engines[arm], port)
        try:
            runs[arm] = bench(
                engines[arm],
                f"pairs_{setting}_{arm}",
                limit=limit,
                max_new_tokens=max_new_tokens,
                port=port,
                overwrite=True,
                oracle_engine_id=engines["ar"].id,
            )
        finally:
            stop(port)
    report = compare(*(str(runs[a]) for a in ARMS), name=f"pairs_{setting}_compare", console=console, overwrite=True)
    final = verify(str(runs["final"]), oracle=engines["ar"], port=port, console=console)
    return {
        "engines": {arm: e.id for arm, e in engines.items()},
        "runs": {a: str(p) for a, p in runs.items()},
        "compare": report,
        "cpu": None,
        "verify": final,
        "seconds": time.perf_counter() - started,
    }


if __name__ == "__main__":
    main()
