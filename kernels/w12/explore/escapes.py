"""What W12's escape correction costs, and whether spreading it over the main loop helps (issue #18; history only).

Per weight set (the six families, and normal weights with 0.01% / 0.1% planted escapes) and shape and M, under
CUDA graphs over 3 rotated weights (w12.bench.graph_time_us): cuBLAS, W12 with the picked config, the same
config with esc_step 16 / 32 (escape entries added a chunk per main-loop step), and the picked config on a copy
of the weight with its escape table emptied (wrong results by design: the planes alone, i.e. the time without
any correction). Run from kernels/:  python3 -m w12.explore.escapes --out esc.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from w12.bench import DRY_SHAPES, check_correctness, escape_weights, family_weights, graph_time_us
from w12.families import SHAPES
from w12.format import W12Tensor
from w12.gemm import bucket_of, linear, pick_config

ARMS_BY_RUN = {
    "run2": {"step16": dict(esc_step=16), "step32": dict(esc_step=32), "xt": dict(xt=True),
             "xt_step16": dict(xt=True, esc_step=16), "xt_step32": dict(xt=True, esc_step=32)},
    "run3": {"early": dict(esc_early=True), "blk32": dict(esc_block=32), "early_blk32": dict(esc_early=True, esc_block=32),
             "step16": dict(esc_step=16), "step32": dict(esc_step=32)},
}
ARMS = ARMS_BY_RUN["run3"]


def stripped(p: W12Tensor) -> W12Tensor:
    return W12Tensor(p.shape, p.rows, p.cols, p.low, p.codes, p.base, torch.zeros_like(p.esc_ptr),
                     p.esc_col[:0], p.esc_bits[:0])


def run(label: str, weights: dict, shapes: dict, ms, rows: list, check: bool) -> None:
    for name, (n, k) in shapes.items():
        bf16s, packs = weights[name]["bf16"], weights[name]["w12"]
        bare = [stripped(p) for p in packs]
        for m in ms:
            cfg = pick_config(n, k, bucket_of(m))
            for arm, change in ARMS.items() if check else ():
                check_correctness(f"{label} {name} {arm}", bf16s[0], packs[0], dataclasses.replace(cfg, **change),
                                  ms=(m,))
            x = torch.randn(m, k, device=bf16s[0].device).to(torch.bfloat16)
            row = dict(set=label, shape=name, M=m, escapes=packs[0].escapes / (n * k), config=vars(cfg))
            row["cublas"] = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            row["w12"] = graph_time_us(lambda p: linear(x, p, config=cfg), packs)
            for arm, change in ARMS.items():
                c = dataclasses.replace(cfg, **change)
                row[arm] = graph_time_us(lambda p: linear(x, p, config=c), packs)
            row["no_correction"] = graph_time_us(lambda p: linear(x, p, config=cfg), bare)
            rows.append(row)
            print(f"{label:14s} {name:8s} M={m:2d} esc {100 * row['escapes']:.4f}%  cuBLAS {row['cublas']:6.1f}  "
                  f"W12 {row['w12']:6.1f} (x{row['cublas'] / row['w12']:.3f})  "
                  + "  ".join(f"{arm} {row[arm]:6.1f}" for arm in ARMS)
                  + f"  no-corr {row['no_correction']:6.1f} (x{row['cublas'] / row['no_correction']:.3f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="normal,student-t4,outliers,stories260k")
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--rates", default="0.001")
    ap.add_argument("--out", default="escapes.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the plumbing only")
    args = ap.parse_args()
    device, shapes = ("cpu", DRY_SHAPES) if args.dry_run else ("cuda", SHAPES)
    ms = [int(v) for v in args.ms.split(",")]
    start, rows = time.time(), []
    print(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()), device, flush=True)
    for rate in [float(r) for r in args.rates.split(",") if r]:
        run(f"planted {100 * rate:g}%", escape_weights(rate, shapes, device), shapes, ms, rows, True)
    for family in args.family.split(","):
        run(family, family_weights(family, shapes, device), shapes, ms, rows,
            family == "stories260k")
    print(f"took {time.time() - start:.0f} s", flush=True)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
