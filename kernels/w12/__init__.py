"""W12: lossless 12-bit bf16 weights, decoded inside the GEMM. See FORMAT.md."""

from .format import W12Tensor, cat, decode, encode

__all__ = ["W12Tensor", "cat", "decode", "encode", "linear", "fused_gemm", "keep_dense", "W12Linear", "apply_w12"]


def __getattr__(name):
    # The GEMM needs Triton; the format does not, so it is imported on first use.
    if name in ("linear", "fused_gemm", "keep_dense"):
        from . import gemm

        return getattr(gemm, name)
    if name in ("W12Linear", "apply_w12"):
        from . import module

        return getattr(module, name)
    raise AttributeError(name)
