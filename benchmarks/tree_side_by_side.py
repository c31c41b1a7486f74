"""N-gram trees (drafter.tree_breadth) beside the hand-written final, stock and ar of the embedded default, on the dev
split, all arms benched interleaved (sidebyside.py's rotating rounds) and every tree arm's answers forced through ar.

    .venv/bin/python benchmarks/tree_side_by_side.py [--limit 6] [--point b2k16=tree_breadth=2,num_draft_tokens=16 ...]

A point is `name=key=value,...` of the tuned-ngram mechanism's drafter keys, applied over the setting's final.
Prints tokens/s ratios with compare's paired bootstrap 95% CIs, accept lengths and verify verdicts;
benchmarks/tune.md holds the latest run."""

from __future__ import annotations

import argparse
import io
import json

from rich.console import Console

from specpilot_build.assemble.builder import build_composed, build_engine
from specpilot_build.config.compose import compose_setting
from specpilot_build.measure.results import load_results
from specpilot_build.measure.sidebyside import bench_side_by_side
from specpilot_build.measure.verify import verify
from specpilot_build.serve.process import stop
from specpilot_build.tune.ports import serve_free
from specpilot_build.tune.promote import paired_speedups

DEFAULT_POINTS = ["b2k16=tree_breadth=2,num_draft_tokens=16", "b3k16=tree_breadth=3,num_draft_tokens=16"]


def overrides(point: str) -> tuple[str, list[str]]:
    name, _, keys = point.partition("=")
    return name, [f"++final.mechanisms.tuned-ngram.drafter.{kv}" for kv in keys.split(",")]


def accept_length(path) -> float:
    """Tokens per target forward over the whole run (each request's accept length weighted by its tokens)."""
    _, data = load_results(path)
    scored = [r for r in data["requests"] if r.get("accept_length")]
    forwards = sum(r["completion_tokens"] / r["accept_length"] for r in scored)
    return sum(r["completion_tokens"] for r in scored) / forwards if forwards else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the hand-written final the tree points were measured against (its final names the tuned-ngram mechanism)
    parser.add_argument("--setting", default="cpu_c1_stories260k_handwritten")
    parser.add_argument("--limit", type=int, default=6, help="dev items per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--point", action="append", default=None)
    parser.add_argument("--prefix", default="tree_sbs")
    args = parser.parse_args()
    engines = {arm: build_engine(args.setting, arm).engine for arm in ("ar", "stock", "final")}
    for point in args.point or DEFAULT_POINTS:
        name, extra = overrides(point)
        engines[name] = build_composed(compose_setting(args.setting, "final", extra)).engine
    print(json.dumps({arm: e.id[:16] for arm, e in engines.items()}))
    ports, pids = {}, {}
    quiet = Console(file=io.StringIO())
    try:
        for arm, engine in engines.items():
            ports[arm], pids[arm] = serve_free(engine.id)
        runs = bench_side_by_side(
            engines,
            {arm: f"{args.prefix}_{arm}" for arm in engines},
            ports,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            pids=pids,
            overwrite=True,
            split="dev",
        )
        verdicts = {
            arm: verify(str(runs[arm]), oracle=engines["ar"], port=ports["ar"], progress=False, console=quiet)[
                "verdict"
            ]
            for arm in engines
            if arm != "ar"
        }
    finally:
        for arm in ports:
            stop(ports[arm])
    trees = [arm for arm in engines if arm not in ("ar", "stock", "final")]
    pairs = [("final", "stock"), ("final", "ar")] + [(t, den) for t in trees for den in ("final", "stock", "ar")]
    speedups = paired_speedups(dict(runs), pairs, "dev")
    print("| pair | speedup [95% CI] | n |")
    print("|---|---|---|")
    for pair, s in speedups.items():
        print(f"| {pair} | {s['speedup']:.3f}× [{s['ci95'][0]:.3f}–{s['ci95'][1]:.3f}] | {s['n']} |")
    print("| arm | engine | accept length | verify |")
    print("|---|---|---|---|")
    for arm in engines:
        print(f"| {arm} | `{engines[arm].id[:12]}` | {accept_length(runs[arm]):.2f} | {verdicts.get(arm, 'oracle')} |")


if __name__ == "__main__":
    main()
