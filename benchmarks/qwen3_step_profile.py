"""Where a decode step of benchmarks/qwen3_e2e.py's model goes: the kernels of one graph-replayed step, per layer,
bf16 and W12 (with the dense fallback), from torch's profiler (CUPTI), on one CUDA GPU.

    PYTHONPATH=kernels:runtimes/reference python3 benchmarks/qwen3_step_profile.py --layers 4

The 27B shapes with --layers layers (few: the per-layer kernels repeat; the lm_head, embedding and the decode
step's argmax and top-k are once a step), normal weights, prompts of 64 tokens, a cache of 192 positions. Per
format and batch: the step's wall time over 20 replays, the kernels' summed time (the rest is the gaps between
kernels), then each kernel name with its count per layer and mean time, largest total first, and the first
layer's kernels in launch order.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from qwen3_e2e import drawn_model
from torch.profiler import ProfilerActivity, profile

from specpilot_lab.decode import DecodeStep, prefill
from specpilot_lab.qwen3 import Qwen3Shape

PROFILED_STEPS = 5


def profile_step(model, label: str, batch: int, layers: int) -> None:
    prompts = torch.randint(0, model.shape.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(batch))
    cache = model.new_cache(batch, 192)
    logits = prefill(model, prompts.cuda(), cache)
    step = DecodeStep(model, cache, logits.argmax(-1), torch.full((batch,), 64, device="cuda"), True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20 * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        stats[e.name][0] += 1
        stats[e.name][1] += e.device_time
    summed = sum(d for _, d in stats.values()) / PROFILED_STEPS
    print(
        f"\n### {label}, batch {batch}: step {wall:.1f} µs (graph replay), {len(kernels) // PROFILED_STEPS} "
        f"kernels summing to {summed:.1f} µs, gaps {wall - summed:.1f} µs\n"
    )
    print("| per layer | mean µs | µs a step | kernel |\n|---:|---:|---:|---|")
    for name, (count, total) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(
            f"| {count / PROFILED_STEPS / layers:.2f} | {total / count:.2f} | {total / PROFILED_STEPS:.1f} | "
            f"`{name[:80]}` |"
        )
    one_step = len(kernels) // PROFILED_STEPS
    per_layer = [e for e in kernels[:one_step]]
    print(
        "\nfirst kernels of a step, in order: "
        + ", ".join(f"{e.name[:28]} {e.device_time:.1f}" for e in per_layer[: min(len(per_layer), 24)])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,16,32")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    shape = Qwen3Shape(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=args.layers,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
    )
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {shape}"
    )
    model = drawn_model(shape, "normal", 0, torch.device("cuda"))
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        profile_step(model, "bf16", batch, args.layers)
    model.to_w12(dense_fallback=True)
    for batch in batches:
        profile_step(model, "W12 + fallback", batch, args.layers)


if __name__ == "__main__":
    main()
