"""Bench client overhead and the cost of verify relative to bench, measured side by side in one run.

    python benchmarks/measurement_loop.py [--setting cpu_c16_stories260k_ngram] [--arm final]
                                          [--limit 25] [--max-new-tokens 128] [--port 30200]

Builds the arm's engine and its ar oracle, serves the engine, benches it (warm-up not counted), stops it,
then verifies the run against the ar oracle (which verify serves itself). Prints a markdown table:
client overhead = summed slot gaps (client-side time between an answer and the slot's next request) over
slots x wall; client CPU = this process's CPU time over wall; verify/bench = verify wall over bench wall.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform

from specpilot_build.measure.bench import bench
from specpilot_build.build.builder import build_engine
from specpilot_build.run.serve import serve, stop
from specpilot_build.measure.verify import verify


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="cpu_c16_stories260k_ngram")
    parser.add_argument("--arm", default="final")
    parser.add_argument("--limit", type=int, default=25, help="items per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=30200)
    args = parser.parse_args()

    engine = build_engine(args.setting, args.arm).engine
    oracle = build_engine(args.setting, "ar").engine
    serve(engine.id, args.port)
    try:
        path = bench(engine.id, f"measure_{args.setting}_{args.arm}", limit=args.limit,
                     max_new_tokens=args.max_new_tokens, port=args.port, overwrite=True, progress=False)
    finally:
        stop(args.port)
    run = json.loads(path.read_text())
    report = verify(str(path), oracle=oracle.id, port=args.port + 1, progress=False)
    tokens = sum(r["completion_tokens"] for r in run["requests"])
    print(f"\n{args.setting} {args.arm}: {platform.node()}, {os.cpu_count()} CPUs, "
          f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print("| setting | c | requests | tokens | bench wall s | tok/s | client overhead | client CPU | "
          "verify wall s | verify/bench | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.setting}/{args.arm} | {run['concurrency']} | {len(run['requests'])} | {tokens} | "
          f"{run['wall_s']:.2f} | {tokens / run['wall_s']:.0f} | {run['client']['overhead_fraction']:.3%} | "
          f"{run['client']['cpu_fraction']:.2%} | {report['wall_s']:.2f} | {report['wall_s'] / run['wall_s']:.3f} | "
          f"{report['verdict']} ({report['verified']}/{report['tokens']}) |")


if __name__ == "__main__":
    main()
