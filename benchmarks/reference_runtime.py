"""Benchmark: the reference runtime's arms against transformers' own generate, on CPU, in one run.

    python benchmarks/reference_runtime.py [--rounds 3] [--max-new-tokens 300] [--threads 1] [--sweep] [--c16]
        [--model DIR] [--prompts N] [--mkl] [--ks 4,6,16] [--step-cost]

`--model`: another converted Llama directory (default: stories260K from the mirror), e.g. SmolLM2-135M-Instruct
as `make models SETTING=cpu_c1_smollm2-135m_ngram` prints it; `--prompts N`: the first N openings only; `--mkl`
adds the arm `ar mkl`: ar on MKL's products padded to MIN_ROWS rows instead of rowgemm's (the runtime before
rowgemm, and what it falls back to where rowgemm cannot be built); `--ks`: final's mechanism at other draft lengths
k. `--step-cost` only times one forward step of M rows (a decode step, a verify step, a prefill) and prints its cost
in one-row steps.

For each round, every arm decodes the same story openings one request after another (the c1 setting):
`ar` (no drafter), `stock` (per-request prompt lookup, the setting's default n/k), `final` (the n-gram cache
shared across requests, tuned n/k; a fresh cache every round, so no round sees an earlier round's outputs),
transformers `generate` plain and with `prompt_lookup_num_tokens`. Arms take turns prompt by prompt, so
machine noise hits all of them alike; besides wall-clock tokens/s the table gives tokens per CPU-second of
the process (all threads), which a machine shared with other work distorts far less. Medians over rounds.
Every arm's tokens are checked against transformers' plain greedy output. `--sweep` also tries final's n, k;
`--c16` adds the batching setting (16 requests at once, one batched step for all).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from specpilot_runtime.config import DrafterConfig
from specpilot_runtime.drafters import make_drafter
from specpilot_runtime.engine import Engine, GenerationRequest
from specpilot_runtime.model import LeanLlama, load_hf_model

REPO = Path(__file__).resolve().parent.parent

MODEL_DIR = REPO.parent / "shared" / "models" / "stories260K"

PROMPTS = [
    "Once upon a time, there was a little girl named Mia.",
    "One day, a boy named Sam went to the beach.",
    "The little dog wanted to play with the ball.",
    "Anna and her mom baked a cake.",
    "There was a big tree in the garden.",
    "Tom liked to run fast.",
    "A small cat lived in a red house.",
    "Lucy found a shiny stone in the park.",
    "The bunny was very hungry.",
    "Ben had a toy car that he loved.",
    "It was a sunny day and the birds were singing.",
    "Sara wanted to see the moon.",
    "Once upon a time, there was a big bear.",
    "Max and Lily went to the zoo.",
    "The old man had a magic hat.",
    "A little fish swam in the blue sea.",
    "Jack wanted to build a tower.",
    "The princess lost her crown.",
    "Tim was sad because it was raining.",
    "One morning, Sue saw a butterfly.",
    "The duck and the frog were friends.",
    "Amy had a new pair of shoes.",
    "The boy climbed up the hill.",
    "Mom gave Lily a big hug.",
]

EOS = frozenset({2})  # stories260K's </s>, SmolLM2's <|im_end|>

# The embedded model's arms with the hand-written final (conf/setting/cpu_c1_stories260k_handwritten.yaml: stock =
# conf/drafter/ngram.yaml; the embedded default's final is now the one make tune promoted, seeded with a corpus).
STOCK = DrafterConfig("ngram", num_draft_tokens=4, ngram_max_n=3, ngram_min_n=1)
FINAL = DrafterConfig("ngram", num_draft_tokens=10, ngram_max_n=8, ngram_min_n=1)  # tuned with --sweep


# The c16 setting batches 16 requests per step; each padded verify row costs real work there, so its
# final arm wants fewer draft tokens (measured with --c16).
FINAL_C16 = DrafterConfig("ngram", num_draft_tokens=2, ngram_max_n=8, ngram_min_n=1)
MAX_STEP = 17  # tokens per forward the models make room for: the largest k of --sweep, plus one


_MODELS: dict[tuple, LeanLlama] = {}


def engine_arm(
    hf, tokenizer, drafter_config: DrafterConfig, options: dict, running: int = 1, use_rowgemm: bool = True
) -> Engine:
    """A fresh engine (empty drafter state) on a model shared by every c1 engine of the same kind: c1 engines
    run one request at a time and each request prefills its own cache, so they can share one; fresh models per
    round would keep every earlier round's (engine threads never end), ~1 GB each for SmolLM2."""
    k = drafter_config.num_draft_tokens
    key = (id(hf), running, use_rowgemm)
    if running > 1 or key not in _MODELS:  # c16 engines each get their own (a burst fills all slots)
        model = LeanLlama(hf, num_slots=running, max_tokens_per_step=MAX_STEP, device="cpu", use_rowgemm=use_rowgemm)
        if running > 1:
            return _started(Engine(model, tokenizer, make_drafter(drafter_config, options), k, running))
        _MODELS[key] = model
    return _started(Engine(_MODELS[key], tokenizer, make_drafter(drafter_config, options), k, running))


