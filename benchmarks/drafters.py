"""Benchmark: trained drafters against plain greedy and the stock n-gram drafter, in process, on the dev split.

    python benchmarks/drafters.py --setting cpu_c1_stories260k_standalone \
        --drafters stories260k-standalone,stories260k-truncated [--limit 2] [--max-new-tokens 96] [--k 4,2] [--threads 1]
        [--ngram-ks 4,6,10] [--hybrids 4:2:1,4:2:2] [--seed 0]

The target is the setting's model (fetched and proven); each drafter is the one lockfiles/drafters.toml pins,
re-hashed in the store. Arms, one reference-runtime engine each, take turns prompt by prompt (machine noise hits
them alike): `ar` (no drafter), `stock` (per-request prompt lookup with conf/drafter/ngram.yaml's defaults: n 1..3,
k 4), each drafter with k proposals per step (an EAGLE-3 head, recipe eagle3, drafts on its arm's target's hidden
states: k chained steps; each head at every k of `--k`, the others at its first), and with `--ngram-ks` the n-gram
final's drafter (one n-gram cache
shared by all requests, n 1..8, as conf/mechanism/shared-ngram-cache.yaml) at each k given; with `--hybrids`
the hybrid drafter (`drafter.fallback: eagle3`) for each NGRAM_K:HEAD_K:M given: the shared cache's proposal
(matches of m..8 tokens, at most NGRAM_K) where it has one, else the chain of each EAGLE-3 head of `--drafters`
(HEAD_K steps). Prompts: the first
`--limit` dev items of every dataset, rendered as bench renders them. Reported per arm: tokens/s (wall), tokens
per CPU-second of this process, the mean acceptance length (tokens per target forward) and whether every output
equals ar's token for token; then each arm's speed (tokens per CPU-second) over ar's, stock's and the first
`--ngram-ks` arm's (and, with two heads or more, the first hybrid arm's) with a 95% bootstrap interval over prompts
(paired: each resample draws the same prompts for every arm), and how many steps each hybrid's sides drafted."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from datetime import UTC, datetime

import torch

from specpilot_build.draft.target import setting_target
from specpilot_build.measure.datasets import BENCHMARKS, load_split
from specpilot_build.measure.prompts import PromptRenderer
from specpilot_build.models.drafters import locked_drafter
from specpilot_runtime.drafters import (
    DraftModelDrafter,
    Eagle3Drafter,
    HybridDrafter,
    NoDrafter,
    PromptLookup,
    SharedNgramCache,
)
from specpilot_runtime.eagle3 import ARCHITECTURE, Eagle3Head
from specpilot_runtime.engine import Engine
from specpilot_runtime.model import LeanLlama, load_hf_model
from specpilot_runtime.runtime import _draft_vocab, _eos_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", required=True)
    parser.add_argument("--drafters", default="", help="lock keys in lockfiles/drafters.toml, comma-separated")
    parser.add_argument(
        "--ngram-ks",
        default="",
        help="also the n-gram final's drafter (shared cache, n 1..8) at these k, comma-separated",
    )
    parser.add_argument(
        "--hybrids",
        default="",
        help="also the hybrid drafter at these NGRAM_K:HEAD_K:M (comma-separated); the head: --drafters' EAGLE-3 head",
    )
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's")
    parser.add_argument("--limit", type=int, default=2, help="dev items per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", default="4", help="proposals per step; an EAGLE-3 head's arms at each (comma-separated)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    torch.set_num_threads(args.threads)
    target = setting_target(args.setting)
    renderer = PromptRenderer(target.directory, target.chat_template)
    rendered = [renderer.render(item.prompt) for name in BENCHMARKS for item in load_split(name, args.limit)]
    context = renderer.context_length or 2048  # prompts that leave no room for the answer are left out
    prompts = [ids for ids in rendered if len(ids) + args.max_new_tokens + max(ks) + 1 <= context]
    eos = _eos_ids(str(target.directory), renderer.tokenizer)
    hf = load_hf_model(target.directory, target.dtype, "cpu")
    arms = {"ar": (NoDrafter(), 0), "stock": (PromptLookup(1, 3), 4)}
    for k in (int(k) for k in args.ngram_ks.split(",") if k):
        arms[f"shared n-gram cache, n 1..8, k {k}"] = (SharedNgramCache(1, 8, 1_000_000), k)
    heads = {}
    head_arms = {}  # arm -> its EAGLE-3 head's directory
    for name in (name for name in args.drafters.split(",") if name):
        recipe = name.removeprefix(target.name + "-")
        directory = locked_drafter(name, args.setting, recipe)
        if ARCHITECTURE in json.loads((directory / "config.json").read_text()).get("architectures", []):
            heads[name] = directory  # an EAGLE-3 head: made below, on its arm's target (it shares the embedding)
            for k in ks:
                head_arms[name if len(ks) == 1 else f"{name} (k {k})"] = directory
                arms[name if len(ks) == 1 else f"{name} (k {k})"] = (None, k)
            continue
        draft = LeanLlama(load_hf_model(directory, target.dtype, "cpu"), 1, ks[0] + 1, "cpu")
        arms[name] = (DraftModelDrafter(draft, _draft_vocab(str(directory), hf.config.vocab_size)), ks[0])
    hybrids = {}
    for spec in (spec for spec in args.hybrids.split(",") if spec):
        if not heads:
            parser.error("--hybrids needs an EAGLE-3 head in --drafters")
        ngram_k, head_k, m = (int(x) for x in spec.split(":"))
        for head_name, directory in heads.items():
            name = f"hybrid: shared cache n {m}..8 k {ngram_k}, else {head_name} k {head_k}"
            hybrids[name] = (directory, ngram_k, head_k, m)
            arms[name] = (None, max(ngram_k, head_k))
    engines = {}
    for arm, (drafter, k) in arms.items():
        model = LeanLlama(hf, 1, k + 1, "cpu")
        if arm in head_arms:
            head = Eagle3Head(head_arms[arm], model, 1)
            model.capture = head.aux_layers
            drafter = Eagle3Drafter(head)
        if arm in hybrids:
            directory, ngram_k, head_k, m = hybrids[arm]
            head = Eagle3Head(directory, model, 1)
            model.capture = head.aux_layers
            drafter = HybridDrafter(SharedNgramCache(m, 8, 1_000_000), Eagle3Drafter(head), ngram_k, head_k)
        engines[arm] = Engine(model, renderer.tokenizer, drafter, k, 1)
        engines[arm].start()
    stats = {arm: {"tokens": 0, "wall": 0.0, "cpu": 0.0, "forwards": 0, "same": 0} for arm in arms}
    per_prompt: dict[str, list[tuple[int, float]]] = {arm: [] for arm in arms}  # (tokens, CPU-s) per prompt
    reference = {}
    for i, prompt in enumerate(prompts):
        for arm, engine in engines.items():
            wall, cpu = time.perf_counter(), time.process_time()
            out = engine.generate(prompt, args.max_new_tokens, timeout=600, stop_token_ids=set(eos))
            s = stats[arm]
            s["wall"] += time.perf_counter() - wall
            s["cpu"] += time.process_time() - cpu
            ids = out["output_ids"]
            per_prompt[arm].append((len(ids), time.process_time() - cpu))
            s["tokens"] += len(ids)
            s["forwards"] += len(ids) / max(out["meta_info"].get("spec_accept_length") or 1.0, 1e-9)
            reference.setdefault(i, ids)
            s["same"] += ids == reference[i]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"# {args.setting}: {len(prompts)} dev prompts ({len(rendered) - len(prompts)} too long for the context left "
        f"out) x {args.max_new_tokens} new tokens, k={args.k}, "
        f"{args.threads} thread(s)"
    )
    print(
        f"# {platform.processor() or platform.machine()} ({os.cpu_count()} cores), "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit}\n"
    )
    print("| arm | tokens | tok/s (wall) | tok per CPU-s | vs ar (CPU) | accept length | identical to ar |")
    print("|---|---|---|---|---|---|---|")
    ar_rate = stats["ar"]["tokens"] / stats["ar"]["cpu"]
    for arm, s in stats.items():
        rate = s["tokens"] / s["cpu"]
        print(
            f"| {arm} | {s['tokens']} | {s['tokens'] / s['wall']:.1f} | {rate:.1f} | {rate / ar_rate:.2f}x | "
            f"{s['tokens'] / s['forwards']:.2f} | {s['same']}/{len(prompts)} |"
        )

    extra = [k for k in arms if k.startswith("shared n-gram")][:1] + (list(hybrids)[:1] if len(heads) > 1 else [])
    print_intervals(per_prompt, args.seed, extra)
    for arm in hybrids:
        steps = engines[arm].drafter.steps
        print(
            f"\n{arm}: steps drafted by the n-grams {steps['ngram']}, by the head {steps['eagle3']}, none {steps['none']}"
        )


def print_intervals(per_prompt: dict[str, list[tuple[int, float]]], seed: int, extra: list[str]) -> None:
    """Each arm's tokens per CPU-second over each baseline's, with a paired 95% bootstrap interval over prompts."""
    baselines = ["ar", "stock", *extra]
    n = len(per_prompt["ar"])
    rng = random.Random(seed)
    draws = [[rng.randrange(n) for _ in range(n)] for _ in range(2000)]

    def rate(arm: str, picks) -> float:
        rows = [per_prompt[arm][i] for i in picks]
        return sum(t for t, _ in rows) / sum(c for _, c in rows)

    print(f"\n| arm | {' | '.join(f'vs {b} (CPU, 95% CI)' for b in baselines)} |")
    print("|---|" + "---|" * len(baselines))
    for arm in per_prompt:
        cells = []
        for base in baselines:
            ratios = sorted(rate(arm, d) / rate(base, d) for d in draws)
            point = rate(arm, range(n)) / rate(base, range(n))
            cells.append(f"{point:.2f}x [{ratios[49]:.2f}, {ratios[1949]:.2f}]")
        print(f"| {arm} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
