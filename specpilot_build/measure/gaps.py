"""The cost model: where each emitted token's time goes, against the ceilings the hardware sets.

From a bench run of an engine (per request: latency, tokens, acceptance and the server's wall time per part:
`meta_info.timing_s` of the reference runtime, or for an SGLang engine the differences of its own /metrics
counters around the request, measure/sglang_metrics.py) and the hardware's peak memory bandwidth, per dataset:

- the ar ceiling: one target forward reads the weights once, so tokens/s <= bandwidth / weight bytes;
- the speculative ceiling at the measured acceptance length (tokens per target forward), drafting free;
- the measured tokens/s, and the time per emitted token split into target forward, drafting, prefill, the
  runtime's own work (acceptance, sampling, detokenising, queueing, waiting in the loop) and what lies outside
  the engine (HTTP, JSON, the client).

The gaps are the seconds per token each part could give back: the target forward above its ceiling (kernels),
drafting (a cheaper drafter), acceptance below the drafter's width (a drafter that agrees more often), runtime
overhead and serving overhead. Ranked largest first: the list a tune should attack first.

Bandwidth: a GPU's peak comes from conf/ceilings/<hardware>.yaml (datasheet figures; not part of any setting,
so an engine id does not depend on them); the CPU has no datasheet figure, so it is measured where gaps runs,
as the best of a few reads of a buffer far larger than the caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.measure import sglang_metrics
from specpilot_build.measure.results import load_results, write_json

SCHEMA = "specpilot.gaps/1"
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
QUANTIZED_BYTES = {"w12": 1.5, "fp8": 1.0}
ENGINE_PARTS = ("queue", "prefill", "draft", "target", "bookkeeping")
CEILINGS_DIR = REPO_ROOT / "conf" / "ceilings"
CEILING_KEYS = {"hardware", "memory_bandwidth_gbs", "source"}
STREAM_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    source: str


def hardware_bandwidth(hardware: str) -> Bandwidth:
    """The peak memory bandwidth of `hardware`: its ceilings file, or measured here for the CPU."""
    path = CEILINGS_DIR / f"{hardware}.yaml"
    if hardware == "cpu" and not path.exists():
        return Bandwidth(measured_read_bandwidth(), "measured here (best of 5 reads of 512 MiB)")
    if not path.exists():
        raise SpecPilotError(f"{path}: no ceilings for hardware {hardware!r}; add memory_bandwidth_gbs and source")
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecPilotError(f"{path}: not YAML ({exc})") from None
    if not isinstance(data, dict):
        raise SpecPilotError(f"{path}: expected a mapping of {', '.join(sorted(CEILING_KEYS))}")
    unknown = set(data) - CEILING_KEYS
    if unknown:
        raise SpecPilotError(f"{path}: unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(CEILING_KEYS))}")
    if data.get("hardware") != hardware:
        raise SpecPilotError(f"{path}: hardware is {data.get('hardware')!r}, expected {hardware!r}")
    value = data.get("memory_bandwidth_gbs")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise SpecPilotError(f"{path}: memory_bandwidth_gbs must be a positive number, got {value!r}")
    if not isinstance(data.get("source"), str) or not data["source"]:
        raise SpecPilotError(f"{path}: source must say where the figure comes from")
    return Bandwidth(float(value) * 1e9, f"{path.relative_to(REPO_ROOT)}: {data['source']}")


def measured_read_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` full reads (a sum) of a buffer far larger than the caches."""
    buffer = np.ones(STREAM_BYTES // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return STREAM_BYTES / best


def weight_bytes(model: dict) -> float:
    """Bytes one target forward reads at least: every weight once, in the dtype it is served in."""
    params = float(model["params_b"]) * 1e9
    quantization = model.get("quantization")
    if quantization in QUANTIZED_BYTES:
        return params * QUANTIZED_BYTES[quantization]
    dtype = model.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise SpecPilotError(f"model {model.get('name')}: no byte size for dtype {dtype!r}")
    return params * DTYPE_BYTES[dtype]


def gaps_report(engine, run: str | Path, bandwidth: Bandwidth | None = None) -> dict:
    """The cost model of `engine`'s bench run `run` (a name or a results path)."""
    path, data = load_results(run)
    if data.get("engine_id") != engine.id:
        raise SpecPilotError(f"{path}: a run of engine {str(data.get('engine_id'))[:16]}, not of {engine.id[:16]}")
    config = engine.config
    if int(data.get("concurrency") or 1) != 1:
        raise SpecPilotError(f"{path}: gaps models one request at a time (c1); this run is c{data['concurrency']}")
    requests = [_with_timing(r, path) for r in data["requests"]]
    missing = [f"{r['dataset']}/{r['item_id']}" for r in requests if not r.get("timing_s")]
    if missing:
        raise SpecPilotError(
            f"{path}: requests {', '.join(missing[:3])} carry no server timing (the reference runtime's "
            "meta_info.timing_s, or an SGLang engine's /metrics around each request); bench at c1 an engine "
            "built since SGLang launch specs carry --enable-metrics (rebuild it: its id moved)"
        )
    bandwidth = bandwidth or hardware_bandwidth(config["hardware"]["name"])
    per_forward_ceiling_s = weight_bytes(config["model"]) / bandwidth.bytes_per_s
    width = 1 + int((config.get("drafter") or {}).get("num_draft_tokens") or 0)
    datasets = sorted({r["dataset"] for r in requests})
    rows = {d: _dataset_row([r for r in requests if r["dataset"] == d], per_forward_ceiling_s, width) for d in datasets}
    rows["overall"] = _dataset_row(requests, per_forward_ceiling_s, width)
    report = {
        "schema": SCHEMA,
        "results": str(path),
        "engine_id": engine.id,
        "setting": data.get("setting"),
        "arm": data.get("arm"),
        "hardware": config["hardware"]["name"],
        "bandwidth_gbs": bandwidth.bytes_per_s / 1e9,
        "bandwidth_source": bandwidth.source,
        "weight_bytes": weight_bytes(config["model"]),
        "drafter_width": width,
        "datasets": rows,
    }
    return report


def _with_timing(request: dict, path: Path) -> dict:
    """The request with its timing_s: its own, or made from the SGLang counters' differences bench recorded."""
    delta = request.get("sglang_metrics")
    if request.get("timing_s") or not delta:
        return request
    where = f"{path}: {request['dataset']}/{request['item_id']}"
    if not isinstance(delta, dict) or not all(isinstance(v, (int, float)) for v in delta.values()):
        raise SpecPilotError(f"{where}: sglang_metrics is not a mapping of counter names to numbers")
    sglang_metrics.check_one_request(delta, int(request["completion_tokens"]), where)
    return {**request, "timing_s": sglang_metrics.timing(delta, where)}


def _dataset_row(requests: list[dict], per_forward_ceiling_s: float, width: int) -> dict[str, Any]:
    tokens = sum(int(r["completion_tokens"]) for r in requests)
    if tokens == 0:
        raise SpecPilotError("no emitted tokens to model")
    latency = sum(float(r["latency_s"]) for r in requests)
    parts = {p: sum(float(r["timing_s"].get(p, 0.0)) for r in requests) for p in ENGINE_PARTS}
    engine = sum(float(r["timing_s"].get("engine", 0.0)) for r in requests)
    forwards = sum(_forwards(r) for r in requests)
    accept = tokens / forwards if forwards else 1.0
    per_token = {
        "target": parts["target"] / tokens,
        "draft": parts["draft"] / tokens,
        "prefill": parts["prefill"] / tokens,
        "runtime": (parts["bookkeeping"] + parts["queue"] + max(0.0, engine - sum(parts.values()))) / tokens,
        "serving": max(0.0, latency - engine) / tokens,
    }
    measured = latency / tokens
    target_per_forward = parts["target"] / forwards if forwards else 0.0
    gaps = {
        "target forward above its bandwidth ceiling": (
            max(0.0, per_token["target"] - per_forward_ceiling_s / accept),
            "a faster forward (fused or compiled kernels, fewer launches)",
        ),
        "drafting": (per_token["draft"], "a cheaper drafter"),
        "acceptance below the drafter's width": (
            max(0.0, target_per_forward / accept - target_per_forward / width) if width > 1 else 0.0,
            "a drafter that agrees with the target more often",
        ),
        "runtime overhead": (per_token["runtime"], "less bookkeeping per step (acceptance, sampling, detokenising)"),
        "serving overhead": (per_token["serving"], "less HTTP/JSON work per request, or streaming"),
        "prefill": (per_token["prefill"], "a faster prefill (shared prefixes, a larger batch)"),
    }
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])
    return {
        "requests": len(requests),
        "tokens": tokens,
        "accept_length": accept,
        "measured_tok_s": tokens / latency,
        "ar_ceiling_tok_s": 1.0 / per_forward_ceiling_s,
        "spec_ceiling_tok_s": accept / per_forward_ceiling_s,
        "per_token_s": per_token,
        "measured_per_token_s": measured,
        "engine_attributed": sum(parts.values()) / engine if engine else 0.0,
        "gaps": [{"gap": name, "per_token_s": s, "closed_by": how} for name, (s, how) in ranked],
    }


