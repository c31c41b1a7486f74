"""Bench client overhead and the cost of verify relative to bench, measured side by side in one run; or, with
--demo-runs N, the demo N times in a row and its final/ar speedups run to run.

    python benchmarks/measurement_loop.py [--setting cpu_c16_stories260k_ngram] [--arm final]
                                          [--limit 25] [--max-new-tokens 128] [--port 30200]
    python benchmarks/measurement_loop.py --demo-runs 5 [--beside-tests] [--setting cpu_c1_stories260k_ngram]
                                          [--limit 3] [--max-new-tokens 128] [--port 30400]

--demo-runs N runs `specpilot demo` (cli/demo.py: the three arms served at once and benched side by side,
compare, CPU-time speedups, score, verify) N times and prints one markdown row per run: final/ar per wall
second and per server CPU-second (overall point estimates and 95% CIs), per whole-process CPU-second, the
verify verdict and near ties, the load average. --beside-tests keeps the test suite (`python -m pytest -q
-p no:cacheprovider`) running in the background the whole time (restarted whenever it ends), as load.
Criterion (issue 16): final/ar per CPU-second above 1 in every run, every run within ±15% of the median.

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
import subprocess
import sys
import time
from pathlib import Path

from specpilot_build.assemble.builder import build_engine
from specpilot_build.measure.bench import bench
from specpilot_build.measure.verify import verify
from specpilot_build.serve.process import serve, stop

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--setting",
        default=None,
        help="default cpu_c16_stories260k_ngram (cpu_c1_stories260k_ngram, the demo's, with --demo-runs)",
    )
    parser.add_argument("--arm", default="final")
    parser.add_argument("--limit", type=int, default=None, help="items per dataset (default 25; 3 with --demo-runs)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=None, help="default 30200 (30400 with --demo-runs)")
    parser.add_argument("--demo-runs", type=int, default=0, help="run the demo this many times instead")
    parser.add_argument("--beside-tests", action="store_true", help="with --demo-runs: the test suite as load")
    args = parser.parse_args()
    if args.demo_runs:
        demo_runs(args)
        return
    args.port = args.port or 30200
    args.setting = args.setting or "cpu_c16_stories260k_ngram"
    args.limit = 25 if args.limit is None else args.limit

    engine = build_engine(args.setting, args.arm).engine
    oracle = build_engine(args.setting, "ar").engine
    serve(engine.id, args.port)
    try:
        path = bench(
            engine.id,
            f"measure_{args.setting}_{args.arm}",
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            port=args.port,
            overwrite=True,
            progress=False,
            oracle_engine_id=oracle.id,
        )
    finally:
        stop(args.port)
    run = json.loads(path.read_text())
    report = verify(str(path), oracle=oracle.id, port=args.port + 1, progress=False)
    tokens = sum(r["completion_tokens"] for r in run["requests"])
    print(
        f"\n{args.setting} {args.arm}: {platform.node()}, {os.cpu_count()} CPUs, "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC\n"
    )
    print(
        "| setting | c | requests | tokens | bench wall s | tok/s | client overhead | client CPU | "
        "verify wall s | verify/bench | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.setting}/{args.arm} | {run['concurrency']} | {len(run['requests'])} | {tokens} | "
        f"{run['wall_s']:.2f} | {tokens / run['wall_s']:.0f} | {run['client']['overhead_fraction']:.3%} | "
        f"{run['client']['cpu_fraction']:.2%} | {report['wall_s']:.2f} | {report['wall_s'] / run['wall_s']:.3f} | "
        f"{report['verdict']} ({report['verified']}/{report['tokens']}) |"
    )


def demo_runs(args) -> None:
    from rich.console import Console

    from specpilot_build.cli.demo import demo, spread_of
    from specpilot_build.measure.compare import OVERALL

    setting = args.setting or "cpu_c1_stories260k_ngram"  # the demo's defaults
    limit = 3 if args.limit is None else args.limit
    port = args.port or 30400
    tests = _TestLoad() if args.beside_tests else None
    rows, started = [], dt.datetime.now(dt.UTC)
    try:
        for run in range(1, args.demo_runs + 1):
            load0 = os.getloadavg()[0]
            with open(os.devnull, "w") as sink:
                result = demo(setting, limit, args.max_new_tokens, port, console=Console(file=sink))
            load1 = os.getloadavg()[0]
            wall = result["compare"]["speedups"]["final/ar"][OVERALL]
            cpu = result["cpu"]["by_measure"]["process_cpu_s"]["final/ar"][OVERALL]
            engine_cpu = result["cpu"]["by_measure"]["cpu_s"]["final/ar"][OVERALL]
            rows.append(
                {
                    "run": run,
                    "wall": wall,
                    "cpu": cpu,
                    "engine_cpu": engine_cpu,
                    "verify": result["verify"],
                    "load": (load0, load1),
                    "seconds": result["seconds"],
                    "tokens": result["cpu"]["tokens"]["final"],
                    "requests": cpu["n"],
                }
            )
            keep(result, run)
            print(
                f"run {run}: final/ar wall {wall['speedup']:.3f}x, server process CPU {cpu['speedup']:.3f}x, "
                f"engine-thread CPU {engine_cpu['speedup']:.3f}x, "
                f"verify {result['verify']['verdict']} ({result['seconds']:.0f} s)",
                file=sys.stderr,
            )
    finally:
        if tests:
            tests.stop()
    print(
        f"\n{setting}, demo --limit {limit} --max-new-tokens {args.max_new_tokens}: {platform.node()}, "
        f"{os.cpu_count()} CPUs, {started:%Y-%m-%d %H:%M}–{dt.datetime.now(dt.UTC):%H:%M} UTC"
        + (f", test suite beside it ({tests.summary()})" if tests else "")
        + "\n"
    )
    print(
        "| run | requests | tokens | final/ar per server-process CPU-s [95% CI] | per engine-thread CPU-s "
        "[95% CI] | per wall s [95% CI] | verify | near ties | load avg start→end | demo s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ci = lambda s: f"{s['speedup']:.3f}× [{s['ci95'][0]:.2f}–{s['ci95'][1]:.2f}]"  # noqa: E731
    for r in rows:
        v = r["verify"]
        print(
            f"| {r['run']} | {r['requests']} | {r['tokens']} | {ci(r['cpu'])} | {ci(r['engine_cpu'])} | "
            f"{ci(r['wall'])} | {v['verdict']} ({v['verified']}/{v['tokens']}) | {v['near_ties']} | "
            f"{r['load'][0]:.1f}→{r['load'][1]:.1f} | {r['seconds']:.0f} |"
        )
    for key, label in (
        ("cpu", "per server-process CPU-second"),
        ("engine_cpu", "per engine-thread CPU-second"),
        ("wall", "per wall second"),
    ):
        s = spread_of([r[key]["speedup"] for r in rows])
        above = all(r[key]["speedup"] > 1 for r in rows)
        print(
            f"\nfinal/ar {label}: median {s['median']:.3f}×, range {s['min']:.3f}–{s['max']:.3f}×, largest "
            f"deviation from the median ±{s['max_deviation']:.1%}; above 1 in every run: {above}; "
            f"within ±15%: {s['max_deviation'] <= 0.15}"
        )


def keep(result: dict, run: int) -> None:
    """Copy the run's three results files and compare report beside them as <name>_run<N>.json (the demo
    overwrites its own names on the next run)."""
    import shutil

    for path in [*result["runs"].values(), result["compare"]["json"]]:
        source = Path(path)
        shutil.copyfile(source, source.with_name(f"{source.stem}_run{run}.json"))


class _TestLoad:
    """The test suite, run again and again in the background until stopped (its own process group)."""

    def __init__(self):
        self.runs, self.proc = [], None
        self.stopping = False
        import threading

        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stopping:
            start = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            code = self.proc.wait()
            self.runs.append((code, time.monotonic() - start))

    def stop(self):
        import signal

        self.stopping = True
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def summary(self) -> str:
        done = ", ".join(f"exit {code} after {seconds:.0f} s" for code, seconds in self.runs)
        return f"`python -m pytest -q -p no:cacheprovider` in a loop: {done or 'none finished'}; the last stopped"


if __name__ == "__main__":
    main()
