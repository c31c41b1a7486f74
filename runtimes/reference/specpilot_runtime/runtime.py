"""Start-up: read the engine config, load target (and draft) model and tokenizer, start the engine.

Last, everything start-up made is frozen out of the garbage collector (gc.freeze): torch, transformers and
the server leave some 415,000 tracked objects, and every full collection walked them all, about 160 ms of CPU
on the 2-core VM, at a moment decided by allocation counts: a request that happened to trigger one (the
final arm's n-gram cache allocates many small tuples, so there more often) paid 30 times its own CPU time.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .config import EngineConfig, RuntimeConfigError, load_engine_config
from .corpus import read_corpus
from .drafters import make_drafter
from .eagle3 import Eagle3Head
from .engine import Engine
from .model import LeanLlama, load_hf_model
from .protocol import ModelLimits

DRAFT_VOCAB = "draft_vocab.safetensors"  # a drafter's reduced head: the target ids it scores (draft_to_target)
# For a model this small, one thread beats several (measured in benchmarks/reference_runtime.md).
SMALL_MODEL_HIDDEN_SIZE = 1024


@dataclass
class Runtime:
    config: EngineConfig
    engine_id: str
    model_path: str
    draft_model_path: str | None
    device: str
    tokenizer: object
    engine: Engine
    limits: ModelLimits
    num_threads: int

    def metrics(self) -> str:
        """Prometheus text exposition in the names SGLang's --enable-metrics uses where one exists (sglang:...),
        plus the engine's wall time per part of a step (specpilot:engine_seconds_total{part=...})."""
        engine = self.engine
        label = 'model_name="' + self.config.model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
        rows = [
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", engine.prompt_tokens),
            (
                "sglang:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                engine.generated_tokens,
            ),
            ("sglang:num_requests_total", "counter", "Number of requests finished.", engine.finished_requests),
            ("sglang:num_running_reqs", "gauge", "The number of running requests.", len(engine.running)),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", engine.waiting.qsize()),
            (
                "sglang:spec_accept_length",
                "gauge",
                "The average acceptance length of speculative decoding.",
                engine.avg_accept_length,
            ),
            (
                "sglang:spec_verify_ct_total",
                "counter",
                "Target forwards of decode steps (per sequence).",
                engine.verify_steps,
            ),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {float(value)!r}"]
        name = "specpilot:engine_seconds_total"
        lines += [f"# HELP {name} Engine-thread wall time per part of the work.", f"# TYPE {name} counter"]
        lines += [f'{name}{{{label},part="{part}"}} {float(v)!r}' for part, v in engine.seconds.items()]
        return "\n".join(lines) + "\n"

    def server_info(self) -> dict:
        engine, cfg = self.engine, self.config
        avg = engine.avg_accept_length
        return {
            "engine_id": self.engine_id,
            "setting": cfg.setting,
            "arm": cfg.arm,
            "runtime": "specpilot-reference",
            "version": __version__,
            "model_path": self.model_path,
            "served_model_name": cfg.model_name,
            "draft_model_path": self.draft_model_path,
            "dtype": cfg.dtype,
            "quantization": cfg.quantization,
            "device": self.device,
            "num_threads": self.num_threads,
            # float32 on CPU: rowgemm, or MKL with padded rows where rowgemm could not be built (model.py)
            "cpu_products": ("rowgemm" if engine.model.rowgemm else "torch") if self.device == "cpu" else None,
            "context_length": self.limits.context_length,
            "speculative_algorithm": cfg.drafter.algorithm,
            "speculative_num_draft_tokens": cfg.drafter.num_draft_tokens,
            "ngram_max_n": cfg.drafter.ngram_max_n,
            "ngram_min_n": cfg.drafter.ngram_min_n,
            "tree_breadth": cfg.drafter.tree_breadth,
            "drafter_fallback": cfg.drafter.fallback,
            # tokens of the corpus drafter that seeded the shared n-gram cache (0: none)
            "ngram_seed_tokens": getattr(getattr(engine.drafter, "index", None), "seed_tokens", 0),
            "fallback_num_draft_tokens": cfg.drafter.fallback_num_draft_tokens or None,
            # hybrid drafter: steps the n-grams drafted, the fallback drafted, neither proposed anything
            "drafted_steps": getattr(engine.drafter, "steps", None),
            "runtime_options": cfg.runtime_options,
            "concurrency": cfg.concurrency,
            "max_running_requests": cfg.max_running_requests,
            "avg_spec_accept_length": avg,
            "spec_verify_ct": engine.verify_steps,
            "spec_decode_tokens": engine.decode_tokens,
            "spec_draft_token_num": engine.draft_tokens,
            "spec_accept_token_num": engine.accepted_tokens,
            "finished_requests": engine.finished_requests,
            "w12_tables": _w12_tables(),
            "w12_layers": engine.model.w12_layers,  # the engine's W12 plan and how many layers it stored each way
            "internal_states": [{"avg_spec_accept_length": avg}],
        }

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.config.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "context_length": self.limits.context_length,
            "vocab_size": self.limits.vocab_size,
            "dtype": self.config.dtype,
        }