def _forwards(request: dict) -> float:
    """Target forwards the request's decode took (prefill's one included): tokens / acceptance length."""
    tokens = int(request["completion_tokens"])
    accept = request.get("accept_length")
    return tokens / float(accept) if accept else float(tokens)


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    """The report as JSON and a PNG of the time per token by part, per dataset, with the ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path = write_json(out.with_suffix(".json"), report)
    names = list(report["datasets"])
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = np.zeros(len(names))
    for part in ("target", "draft", "prefill", "runtime", "serving"):
        values = np.array([report["datasets"][n]["per_token_s"][part] * 1e3 for n in names])
        ax.bar(names, values, bottom=bottom, label=part)
        bottom += values
    ceiling = [1e3 / report["datasets"][n]["spec_ceiling_tok_s"] for n in names]
    ax.plot(names, ceiling, "k_", markersize=30, label="speculative ceiling")
    ax.set_ylabel("ms per emitted token")
    ax.set_title(f"{report['setting']} / {report['arm']}: where a token's time goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png_path = out.with_suffix(".png")
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"time per emitted token (ms), {report['setting']}/{report['arm']}")
    parts = ("target", "draft", "prefill", "runtime", "serving")
    for column in ("dataset", "tok/s", "ceiling\nar", "ceiling\nspec", "accept", *parts):
        table.add_column(column, justify="left" if column == "dataset" else "right", no_wrap=True)
    for name, row in report["datasets"].items():
        table.add_row(
            name,
            f"{row['measured_tok_s']:.0f}",
            f"{row['ar_ceiling_tok_s']:.0f}",
            f"{row['spec_ceiling_tok_s']:.0f}",
            f"{row['accept_length']:.2f}",
            *(f"{row['per_token_s'][p] * 1e3:.3f}" for p in parts),
        )
    console.print(table)
    overall = report["datasets"]["overall"]
    console.print(
        f"measured {overall['measured_per_token_s'] * 1e3:.3f} ms per token; the engine's timed parts cover "
        f"{overall['engine_attributed']:.1%} of its time (the rest: waiting in the loop, in runtime)"
    )
    gaps = Table(title="gaps, largest first (overall)")
    for column in ("gap", "ms/token", "closed by"):
        gaps.add_column(column)
    for gap in report["datasets"]["overall"]["gaps"]:
        gaps.add_row(gap["gap"], f"{gap['per_token_s'] * 1e3:.3f}", gap["closed_by"])
    console.print(gaps)
    console.print(f"bandwidth {report['bandwidth_gbs']:.1f} GB/s ({report['bandwidth_source']})")
