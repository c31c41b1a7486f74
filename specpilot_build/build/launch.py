"""The launch spec of an engine: the argv and environment serve runs, with placeholders serve fills in.

Placeholders: {python} {engine} {engine_id} {model} {draft_model} {host} {port}."""
from __future__ import annotations

REFERENCE_MODULE = "specpilot_runtime.server"


def launch_spec(cfg: dict) -> dict:
    if cfg["runtime"]["name"] == "reference":
        return _reference(cfg)
    return _sglang(cfg)


def _reference(cfg: dict) -> dict:
    argv = ["{python}", "-m", REFERENCE_MODULE, "--engine", "{engine}", "--engine-id", "{engine_id}",
            "--model", "{model}", "--host", "{host}", "--port", "{port}"]
    if cfg["drafter"].get("repo"):
        argv += ["--draft-model", "{draft_model}"]
    env = {"PYTHONPATH": "{engine}/runtime:{engine}/kernels", "PYTHONDONTWRITEBYTECODE": "1"}
    return {"runtime": "reference", "argv": argv, "env": env}


def sglang_args(cfg: dict) -> list[str]:
    """SGLang server arguments (without model path, host and port). Stock arms keep SGLang's defaults
    (max running requests, CUDA-graph sizes, block sizes); `final` mechanisms add tuned values."""
    model, drafter = cfg["model"], cfg["drafter"]
    args: dict = {"dtype": model["dtype"]}
    if model.get("quantization"):
        args["quantization"] = model["quantization"]
    if drafter["algorithm"] != "none":
        args["speculative-algorithm"] = drafter["algorithm"]
        if drafter.get("repo"):
            args["speculative-draft-model-path"] = "{draft_model}"
        for key, flag in (("num_steps", "speculative-num-steps"), ("eagle_topk", "speculative-eagle-topk"),
                          ("num_draft_tokens", "speculative-num-draft-tokens")):
            if drafter.get(key) is not None:
                args[flag] = drafter[key]
    args.update(cfg["runtime"].get("launch_args", {}))
    argv: list[str] = []
    for flag, value in args.items():
        if value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [f"--{flag}", *map(str, value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def _sglang(cfg: dict) -> dict:
    argv = ["{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}",
            "--port", "{port}", *sglang_args(cfg)]
    env = {"PYTHONPATH": "{engine}/python:{engine}/kernels", "PYTHONDONTWRITEBYTECODE": "1", "SPECPILOT_ENGINE_ID": "{engine_id}"}
    return {"runtime": "sglang", "argv": argv, "env": env}
