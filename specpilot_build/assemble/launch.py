"""The launch spec of an engine: the argv and environment serve runs, with placeholders serve fills in.

Placeholders: {python} {engine} {engine_id} {model} {draft_model} {host} {port}."""

from __future__ import annotations

from specpilot_build.assemble.corpus import external_corpus_path
from specpilot_build.config.effective import CORPUS_PATH_FLAG
from specpilot_build.models.synthetic import is_synthetic

REFERENCE_MODULE = "specpilot_runtime.server"
DRAFTER_FLAGS = {
    "num_steps": "speculative-num-steps",
    "eagle_topk": "speculative-eagle-topk",
    "num_draft_tokens": "speculative-num-draft-tokens",
}


def launch_spec(cfg: dict) -> dict:
    if cfg["runtime"]["name"] == "reference":
        return _reference(cfg)
    return _sglang(cfg)


def _reference(cfg: dict) -> dict:
    argv = [
        "{python}",
        "-m",
        REFERENCE_MODULE,
        "--engine",
        "{engine}",
        "--engine-id",
        "{engine_id}",
        "--model",
        "{model}",
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    if cfg["drafter"].get("repo") or cfg["drafter"].get("recipe"):
        argv += ["--draft-model", "{draft_model}"]
    env = {"PYTHONPATH": "{engine}/runtime:{engine}/kernels", "PYTHONDONTWRITEBYTECODE": "1"}
    return {"runtime": "reference", "argv": argv, "env": env}


def sglang_flags(cfg: dict) -> dict:
    """SGLang server arguments (flag without `--` → value; without model path, host and port). Stock arms keep
    SGLang's defaults (max running requests, CUDA-graph sizes, block sizes); `final` mechanisms add tuned values."""
    model, drafter = cfg["model"], cfg["drafter"]
    # SGLang's Prometheus counters: where a c1 bench reads each request's time by part (measure/sglang_metrics.py);
    # they change no token, and being in the launch spec they are part of the engine id that serve runs exactly
    args: dict = {"enable-metrics": True, "dtype": model["dtype"]}
    if is_synthetic(model["repo"]):  # a config without weights (models/synthetic.py): SGLang's seeded dummy weights
        args["load-format"] = "dummy"
    if model.get("quantization"):
        args["quantization"] = model["quantization"]
    if drafter["algorithm"] != "none":
        args["speculative-algorithm"] = drafter["algorithm"]
        corpus = external_corpus_path(cfg)
        if corpus is not None:  # NGRAM's external corpus: the JSONL the build wrote into the tree
            args[CORPUS_PATH_FLAG] = "{engine}/" + corpus
        elif drafter.get("repo") or drafter.get("recipe"):
            args["speculative-draft-model-path"] = "{draft_model}"
            if drafter.get("repo") and is_synthetic(drafter["repo"]):
                args["speculative-draft-load-format"] = "dummy"
        for key, flag in DRAFTER_FLAGS.items():
            if drafter.get(key) is not None:
                args[flag] = drafter[key]
    args.update(cfg["runtime"].get("launch_args", {}))
    return args


def sglang_args(cfg: dict) -> list[str]:
    argv: list[str] = []
    for flag, value in sglang_flags(cfg).items():
        if value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [f"--{flag}", *map(str, value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def flag_origins(cfg: dict, composed_final: dict | None) -> dict[str, str]:
    """Where each SGLang flag of `sglang_flags(cfg)` was set: a config field or a final-arm mechanism."""
    where = {
        "enable-metrics": "every SGLang engine (assemble/launch.py: the counters gaps reads)",
        "dtype": "model.dtype",
        "quantization": "model.quantization",
        "speculative-algorithm": "drafter.algorithm",
        "speculative-draft-model-path": "drafter.repo",
        "load-format": "model.repo (synthetic)",
        "speculative-draft-load-format": "drafter.repo (synthetic)",
        CORPUS_PATH_FLAG: "drafter.recipe (a corpus drafter: the JSONL the build writes into the tree)",
    }
    where.update({flag: f"drafter.{key}" for key, flag in DRAFTER_FLAGS.items()})
    for name, body in ((composed_final or {}).get("mechanisms") or {}).items():
        for flag in (body or {}).get("launch_args") or {}:
            where[flag] = f"mechanism '{name}' (final.mechanisms.{name}.launch_args)"
        if ((body or {}).get("model") or {}).get("quantization"):
            where["quantization"] = f"mechanism '{name}' (final.mechanisms.{name}.model.quantization)"
    return where


def _sglang(cfg: dict) -> dict:
    argv = [
        "{python}",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "{model}",
        "--host",
        "{host}",
        "--port",
        "{port}",
        *sglang_args(cfg),
    ]
    env = {
        "PYTHONPATH": "{engine}/python:{engine}/kernels",
        "PYTHONDONTWRITEBYTECODE": "1",
        "SPECPILOT_ENGINE_ID": "{engine_id}",
        # the device timer behind sglang:forward_execution_seconds_total{category} (target and draft runners)
        "SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1",
    }
    return {"runtime": "sglang", "argv": argv, "env": env}
