"""One launch each of the picked fused kernel on qkv at M = 16 and M = 64 (normal weights) and of the noplane
probe at M = 64, for Nsight Compute (issue #18, history only):

    cd kernels && ncu --clock-control none -k regex:"w12_gemm|probe" --launch-skip-before-match 0 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis python3 -m w12.explore.ncu64
"""
import torch

from ..families import SHAPES, draw
from ..format import encode
from ..gemm import bucket_of, config_for, fused_gemm
from .m64 import probe

n, k = SHAPES["qkv"]
packed = encode(draw("normal", n, k, seed=0, device="cuda"))
for m in (16, 64):
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    cfg = config_for(packed, bucket_of(m))
    fused_gemm(x, packed, cfg)
    torch.cuda.synchronize()
    print(f"M={m} {cfg}", flush=True)
probe(x, packed, config_for(packed, 64), "noplane")
torch.cuda.synchronize()
