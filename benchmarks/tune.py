"""`make tune` on the embedded default, with today's hand-written final as the study's first trial, so the best
trial and the hand-written final are measured on the same tune slice against the same stock, in one run.

    SPECPILOT_DATA=/tmp/spdata .venv/bin/python benchmarks/tune.py [--trials 8] [--limit 3] [--study NAME]

Prints the tune's table and the comparison; benchmarks/tune.md holds the latest run."""

from __future__ import annotations

import argparse
import json
from typing import Any

from specpilot_build.config.compose import compose_setting
from specpilot_build.defaults import DEFAULT_SETTING
from specpilot_build.tune.run import tune
from specpilot_build.tune.space import load_space


def hand_written(setting: str, space_name: str) -> dict[str, Any]:
    """The setting's final mechanisms today as a point of the space: what they set, else the setting's own value
    (a runtime option they leave unset is off)."""
    config = compose_setting(setting, "final").config
    merged: dict[str, dict[str, Any]] = {}
    for mech in (config.get("final") or {}).get("mechanisms", {}).values():
        for section in ("drafter", "runtime_options"):
            merged.setdefault(section, {}).update(mech.get(section) or {})
    point = {}
    for key in load_space(space_name).params:
        if "." not in key:  # a mechanism's own key (overlay): the hand-written final's, if one sets it
            point[key] = next((m.get(key) for m in config["final"]["mechanisms"].values() if m.get(key)), None)
            continue
        section, name = key.split(".", 1)
        base = config["drafter"].get(name) if section == "drafter" else False
        point[key] = merged.get(section, {}).get(name, base)
        if key == "drafter.tree_breadth" and point[key] is None:  # unset: the chain
            point[key] = 1
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default=DEFAULT_SETTING)
    parser.add_argument("--space", default="ngram")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--study", default=None)
    parser.add_argument("--port", type=int, default=31600)
    args = parser.parse_args()
    start = hand_written(args.setting, args.space)
    print(f"trial 0 is today's hand-written final: {json.dumps(start)}")
    summary = tune(
        args.setting,
        args.space,
        args.trials,
        "tpe",
        0,
        args.study,
        args.limit,
        args.max_new_tokens,
        port=args.port,
        write_winner=False,
        enqueue=[start],
    )
    first = summary["trials"][0]
    best = summary["best"]
    if first["state"] == "COMPLETE" and best is not None:
        print(
            f"hand-written final (trial 0): final/stock {first['final_stock']['speedup']:.3f}× "
            f"[{first['final_stock']['ci95'][0]:.3f}–{first['final_stock']['ci95'][1]:.3f}]; best (trial "
            f"{best['number']}): {best['final_stock']['speedup']:.3f}× [{best['final_stock']['ci95'][0]:.3f}–"
            f"{best['final_stock']['ci95'][1]:.3f}]"
        )


if __name__ == "__main__":
    main()