def _started(engine: Engine) -> Engine:
    engine.start()
    return engine


def run_burst(engine: Engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """All prompts submitted at once (the c16 setting's load); returns outputs in prompt order."""
    events, outputs = [], {}
    for i, prompt in enumerate(prompts):
        done = threading.Event()
        events.append(done)

        def emit(kind, payload, i=i, done=done):
            if kind in ("done", "error"):
                outputs[i] = payload["output_ids"] if kind == "done" else None
                done.set()

        engine.submit(GenerationRequest(prompt, max_new, emit=emit))
    for done in events:
        done.wait()
    return [outputs[i] for i in range(len(prompts))]


def run_engine(engine: Engine, prompt: list[int], max_new: int) -> list[int]:
    return engine.generate(prompt, max_new, stop_token_ids=EOS)["output_ids"]  # as run_hf: eos id 2 ends it


def run_hf(hf, prompt: list[int], max_new: int, lookup: int | None) -> list[int]:
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=2, eos_token_id=2, **extra
        )
    return out[0, len(prompt) :].tolist()


def timed(fn, *args):
    """(wall seconds, CPU seconds of the whole process, result). CPU time is what a busy machine distorts least."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sweep", action="store_true", help="also try final's n (max_n) and k")
    parser.add_argument("--c16", action="store_true", help="also the c16 setting: 16 requests at once, batched")
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="a converted Llama directory")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N openings")
    parser.add_argument("--mkl", action="store_true", help="also `ar mkl`: MKL's products with padded rows")
    parser.add_argument("--step-cost", action="store_true", help="only time one forward step of M rows (M = 1..64)")
    parser.add_argument("--ks", default="", help="also final (shared cache, n=8) at these k, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    hf = load_hf_model(args.model, "float32", "cpu")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[: args.prompts]]
    max_new = args.max_new_tokens
    if args.step_cost:
        step_cost_table(hf, args)
        return

    arms = {
        "ar": lambda: engine_arm(hf, tokenizer, DrafterConfig(), {}),
        "stock": lambda: engine_arm(hf, tokenizer, STOCK, {}),
        "final": lambda: engine_arm(hf, tokenizer, FINAL, {"shared_ngram_cache": True}),
    }
    if args.mkl:
        arms["ar mkl"] = lambda: engine_arm(hf, tokenizer, DrafterConfig(), {}, use_rowgemm=False)
    for k in (int(k) for k in args.ks.split(",") if k):
        cfg = DrafterConfig("ngram", num_draft_tokens=k, ngram_max_n=FINAL.ngram_max_n, ngram_min_n=1)
        arms[f"final k={k}"] = lambda cfg=cfg: engine_arm(hf, tokenizer, cfg, {"shared_ngram_cache": True})
    if args.sweep:
        for k in (6, 8, 10, 12, 16):
            for n in (4, 8, 16):
                cfg = DrafterConfig("ngram", num_draft_tokens=k, ngram_max_n=n, ngram_min_n=1)
                shared = {"shared_ngram_cache": True}
                arms[f"final k={k} n={n}"] = lambda cfg=cfg: engine_arm(hf, tokenizer, cfg, shared)
    hf_arms = {
        "hf generate": None,
        f"hf generate prompt_lookup={STOCK.num_draft_tokens}": STOCK.num_draft_tokens,
        "hf generate prompt_lookup=10": 10,
    }

    names = [*arms, *hf_arms]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    accept: dict[str, list[float]] = {name: [] for name in arms}
    mismatches = {name: 0 for name in names}
    tokens = 0
    for round_no in range(args.rounds):
        engines = {name: make() for name, make in arms.items()}  # fresh: final's cache starts empty
        for engine in engines.values():
            run_engine(engine, prompts[0][:3], 4)  # warm-up; counters reset below
            engine.verify_steps = engine.decode_tokens = 0
        round_wall = {name: 0.0 for name in names}
        round_cpu = {name: 0.0 for name in names}
        tokens = 0
        # Prompt by prompt, every arm in turn: machine noise spreads evenly over the arms.
        for prompt in prompts:
            dt, ct, reference = timed(run_hf, hf, prompt, max_new, None)
            round_wall["hf generate"] += dt
            round_cpu["hf generate"] += ct
            tokens += len(reference)
            for name, lookup in hf_arms.items():
                if lookup is not None:
                    dt, ct, out = timed(run_hf, hf, prompt, max_new, lookup)
                    round_wall[name] += dt
                    round_cpu[name] += ct
                    mismatches[name] += out != reference
            for name, engine in engines.items():
                dt, ct, out = timed(run_engine, engine, prompt, max_new)
                round_wall[name] += dt
                round_cpu[name] += ct
                mismatches[name] += out != reference
        for name in names:
            wall[name].append(round_wall[name])
            cpu[name].append(round_cpu[name])
        for name, engine in engines.items():
            accept[name].append(engine.avg_accept_length)
        print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)

    print(
        f"# reference runtime benchmark — {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"{len(prompts)} prompts x {max_new} new tokens ({tokens} tokens per round), {args.rounds} round(s), "
        f"greedy, c1 (one request at a time), CPU, {args.model.name} float32\n"
    )
    print(
        "| arm | tok/s wall (median) | wall spread | tok/s per CPU-second | vs hf generate (CPU) | "
        "vs ar (CPU) | vs ar (wall) | mean accept length | identical to hf greedy |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base_hf, base_ar = statistics.median(cpu["hf generate"]), statistics.median(cpu["ar"])
    base_ar_wall = statistics.median(wall["ar"])
    for name in names:
        med_wall, med_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        acc = f"{statistics.median(accept[name]):.2f}" if name in accept else "–"
        same = "yes" if mismatches[name] == 0 else f"NO ({mismatches[name]} outputs differ)"
        print(
            f"| {name} | {tokens / med_wall:.0f} | {tokens / max(wall[name]):.0f}–{tokens / min(wall[name]):.0f} | "
            f"{tokens / med_cpu:.0f} | {base_hf / med_cpu:.2f}× | {base_ar / med_cpu:.2f}× | "
            f"{base_ar_wall / med_wall:.2f}× | {acc} | {same} |"
        )
    if args.c16:
        c16_table(hf, tokenizer, prompts[:16], max_new, args.rounds)


STEP_ROWS = (1, 2, 3, 5, 7, 9, 11, 13, 17, 32, 64)


def step_cost_table(hf, args) -> None:
    """CPU ms of one forward step of M tokens (logits for all M, as verify takes them) after a 128-token prefill:
    what a decode step (M = 1), a verify step of k drafts (M = k + 1) and a prefill cost, arms taking turns per M."""
    kernels = {"rowgemm": True, **({"mkl (padded)": False} if args.mkl else {})}
    models = {
        name: LeanLlama(hf, num_slots=1, max_tokens_per_step=64, device="cpu", use_rowgemm=use)
        for name, use in kernels.items()
    }
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, hf.config.vocab_size, (1, 128), generator=gen)
    for model in models.values():
        model.forward(prefix, [0], [0])
    ms: dict[str, dict[int, float]] = {name: {} for name in models}
    for m in STEP_ROWS:
        tokens = torch.randint(0, hf.config.vocab_size, (1, m), generator=gen)
        for name, model in models.items():
            times = []
            for _ in range(max(3, args.rounds)):
                t = time.process_time()
                model.forward(tokens, [0], [128])
                times.append(time.process_time() - t)
            ms[name][m] = statistics.median(times) * 1e3
    print(
        f"# one forward step of M rows — {args.model.name}, {platform.node()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"CPU ms (median of {max(3, args.rounds)}) after 128 tokens of context, and in one-row steps\n"
    )
    print("| M | " + " | ".join(f"{name} ms | x 1-row" for name in models) + " |")
    print("|---:|" + "---:|---:|" * len(models))
    for m in STEP_ROWS:
        print(f"| {m} | " + " | ".join(f"{ms[n][m]:.1f} | {ms[n][m] / ms[n][1]:.2f}" for n in models) + " |")


def c16_table(hf, tokenizer, prompts, max_new: int, rounds: int) -> None:
    shared = {"shared_ngram_cache": True}
    arms = {"ar": (DrafterConfig(), {}), "stock": (STOCK, {}), "final": (FINAL_C16, shared)}
    for k in (4, 6, 10):
        arms[f"final k={k}"] = (DrafterConfig("ngram", k, FINAL_C16.ngram_max_n, 1), shared)
    wall = {name: [] for name in arms}
    cpu = {name: [] for name in arms}
    accept = {name: [] for name in arms}
    mismatches = {name: 0 for name in arms}
    reference = [run_engine(engine_arm(hf, tokenizer, DrafterConfig(), {}), p, max_new) for p in prompts]
    tokens = sum(len(o) for o in reference)
    for _ in range(rounds):
        for name, (cfg, options) in arms.items():
            engine = engine_arm(hf, tokenizer, cfg, options, running=16)
            run_burst(engine, [p[:3] for p in prompts], 4)  # warm-up
            engine.verify_steps = engine.decode_tokens = 0
            dt, ct, outs = timed(run_burst, engine, prompts, max_new)
            wall[name].append(dt)
            cpu[name].append(ct)
            accept[name].append(engine.avg_accept_length)
            mismatches[name] += sum(a != b for a, b in zip(outs, reference))
    print(
        f"\n## c16: {len(prompts)} requests at once, max_running_requests 16, {max_new} new tokens each, "
        f"{rounds} round(s)\n"
    )
    print(
        "| arm | tok/s wall (median) | tok/s per CPU-second | vs ar (CPU) | mean accept length | "
        "identical to one-at-a-time ar |"
    )
    print("|---|---:|---:|---:|---:|---|")
    base = statistics.median(cpu["ar"])
    for name in arms:
        med = statistics.median(cpu[name])
        same = "yes" if mismatches[name] == 0 else f"NO ({mismatches[name]} outputs differ)"
        print(
            f"| {name} | {tokens / statistics.median(wall[name]):.0f} | {tokens / med:.0f} | {base / med:.2f}× | "
            f"{statistics.median(accept[name]):.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
