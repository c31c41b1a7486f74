"""Benchmark: the reference runtime's decode attention, fused.attention's Triton kernel against the SDPA call the
Qwen3 forward made before it (memory-efficient attention with an additive mask, the mask made once outside the
timing, as the forward made it once per step), on one CUDA GPU, side by side in one run.

    PYTHONPATH=runtimes/reference python3 benchmarks/decode_attention.py

The 27B shapes' attention (64 query heads, 8 KV heads of 128, bf16), one token per sequence (T = 1) seeing the
whole cache (position length - 1), at batch 1, 8, 16, 32 and cache lengths 192 (benchmarks/qwen3_e2e.py's),
1024 and 4096; the kernel with its default split of the keys, with one split and with four. Times are per call,
the best of 5 replays of a CUDA graph of 50 calls. Each arm's output is checked against float64 attention
first (largest error printed).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from specpilot_lab import fused

HEADS, KV_HEADS, DIM = 64, 8, 128
GROUP = HEADS // KV_HEADS


def graph_time(fn, calls: int = 50, replays: int = 5) -> float:
    """µs per call: fn captured `calls` times in one CUDA graph, the best of `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture stream
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def case(batch: int, length: int, seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(batch, 1, HEADS, DIM, generator=g, device="cuda").bfloat16()
    k = torch.randn(batch, KV_HEADS, length, DIM, generator=g, device="cuda").bfloat16()
    v = torch.randn(batch, KV_HEADS, length, DIM, generator=g, device="cuda").bfloat16()
    return q, k, v, torch.full((batch, 1), length - 1, device="cuda")


def sdpa_arm(q, k, v, positions):
    """The forward's attention before fused.attention, its mask made once."""
    batch, length = q.shape[0], k.shape[2]
    hidden = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    mask = torch.where(torch.arange(length, device=q.device) <= positions[..., None], 0.0, hidden).to(q.dtype)
    mask = mask[:, None, :, None].expand(batch, 1, 1, GROUP, length).reshape(batch, 1, GROUP, length)
    grouped = q.reshape(batch, 1, KV_HEADS, GROUP, DIM).transpose(1, 2).reshape(batch, KV_HEADS, GROUP, DIM)

    def run():
        with sdpa_kernel(fused.ATTENTION_BACKENDS):
            o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
        return o.reshape(batch, KV_HEADS, 1, GROUP, DIM).transpose(1, 2).reshape(batch, 1, HEADS, DIM)

    return run


def exact(q, k, v):
    scores = torch.einsum("bthd,bhld->bthl", q.double(), k.double().repeat_interleave(GROUP, 1)) / DIM**0.5
    return torch.einsum("bthl,bhld->bthd", scores.softmax(-1), v.double().repeat_interleave(GROUP, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--lengths", default="192,1024,4096")
    args = p.parse_args()
    if not torch.cuda.is_available() or fused.triton is None:
        raise SystemExit("decode_attention.py needs a CUDA device and Triton")
    torch.set_grad_enabled(False)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {fused.triton.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| batch | cache length | SDPA µs | kernel, default splits µs (splits) | 1 split µs | 4 splits µs "
        "| speedup (default) | largest error: SDPA / kernel |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            q, k, v, positions = case(batch, length)
            sdpa = sdpa_arm(q, k, v, positions)
            arms = [sdpa] + [lambda s=s: fused.attention(q, k, v, positions, splits=s) for s in (None, 1, 4)]
            truth = exact(q, k, v)
            errors = [float((arm().double() - truth).abs().max()) for arm in arms[:2]]
            times = [graph_time(arm) for arm in arms]
            splits = fused.default_splits(batch, KV_HEADS, length, q.device)
            print(
                f"| {batch} | {length} | {times[0]:.2f} | {times[1]:.2f} ({splits}) | {times[2]:.2f} | "
                f"{times[3]:.2f} | {times[0] / times[1]:.2f} | {errors[0]:.2e} / {errors[1]:.2e} |"
            )


if __name__ == "__main__":
    main()
