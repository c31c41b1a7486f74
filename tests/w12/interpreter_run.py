"""Runs the fused W12 kernel under Triton's interpreter (CPU) on the cases in a .pt file.

Invoked by test_gemm_interpreter.py in a fresh process: TRITON_INTERPRET must be set before
triton is imported, and setting it in the test process would leak into other tests.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from w12 import encode  # noqa: E402
from w12.gemm import Config, fused_gemm  # noqa: E402


def main(path: str) -> None:
    cases = torch.load(path)
    for case in cases:
        packed = encode(case["w"])
        cfg = Config(block_n=case["block_n"], block_k=case["block_k"], swap=case["swap"])
        case["y"] = fused_gemm(case["x"], packed, cfg)
    torch.save(cases, path)


if __name__ == "__main__":
    main(sys.argv[1])
