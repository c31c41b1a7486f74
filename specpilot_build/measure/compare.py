"""Compare: speedups of final over stock, final over ar and stock over ar, with 95% CIs and output identity.

Method (fixed; the seed is part of it):
- c1 (one request at a time): a run's speed on a set of prompts is its summed completion tokens over its
  summed request latencies; a speedup is the ratio of two arms' speeds on the same prompts (paired).
- c16 (batching): the point estimate is the throughput ratio, tokens over the dataset's wall time (overall:
  all tokens over the summed walls). Its CI takes its relative spread from the per-request bootstrap below.
- CI: paired bootstrap, 2000 resamples, numpy default_rng(20261129). Each resample draws prompts with
  replacement (within each dataset, so "overall" keeps the dataset mix), recomputes the ratio of sums for
  both arms on the same draw, and the 2.5th/97.5th percentiles form the interval.
- Identity: a request is identical between two arms when their output ids are equal token for token.
Runs are comparable only when they hold the same prompts (dataset, item id, prompt digest), the same token
budget and concurrency, and the same target model; anything else is refused.

Nothing read is trusted: every prompt digest is recomputed from its `prompt_ids` and every completion count
from its `output_ids`; each run's recorded engine manifest must hash to its engine id and name the arm it is
passed as (ar serves no drafter, stock and final do); the three runs must be three different engines of one
setting, target pin, dtype and hardware. A report is never overwritten unless asked (`overwrite=True`), and
each is written with an in-toto statement binding its speedups to the three results files (attest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specpilot_build import __version__
from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import attest
from specpilot_build.measure.prompts import prompt_digest, prompts_digest
from specpilot_build.measure.results import (
    load_results,
    require_current,
    results_dir,
    write_json,
)
from specpilot_build.serve import client
from specpilot_build.store.manifest import engine_id as engine_id_of

PAIRS = (("final", "stock"), ("final", "ar"), ("stock", "ar"))
RESAMPLES = 2000
SEED = 20261129
OVERALL = "overall"


def compare(
    ar: str, stock: str, final: str, name: str | None = None, chart: bool = True, console=None, overwrite: bool = False
) -> dict:
    """Compare three bench runs (paths or names); writes <results>/<name>.json, .png and .intoto.json, prints a
    table. Refuses to replace an existing report unless `overwrite`."""
    runs = {}
    for arm, ref in (("ar", ar), ("stock", stock), ("final", final)):
        path, data = load_results(ref)
        runs[arm] = (path, data)
    check_arms(runs)
    check_records(runs)
    check_comparable(runs)
    name = name or f"compare_{runs['final'][1]['name']}"
    out = results_dir() / f"{name}.json"
    if out.exists() and not overwrite:
        raise SpecPilotError(
            f"{out} exists (an earlier compare); choose another NAME or pass --overwrite (OVERWRITE=1) to replace it"
        )
    report = speed_report({arm: data for arm, (_, data) in runs.items()})
    report["runs"] = {
        arm: {
            "path": str(path),
            "name": data["name"],
            "engine_id": data["engine_id"],
            "manifest_digest": data.get("manifest_digest"),
            "oracle_engine_id": data.get("oracle_engine_id"),
            "arm": data["arm"],
            "date_utc": data["date_utc"],
        }
        for arm, (path, data) in runs.items()
    }
    report["json"] = str(out)
    report["statement"] = str(attest.statement_path(out))
    if chart:
        report["chart"] = str(speedup_chart(report, out.with_suffix(".png")))
    write_json(out, report)
    subjects = [path for path, _ in runs.values()] + [out] + ([Path(report["chart"])] if chart else [])
    attest.write_statement(
        out,
        subjects,
        attest.PREDICATE_COMPARE,
        compare_predicate(report, {arm: data for arm, (_, data) in runs.items()}),
    )
    print_table(report, console)
    return report


def compare_predicate(report: dict, runs: dict) -> dict:
    ar = runs["ar"]
    return {
        "engine_ids": {arm: data["engine_id"] for arm, data in runs.items()},
        "oracle_engine_ids": {arm: data.get("oracle_engine_id") for arm, data in runs.items()},
        "setting": ar.get("setting"),
        "target_pin": ar.get("target_pin"),
        "dtype": _dtype(ar["engine_manifest"]),
        "hardware": {arm: data.get("hardware") for arm, data in runs.items()},
        "versions": {
            "runs": {arm: data.get("versions") for arm, data in runs.items()},
            "servers": {arm: data.get("served") for arm, data in runs.items()},
            "specpilot": __version__,
        },
        "concurrency": report["concurrency"],
        "method": {"resamples": report["resamples"], "seed": report["seed"]},
        "speedups": {
            pair: {d: {"speedup": s["speedup"], "ci95": s["ci95"], "n": s["n"]} for d, s in per_dataset.items()}
            for pair, per_dataset in report["speedups"].items()
        },
        "identity": {
            pair: {d: {"identical": i["identical"], "requests": i["requests"]} for d, i in per_dataset.items()}
            for pair, per_dataset in report["identity"].items()
        },
    }


def check_arms(runs: dict) -> None:
    """Each run is a different engine, of the arm it is passed as (by its manifest), all of one setting, target
    pin, dtype and hardware; ar serves no drafter, stock and final do."""
    seen_paths: dict[Path, str] = {}
    seen_engines: dict[str, str] = {}
    for arm, (path, data) in runs.items():
        require_current(path, data)
        where = Path(path).resolve()
        if where in seen_paths:
            raise SpecPilotError(
                f"{path} is passed as both {seen_paths[where]} and {arm}: compare needs three "
                "different runs, one per arm"
            )
        seen_paths[where] = arm
        engine_id = data.get("engine_id")
        if engine_id in seen_engines:
            raise SpecPilotError(
                f"the {seen_engines[engine_id]} and {arm} runs are both of engine "
                f"{str(engine_id)[:12]}: compare needs one engine per arm"
            )
        seen_engines[engine_id] = arm
    for arm, (path, data) in runs.items():
        engine_id = data.get("engine_id")
        manifest = data.get("engine_manifest")
        if (
            not isinstance(manifest, dict)
            or engine_id_of(manifest) != engine_id
            or data.get("manifest_digest") != f"blake3:{engine_id}"
        ):
            raise SpecPilotError(
                f"{path}: its recorded engine manifest does not hash to its engine id "
                f"{str(engine_id)[:12]}; the record was altered or is not a bench run"
            )
        served = client.served_engine_id(data.get("server_info") or {})
        if served != engine_id:
            raise SpecPilotError(
                f"{path}: it records engine {str(engine_id)[:12]}, but its server reported "
                f"{str(served)[:12]} in server_info; the record was altered"
            )
        manifest_arm = manifest.get("arm")
        if manifest_arm != arm or data.get("arm") != arm:
            raise SpecPilotError(
                f"{path} is passed as the {arm} arm, but its engine {engine_id[:12]} is the "
                f"{manifest_arm} arm (its manifest; the record says {data.get('arm')}): arms "
                "swapped or repeated"
            )
        drafter = _drafter(manifest)
        if arm == "ar" and drafter:
            raise SpecPilotError(f"{path}: the ar engine {engine_id[:12]} serves a drafter ({drafter})")
        if arm != "ar" and not drafter:
            raise SpecPilotError(f"{path}: the {arm} engine {engine_id[:12]} serves no drafter")
    traits = {arm: _traits(data["engine_manifest"]) for arm, (_, data) in runs.items()}
    differ = []
    for key in ("target_pin", "dtype", "quantization", "hardware", "setting"):
        values = {arm: t[key] for arm, t in traits.items()}
        if len({repr(v) for v in values.values()}) > 1:
            differ.append(f"{key} (" + ", ".join(f"{arm} {v}" for arm, v in values.items()) + ")")
    if differ:
        raise SpecPilotError(
            f"the runs' engines differ in {'; '.join(differ)}: compare only arms of one "
            "setting, target, dtype and hardware"
        )


def check_records(runs: dict) -> None:
    """Recompute what compare reads from each run's ids: prompt digests and completion counts."""
    for arm, (path, data) in runs.items():
        for r in data["requests"]:
            where = f"{path} ({arm}): {r['dataset']} item {r['item_id']}"
            recomputed = prompt_digest(r["prompt_ids"])
            if r.get("prompt_digest") != recomputed:
                raise SpecPilotError(
                    f"{where}: prompt_digest {str(r.get('prompt_digest'))[:16]}… is not the "
                    f"sha256 of its prompt_ids ({recomputed[:16]}…)"
                )
            if r.get("completion_tokens") != len(r["output_ids"]):
                raise SpecPilotError(
                    f"{where}: completion_tokens {r.get('completion_tokens')} but {len(r['output_ids'])} output_ids"
                )
        if data.get("prompts_digest") != prompts_digest(data["requests"]):
            raise SpecPilotError(f"{path} ({arm}): prompts_digest is not the digest of its requests' prompts")


