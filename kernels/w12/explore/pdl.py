"""A/B of programmatic dependent launch (PDL) for the W12 kernels, side by side in one run: the decode stack and
the GEMM table with PDL off, on for the ws kernel only, and on for both kernels (plans remade per arm).
Run from kernels/: python3 -m w12.explore.pdl --family normal,student-t4 --out FILE."""
import argparse
import json
import time

import torch

from w12 import bench, gemm, ws

ARMS = {"off": (False, False), "ws": (True, False), "ws_trigger": (True, True)}


def set_arm(arm: str, packs) -> None:
    ws.PDL, gemm.TRIGGER = ARMS[arm]
    for p in packs:
        p.plans.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="normal")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--stack-ms", default="1,8,16,32,64")
    ap.add_argument("--ms", default="1,16,32,64", help="the GEMM table's M (empty: no table)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    stack_ms = [int(v) for v in a.stack_ms.split(",")]
    ms = [int(v) for v in a.ms.split(",") if v]
    result = {"device": torch.cuda.get_device_name(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                              time.gmtime()), "families": {}}
    for family in a.family.split(","):
        res = result["families"][family] = {"stack": {}, "table": {}}
        bf16_layers, w12_layers = bench.stack_weights(a.layers, family, bench.SHAPES, "cuda")
        packs = [p for wl in w12_layers for p in wl]
        for m in stack_ms:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for (_, k) in bench.SHAPES.values()]
            outs = {}

            def step_bf16():
                for bl in bf16_layers:
                    for x, w in zip(xs, bl):
                        outs[w.shape] = torch.nn.functional.linear(x, w)

            def step_w12():
                for wl in w12_layers:
                    for x, p in zip(xs, wl):
                        outs[p.shape] = gemm.linear(x, p)

            row = {"bf16_us": bench.replay_us(step_bf16, "cuda")[0]}
            ref = None
            for arm in ARMS:
                set_arm(arm, packs)
                row[arm + "_us"] = bench.replay_us(step_w12, "cuda")[0]
                got = {k: v.clone() for k, v in outs.items()}
                if ref is None:
                    ref = got
                row[arm + "_same_bits"] = all(torch.equal(ref[k], got[k]) for k in ref)
            row["bf16_again_us"] = bench.replay_us(step_bf16, "cuda")[0]
            res["stack"][m] = row
            print(f"stack {family} M={m:2d} bf16 {row['bf16_us'] / 1e3:.3f} ms  " + "  ".join(
                f"{arm} {row[arm + '_us'] / 1e3:.3f} ms x{row['bf16_us'] / row[arm + '_us']:.3f}"
                f"{'' if row[arm + '_same_bits'] else ' BITS DIFFER'}" for arm in ARMS), flush=True)
        del bf16_layers, w12_layers, packs
        torch.cuda.empty_cache()
        if not ms:
            continue
        weights = bench.family_weights(family, bench.SHAPES, "cuda")
        packs = [p for v in weights.values() for p in v["w12"]]
        for name, (n, k) in bench.SHAPES.items():
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                row = {"cublas_us": bench.graph_time_us(lambda w: torch.nn.functional.linear(x, w),
                                                        weights[name]["bf16"])}
                for arm in ARMS:
                    set_arm(arm, packs)
                    row[arm + "_us"] = bench.graph_time_us(lambda p: gemm.linear(x, p), weights[name]["w12"])
                res["table"][f"{name},{m}"] = row
                print(f"gemm {family} {name:8s} M={m:2d} cuBLAS {row['cublas_us']:6.1f} us  " + "  ".join(
                    f"{arm} {row[arm + '_us']:6.1f} x{row['cublas_us'] / row[arm + '_us']:.3f}" for arm in ARMS),
                    flush=True)
        del weights, packs
        torch.cuda.empty_cache()
    set_arm("ws_trigger", [])
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
