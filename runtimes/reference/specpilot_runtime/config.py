"""The engine's resolved config (`<engine>/config.json`), read and checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARMS = ("ar", "stock", "final")
DTYPES = ("float32", "bfloat16", "float16")
ALGORITHMS = ("none", "ngram", "draft_model", "eagle3")
FALLBACKS = ("eagle3",)  # drafters the ngram drafter may hand a step to when it has no proposal
MAX_TREE_BREADTH = 8  # tree.py keeps this many continuations per n-gram

# Mechanisms a `final` arm may switch on, with their value types.
RUNTIME_OPTIONS = {
    "shared_ngram_cache": bool,  # one n-gram index over all earlier prompts and outputs
    "ngram_cache_capacity": int,  # tokens the shared index keeps before it starts afresh
    "num_threads": int,  # torch CPU threads (the default is 1 for tiny models)
    "w12_dense_fallback": bool,  # W12 weights keep their bf16 copy where cuBLAS beats the fused GEMM (memory
    # for speed: +2 bytes per such weight)
}


class RuntimeConfigError(Exception):
    """A problem with the engine's config or the launch arguments; printed as one line, no traceback."""


@dataclass(frozen=True)
class DrafterConfig:
    algorithm: str = "none"
    num_draft_tokens: int = 0
    ngram_max_n: int = 4
    ngram_min_n: int = 1
    tree_breadth: int = 1  # > 1: the n-gram drafters propose trees of this breadth (tree.py)
    fallback: str | None = None  # eagle3: the head drafts the steps where the n-grams propose nothing
    fallback_num_draft_tokens: int = 0  # the fallback's own k (default: num_draft_tokens)

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens one step may propose (what a verify forward must fit)."""
        return max(self.num_draft_tokens, self.fallback_num_draft_tokens)


@dataclass(frozen=True)
class EngineConfig:
    setting: str
    arm: str
    model_name: str
    dtype: str
    quantization: str | None
    device: str
    drafter: DrafterConfig
    runtime_options: dict = field(default_factory=dict)
    concurrency: int = 1
    max_running_requests: int = 1


def load_engine_config(engine_dir: str | Path) -> EngineConfig:
    path = Path(engine_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeConfigError(f"{path}: missing; is {engine_dir} an engine directory?") from None
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"{path}: not valid JSON ({exc})") from None
    return parse_engine_config(raw, str(path))


def parse_engine_config(raw: dict, where: str = "config.json") -> EngineConfig:
    def get(*keys, default=KeyError):
        node = raw
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                if default is KeyError:
                    raise RuntimeConfigError(f"{where}: missing key {'.'.join(keys)}")
                return default
            node = node[key]
        return node

    def choice(value, allowed, key):
        if value not in allowed:
            raise RuntimeConfigError(f"{where}: {key} is {value!r}; expected one of {', '.join(allowed)}")
        return value

    def positive_int(value, key, minimum=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise RuntimeConfigError(f"{where}: {key} is {value!r}; expected an integer >= {minimum}")
        return value

    arm = choice(get("arm", "name"), ARMS, "arm.name")
    algorithm = choice(get("drafter", "algorithm", default="none"), ALGORITHMS, "drafter.algorithm")
    drafter = DrafterConfig(algorithm=algorithm)
    if algorithm != "none":
        max_n = positive_int(get("drafter", "ngram_max_n", default=4), "drafter.ngram_max_n")
        min_n = positive_int(get("drafter", "ngram_min_n", default=1), "drafter.ngram_min_n")
        if min_n > max_n:
            raise RuntimeConfigError(f"{where}: drafter.ngram_min_n {min_n} > drafter.ngram_max_n {max_n}")
        breadth = get("drafter", "tree_breadth", default=None)
        breadth = 1 if breadth is None else positive_int(breadth, "drafter.tree_breadth")
        if breadth > MAX_TREE_BREADTH:
            raise RuntimeConfigError(f"{where}: drafter.tree_breadth is {breadth}; expected at most {MAX_TREE_BREADTH}")
        if breadth > 1 and algorithm != "ngram":
            raise RuntimeConfigError(f"{where}: drafter.tree_breadth {breadth} needs drafter.algorithm ngram")
        k = positive_int(get("drafter", "num_draft_tokens"), "drafter.num_draft_tokens")
        fallback = get("drafter", "fallback", default=None)
        fallback_k = get("drafter", "fallback_num_draft_tokens", default=None)
        if fallback is not None:
            choice(fallback, FALLBACKS, "drafter.fallback")
            if algorithm != "ngram" or breadth > 1:
                raise RuntimeConfigError(
                    f"{where}: drafter.fallback {fallback} needs drafter.algorithm ngram drafting chains "
                    f"(it is {algorithm}, tree_breadth {breadth})"
                )
            fallback_k = k if fallback_k is None else positive_int(fallback_k, "drafter.fallback_num_draft_tokens")
        elif fallback_k is not None:
            raise RuntimeConfigError(
                f"{where}: drafter.fallback_num_draft_tokens does nothing without drafter.fallback"
            )
        drafter = DrafterConfig(
            algorithm=algorithm,
            num_draft_tokens=k,
            ngram_max_n=max_n,
            ngram_min_n=min_n,
            tree_breadth=breadth,
            fallback=fallback,
            fallback_num_draft_tokens=fallback_k or 0,
        )
    options = get("runtime_options", default={}) or {}
    if not isinstance(options, dict):
        raise RuntimeConfigError(f"{where}: runtime_options must be a mapping, got {options!r}")
    for name, value in options.items():
        if name not in RUNTIME_OPTIONS:
            raise RuntimeConfigError(
                f"{where}: runtime_options.{name} is not a mechanism of the reference runtime "
                f"(known: {', '.join(sorted(RUNTIME_OPTIONS))})"
            )
        expected = RUNTIME_OPTIONS[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise RuntimeConfigError(f"{where}: runtime_options.{name} is {value!r}; expected {expected.__name__}")
    if options.get("shared_ngram_cache") and algorithm != "ngram":
        raise RuntimeConfigError(f"{where}: runtime_options.shared_ngram_cache needs drafter.algorithm ngram")
    quantization = get("model", "quantization", default=None)
    if quantization not in (None, "w12"):
        raise RuntimeConfigError(f"{where}: model.quantization {quantization!r} is not supported (null or w12)")
    dtype = choice(get("model", "dtype", default="float32"), DTYPES, "model.dtype")
    if quantization == "w12" and dtype != "bfloat16":
        raise RuntimeConfigError(f"{where}: model.quantization w12 stores bf16 weights; model.dtype is {dtype!r}")
    if options.get("w12_dense_fallback") and quantization != "w12":
        raise RuntimeConfigError(
            f"{where}: runtime_options.w12_dense_fallback needs model.quantization w12 (it is {quantization!r})"
        )
    return EngineConfig(
        setting=str(get("setting")),
        arm=arm,
        model_name=str(get("model", "name")),
        dtype=dtype,
        quantization=quantization,
        device=choice(get("hardware", "device", default="cpu"), ("cpu", "cuda"), "hardware.device"),
        drafter=drafter,
        runtime_options=dict(options),
        concurrency=positive_int(get("batching", "concurrency", default=1), "batching.concurrency"),
        max_running_requests=positive_int(
            get("batching", "max_running_requests", default=1), "batching.max_running_requests"
        ),
    )
