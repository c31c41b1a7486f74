import sys, torch
sys.path.insert(0, "kernels")
from w12.bench import llm_like_weight
from w12.format import encode
from w12.gemm import fused_gemm, TUNED
for n, k in ((10240, 5120), (34816, 5120)):
    w = llm_like_weight(n, k, 1); p = encode(w)
    for m in (32, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        cfg = TUNED[(n, k, 32 if m == 32 else 8)]
        for _ in range(2):
            fused_gemm(x, p, cfg)
torch.cuda.synchronize()
