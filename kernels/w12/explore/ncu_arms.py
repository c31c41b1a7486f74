"""Nsight Compute over gate_up at M = 32 (normal): main's ws kernel, the escape-warps and the prefetch variants,
3 launches each in that order (ncu --launch-skip picks them). From kernels/."""
import sys
import torch
from w12 import ws
from w12.families import SHAPES, draw
from w12.format import encode

ARMS = {"before": "w12/explore/w12_ws_before.cu", "warps": "w12/explore/w12_ws_escape_warps.cu",
        "prefetch": "w12/explore/w12_ws_prefetch.cu"}
shape, m = sys.argv[1], int(sys.argv[2])
n, k = SHAPES[shape]
w = draw("normal", n, k, seed=100, device="cuda")
packed = encode(w, layout="units")
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
plans = {}
for arm, src in ARMS.items():
    ws._load.cache_clear()
    ws.SOURCE = __import__("pathlib").Path(src)
    lib = ws._load("sm_90a")
    ws.build = lambda device=None, lib=lib: lib
    plans[arm] = ws.WsPlan(packed, next(b for b in ws.BUCKETS if m <= b))
torch.cuda.synchronize()
for arm, plan in plans.items():
    for _ in range(3):
        plan(x, m)
    torch.cuda.synchronize()
print("done", list(plans))
