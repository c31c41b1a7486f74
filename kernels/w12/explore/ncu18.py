"""One launch each of the CUDA and the Triton W12 kernel (qkv, M=1 and M=32) for ncu."""
import torch, w12
from w12.gemm import Config, fused_gemm
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
n, k = 10240, 5120
sigma = 0.02 * torch.exp(0.5 * torch.randn(n, 1, device=dev, generator=g))
w = (torch.randn(n, k, device=dev, generator=g) * sigma).to(torch.bfloat16)
p = w12.encode(w)
for m in (1, 32):
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    for cfg in (Config(kernel="cuda", split_k=3, num_stages=3),
                Config(32, 128, 2, 3, swap=True) if m == 1 else Config(64, 128, 4, 2, split_k=2, esc_after=True)):
        for _ in range(3):
            fused_gemm(x, p, cfg)
torch.cuda.synchronize()
print("ok")
