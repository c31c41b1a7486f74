"""Trials through a Hydra launcher (`LAUNCHER=submitit_local`, `submitit_slurm`, `slurm`, `local`, ...): each trial,
and the leaders' re-measurement, is one Hydra job that may run on another machine.

The tune asks Optuna for a batch of trials, writes one job spec per trial (<study dir>/<batch>/<job>.spec.json:
the setting, the candidate's overrides, the tuning slice) and runs the batch as a Hydra multirun through the
launcher (one `+tune_job.spec=<path>` per job). A job has no fixed PORT: it serves its own ar, stock and candidate,
each on a free port of its machine, benches them interleaved, forces the candidate's tokens through ar, and writes
<job>.result.json beside its spec. The tune reads every result back and trusts nothing in it: its schema, the
digest of the spec it answers (so a stale or foreign result cannot be told as this trial's), its own digest, the
objective recomputed from the recorded final/stock CI and the verdict, and each results file's sha256 against the
digest recorded for it. A job that wrote nothing readable is a failed trial with the reason."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from specpilot_build.errors import SpecPilotError, debug_enabled
from specpilot_build.locations import conf_dir, data_dir

SPEC = "specpilot.tune_job/1"
RESULT = "specpilot.tune_job_result/1"
KINDS = ("trial", "leaders")


def digest(data: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


# --- the tune's side -------------------------------------------------------------------------------------------


def launch(launcher: str, batch_dir: Path, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run one job per spec through `launcher` (a Hydra multirun); returns each job's checked result, in order:
    {"ok", "objective", "attrs"} or, where the job wrote nothing readable, a failure with the reason."""
    import sys

    import hydra

    batch_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, spec in enumerate(specs):
        if spec.get("schema") != SPEC or spec.get("kind") not in KINDS:
            raise SpecPilotError(f"internal: not a tune job spec: {spec}")
        path = batch_dir / f"{i}.spec.json"
        path.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        path.with_name(f"{i}.result.json").unlink(missing_ok=True)
        paths.append(path)
    args = [
        "--multirun",
        "+tune_job.spec=" + ",".join(_quoted(str(p)) for p in paths),
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={batch_dir / 'hydra'}",
        f"hydra.run.dir={batch_dir / 'hydra'}",
        "hydra.job.chdir=false",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    main = hydra.main(config_path=str(conf_dir()), config_name=None, version_base="1.3")(run_job)
    saved = sys.argv
    sys.argv = ["specpilot-tune", *args]
    stopped = None
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            stopped = f"LAUNCHER={launcher}: the Hydra multirun stopped (exit status {exc.code}); its output is above"
    finally:
        sys.argv = saved
    results = [read_result(path) for path in paths]
    for result in results:
        if stopped and not result["ok"]:
            result["attrs"]["reason"] = f"{stopped}; {result['attrs'].get('reason')}"
    return results


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def read_result(spec_path: Path) -> dict[str, Any]:
    """The job's result for `spec_path`, checked; a failure naming why when it is missing or does not check."""
    result_path = spec_path.with_name(spec_path.name.replace(".spec.json", ".result.json"))
    try:
        raw = json.loads(result_path.read_text())
        return check_result(raw, file_sha256(spec_path))
    except FileNotFoundError:
        reason = f"the launched job wrote no result ({result_path}); see its log under {spec_path.parent / 'hydra'}"
    except (ValueError, SpecPilotError) as exc:
        reason = f"{result_path}: {' '.join(str(exc).split())}"
    return {"ok": False, "objective": None, "attrs": {"reason": reason}}


def check_result(raw: Any, spec_digest: str) -> dict[str, Any]:
    """A job's result as the tune may use it: the schema, the spec it answers, its own digest, the objective and
    verdict consistent with what it records, each results file's sha256 as recorded."""
    from specpilot_build.tune.trial import LOSSLESS

    if not isinstance(raw, dict) or raw.get("schema") != RESULT:
        raise SpecPilotError(f"not a tune job result (schema {raw.get('schema') if isinstance(raw, dict) else None})")
    body = {k: v for k, v in raw.items() if k != "digest"}
    if raw.get("digest") != digest(body):
        raise SpecPilotError("its digest does not match its content; the result was altered or cut short")
    if raw.get("spec_digest") != spec_digest:
        raise SpecPilotError("it answers another job spec than the one this tune wrote (a stale or foreign result)")
    ok, attrs, objective = raw.get("ok"), raw.get("attrs"), raw.get("objective")
    if not isinstance(ok, bool) or not isinstance(attrs, dict):
        raise SpecPilotError("its ok or attrs field has the wrong type")
    if raw.get("kind") == "leaders":
        record = attrs.get("record")
        if ok and not (isinstance(record, dict) and isinstance(record.get("trials"), dict)):
            raise SpecPilotError("a leaders result without its record")
        digests = (record or {}).get("results_digests") or {}
        runs = (record or {}).get("runs") or {}
    else:
        if ok:
            fs = attrs.get("final_stock")
            if not (isinstance(fs, dict) and isinstance(objective, (int, float)) and objective == fs["ci95"][0]):
                raise SpecPilotError("its objective is not the lower bound of the final/stock CI it records")
            if attrs.get("verdict") != LOSSLESS:
                raise SpecPilotError(f"it is marked ok, but verify says {attrs.get('verdict')}")
        elif not isinstance(attrs.get("reason"), str):
            raise SpecPilotError("a failed trial without its reason")
        digests = attrs.get("results_digests") or {}
        runs = attrs.get("runs") or {}
    for arm, path in runs.items():
        if file_sha256(Path(path)) != digests.get(arm):
            raise SpecPilotError(f"its {arm} results file {path} does not have the sha256 it records")
    return {"ok": ok, "objective": objective, "attrs": attrs}


# --- the job's side --------------------------------------------------------------------------------------------


def run_job(cfg) -> dict[str, Any]:
    """A Hydra job (the launcher may run it anywhere the data directory is shared): run the spec, write the result."""
    spec_path = Path(str(cfg.tune_job.spec))
    raw = spec_path.read_bytes()
    spec = json.loads(raw)
    if spec.get("schema") != SPEC or spec.get("kind") not in KINDS:
        raise SpecPilotError(f"{spec_path}: not a tune job spec")
    try:
        ok, objective, attrs = _run_trial(spec) if spec["kind"] == "trial" else _run_leaders(spec)
    except Exception as exc:  # recorded as the trial's reason: the tune reads it back wherever the job ran
        if debug_enabled():
            raise
        text = str(exc) if isinstance(exc, SpecPilotError) else f"{type(exc).__name__}: {exc}"
        ok, objective, attrs = False, None, {"reason": " ".join(text.split())[:600]}
    body = {
        "schema": RESULT,
        "kind": spec["kind"],
        "spec_digest": "sha256:" + hashlib.sha256(raw).hexdigest(),
        "ok": ok,
        "objective": objective,
        "attrs": attrs,
        "host": _host(),
        "pid": os.getpid(),
    }
    from specpilot_build.measure.results import write_json

    write_json(
        spec_path.with_name(spec_path.name.replace(".spec.json", ".result.json")), {**body, "digest": digest(body)}
    )
    return {"ok": ok, "objective": objective}


def _host() -> str:
    import socket

    return socket.gethostname()


def _served_baseline(setting: str):
    """Build ar and stock and serve each on a free port of this machine; returns (engines, ports, pids)."""
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.tune.ports import serve_free

    engines = {arm: build_engine(setting, arm).engine for arm in ("ar", "stock")}
    ports, pids = {}, {}
    for arm, engine in engines.items():
        ports[arm], pids[arm] = serve_free(engine.id)
    return engines, ports, pids


def _run_trial(spec: dict[str, Any]) -> tuple[bool, float | None, dict[str, Any]]:
    from specpilot_build.serve.process import stop
    from specpilot_build.tune.ports import free_port
    from specpilot_build.tune.trial import Slice, run_trial

    started = time.perf_counter()
    baseline, ports, pids = {}, {}, {}
    final_port = free_port()
    try:
        baseline, ports, pids = _served_baseline(spec["setting"])
        outcome = run_trial(
            setting=spec["setting"],
            mechanisms=spec["mechanisms"],
            values=spec["values"],
            baseline=baseline,
            ports={**ports, "final": final_port},
            pids=pids,
            slice_=Slice(**spec["slice"]),
            run_prefix=spec["run_prefix"],
            timeout_s=spec["timeout_s"],
        )
    finally:
        for arm in pids:
            stop(ports[arm])
    attrs = {
        **outcome.attrs,
        "ports": {**ports, "final": final_port},
        "job_seconds": round(time.perf_counter() - started, 1),
    }
    return outcome.ok, outcome.objective, attrs


def _run_leaders(spec: dict[str, Any]) -> tuple[bool, float | None, dict[str, Any]]:
    from specpilot_build.serve.process import stop
    from specpilot_build.tune.leaders import remeasure
    from specpilot_build.tune.trial import Slice

    ports, pids = {}, {}
    try:
        baseline, ports, pids = _served_baseline(spec["setting"])
        record = remeasure(
            setting=spec["setting"],
            leaders=spec["leaders"],
            baseline=baseline,
            ports=ports,
            pids=pids,
            slice_=Slice(**spec["slice"]),
            prefix=spec["run_prefix"],
        )
    finally:
        for arm in pids:
            stop(ports[arm])
    return True, None, {"record": record}


def batch_dir(study: str, label: str) -> Path:
    return data_dir() / "tune" / study / "launched" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
