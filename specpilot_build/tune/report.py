"""A study's report beside its summary: <study>.report.md (every trial, the best so far, the winner) and
<study>.png (the objective per trial with the best so far, and one slice per parameter: objective against value).

Drawn from the summary run.summarize() returns, so it shows exactly what the study recorded; failed trials are
listed with their reason and drawn as crosses on the baseline of each panel (they have no objective)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(summary: dict[str, Any], directory: Path) -> dict[str, str]:
    """Write the markdown and the PNG for `summary`; returns their paths."""
    name = summary["study"]
    png = chart(summary, directory / f"{name}.png")
    md = directory / f"{name}.report.md"
    partial = md.with_name(f".{md.name}.partial")
    partial.write_text(markdown(summary, png.name))
    partial.replace(md)
    return {"markdown": str(md), "chart": str(png)}


def best_so_far(trials: list[dict]) -> list[float | None]:
    """Per trial in order, the highest objective of the completed trials up to it (None before the first)."""
    out: list[float | None] = []
    best: float | None = None
    for t in trials:
        if t["state"] == "COMPLETE" and (best is None or t["objective"] > best):
            best = t["objective"]
        out.append(best)
    return out


def markdown(summary: dict[str, Any], chart_name: str) -> str:
    trials = summary["trials"]
    keys = sorted({k for t in trials for k in t["params"]})
    lines = [
        f"# Tune study `{summary['study']}`",
        "",
        f"Objective: the lower bound of the paired-bootstrap 95% CI of final/stock tokens/s on the tune split. "
        f"{summary['complete']} complete, {summary['failed']} failed, {summary['cache_hits']} cache hit(s), "
        f"{summary.get('duplicates', 0)} repeated point(s) reused. "
        f"Study storage: `{summary['storage']}`.",
        "",
        f"![objective per trial, best so far, parameter slices]({chart_name})",
        "",
        "| trial | " + " | ".join(keys) + " | objective | best so far | final/stock [95% CI] | final/ar | state |",
        "|" + "---|" * (len(keys) + 6),
    ]
    for t, best in zip(trials, best_so_far(trials)):
        fs = t.get("final_stock")
        cells = [str(t["number"])] + [json.dumps(t["params"].get(k)) for k in keys]
        cells += [
            f"{t['objective']:.3f}" if t["objective"] is not None else "",
            f"{best:.3f}" if best is not None else "",
            f"{fs['speedup']:.3f}× [{fs['ci95'][0]:.3f}–{fs['ci95'][1]:.3f}]" if fs else "",
            f"{t['final_ar']:.3f}×" if t.get("final_ar") else "",
            ("complete" if t["state"] == "COMPLETE" else f"{t['state'].lower()}: {t.get('reason') or ''}")
            + (f" (point of trial {t['duplicate_of']}, reused)" if t.get("duplicate_of") is not None else ""),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += leaders_section(summary)
    best = summary.get("best")
    lines.append("")
    if best is None:
        lines.append("No trial completed lossless: no winner.")
    else:
        again = best.get("remeasured")
        chosen_by = (
            f"re-measured lower bound {again['final_stock']['ci95'][0]:.3f} (its trial's objective "
            f"{best['objective']:.3f})"
            if again
            else f"objective {best['objective']:.3f}"
        )
        lines.append(
            f"Best: trial {best['number']}, {chosen_by}, engine `{best['engine_id']}`"
            + (f", written to `{summary['winner']}`." if summary.get("winner") else ".")
        )
    confirmed = summary.get("promote")
    if confirmed:
        gains = "; ".join(
            f"{pair} {g['speedup']:.3f}× [{g['ci95'][0]:.3f}–{g['ci95'][1]:.3f}] (n {g['n']})"
            for pair, g in (confirmed.get("speedups") or {}).items()
        )
        verdict = f"verify {confirmed['verdict']}" if confirmed.get("verdict") else ""
        outcome = "promoted" if confirmed["promoted"] else f"not promoted: {confirmed.get('reason')}"
        lines += ["", f"PROMOTE (dev split, against the current final): {gains}; {verdict}; {outcome}."]
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = summary["trials"]
    keys = sorted({k for t in trials for k in t["params"]})
    done = [t for t in trials if t["state"] == "COMPLETE"]
    failed = [t for t in trials if t["state"] != "COMPLETE"]
    floor = min([t["objective"] for t in done] + [1.0]) - 0.05  # where failed trials are drawn
    columns = 1 + len(keys)
    fig, axes = plt.subplots(1, columns, figsize=(4.2 + 2.6 * len(keys), 3.4), squeeze=False)
    ax = axes[0][0]
    ax.scatter([t["number"] for t in done], [t["objective"] for t in done], label="trial", zorder=3)
    ax.scatter([t["number"] for t in failed], [floor] * len(failed), marker="x", color="red", label="failed")
    steps = [(t["number"], b) for t, b in zip(trials, best_so_far(trials)) if b is not None]
    if steps:
        ax.step([n for n, _ in steps], [b for _, b in steps], where="post", color="black", label="best so far")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("trial")
    ax.set_ylabel("objective (CI lower bound, final/stock)")
    ax.set_title(summary["study"], fontsize=9)
    ax.legend(fontsize=7)
    for i, key in enumerate(keys, start=1):
        ax = axes[0][i]
        values = sorted({json.dumps(t["params"].get(key)) for t in trials})
        numeric = all(
            isinstance(t["params"].get(key), (int, float)) and not isinstance(t["params"].get(key), bool)
            for t in trials
        )

        def x(t, key=key, values=values, numeric=numeric):
            v = t["params"].get(key)
            return float(v) if numeric else values.index(json.dumps(v))

        ax.scatter([x(t) for t in done], [t["objective"] for t in done], zorder=3)
        ax.scatter([x(t) for t in failed], [floor] * len(failed), marker="x", color="red")
        if not numeric:
            ax.set_xticks(range(len(values)), values, fontsize=7)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel(key, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial.png")
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    partial.replace(path)
    return path


def leaders_section(summary: dict[str, Any]) -> list[str]:
    """The leaders' re-measurement (tune/leaders.py) beside each leader's trial result; empty when none ran."""
    record = summary.get("leaders")
    if not record:
        return []
    rows = {t["number"]: t for t in summary["trials"]}
    lines = [
        "",
        f"Leaders re-measured side by side with stock and ar on the {record['split']} split "
        f"({record['seconds']:.0f} s); the winner is the highest re-measured lower bound:",
        "",
        "| trial | trial's final/stock [95% CI] | re-measured final/stock [95% CI] | re-measured final/ar | verify |",
        "|---|---|---|---|---|",
    ]
    for number in record["leaders"]:
        first, again = rows[number]["final_stock"], record["trials"][str(number)]
        fs = again["final_stock"]
        mark = " (chosen)" if number == record["chosen"] else ""
        lines.append(
            f"| {number}{mark} | {first['speedup']:.3f}× [{first['ci95'][0]:.3f}–{first['ci95'][1]:.3f}] | "
            f"{fs['speedup']:.3f}× [{fs['ci95'][0]:.3f}–{fs['ci95'][1]:.3f}] | "
            f"{again['final_ar']['speedup']:.3f}× | {again['verdict']} |"
        )
    return lines