def _drafter(manifest: dict) -> str | None:
    config = manifest.get("config") or {}
    algorithm = (config.get("drafter") or {}).get("algorithm")
    uses = (config.get("arm") or {}).get("uses_drafter")
    if algorithm in (None, "none") and not uses:
        return None
    return algorithm or "a drafter"


def _dtype(manifest: dict):
    return ((manifest.get("config") or {}).get("model") or {}).get("dtype")


def _traits(manifest: dict) -> dict:
    config = manifest.get("config") or {}
    pin = ((manifest.get("inputs") or {}).get("checkpoints") or {}).get("model") or {}
    return {
        "setting": manifest.get("setting"),
        "target_pin": f"{pin.get('repo')}@{pin.get('revision')}",
        "dtype": _dtype(manifest),
        "quantization": (config.get("model") or {}).get("quantization"),
        "hardware": (config.get("hardware") or {}).get("name"),
    }


def check_comparable(runs: dict) -> None:
    (base_arm, (base_path, base)), *others = runs.items()
    base_prompts = _prompts(base)
    for _arm, (path, data) in others:
        if data["target_pin"] != base["target_pin"]:
            raise SpecPilotError(
                f"{path} was run on target {_pin(data)}, {base_path} on {_pin(base)}: "
                "only runs of one target model compare"
            )
        for key in ("max_new_tokens", "concurrency"):
            if data[key] != base[key]:
                raise SpecPilotError(
                    f"{path} has {key}={data[key]}, {base_path} has {base[key]}: bench all arms with the same settings"
                )
        prompts = _prompts(data)
        if prompts != base_prompts:
            differ = sorted(set(prompts.items()) ^ set(base_prompts.items()))[0]
            raise SpecPilotError(
                f"{path} and {base_path} hold different prompts (first difference: "
                f"{differ[0][0]} item {differ[0][1]}); bench every arm on the same split"
            )


