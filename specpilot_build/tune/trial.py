"""One trial: compose the candidate as the final arm's mechanism, build it, serve it, bench it interleaved with ar
and stock on the tune split, compare, force every token of its run through ar; the objective is the lower bound of
the paired-bootstrap 95% CI of final/stock tokens per second. Anything that goes wrong is the trial's reason."""

from __future__ import annotations

import io
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from specpilot_build.defaults import ARMS
from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import Engine
from specpilot_build.tune.space import candidate_overrides

SPLIT = "tune"
REASON_CHARS = 600  # a failure's message (a server's log tail included), on one line
LOSSLESS = "lossless"  # verify's verdict when every token of the run is what ar emits


@dataclass(frozen=True)
class Slice:
    """The tuning slice every trial benches: the first `limit` tune-split items of each dataset."""

    limit: int | None
    max_new_tokens: int
    datasets: list[str] | None


@dataclass
class Outcome:
    ok: bool
    attrs: dict[str, Any] = field(default_factory=dict)  # recorded on the trial
    objective: float | None = None


class TrialTimeout(SpecPilotError):
    pass


def run_trial(
    *,
    setting: str,
    mechanisms: list[str],
    values: dict[str, Any],
    baseline: dict[str, Engine],  # ar and stock, built once and served for the whole tune
    ports: dict[str, int],
    pids: dict[str, int],
    slice_: Slice,
    run_prefix: str,
    timeout_s: float,
) -> Outcome:
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.serve.process import serve, stop

    attrs: dict[str, Any] = {"overrides": candidate_overrides(mechanisms, values)}
    started = time.perf_counter()
    served = False
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        composed = compose_setting(setting, "final", attrs["overrides"])
        built = build_composed(composed)
        attrs.update(engine_id=built.engine.id, cache_hit=not built.created)
        served = True
        pids = {**pids, "final": serve(built.engine.id, ports["final"], quiet=True)["pid"]}
        measured = _measure({**baseline, "final": built.engine}, ports, pids, slice_, run_prefix)
        attrs.update(measured)
    except TrialTimeout:
        attrs["reason"] = f"timed out after {timeout_s:.0f} s"
    except SpecPilotError as exc:
        attrs["reason"] = " ".join(str(exc).split())[:REASON_CHARS] or type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if served:
            stop(ports["final"])
        attrs["seconds"] = round(time.perf_counter() - started, 1)
    if "reason" in attrs:
        return Outcome(ok=False, attrs=attrs)
    if attrs["verdict"] != LOSSLESS:
        attrs["reason"] = f"not lossless: verify says {attrs['verdict']} ({attrs['verify_json']})"
        return Outcome(ok=False, attrs=attrs)
    return Outcome(ok=True, attrs=attrs, objective=attrs["final_stock"]["ci95"][0])


def _on_alarm(signum, frame) -> None:
    raise TrialTimeout("trial timed out")


def _measure(engines: dict[str, Engine], ports: dict, pids: dict, slice_: Slice, prefix: str) -> dict[str, Any]:
    from specpilot_build.measure.attest import file_digests
    from specpilot_build.measure.compare import OVERALL, compare
    from specpilot_build.measure.results import load_results
    from specpilot_build.measure.sidebyside import bench_side_by_side
    from specpilot_build.measure.verify import verify

    names = {arm: f"{prefix}_{arm}" for arm in ARMS}
    runs = bench_side_by_side(
        engines,
        names,
        ports,
        limit=slice_.limit,
        max_new_tokens=slice_.max_new_tokens,
        datasets=slice_.datasets,
        pids=pids,
        overwrite=True,
        split=SPLIT,
    )
    quiet = Console(file=io.StringIO())
    report = compare(
        str(runs["ar"]),
        str(runs["stock"]),
        str(runs["final"]),
        name=f"{prefix}_compare",
        chart=False,
        console=quiet,
        overwrite=True,
    )
    verification = verify(str(runs["final"]), oracle=engines["ar"], port=ports["ar"], progress=False, console=quiet)
    _, final = load_results(runs["final"])
    pair = report["speedups"]["final/stock"][OVERALL]
    return {
        "final_stock": {"speedup": pair["speedup"], "ci95": pair["ci95"], "n": pair["n"]},
        "final_ar": report["speedups"]["final/ar"][OVERALL]["speedup"],
        "accept_length": report["accept_length"]["final"][OVERALL],
        "runs": {arm: str(runs[arm]) for arm in ARMS},
        "results_digests": {arm: "sha256:" + file_digests(runs[arm])["sha256"] for arm in ARMS},
        "compare_json": report["json"],
        "split": SPLIT,
        "prompts_digest": final["prompts_digest"],
        "prompt_digests": [r["prompt_digest"] for r in final["requests"]],
        "verdict": verification["verdict"],
        "verify_json": verification["json"],
        "verify_statement": verification["statement"],
        "verify_digest": "sha256:" + file_digests(verification["statement"])["sha256"],
    }
