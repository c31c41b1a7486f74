"""Exploration (#18, the escape cliff): the escapes' correction in a kernel of its own before the GEMM
(`Config.esc_pre`, `gemm.escape_correction`) against the in-kernel correction of the picked configs.

    cd kernels && python3 -m w12.explore.pre --out pre.json

Per weight set (normal with 0.01% and 0.1% planted escapes, student-t4, outliers), shape and M: cuBLAS, the
picked path (`linear`: light or heavy config, escapes in the kernel) and `pre` (the light config of the shape with
`esc_pre`: the correction kernel, then the GEMM starting from its fp32 tile), each under CUDA graphs over rotated
buffers, side by side; `pre` checked within one bf16 ulp of float64 and deterministic first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from .. import bench
from ..families import SHAPES
from ..gemm import bucket_of, linear, pick_config

SETS = (("planted 0.01%", 1e-4), ("planted 0.1%", 1e-3), ("student-t4", None), ("outliers", None))


def pre_config(n: int, k: int, m: int):
    return dataclasses.replace(pick_config(n, k, bucket_of(m), False), esc_pre=True, esc_step=0, xt=False,
                               esc_after=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,32")
    ap.add_argument("--out", default="pre.json")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    rows, t0 = [], time.time()
    for label, rate in SETS:
        weights = (bench.escape_weights(rate, SHAPES, "cuda") if rate is not None
                   else bench.family_weights(label, SHAPES, "cuda"))
        for name, (n, k) in SHAPES.items():
            bf16s, packs = weights[name]["bf16"], weights[name]["w12"]
            for m in ms:
                cfg = pre_config(n, k, m)
                bench.check_correctness(f"{label} {name} pre", bf16s[0], packs[0], cfg, ms=(m,))
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t_ref = bench.graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
                t_cur = bench.graph_time_us(lambda p: linear(x, p), packs)
                t_pre = bench.graph_time_us(lambda p: linear(x, p, config=cfg), packs)
                row = dict(set=label, shape=name, M=m, escape_rate=packs[0].escapes / (n * k), cublas_us=t_ref,
                           picked_us=t_cur, pre_us=t_pre, picked_speedup=t_ref / t_cur, pre_speedup=t_ref / t_pre)
                rows.append(row)
                print(f"{label:14s} {name:8s} M={m:2d} esc {100 * row['escape_rate']:.4f}%  cuBLAS {t_ref:6.1f}  "
                      f"picked {t_cur:6.1f} (x{t_ref / t_cur:.3f})  pre {t_pre:6.1f} (x{t_ref / t_pre:.3f})  "
                      f"[{time.time() - t0:.0f} s]", flush=True)
        json.dump(rows, open(args.out, "w"), indent=1)
        del weights
        torch.cuda.empty_cache()
    by = {(r["set"], r["shape"], r["M"]): r for r in rows}
    print("\ncliff (0.1% time / 0.01% time): picked, pre everywhere, pre for heavy only")
    for name in SHAPES:
        for m in ms:
            lo, hi = by.get(("planted 0.01%", name, m)), by.get(("planted 0.1%", name, m))
            if lo and hi:
                print(f"  {name:8s} M={m:2d}  {hi['picked_us'] / lo['picked_us']:.3f}  {hi['pre_us'] / lo['pre_us']:.3f}"
                      f"  {hi['pre_us'] / lo['picked_us']:.3f}")


if __name__ == "__main__":
    main()