def speed_report(runs: dict) -> dict:
    """Speedups, CIs, identity and accept lengths for runs {'ar','stock','final'} already checked comparable."""
    concurrency = runs["ar"]["concurrency"]
    datasets = sorted({r["dataset"] for r in runs["ar"]["requests"]})
    aligned = {arm: _aligned(data, runs["ar"]) for arm, data in runs.items()}
    rng = np.random.default_rng(SEED)
    draws = {d: rng.integers(0, len(aligned["ar"][d]), size=(RESAMPLES, len(aligned["ar"][d]))) for d in datasets}
    speedups: dict[str, dict[str, Any]] = {}
    identity: dict[str, dict[str, Any]] = {}
    for num, den in PAIRS:
        key = f"{num}/{den}"
        speedups[key], identity[key] = {}, {}
        for dataset in datasets + [OVERALL]:
            parts = datasets if dataset == OVERALL else [dataset]
            speedups[key][dataset] = _speedup(runs, aligned, draws, num, den, parts, concurrency)
            identity[key][dataset] = _identity(aligned[num], aligned[den], parts)
    accept = {
        arm: {
            d: _mean(
                [
                    r["accept_length"]
                    for part in (datasets if d == OVERALL else [d])
                    for r in aligned[arm][part]
                    if r["accept_length"] is not None
                ]
            )
            for d in datasets + [OVERALL]
        }
        for arm in runs
    }
    return {
        "schema": "specpilot.compare/1",
        "concurrency": concurrency,
        "datasets": datasets,
        "method": __doc__.split("Method (fixed; the seed is part of it):\n")[1].split("\nRuns are")[0],
        "resamples": RESAMPLES,
        "seed": SEED,
        "speedups": speedups,
        "identity": identity,
        "accept_length": accept,
    }


def ratio_of_sums_ci(lat_num, tok_num, lat_den, tok_den, draws: list[np.ndarray]) -> tuple[float, float, float]:
    """Speed ratio num/den = (tok_num/lat_num)/(tok_den/lat_den) on all prompts, and its bootstrap 95% CI.

    `draws` holds one (resamples, n_part) index array per stratum; arrays are concatenated per stratum."""
    point = (np.sum(np.concatenate(tok_num)) / np.sum(np.concatenate(lat_num))) / (
        np.sum(np.concatenate(tok_den)) / np.sum(np.concatenate(lat_den))
    )
    sums = {
        name: sum(np.asarray(values[i])[draw].sum(axis=1) for i, draw in enumerate(draws))
        for name, values in (("ln", lat_num), ("tn", tok_num), ("ld", lat_den), ("td", tok_den))
    }
    ratios = (sums["tn"] / sums["ln"]) / (sums["td"] / sums["ld"])
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(point), float(low), float(high)


