"""PROMOTE: confirm a tune's winner on the evaluation prompts against the setting's current final, and only if it
is faster with the whole 95% CI above 1 (and lossless) make it the setting's final.

The confirmation serves ar, the current final and the new final (the winner, conf/mechanism/tuned/<setting>.yaml)
and benches them interleaved on the dev split (the prompts bench, compare and score report on; a tune never saw
them): sidebyside.py's rounds, with the current final in the middle slot. The speedup new/current is compare's
paired bootstrap (ratio of sums, 2000 resamples, its seed); the new final's run is forced token by token through ar.

Promotion is an ordinary config change: the winner is copied to conf/mechanism/promoted/<setting>.yaml (a later
tune rewrites tuned/<setting>.yaml, never the final) and the preset's defaults list names it in place of the
final's mechanisms, so `make diff` of the old and new final shows exactly the values that moved. Both files are
written whole (temporary file, rename); the preset must then compose and build to exactly the confirmed engine,
else both are put back as they were."""

from __future__ import annotations

import io
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import conf_dir, data_dir
from specpilot_build.tune.space import MECHANISM
from specpilot_build.tune.winner import winner_overrides, winner_path

SPLIT = "dev"
PROMOTED = "promoted"  # conf/mechanism/promoted/<setting>.yaml: the preset's final, once confirmed
SLOTS = {"ar": "ar", "current": "stock", "new": "final"}  # our arms -> sidebyside's three slots
ENTRY = re.compile(r"^(\s*)-\s*/mechanism@final\.mechanisms\.([\w.-]+)\s*:\s*(\S+)\s*(#.*)?$")


def promoted_path(setting: str) -> Path:
    return conf_dir() / "mechanism" / PROMOTED / f"{setting}.yaml"


def setting_path(setting: str) -> Path:
    return conf_dir() / "setting" / f"{setting}.yaml"


