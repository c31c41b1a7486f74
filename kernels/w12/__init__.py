"""W12: lossless 12-bit bf16 weights, decoded inside the GEMM. See FORMAT.md."""
from .format import W12Tensor, decode, encode

__all__ = ["W12Tensor", "decode", "encode", "linear", "W12Linear"]


def __getattr__(name):
    # The GEMM needs Triton; the format does not.
    if name in ("linear", "fused_gemm", "W12Linear"):
        from . import gemm, module
        return getattr(module if name == "W12Linear" else gemm, name)
    raise AttributeError(name)
