"""The ws kernel's variants in the model's own order: benchmarks/qwen3_e2e.py's model (27B shapes, --layers
layers, W12 with the dense fallback), one graph-replayed decode step per batch, each arm's plans made anew, arms
interleaved over rounds; the step's top-8 logits compared with the first arm's (bits). From the repo root:
PYTHONPATH=kernels:runtimes/reference:benchmarks python3 kernels/w12/explore/model_ab.py"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qwen3_e2e import drawn_model
from specpilot_runtime.decode import DecodeStep, prefill
from specpilot_runtime.qwen3 import Qwen3Shape
from w12 import ws
from w12.explore.esc_warps import ARMS, libraries
from w12.explore import defer
import contextlib
ARM_MODES = {"resolve": "resolve", "resolve_pdl": "resolve_pdl"}


def step_us(model, packed, lib, batch, prompts, replays=40, deferred=None):
    if deferred:
        defer.MODE[0] = deferred
    with defer.enabled(lib) if deferred else contextlib.nullcontext():
        return _step_us(model, packed, lib, batch, prompts, replays)


def _step_us(model, packed, lib, batch, prompts, replays):
    for p in packed:
        p.plans.clear()
    ws._WORKSPACES.clear()
    ws.build = lambda device=None: lib
    cache = model.new_cache(batch, 192)
    logits = prefill(model, prompts, cache)
    step = DecodeStep(model, cache, logits.argmax(-1), torch.full((batch,), 64, device="cuda"), True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    top = step.top.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / replays, top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="normal,outliers")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    libs = libraries()
    shape = Qwen3Shape(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=args.layers,
                       num_heads=64, num_kv_heads=8, head_dim=128, max_positions=4096)
    rows = []
    for family in args.family.split(","):
        model = drawn_model(shape, family, 0, torch.device("cuda"))
        model.to_w12(dense_fallback=True)
        torch.cuda.empty_cache()
        packed = [layer.packed for _, layer in model.projections()]
        for batch in map(int, args.batches.split(",")):
            prompts = torch.randint(0, shape.vocab_size, (batch, 64),
                                    generator=torch.Generator().manual_seed(batch)).cuda()
            times = {arm: [] for arm in libs}
            tops = {}
            for r in range(args.rounds):
                for arm in (list(libs) if r % 2 == 0 else list(reversed(libs))):
                    try:
                        t, top = step_us(model, packed, libs[arm], batch, prompts, deferred=ARM_MODES.get(arm))
                    except Exception as err:   # e.g. a launch option this Triton lacks: the arm is dropped
                        print(f"{arm}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                        t, top = float("nan"), torch.full((batch, 8), float("nan"), device="cuda")
                        torch.cuda.synchronize()
                    times[arm].append(t)
                    tops.setdefault(arm, top)
            first = next(iter(libs))
            same = {arm: torch.equal(tops[arm], tops[first]) for arm in libs}
            med = {arm: statistics.median(v) for arm, v in times.items()}
            row = dict(family=family, batch=batch, layers=args.layers, step_us=med, all_us=times, top_equal=same,
                       per_layer_gain_us={arm: (med[first] - med[arm]) / args.layers for arm in libs})
            rows.append(row)
            print(f"{family:9s} batch {batch:2d}: step µs " + ", ".join(
                f"{arm} {med[arm]:.1f} ({row['per_layer_gain_us'][arm]:+.2f} µs/layer{'' if same[arm] else ', TOP DIFFERS'})"
                for arm in libs) + "  spread " + ", ".join(f"{arm} {max(v) - min(v):.1f}" for arm, v in times.items()),
                flush=True)
        del model, packed
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                                  device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
