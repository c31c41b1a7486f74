"""One launch of the ws kernel for a profiler: python -m w12.explore.one SHAPE M PROBE"""
import sys

import torch

from ..families import SHAPES, draw
from ..format import encode
from .ws import Kernel, Planes, build

name, m, probe = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n, k = SHAPES[name]
run = Kernel(build(), "cuda")
w = Planes(encode(draw("normal", n, k, seed=0, device="cuda")))
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
for _ in range(3):
    run(x, w, probe=probe)
torch.cuda.synchronize()
