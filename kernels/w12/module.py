"""nn.Module wrapper: a Linear whose weight is held in W12 form."""

from __future__ import annotations

import torch

from .format import W12Tensor, decode, encode
from .gemm import keep_dense, linear


class W12Linear(torch.nn.Module):
    def __init__(self, packed: W12Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if len(packed.shape) != 2:
            raise ValueError(f"W12Linear needs a 2-D weight, got shape {packed.shape}")
        self.packed = packed
        self.in_features, self.out_features = packed.cols, packed.rows
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, layer: torch.nn.Linear, dense_fallback: bool = False) -> W12Linear:
        """Encode a Linear's weight (cast to bf16, i.e. lossless for a bf16 layer). With `dense_fallback`, the bf16
        weight stays too where its shape's GEMM falls back to cuBLAS at some M (gemm.keep_dense)."""
        weight = layer.weight.detach().to(torch.bfloat16)
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)
        packed = encode(weight)
        if dense_fallback:
            keep_dense(packed, weight)
        return cls(packed, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The exact bf16 weight, decoded on each access (for code that reads .weight at load time)."""
        return decode(self.packed)

    def _apply(self, fn, recurse=True):
        # .to(device)/.cuda() move the packed planes along with the bias.
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0, device=self.packed.device))
        if probe.device != self.packed.device:
            self.packed = self.packed.to(probe.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(torch.bfloat16), self.packed, self.bias)

    def extra_repr(self) -> str:
        fallback = f", bf16 copy for M buckets {self.packed.dense_buckets}" if self.packed.dense is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits_per_weight={self.packed.bits_per_weight():.3f}, escapes={self.packed.escapes}{fallback}"
        )


def apply_w12(model: torch.nn.Module, dense_fallback: bool = False, plan: dict | None = None) -> int:
    """Replace every nn.Linear of a bf16 model by a W12Linear in place; returns how many were replaced. With a
    `plan` (plan.json's content, w12.plan), a Linear whose shape (and escape class) the plan keeps bf16 stays.

    Lossless: each replaced layer computes with exactly its original weights (its `.weight` still
    reads them back bit for bit). On CUDA with <= 64 rows the fused kernel runs (or, with `dense_fallback`, cuBLAS
    on the kept bf16 weight in the M buckets where that is faster); otherwise F.linear runs on the decoded weight
    (or on the kept copy).
    """
    from .plan import encode_planned

    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    for name, layer in targets:
        if layer.weight.dtype != torch.bfloat16:
            raise TypeError(
                f"W12 stores bf16 weights; {name}.weight is {layer.weight.dtype} (load the model in bfloat16)"
            )
    replaced = 0
    for name, layer in targets:
        if plan is None:
            new = W12Linear.from_linear(layer, dense_fallback)
        else:
            packed = encode_planned(layer.weight.detach(), plan)
            if packed is None:
                continue
            bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)
            new = W12Linear(packed, bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced += 1
    return replaced
