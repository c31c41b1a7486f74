"""Runs the fused W12 kernel under Triton's interpreter (CPU) on the cases in a .pt file.

Invoked by test_gemm_interpreter.py in a fresh process: TRITON_INTERPRET must be set before
triton is imported, and setting it in the test process would leak into other tests.
"""

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from w12 import encode  # noqa: E402
from w12.gemm import Config, decode_on_device, fused_gemm  # noqa: E402


def main(path: str) -> None:
    cases = torch.load(path)
    for case in cases:
        t0 = time.time()
        packed = encode(case["w"], case["layout"])
        assert packed.layout == case["layout"]
        if "x" not in case:  # the M > 32 path's decode kernel
            case["decoded"] = decode_on_device(packed)
            continue
        cfg = Config(**case["config"])
        case["y"] = fused_gemm(case["x"], packed, cfg)
        if cfg.split_k > 1:  # the arrival counters must have reset
            case["y_again"] = fused_gemm(case["x"], packed, cfg)
        print(f"{case['x'].shape} {cfg}: {time.time() - t0:.1f}s", file=sys.stderr)
    torch.save(cases, path)


if __name__ == "__main__":
    main(sys.argv[1])
