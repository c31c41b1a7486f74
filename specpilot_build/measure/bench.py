"""Bench: the dev splits' first turns, greedy, through the server that serves exactly one engine id.

Prompts are rendered on the client (prompts.py) so every arm gets identical input ids. A request's budget is
`max_new_tokens`, cut so that prompt + output stays below the model's context (as SGLang cuts it; it also lets
verify force the whole output, since servers refuse inputs as long as the context). The cut is identical for
every arm and recorded per request; a prompt that leaves no room for one new token is skipped and listed (in
the results and on screen). A short warm-up pass (not counted) precedes the timed pass. Datasets run one after
another, each with the setting's concurrency, so each has its own wall time (the c16 throughput of that
dataset). One results JSON holds everything compare, score and verify need, and what binds it to its inputs:
the server's /server_info as served, the engine's manifest (whose blake3 digest is the engine id) and the
oracle's engine id and manifest (the setting's `ar` engine, built from the same pins when the run was benched).

Where the time goes: the reference runtime answers each request with `meta_info.timing_s`; SGLang does not, so a
c1 bench of an SGLang engine reads its /metrics before the first request and after each answer (outside the
timed wall) and keeps each request's counter differences as `sglang_metrics` (measure/sglang_metrics.py).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
import subprocess
import sys
import time

from specpilot_build.defaults import DEFAULT_PORT
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.measure import sglang_metrics
from specpilot_build.measure.datasets import BENCHMARKS, dataset_pin, load_split
from specpilot_build.measure.prompts import PromptRenderer, prompts_digest
from specpilot_build.measure.results import SCHEMA, manifest_record, results_path, write_json
from specpilot_build.models.checkpoints import model_dirs
from specpilot_build.serve import client
from specpilot_build.store.engines import Engine, resolve_engine

WARMUP_TOKENS = 32


def bench(
    engine_ref: Engine | str,
    name: str,
    limit: int | None = None,
    max_new_tokens: int = 2048,
    port: int = DEFAULT_PORT,
    datasets: list[str] | None = None,
    host: str = "127.0.0.1",
    overwrite: bool = False,
    progress: bool = True,
    oracle_engine_id: str | None = None,
    split: str = "dev",
):
    """Bench the engine served on host:port; returns the path of the results JSON.

    `oracle_engine_id`: the engine `verify` forces the run's tokens through, the setting's `ar` engine (the
    caller builds or finds it: measure/ builds nothing); an ar engine is its own oracle. `split`: the datasets'
    split benched (datasets.SPLITS; `tune` only for a search), recorded in the results."""
    engine = resolve_engine(engine_ref) if isinstance(engine_ref, str) else engine_ref
    if oracle_engine_id is None:
        if engine.manifest.get("arm") != "ar":
            raise SpecPilotError(
                f"bench of the {engine.manifest.get('arm')} engine {engine.id[:12]} needs the "
                "oracle's engine id (the setting's ar engine) to record"
            )
        oracle_engine_id = engine.id
    oracle = engine if oracle_engine_id == engine.id else resolve_engine(oracle_engine_id)
    if oracle.id != oracle_engine_id:
        raise SpecPilotError(f"oracle engine {oracle_engine_id} is not in the store (found {oracle.id[:12]})")
    for checked in (engine, oracle):  # both manifests hash to their ids before anything is sent
        manifest_record(checked)
    out = results_path(name)
    if out.exists() and not overwrite:
        raise SpecPilotError(f"{out} exists; choose another NAME or remove it")
    url = f"http://{host}:{port}"
    info = client.server_info(url)
    served = client.served_engine_id(info)
    if served != engine.id:
        raise SpecPilotError(
            f"the server on port {port} serves engine {served or '(unnamed)'}, not "
            f"{engine.id[:16]}; run `make serve ENGINE={engine.id[:16]} PORT={port}` first"
        )
    config = engine.config
    concurrency = int(config["batching"]["concurrency"])
    names = list(datasets or config.get("datasets") or BENCHMARKS)
    renderer = PromptRenderer(
        model_dirs(engine.manifest["inputs"]["checkpoints"], config)["model"], config["model"].get("chat_template")
    )
    context = config["model"].get("context_length") or renderer.context_length
    plan, skipped = plan_requests(renderer, names, limit, max_new_tokens, context, split)
    for entry in (e for entries in skipped.values() for e in entries):
        print(f"skipped {entry['dataset']} item {entry['item_id']}: {entry['reason']}", file=sys.stderr)
    if not any(plan.values()):
        raise SpecPilotError(f"no prompt fits the model's context of {context} tokens; nothing to bench")

    date = dt.datetime.now(dt.UTC)
    warmup = _warm_up(url, plan, concurrency)
    probes = metrics_probes(url, engine.config, concurrency)
    requests, per_dataset, totals = [], {}, {"wall_s": 0.0, "client_gap_s": 0.0, "client_cpu_s": 0.0}
    with client.progress_bar(progress, sum(len(v) for v in plan.values())) as advance:
        for dataset, entries in plan.items():
            if not entries:
                continue
            bodies = [generate_body(e["prompt_ids"], e["max_new_tokens"]) for e in entries]
            done = client.post_all(url, bodies, concurrency, on_answer=advance, probe=probes and probes())
            for entry, answer in zip(entries, done.answers):
                requests.append(request_record(entry, answer))
            if done.probes is not None:
                attach_metrics(requests[-len(entries) :], done.probes, url)
            per_dataset[dataset] = {
                "requests": len(entries),
                "wall_s": done.wall_s,
                "completion_tokens": sum(r["completion_tokens"] for r in requests if r["dataset"] == dataset),
                "client_gap_s": done.client_gap_s,
            }
            totals["wall_s"] += done.wall_s
            totals["client_gap_s"] += done.client_gap_s
            totals["client_cpu_s"] += done.client_cpu_s

    results = results_record(
        engine,
        oracle,
        info,
        name=name,
        renderer=renderer,
        context=context,
        names=names,
        plan=plan,
        skipped=skipped,
        limit=limit,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        date=date,
        warmup=warmup,
        requests=requests,
        per_dataset=per_dataset,
        wall_s=totals["wall_s"],
        gap_s=totals["client_gap_s"],
        client_cpu_s=totals["client_cpu_s"],
        split=split,
    )
    return write_json(out, results)


def results_record(
    engine: Engine,
    oracle: Engine,
    info: dict,
    *,
    name: str,
    renderer: PromptRenderer,
    context: int | None,
    names: list[str],
    plan: dict,
    skipped: dict,
    limit: int | None,
    max_new_tokens: int,
    concurrency: int,
    date: dt.datetime,
    warmup: dict,
    requests: list[dict],
    per_dataset: dict,
    wall_s: float,
    gap_s: float,
    client_cpu_s: float,
    split: str = "dev",
) -> dict:
    """One bench run's results: bound to the engine's and the oracle's manifests and to what the server
    reported, with every request (bench and the side-by-side bench write the same record)."""
    engine_record, oracle_record = manifest_record(engine), manifest_record(oracle)
    config = engine.config
    slots = max(1, concurrency)
    return {
        "schema": SCHEMA,
        "name": name,
        "engine_id": engine.id,
        "manifest_digest": engine_record["digest"],
        "engine_manifest": engine_record["manifest"],
        "oracle_engine_id": oracle.id,
        "oracle": {
            "engine_id": oracle.id,
            "manifest_digest": oracle_record["digest"],
            "manifest": oracle_record["manifest"],
        },
        "served": {
            "engine_id": client.served_engine_id(info),
            "runtime": info.get("runtime"),
            "version": info.get("version"),
        },
        "setting": config.get("setting"),
        "arm": config["arm"]["name"],
        "hardware": config.get("hardware"),
        "model": {k: config["model"].get(k) for k in ("name", "repo", "dtype", "quantization")},
        "target_pin": dict(engine.model_pin),
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "context_length": context,
        "chat_template": renderer.uses_chat_template,
        "date_utc": date.isoformat(timespec="seconds"),
        "versions": _versions(info),
        "machine": {"host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "server_info": info,
        "datasets": {
            d: {
                "split": split,
                "limit": limit,
                "requests": len(plan[d]),
                "sha256": dataset_pin(d)["sha256"],
                "skipped_too_long": [e["item_id"] for e in skipped[d]],
            }
            for d in names
        },
        "skipped": [e for d in names for e in skipped[d]],
        "prompts_digest": prompts_digest(requests),
        "warmup": warmup,
        "wall_s": wall_s,
        "per_dataset": per_dataset,
        "client": {
            "gap_s": gap_s,
            "cpu_s": client_cpu_s,
            "overhead_fraction": gap_s / (slots * wall_s) if wall_s else 0.0,
            "cpu_fraction": client_cpu_s / wall_s if wall_s else 0.0,
        },
        "requests": requests,
    }


def plan_requests(
    renderer: PromptRenderer,
    names: list[str],
    limit: int | None,
    max_new_tokens: int,
    context: int | None,
    split: str = "dev",
) -> tuple[dict, dict]:
    plan: dict[str, list[dict]] = {}
    skipped: dict[str, list[dict]] = {}
    for dataset in names:
        plan[dataset], skipped[dataset] = [], []
        for item in load_split(dataset, limit, split):
            prompt = renderer.prompt(dataset, item.id, item.prompt)
            budget = max_new_tokens if context is None else min(max_new_tokens, context - 1 - len(prompt.ids))
            if budget < 1:
                skipped[dataset].append(
                    {
                        "dataset": dataset,
                        "item_id": item.id,
                        "prompt_tokens": len(prompt.ids),
                        "reason": f"too long for the context: {len(prompt.ids)} prompt tokens "
                        f"leave no room for a new token in {context}",
                    }
                )
                continue
            plan[dataset].append(
                {
                    "dataset": dataset,
                    "item_id": item.id,
                    "prompt_digest": prompt.digest,
                    "prompt_ids": prompt.ids,
                    "max_new_tokens": budget,
                }
            )
    return plan, skipped


def generate_body(prompt_ids: list[int], max_new_tokens: int) -> dict:
    return {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}


def request_record(entry: dict, answer: client.Answer) -> dict:
    meta = answer.body.get("meta_info", {})
    output_ids = list(answer.body.get("output_ids") or [])
    completion = int(meta.get("completion_tokens", len(output_ids)))
    return {
        **entry,
        "output_ids": output_ids,
        "output_text": answer.body.get("text", ""),
        "prompt_tokens": int(meta.get("prompt_tokens", len(entry["prompt_ids"]))),
        "completion_tokens": completion,
        "latency_s": answer.latency,
        "accept_length": accept_length(meta, completion),
        "finish_reason": finish_reason(meta),
        "timing_s": timing(meta),
    }


def timing(meta: dict) -> dict[str, float] | None:
    """The server's wall time per part of the request (the reference runtime's meta_info.timing_s), if any."""
    parts = meta.get("timing_s")
    if not isinstance(parts, dict) or not all(isinstance(v, (int, float)) for v in parts.values()):
        return None
    return {str(k): float(v) for k, v in parts.items()}


def accept_length(meta: dict, completion_tokens: int) -> float | None:
    """Mean tokens committed per target forward: the server's own figure, else tokens / verify passes."""
    passes = meta.get("spec_verify_ct")
    if passes == 0:  # no speculative step ran (an ar engine)
        return None
    if isinstance(meta.get("spec_accept_length"), (int, float)):
        return float(meta["spec_accept_length"])
    if isinstance(passes, int) and passes > 0:
        return completion_tokens / passes
    return None


