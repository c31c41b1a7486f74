"""Test helper: load the W12 quantization method (overlays/w12's files/.../quantization/w12.py) from an SGLang tree
in a child interpreter, against that tree's own base classes, and run it on real stories260K layers.

Functions only; the child's path is given by the caller (an engine tree, or a wheel unpacked with the overlay
applied, plus kernels/ and any stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The quantization package's __init__ imports every method (some GPU-only, tvm_ffi); the child registers the package
# without running it, so the tree's base_config and the overlay's module load as they are. Everything the method
# touches (base_config, set_weight_attrs, the overlay module, kernels/w12) is real.
_RUN_METHOD = r"""
import importlib, json, sys, types
import torch, torch.nn.functional as F
from safetensors.torch import load_file
import sglang.srt.layers as layers
package = types.ModuleType("sglang.srt.layers.quantization")
package.__path__ = [layers.__path__[0] + "/quantization"]
sys.modules[package.__name__] = package
overlay = importlib.import_module("sglang.srt.layers.quantization.w12")
base = importlib.import_module("sglang.srt.layers.quantization.base_config")
import w12
overlay.ENCODE_ROWS = 50  # several encode chunks joined by w12.cat
weights = load_file(sys.argv[1])
out = {"from": [overlay.__file__, base.__file__],
       "abstract_left": sorted(overlay.W12Config.__abstractmethods__ | overlay.W12LinearMethod.__abstractmethods__),
       "bases": [issubclass(overlay.W12Config, base.QuantizationConfig),
                 issubclass(overlay.W12LinearMethod, base.LinearMethodBase)],
       "config": [type(overlay.W12Config.from_config(c)).__name__ for c in ({}, None)],
       "stored": [], "round_trip": [], "exact": []}
cfg = overlay.W12Config.from_config({})
out["name"], out["files"], out["capability"] = cfg.get_name(), cfg.get_config_filenames(), cfg.get_min_capability()
for name, with_bias in (("model.layers.0.mlp.gate_proj.weight", False), ("model.layers.3.mlp.down_proj.weight", True)):
    w = weights[name].to(torch.bfloat16)
    layer, method = torch.nn.Module(), overlay.W12LinearMethod()
    method.create_weights(layer, w.shape[1], [w.shape[0]], w.shape[1], w.shape[0], torch.bfloat16,
                          weight_loader=lambda p, t: p.data.copy_(t))
    layer.weight.weight_loader(layer.weight, w)
    method.process_weights_after_loading(layer)
    out["stored"].append("bf16" if layer.w12_weight is None else "w12")
    out["round_trip"].append(None if layer.w12_weight is None else isinstance(layer.w12_weight, w12.W12Tensor)
                             and torch.equal(w12.decode(layer.w12_weight).view(torch.int16), w.view(torch.int16)))
    bias = torch.randn(w.shape[0]).to(torch.bfloat16) if with_bias else None
    x = torch.randn(7, w.shape[1]).to(torch.bfloat16)
    out["exact"].append(torch.equal(method.apply(layer, x, bias), F.linear(x, w, bias)))
    out["weight_freed"] = "weight" not in dict(layer.named_parameters())
print("RESULT " + json.dumps(out))
"""

# What a CPU test expects of the method on any SGLang release it supports (beside where it was loaded from).
EXPECTED = {
    "stored": ["w12", "w12"],
    "abstract_left": [],
    "bases": [True, True],
    "config": ["W12Config", "W12Config"],
    "round_trip": [True, True],
    "exact": [True, True],
    "name": "w12",
    "files": [],
    "capability": 80,
    "weight_freed": True,
}
# The same under an engine's W12 plan for a GPU with tables: stories260K's shapes are in no table, so the method keeps
# them bf16 (no encoding, no second copy) and computes with the loaded weight.
EXPECTED_KEPT_BF16 = {**EXPECTED, "stored": ["bf16", "bf16"], "round_trip": [None, None], "weight_freed": False}


def run_method(path: list[str], model: Path, cwd: Path) -> dict:
    """The child's RESULT dict; an assertion naming the child's stderr when it printed none."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_METHOD, str(model)], capture_output=True, text=True, env=env, timeout=300, cwd=cwd
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-2000:]
    return json.loads(line[len("RESULT ") :])
