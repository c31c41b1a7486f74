"""Exploration (BENCH.md item 22; history only): end to end, qkv and o as units on the ws kernel against main's rows
on the Triton kernel (cuBLAS on the kept copy at M = 17-64 for qkv), in today's runtime, where every kernel ahead of
qkv (the norm) and of o (the attention kernel) signals launch_dependents, so a ws kernel there starts early (item 16's
A/B, which kept rows, ran before the attention kernel existed).

One process per family: the model is drawn, bf16 decodes every batch, the projections are encoded as main does (with
the dense fallback), then qkv and o are decoded back (exact) and re-encoded arm by arm: main, units, main, units (the
repeats bracket drift). gate_up and down stay as main has them. Every arm checks graph replay against eager steps.

    PYTHONUNBUFFERED=1 PYTHONPATH=kernels:runtimes/reference:benchmarks python3 kernels/w12/explore/qkvo_units_e2e.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

import qwen3_e2e as e2e
from w12 import gemm
from w12.format import encode

SHAPES = {"qkv", "o"}
_config_for = gemm.config_for


def config_for(packed, bucket):
    cfg = _config_for(packed, bucket)
    return dataclasses.replace(cfg, kernel="ws") if packed.units is not None else cfg


gemm.config_for = config_for


def reencode(model, layout: str) -> None:
    for name, module in model.projections():
        if name.rsplit(".", 1)[1] not in SHAPES:
            continue
        old = module.packed
        weight = old.dense if old.dense is not None else gemm.decode_on_device(old)
        new = encode(weight, layout)
        if gemm.keep_dense(new, weight) and layout == "units":
            new.dense_buckets = tuple(b for b in new.dense_buckets if b == 64)
        module.packed = new
    torch.cuda.synchronize()
    e2e._release_memory(model.device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="normal,outliers")
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--arms", default="rows,units,rows,units")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    args = argparse.Namespace(new_tokens=128, prompt_tokens=64, warmup_steps=3, seed=0)
    shape = e2e.Qwen3Shape(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=64,
                           num_heads=64, num_kv_heads=8, head_dim=128, max_positions=4096)
    device = torch.device("cuda")
    batches = [int(b) for b in a.batches.split(",")]
    prompts = {b: torch.randint(0, shape.vocab_size, (b, 64), generator=torch.Generator().manual_seed(b))
               for b in batches}
    record = {}
    for family in a.family.split(","):
        model = e2e.drawn_model(shape, family, 0, device)
        bf16 = {b: e2e.decode(model, "bf16", prompts[b], args, True).tokens_per_second for b in batches}
        model.to_w12(dense_fallback=True)
        e2e._release_memory(device)
        arms = []
        for arm in a.arms.split(","):
            reencode(model, arm)
            same = e2e.graph_check(model, prompts[max(batches)])
            tok = {b: e2e.decode(model, f"{arm}", prompts[b], args, True).tokens_per_second for b in batches}
            arms.append({"arm": arm, "graph_equals_eager": same, "tok_s": tok,
                         "speedup": {b: tok[b] / bf16[b] for b in batches}})
        record[family] = {"bf16_tok_s": bf16, "arms": arms}
        del model
        e2e._release_memory(device)
        print(f"\n{family}: speedup over bf16 (batch {', '.join(map(str, batches))})")
        for arm in dict.fromkeys(x["arm"] for x in arms):
            runs = [x for x in arms if x["arm"] == arm]
            cells = [f"{statistics.mean(r['speedup'][b] for r in runs):.3f} "
                     "(" + " / ".join(f"{r['speedup'][b]:.3f}" for r in runs) + ")" for b in batches]
            print(f"  {arm:6s} " + "  ".join(cells))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
