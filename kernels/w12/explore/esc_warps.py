"""A/B on the H200: the ws kernel with escapes corrected by the consumers (before, explore/w12_ws_before.cu) against
main's csrc/w12_ws.cu (escapes by the producer warpgroup's idle warps). Same weights, same x: bits compared, then
graph-timed side by side with cuBLAS. Run from kernels/: python3 -m w12.explore.esc_warps --out esc.json"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from w12 import ws
from w12.bench import graph_time_us
from w12.families import SHAPES, draw, normal_with_escapes
from w12.format import encode

HERE = Path(__file__).parent
ARMS = {"before": HERE / "w12_ws_before.cu", "resolve": HERE / "w12_ws_defer.cu", "resolve_pdl": HERE / "w12_ws_defer.cu"}


def libraries(arch: str = "sm_90a") -> dict:
    libs = {}
    for arm, source in ARMS.items():
        ws._load.cache_clear()
        ws.SOURCE = source
        libs[arm] = ws._load(arch)
    return libs


def weights(family: str, n: int, k: int, copies: int = 3):
    out = []
    for b in range(copies):
        if family.startswith("planted"):
            w = normal_with_escapes(n, k, float(family.split("-")[1]), seed=100 + b, device="cuda")
        else:
            w = draw(family, n, k, seed=100 + b, device="cuda")
        out.append((w, encode(w, layout="units")))
    torch.cuda.synchronize()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="normal,outliers,planted-0.0001,planted-0.001")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--ms", default="1,8,16,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    libs = libraries()
    rows = []
    for family in args.family.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            ws_ = weights(family, n, k)
            escapes = sum(p.escapes for _, p in ws_) / sum(p.rows * p.cols for _, p in ws_)
            for m in map(int, args.ms.split(",")):
                bucket = next(b for b in ws.BUCKETS if m <= b)
                plans = {}
                for arm, lib in libs.items():
                    ws.build = lambda device=None, lib=lib: lib
                    plans[arm] = [ws.WsPlan(p, bucket) for _, p in ws_]
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = [plans["before"][i](x, m) for i in range(len(ws_))]
                same = {arm: all(torch.equal(ref[i], plans[arm][i](x, m)) for i in range(len(ws_))) for arm in libs}
                times = {arm: [] for arm in [*libs, "cublas"]}
                for order in ([*libs, "cublas"], ["cublas", *reversed(libs)]):
                    for arm in order:
                        if arm == "cublas":
                            t = graph_time_us(lambda w: F.linear(x, w), [w for w, _ in ws_])
                        else:
                            t = graph_time_us(lambda plan: plan(x, m), plans[arm])
                        times[arm].append(t)
                t = {arm: statistics.mean(v) for arm, v in times.items()}
                row = dict(family=family, shape=name, M=m, escape_rate=escapes, bits_equal=same,
                           **{f"{arm}_us": v for arm, v in t.items()})
                rows.append(row)
                print(f"{family:15s} {name:8s} M={m:2d} esc {100 * escapes:.4f}% cuBLAS {t['cublas']:6.1f} " + " ".join(
                    f"{arm} {t[arm]:6.1f}{'' if same[arm] else ' BITS DIFFER'}" for arm in libs), flush=True)
                del plans
            del ws_
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                                  device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
