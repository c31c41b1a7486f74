# SpecPilot overlay (overlays/w12): the W12 weight format as an SGLang quantization method.
"""`--quantization w12`: bf16 checkpoints, weights encoded losslessly to W12 at load (no checkpoint config).

Linear layers load their bf16 weights as usual; process_weights_after_loading encodes each weight to W12
(kernels/w12, shipped in the engine tree as <engine>/kernels/w12 and put on PYTHONPATH by the launch spec)
and frees the bf16 copy; apply runs W12's GEMM (fused decode-in-GEMM for <= 64 rows, decode + cuBLAS above).
A weight the engine's W12 plan keeps bf16 (kernels/w12/plan.json, chosen at build time from the GPU's tables: W12
not shown to win at every batch the setting serves, or on a weight with that many escapes) stays as loaded and
runs F.linear: no second copy either way.
Embeddings, the LM head, attention and MoE layers stay unquantized."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.nn.parameter import Parameter

from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.utils import set_weight_attrs

# Rows encoded per step: bounds the encoder's int32 temporaries (~20 bytes per weight) on large matrices.
ENCODE_ROWS = 2048


def _encode_in_chunks(weight: torch.Tensor):
    import w12

    parts = [w12.encode(weight[row:row + ENCODE_ROWS]) for row in range(0, weight.shape[0], ENCODE_ROWS)]
    return parts[0] if len(parts) == 1 else w12.cat(parts)


class W12Config(QuantizationConfig):
    """Online W12: nothing to read from the checkpoint."""

    def get_name(self) -> str:
        return "w12"

    def get_supported_act_dtypes(self) -> List[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # Triton's tl.dot on bf16 and the byte-permute PTX the kernel uses

    @staticmethod
    def get_config_filenames() -> List[str]:
        return []

    @classmethod
    def from_config(cls, config: Optional[Dict[str, Any]] = None) -> "W12Config":
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional["W12LinearMethod"]:
        from sglang.srt.layers.linear import LinearBase

        return W12LinearMethod() if isinstance(layer, LinearBase) else None

    def get_scaled_act_names(self) -> List[str]:
        return []


class W12LinearMethod(LinearMethodBase):
    """A bf16 weight [out, in] while loading; a W12 tensor (`layer.w12_weight`) after."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        weight = Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                       dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "w12_weight", None) is not None and "weight" not in layer._parameters:
            return  # already encoded (some loaders call this twice)
        import w12
        import w12.plan

        weight = layer.weight.data
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"--quantization w12 stores bf16 weights; this layer's weight is {weight.dtype} "
                            "(serve with --dtype bfloat16)")
        layer.w12_weight = w12.plan.encode_planned(weight, encode=_encode_in_chunks)
        if layer.w12_weight is None:  # the plan keeps this weight bf16 (as loaded, no second copy)
            return
        on_gpu = weight.is_cuda
        del layer.weight, weight
        if on_gpu:
            torch.cuda.empty_cache()  # hand the bf16 copy back before SGLang sizes its KV cache
        self._linear = w12.linear

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.w12_weight is None:
            return torch.nn.functional.linear(x, layer.weight, bias)
        return self._linear(x, layer.w12_weight, bias)