def promote(
    setting: str,
    mechanisms: list[str],
    study_name: str,
    port: int,
    limit: int | None = 2,
    max_new_tokens: int = 128,
    datasets: list[str] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Confirm the winner against the current final; returns the confirmation (written beside the study's
    summary as <study>.promote.json) with `promoted` true only when conf/ was changed."""
    from specpilot_build.assemble.builder import build_composed, build_engine
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.measure.attest import file_digests
    from specpilot_build.measure.sidebyside import bench_side_by_side
    from specpilot_build.measure.verify import verify
    from specpilot_build.serve.process import serve, stop

    console = console or Console()
    winner = winner_path(setting)
    if not winner.is_file():
        raise SpecPilotError(
            f"PROMOTE: no winner {winner} to confirm (a tune writes it when a trial completes lossless)"
        )
    engines = {
        "ar": build_engine(setting, "ar").engine,
        "current": build_engine(setting, "final").engine,
        "new": build_composed(compose_setting(setting, "final", winner_overrides(setting, mechanisms))).engine,
    }
    out = data_dir() / "tune" / f"{study_name}.promote.json"
    report: dict[str, Any] = {
        "schema": "specpilot.promote/1",
        "setting": setting,
        "study": study_name,
        "winner": str(winner),
        "engine_ids": {arm: e.id for arm, e in engines.items()},
        "split": SPLIT,
        "promoted": False,
    }
    if engines["new"].id == engines["current"].id:
        report["reason"] = f"the winner is already the final of {setting} (engine {engines['new'].id[:16]})"
        return _finish(report, out, console)
    ports = {SLOTS[arm]: port + i for i, arm in enumerate(SLOTS)}
    names = {SLOTS[arm]: f"promote_{study_name}_{arm}" for arm in SLOTS}
    pids: dict[str, int] = {}
    quiet = Console(file=io.StringIO())
    console.print(
        f"PROMOTE: confirming {winner.name} (engine {engines['new'].id[:12]}) against the current final "
        f"(engine {engines['current'].id[:12]}) on the {SPLIT} split, interleaved, with ar"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers as Ctrl-C does
    try:
        for arm, slot in SLOTS.items():
            pids[slot] = serve(engines[arm].id, ports[slot], quiet=True)["pid"]
        runs = bench_side_by_side(
            {SLOTS[arm]: engines[arm] for arm in SLOTS},
            names,
            ports,
            limit=limit,
            max_new_tokens=max_new_tokens,
            datasets=datasets,
            pids=pids,
            overwrite=True,
            split=SPLIT,
        )
        verification = verify(str(runs["final"]), oracle=engines["ar"], port=ports["ar"], progress=False, console=quiet)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for slot in pids:
            stop(ports[slot])
    report["runs"] = {arm: str(runs[SLOTS[arm]]) for arm in SLOTS}
    report["results_digests"] = {arm: "sha256:" + file_digests(runs[SLOTS[arm]])["sha256"] for arm in SLOTS}
    report["speedups"] = confirm_speedups({arm: runs[SLOTS[arm]] for arm in SLOTS})
    report["verdict"] = verification["verdict"]
    report["verify_statement"] = verification["statement"]
    report["verify_digest"] = "sha256:" + file_digests(verification["statement"])["sha256"]
    gain = report["speedups"]["new/current"]
    if report["verdict"] != "lossless":
        report["reason"] = f"the new final is not lossless on the {SPLIT} split: verify says {report['verdict']}"
    elif not gain["ci95"][0] > 1.0:
        report["reason"] = (
            f"new/current {gain['speedup']:.3f}× [{gain['ci95'][0]:.3f}–{gain['ci95'][1]:.3f}]: "
            "the CI's lower bound is not above 1"
        )
    else:
        report["changed"] = [str(p) for p in switch_final(setting, winner, engines["new"].id, report)]
        report["promoted"] = True
    return _finish(report, out, console)


def confirm_speedups(runs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """new/current, new/ar and current/ar tokens per second, overall, with compare's paired bootstrap CI; the runs
    are checked as compare checks them (digests recomputed from the ids, same prompts, budgets and target)."""
    return paired_speedups(runs, (("new", "current"), ("new", "ar"), ("current", "ar")), SPLIT)


def paired_speedups(runs: dict[str, Path], pairs, split: str) -> dict[str, dict[str, Any]]:
    """`num/den` tokens per second for each pair of runs benched side by side on `split`, overall, with compare's
    paired bootstrap CI (its resamples and seed); the runs are checked as compare checks them."""
    from specpilot_build.measure.compare import OVERALL, RESAMPLES, SEED, _aligned, _speedup, check_comparable
    from specpilot_build.measure.compare import check_records as check_ids
    from specpilot_build.measure.results import load_results

    loaded = {arm: load_results(path) for arm, path in runs.items()}
    check_ids(loaded)
    check_comparable(loaded)
    data = {arm: d for arm, (_, d) in loaded.items()}
    for arm, d in data.items():
        splits = sorted({str(part.get("split")) for part in d["datasets"].values()})
        if splits != [split]:
            raise SpecPilotError(f"{loaded[arm][0]}: benched the {', '.join(splits)} split, not {split}")
    concurrency = data["ar"]["concurrency"]
    datasets = sorted({r["dataset"] for r in data["ar"]["requests"]})
    aligned = {arm: _aligned(d, data["ar"]) for arm, d in data.items()}
    rng = np.random.default_rng(SEED)
    draws = {d: rng.integers(0, len(aligned["ar"][d]), size=(RESAMPLES, len(aligned["ar"][d]))) for d in datasets}
    out = {}
    for num, den in pairs:
        s = _speedup(data, aligned, draws, num, den, datasets, concurrency)
        out[f"{num}/{den}"] = {"dataset": OVERALL, "n": s["n"], "speedup": s["speedup"], "ci95": s["ci95"]}
    return out


def switch_final(setting: str, winner: Path, engine_id: str, report: dict) -> list[Path]:
    """Copy the winner to promoted/<setting>.yaml and name it in the preset's defaults list instead of the final's
    mechanisms; both written whole, and put back unless the preset then builds to exactly `engine_id`."""
    from specpilot_build.assemble.builder import build_engine

    preset, mechanism = setting_path(setting), promoted_path(setting)
    gain = report["speedups"]["new/current"]
    header = (
        f"# Promoted by `make tune SETTING={setting} PROMOTE=1`: on the {SPLIT} split, new/current final "
        f"{gain['speedup']:.4f}× [{gain['ci95'][0]:.4f}–{gain['ci95'][1]:.4f}] (n {gain['n']}), "
        f"verify {report['verdict']} ({report['verify_digest']}).\n"
    )
    texts = {mechanism: header + winner.read_text(), preset: switched_preset(preset.read_text(), setting, preset)}
    previous = {path: path.read_bytes() if path.exists() else None for path in texts}
    try:
        for path, text in texts.items():
            _write_whole(path, text)
        built = build_engine(setting, "final").engine
        if built.id != engine_id:
            raise SpecPilotError(
                f"{preset} now composes to engine {built.id[:16]}, not the confirmed {engine_id[:16]}; put back"
            )
    except BaseException:
        for path, data in previous.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                _write_whole(path, data.decode())
        raise
    return list(texts)


def switched_preset(text: str, setting: str, where: Path) -> str:
    """The preset with its `- /mechanism@final.mechanisms.<name>: <file>` entries replaced, at the first one's
    place, by the promoted mechanism (named `tuned`, so it builds to the very engine the tune measured)."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if ENTRY.match(line.rstrip("\n"))]
    entry = f"/mechanism@final.mechanisms.{MECHANISM}: {PROMOTED}/{setting}"
    if found:
        indent = ENTRY.match(lines[found[0]].rstrip("\n")).group(1)  # type: ignore[union-attr]
        lines[found[0]] = f"{indent}- {entry}\n"
        return "".join(line for i, line in enumerate(lines) if i not in found[1:])
    at = next((i for i, line in enumerate(lines) if line.rstrip() == "defaults:"), None)
    if at is None:
        raise SpecPilotError(f"{where}: no defaults list to name the promoted final in")
    lines.insert(at + 1, f"  - {entry}\n")
    return "".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _write_whole(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def _finish(report: dict, out: Path, console: Console) -> dict:
    from specpilot_build.measure.results import write_json

    report["json"] = str(write_json(out, report))
    gains = report.get("speedups") or {}
    shown = "; ".join(f"{k} {v['speedup']:.3f}× [{v['ci95'][0]:.3f}–{v['ci95'][1]:.3f}]" for k, v in gains.items())
    if report["promoted"]:
        console.print(f"PROMOTED: {shown}; verify {report['verdict']}; changed {', '.join(report['changed'])}")
    else:
        console.print(f"not promoted: {report['reason']}" + (f" ({shown})" if shown else "") + "; conf/ unchanged")
    console.print(f"confirmation {report['json']}")
    return report