def _speedup(runs, aligned, draws, num, den, parts, concurrency) -> dict:
    def column(arm, field):
        return [np.array([r[field] for r in aligned[arm][d]], dtype=float) for d in parts]

    point, low, high = ratio_of_sums_ci(
        column(num, "latency_s"),
        column(num, "completion_tokens"),
        column(den, "latency_s"),
        column(den, "completion_tokens"),
        [draws[d] for d in parts],
    )
    result: dict[str, Any] = {"n": sum(len(aligned[num][d]) for d in parts)}
    if concurrency > 1:
        throughput = {
            arm: sum(runs[arm]["per_dataset"][d]["completion_tokens"] for d in parts)
            / sum(runs[arm]["per_dataset"][d]["wall_s"] for d in parts)
            for arm in (num, den)
        }
        scale = (throughput[num] / throughput[den]) / point
        point, low, high = point * scale, low * scale, high * scale
        result["throughput_tok_s"] = throughput
    result.update({"speedup": point, "ci95": [low, high]})
    return result


def _identity(num: dict, den: dict, parts) -> dict:
    pairs = [(a, b) for d in parts for a, b in zip(num[d], den[d])]
    identical = sum(a["output_ids"] == b["output_ids"] for a, b in pairs)
    first = next(
        (
            {
                "dataset": a["dataset"],
                "item_id": a["item_id"],
                "position": _divergence(a["output_ids"], b["output_ids"]),
            }
            for a, b in pairs
            if a["output_ids"] != b["output_ids"]
        ),
        None,
    )
    return {
        "identical": identical,
        "requests": len(pairs),
        "fraction": identical / len(pairs) if pairs else 1.0,
        "first_difference": first,
    }


def _divergence(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _aligned(data: dict, reference: dict) -> dict:
    """The run's requests per dataset, in the reference run's order of items."""
    by_key = {(r["dataset"], r["item_id"]): r for r in data["requests"]}
    aligned: dict[str, list[dict]] = {}
    for r in reference["requests"]:
        aligned.setdefault(r["dataset"], []).append(by_key[(r["dataset"], r["item_id"])])
    return aligned


def _prompts(data: dict) -> dict:
    return {(r["dataset"], r["item_id"]): r["prompt_digest"] for r in data["requests"]}


def _pin(data: dict) -> str:
    pin = data.get("target_pin") or {}
    return f"{pin.get('repo')}@{str(pin.get('revision'))[:12]}"


def _mean(values):
    return float(np.mean(values)) if values else None


def print_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"speedup [95% paired bootstrap CI], c{report['concurrency']}")
    table.add_column("dataset", no_wrap=True)
    for pair in report["speedups"]:
        table.add_column(pair, justify="right", no_wrap=True)
    table.add_column("identical\nfinal/ar", justify="right")
    table.add_column("accept\nfinal", justify="right")
    for dataset in report["datasets"] + [OVERALL]:
        row = [dataset]
        for per_dataset in report["speedups"].values():
            s = per_dataset[dataset]
            row.append(f"{s['speedup']:.2f}×\n[{s['ci95'][0]:.2f}–{s['ci95'][1]:.2f}]")
        ident = report["identity"]["final/ar"][dataset]
        row.append(f"{ident['identical']}/{ident['requests']}")
        accept = report["accept_length"]["final"].get(dataset)
        row.append(f"{accept:.2f}" if accept is not None else "-")
        table.add_row(*row, end_section=True)
    console.print(table)


def speedup_chart(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = report["datasets"] + [OVERALL]
    pairs = list(report["speedups"])
    width = 0.8 / len(pairs)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(groups), 3.6))
    for i, pair in enumerate(pairs):
        values = [report["speedups"][pair][g]["speedup"] for g in groups]
        low = [v - report["speedups"][pair][g]["ci95"][0] for v, g in zip(values, groups)]
        high = [report["speedups"][pair][g]["ci95"][1] - v for v, g in zip(values, groups)]
        xs = [x + (i - (len(pairs) - 1) / 2) * width for x in range(len(groups))]
        ax.bar(xs, values, width, yerr=[low, high], capsize=3, label=pair)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup (×)")
    ax.set_title(
        f"{report['runs']['final']['name'] if 'runs' in report else ''} c{report['concurrency']}, 95% bootstrap CI"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