def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def metrics_probes(url: str, config: dict, concurrency: int, settle_s: float = 1.0):
    """Makes, per pass, a read of an SGLang engine's /metrics for a c1 bench (None for the reference runtime,
    whose answers carry their timing, and above c1). After an answer it reads again until SGLang has counted
    that request finished (it counts it just after answering). A server without the metrics is benched all the
    same, with a note."""
    if config["runtime"]["name"] == "reference" or concurrency != 1:
        return None
    try:
        sglang_metrics.scrape(url)
    except SpecPilotError as exc:
        print(f"note: no per-part timing recorded, `make gaps` will refuse this run: {exc}", file=sys.stderr)
        return None

    def new_probe():
        finished: list[float] = []  # the finished-requests counter at each read

        def probe() -> dict[str, float]:
            snapshot, deadline = sglang_metrics.scrape(url), time.perf_counter() + settle_s
            while finished and snapshot[sglang_metrics.REQUESTS] <= finished[-1] and time.perf_counter() < deadline:
                time.sleep(0.002)
                snapshot = sglang_metrics.scrape(url)
            finished.append(snapshot[sglang_metrics.REQUESTS])
            return snapshot

        return probe

    return new_probe


def attach_metrics(records: list[dict], probes: list[dict[str, float]], url: str) -> None:
    """Each request's SGLang counter differences (the reads before and after it) as its `sglang_metrics`."""
    for index, record in enumerate(records):
        where = f"{url}/metrics around {record['dataset']} item {record['item_id']}"
        record["sglang_metrics"] = sglang_metrics.difference(probes[index], probes[index + 1], where)


def _warm_up(url: str, plan: dict, concurrency: int) -> dict:
    entries = [e for entries in plan.values() for e in entries][: max(1, concurrency)]
    bodies = [generate_body(e["prompt_ids"], min(WARMUP_TOKENS, e["max_new_tokens"])) for e in entries]
    done = client.post_all(url, bodies, concurrency)
    return {"requests": len(bodies), "max_new_tokens": WARMUP_TOKENS, "wall_s": done.wall_s}


def _versions(info: dict) -> dict:
    versions = {"python": sys.version.split()[0], "server": info.get("version")}
    for package in ("specpilot", "httpx", "transformers", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        git = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if git.returncode == 0:
            versions["specpilot_git"] = git.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return versions
