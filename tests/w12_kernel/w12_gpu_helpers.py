"""Weights and the exactness check shared by the W12 GPU tests."""

import torch


def llm_like(n, k, seed, rate=1 / 500):
    """bf16 [n, k] on the GPU: Normal with a log-normal sigma per row, and about n * k * rate weights (at least 4)
    pushed far out of their row's window: a third ×2^20, a third ×2^-30, a third zeroed."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sigma = 0.02 * torch.exp(0.5 * torch.randn(n, 1, device="cuda", generator=g))
    w = torch.randn(n, k, device="cuda", generator=g) * sigma
    flat = w.view(-1)
    idx = torch.randint(0, n * k, (max(4, round(n * k * rate)),), device="cuda", generator=g)
    flat[idx[0::3]] *= 2.0**20
    flat[idx[1::3]] *= 2.0**-30
    flat[idx[2::3]] = 0.0
    return w.to(torch.bfloat16)


def assert_close_to_exact(x, w, y):
    """y within one bf16 ulp (+1e-5 sum |x||w|) of the float64 x @ w.T."""
    ref = x.double() @ w.double().T
    bound = 2.0**-7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert torch.all((y.double() - ref).abs() <= bound)
