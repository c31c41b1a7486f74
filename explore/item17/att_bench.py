"""Attention alone, graph-timed: SDPA (memory-efficient, mask made once outside) vs fused.attention (default
splits, one split, 4 splits), decode (T = 1), 64 query / 8 KV heads of 128."""
import sys
sys.path.insert(0, "tests")
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from specpilot_runtime import fused
from test_runtime_fused import attention_case


def timed(fn, reps=50):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


print("| batch | length | SDPA us | fused (default) us | 1 split us | 4 splits us |")
print("|---:|---:|---:|---:|---:|---:|")
for length in (192, 1024, 4096):
    for batch in (1, 8, 16, 32):
        q, k, v, _ = attention_case(batch, 1, length, torch.bfloat16, "cuda")
        positions = torch.full((batch, 1), length - 1, device="cuda")
        hidden = torch.full((), float("-inf"), dtype=q.dtype, device="cuda")
        mask = torch.where(torch.arange(length, device="cuda") <= positions[..., None], 0.0, hidden).to(q.dtype)
        mask = mask[:, None, :, None].expand(batch, 1, 1, 8, length).reshape(batch, 1, 8, length)
        grouped = q.reshape(batch, 1, 8, 8, 128).transpose(1, 2).reshape(batch, 8, 8, 128)

        def sdpa():
            with sdpa_kernel(fused.ATTENTION_BACKENDS):
                o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
            return o.reshape(batch, 8, 1, 8, 128).transpose(1, 2).reshape(batch, 1, 64, 128)
        row = [timed(sdpa)] + [timed(lambda: fused.attention(q, k, v, positions, splits=s)) for s in (None, 1, 4)]
        print(f"| {batch} | {length} | " + " | ".join(f"{t:.2f}" for t in row) + " |")