def load_runtime(engine_dir: str, engine_id: str, model: str, draft_model: str | None, device: str | None) -> Runtime:
    config = load_engine_config(engine_dir)
    device = device or ("cuda:0" if config.device == "cuda" else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeConfigError(f"--device {device}: no CUDA device is visible to torch {torch.__version__}")
    num_threads = _set_threads(config, model, device)
    hf_model = _load_checked(model, config.dtype, device, "--model")
    dense_fallback = bool(config.runtime_options.get("w12_dense_fallback"))
    if config.quantization == "w12":
        _check_w12(dense_fallback)
    tokenizer = _load_tokenizer(model)
    k = config.drafter.max_draft_tokens
    slots = config.max_running_requests
    target = LeanLlama(
        hf_model,
        num_slots=slots,
        max_tokens_per_step=k + 1,
        device=device,
        w12=config.quantization == "w12",
        dense_fallback=dense_fallback,
    )
    draft = draft_to_target = None
    if config.drafter.algorithm == "draft_model":
        if not draft_model:
            raise RuntimeConfigError("drafter.algorithm is draft_model: pass --draft-model <hf_model_dir>")
        draft_hf = _load_checked(draft_model, config.dtype, device, "--draft-model")
        if draft_hf.config.vocab_size != hf_model.config.vocab_size:
            raise RuntimeConfigError(
                f"--draft-model {draft_model}: vocabulary {draft_hf.config.vocab_size} "
                f"differs from the target's {hf_model.config.vocab_size}"
            )
        _check_same_tokenizer(draft_model, tokenizer)
        draft = LeanLlama(draft_hf, num_slots=slots, max_tokens_per_step=k + 1, device=device)
        draft_to_target = _draft_vocab(draft_model, hf_model.config.vocab_size)
    if "eagle3" in (config.drafter.algorithm, config.drafter.fallback):
        if not draft_model:
            raise RuntimeConfigError("the drafter runs an EAGLE-3 head: pass --draft-model <EAGLE-3 head directory>")
        _check_same_tokenizer(draft_model, tokenizer)
        draft = Eagle3Head(draft_model, target, slots)
        target.capture = draft.aux_layers  # the target keeps those layers' outputs only now
    corpus = None
    if config.drafter.algorithm == "ngram" and config.drafter.fallback is None and draft_model:
        corpus = _corpus(config, draft_model, tokenizer, hf_model.config.vocab_size)
    drafter = make_drafter(config.drafter, config.runtime_options, draft, draft_to_target)
    if corpus is not None:
        drafter.index.seed(corpus)  # before the first request (the engine starts below)
    limits = ModelLimits(
        vocab_size=target.shape.vocab_size,
        context_length=target.shape.context_length,
        eos_token_ids=_eos_ids(model, tokenizer),
    )
    engine = Engine(target, tokenizer, drafter, k, config.max_running_requests)
    _warm_up(target)
    gc.collect()
    gc.freeze()  # start-up's objects stay; full collections no longer walk them (see the module docstring)
    engine.start()
    return Runtime(config, engine_id, str(model), draft_model, device, tokenizer, engine, limits, num_threads)


def _corpus(config: EngineConfig, draft_model: str, tokenizer, vocab_size: int) -> list[list[int]]:
    """A corpus drafter's rows for the shared n-gram cache (the ngram drafter's --draft-model)."""
    if not config.runtime_options.get("shared_ngram_cache") or config.drafter.tree_breadth > 1:
        raise RuntimeConfigError(
            f"--draft-model {draft_model}: a corpus seeds the shared n-gram cache of the chain drafter; "
            "runtime_options.shared_ngram_cache is off or drafter.tree_breadth > 1"
        )
    _check_same_tokenizer(draft_model, tokenizer)
    return read_corpus(draft_model, vocab_size)


def _set_threads(config: EngineConfig, model: str, device: str) -> int:
    threads = config.runtime_options.get("num_threads") or int(os.environ.get("SPECPILOT_THREADS", "0"))
    if not threads and device == "cpu":
        hidden = _read_json(Path(model) / "config.json", "--model").get("hidden_size", 0)
        threads = 1 if hidden <= SMALL_MODEL_HIDDEN_SIZE else torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _load_checked(model_dir: str, dtype: str, device: str, flag: str):
    config = _read_json(Path(model_dir) / "config.json", flag)
    if config.get("model_type") != "llama":
        raise RuntimeConfigError(
            f"{flag} {model_dir}: model_type {config.get('model_type')!r}; the reference "
            "runtime serves Llama-architecture checkpoints only"
        )
    _check_vocab_shapes(Path(model_dir), config, flag)
    return load_hf_model(model_dir, dtype, device)


def _check_vocab_shapes(model_dir: Path, config: dict, flag: str) -> None:
    """The embedding and head in the weights have the rows and width config.json says (transformers would stop
    with a traceback); read from the safetensors headers, no tensor loaded."""
    from safetensors import safe_open

    expected = [config.get("vocab_size"), config.get("hidden_size")]
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in weights.keys():
                    shape = list(weights.get_slice(name).get_shape())
                    if shape != expected:
                        raise RuntimeConfigError(
                            f"{flag} {model_dir}: {path.name} holds {name} of shape {shape}, but config.json "
                            f"says vocab_size {expected[0]}, hidden_size {expected[1]}"
                        )


def _read_json(path: Path, flag: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeConfigError(f"{flag}: {path} is missing; expected a Hugging Face model directory") from None
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"{flag}: {path} is not valid JSON ({exc})") from None


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _check_same_tokenizer(draft_model: str, tokenizer) -> None:
    """A drafter's proposals are target token ids: its tokenizer must map every token as the target's does."""
    draft_tokenizer = _load_tokenizer(draft_model)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise RuntimeConfigError(f"--draft-model {draft_model}: its tokenizer's vocabulary differs from the target's")


def _draft_vocab(draft_model: str, vocab_size: int) -> torch.Tensor | None:
    """draft_to_target of a drafter with a reduced head (draft_vocab.safetensors): sorted, unique int64 target ids."""
    path = Path(draft_model) / DRAFT_VOCAB
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        ids = load_file(str(path))["draft_to_target"]
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types for a damaged file)
        raise RuntimeConfigError(f"{path}: no readable draft_to_target tensor ({type(exc).__name__})") from None
    if not (
        ids.dtype == torch.int64
        and ids.dim() == 1
        and len(ids) > 0
        and bool((ids[1:] > ids[:-1]).all())
        and 0 <= int(ids[0])
        and int(ids[-1]) < vocab_size
    ):
        raise RuntimeConfigError(f"{path}: draft_to_target must be sorted, unique int64 target ids below {vocab_size}")
    return ids


