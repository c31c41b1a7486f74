"""Format version 4 against version 3 on the H200 (issue #18, BENCH.md next step 1; exploration): the same bf16
matrices encoded both ways, cuBLAS, version 3's Triton kernel (main before the change, imported as `w12v3` from
$W12_V3), version 4's Triton kernel and the warp-specialized CUDA kernel (w12.ws) side by side, each graph-timed
over 3 rotated weights, each result checked within one bf16 ulp of float64 (ws also for determinism).

    cd kernels && W12_V3=../w12_carry python3 -m w12.explore.layout_ab --families normal,student-t4 --out $OUT/ab.json

It ran on the lent H200 (torch 2.11.0+cu130, triton 3.6.0) on 2026-12-02 against working trees between 46cf28c and
0a4e3a8, in which version 4 stored every matrix as units (no rows layout yet); `W12_V3` held 46cf28c's w12 package
renamed w12v3. The logs, in order:
- ab_triton.json (01:41 UTC): the Triton kernel on 64-column units against version 3: 0.88-0.91x of it at M = 1.
- ab_triton128.json (01:49): units of 128 columns (each plane's run a 128-byte line): worse, 0.64x of version 3.
- ab_rot_ws.json (01:53): 64-column units, each program starting its K loop at its own step (no better), and the
  ws kernel (ws.py) beside them: the ws kernel wins at M >= 16 everywhere and on gate_up at every M.
- ab_diag.json / ab_noperm.json (01:58): --bk64, and --no-permute (x not reordered: wrong sums, timing only):
  the K-order permutation of x costs 2% at M = 1 and 10% at M = 16, the units layout itself 8% and 12%.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

import torch
import triton
import triton.language as tl

from .. import gemm
from ..bench import graph_time_us
from ..families import SHAPES, draw
from ..format import encode
from ..gemm import bucket_of, config_for, fused_gemm, linear

BUFFERS = 3


@triton.jit
def _unordered(x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    return x


def close_to_exact(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="normal,student-t4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--no-ws", action="store_true")
    ap.add_argument("--bk64", action="store_true", help="also version 4's Triton kernel with 64 half-columns a step")
    ap.add_argument("--no-permute", action="store_true",
                    help="version 4's Triton kernel without reordering x to the planes' K order (wrong sums: timing only)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.no_permute:
        gemm._stored_order = _unordered
    sys.path.insert(0, os.environ["W12_V3"])
    v3 = importlib.import_module("w12v3")
    v3gemm = importlib.import_module("w12v3.gemm")
    ws = None
    if not args.no_ws:
        from .. import ws
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for family in args.families.split(","):
        for i, name in enumerate(args.shapes.split(",")):
            n, k = SHAPES[name]
            bf16s = [draw(family, n, k, seed=10 * i + b, device="cuda") for b in range(BUFFERS)]
            old = [v3.encode(w) for w in bf16s]
            new = [encode(w) for w in bf16s]
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                row = dict(family=family, shape=name, M=m)
                row["cublas_us"] = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
                row["v3_us"] = graph_time_us(lambda p: v3gemm.linear(x, p), old)
                row["v4_us"] = graph_time_us(lambda p: linear(x, p), new)
                row["v3_ok"] = close_to_exact(x, bf16s[0], v3gemm.linear(x, old[0]))
                row["v4_ok"] = close_to_exact(x, bf16s[0], linear(x, new[0]))
                row["config"] = vars(config_for(new[0], bucket_of(m)))
                if args.bk64:
                    cfg64 = dataclasses.replace(config_for(new[0], bucket_of(m)), block_k=64)
                    row["v4bk64_us"] = graph_time_us(lambda p: fused_gemm(x, p, cfg64), new)
                    row["v4bk64_ok"] = close_to_exact(x, bf16s[0], fused_gemm(x, new[0], cfg64))
                if ws is not None and ws.supported(new[0], m):
                    plans = [ws.WsPlan(p, bucket_of(m)) for p in new]
                    row["ws_us"] = graph_time_us(lambda pl: pl(x, m), plans)
                    y1, y2 = plans[0](x, m), plans[0](x, m)
                    row["ws_ok"] = close_to_exact(x, bf16s[0], y1)
                    row["ws_deterministic"] = bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16)))
                t = row["cublas_us"]
                cells = "  ".join(f"{arm} {row[arm + '_us']:6.1f} x{t / row[arm + '_us']:.3f}{'' if row[arm + '_ok'] else ' WRONG'}"
                                  for arm in ("v3", "v4", "v4bk64", "ws") if arm + "_us" in row)
                print(f"{family:11s} {name:8s} M={m:2d} cuBLAS {t:6.1f}  {cells}", flush=True)
                rows.append(row)
            del old, new, bf16s
            torch.cuda.empty_cache()
    for family in args.families.split(","):
        for m in ms:
            sel = [r for r in rows if r["family"] == family and r["M"] == m]
            gm = {arm: torch.tensor([r["cublas_us"] / r[arm + "_us"] for r in sel]).log().mean().exp().item()
                  for arm in ("v3", "v4", "v4bk64", "ws") if all(arm + "_us" in r for r in sel)}
            print(f"geomean {family:11s} M={m:2d} " + "  ".join(f"{a} {v:.3f}" for a, v in gm.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