def _w12_tables() -> dict | None:
    """Which GPU's W12 tables this process runs (w12.gemm.TABLES), when the GEMM module is loaded."""
    gemm = sys.modules.get("w12.gemm")
    return dict(gemm.TABLES) if gemm is not None else None


def _check_w12(dense_fallback: bool) -> None:
    """W12 weights need the `w12` package (kernels/w12, shipped as <engine>/kernels/w12 on PYTHONPATH); keeping
    their bf16 copies needs its GEMM module too (w12.keep_dense), which imports Triton."""
    try:
        import w12  # noqa: PLC0415, F401
    except ImportError:
        raise RuntimeConfigError(
            "model.quantization is w12 but no `w12` package is on sys.path "
            "(the engine's kernels/ directory must be on PYTHONPATH)"
        ) from None
    if dense_fallback:
        try:
            import w12.gemm  # noqa: F401
        except ImportError as exc:
            raise RuntimeConfigError(
                f"runtime_options.w12_dense_fallback needs w12.gemm, which failed to import "
                f"({exc}); install Triton (pip install 'specpilot[kernels]')"
            ) from None


def _eos_ids(model_dir: str, tokenizer) -> frozenset[int]:
    ids = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = _read_json(gen, "--model").get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _warm_up(model: LeanLlama) -> None:
    with torch.inference_mode():
        for steps in (4, 1):
            model.forward(torch.zeros(1, steps, dtype=torch.long, device=model.device), [0], [0])
