"""qkv and o as units on the ws kernel against main's rows on the Triton kernel (issue #18, BENCH.md next step 1 of
2026-12-02 04:55; exploration, history only), on the H200, every family, side by side in one run:

- GEMM (qkv and o; 3 rotated weights, CUDA graphs): cuBLAS; main (rows, the Triton kernel, tuned tiles); the
  Triton kernel on units (same tiles); the ws kernel on units. Every W12 result within one bf16 ulp of float64.
- Decode stack (64 layers of qkv, o, gate_up, down; one CUDA graph per step): bf16; main; main with its
  fallback (fallback_h200.json); qkv and o as units on the ws kernel; the same with cuBLAS where this run's GEMM
  table has ws below cuBLAS for qkv or o (and main's fallback for gate_up and down).

    cd kernels && python3 -m w12.explore.qkvo_units --out $OUT/qkvo.json

Ran on the lent H200 (torch 2.11.0+cu130, triton 3.6.0) on 2026-12-02 06:45 UTC against a6698d2 (run_qkvo.sh):
qkvo_h200.json and its log. run_qkvo.sh first ran the PDL hazard test against a build of csrc/w12_ws.cu without
the producer's griddepcontrol.wait (hazard_probe_h200.txt: 3 failed; with it restored: 3 passed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from ..bench import graph_time_us, replay_us, stack_weights, with_dense
from ..families import FAMILIES, SHAPES, draw
from ..format import decode, encode
from ..gemm import Config, bucket_of, config_for, linear, prepare

BUFFERS = 3
SHAPES_AB = ("qkv", "o")
WS = Config(kernel="ws")


def close_to_exact(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def as_units(w: torch.Tensor, buckets=(8, 16, 32, 64)):
    packed = encode(w, layout="units")
    for b in buckets:
        prepare(packed, b, WS)
    return packed


class TritonUnits:
    """The Triton kernel on a units weight with the shape's tuned tiles (as if Config.kernel were "triton")."""

    def __init__(self, packed, m):
        cfg = dataclasses.replace(config_for(packed, bucket_of(m)), kernel="triton")
        self.packed = dataclasses.replace(packed, plans={})
        self.device = packed.device
        prepare(self.packed, bucket_of(m), cfg)

    def __call__(self, x):
        return linear(x, self.packed)


def gemm_rows(family: str, ms) -> list[dict]:
    rows = []
    for i, name in enumerate(SHAPES_AB):
        n, k = SHAPES[name]
        bf16s = [draw(family, n, k, seed=10 * i + b, device="cuda") for b in range(BUFFERS)]
        main = [encode(w) for w in bf16s]
        units = [as_units(w) for w in bf16s]
        assert main[0].layout == "rows" and units[0].layout == "units"
        assert torch.equal(decode(units[0]).view(torch.int16), bf16s[0].view(torch.int16))
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            tri = [TritonUnits(p, m) for p in units]
            row = dict(family=family, shape=name, M=m, escape_rate=main[0].escapes / (n * k))
            row["cublas_us"] = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            row["main_us"] = graph_time_us(lambda p: linear(x, p), main)
            row["triton_units_us"] = graph_time_us(lambda t: t(x), tri)
            row["ws_us"] = graph_time_us(lambda p: linear(x, p), units)
            row["main_ok"] = close_to_exact(x, bf16s[0], linear(x, main[0]))
            row["triton_units_ok"] = close_to_exact(x, bf16s[0], tri[0](x))
            y1, y2 = linear(x, units[0]), linear(x, units[0])
            row["ws_ok"] = close_to_exact(x, bf16s[0], y1)
            row["ws_deterministic"] = bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16)))
            t = row["cublas_us"]
            cells = "  ".join(f"{arm} {row[arm + '_us']:6.1f} x{t / row[arm + '_us']:.3f}"
                              f"{'' if row[arm + '_ok'] else ' WRONG'}" for arm in ("main", "triton_units", "ws"))
            print(f"{family:11s} {name:4s} M={m:2d} cuBLAS {t:6.1f}  {cells}", flush=True)
            rows.append(row)
            del tri
        del main, units, bf16s
        torch.cuda.empty_cache()
    return rows


def stack_rows(family: str, ms, ws_slower: dict, layers: int) -> list[dict]:
    bf16_layers, main_layers = stack_weights(layers, family, SHAPES, "cuda")
    main_fb = [[with_dense(p, w) for p, w in zip(wl, bl)] for wl, bl in zip(main_layers, bf16_layers)]
    units_layers = [[as_units(w) if name in SHAPES_AB else p for name, w, p in zip(SHAPES, bl, wl)]
                    for bl, wl in zip(bf16_layers, main_layers)]
    units_fb = []
    for bl, ul, fl in zip(bf16_layers, units_layers, main_fb):
        layer = []
        for name, w, u, f in zip(SHAPES, bl, ul, fl):
            if name in SHAPES_AB:
                slow = tuple(sorted(ws_slower.get(name, ())))
                layer.append(dataclasses.replace(u, dense=w, dense_buckets=slow) if slow else u)
            else:
                layer.append(f)
        units_fb.append(layer)
    torch.cuda.synchronize()
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for (_, k) in SHAPES.values()]
        outs = {}

        def step_bf16():
            for bl in bf16_layers:
                for x, w in zip(xs, bl):
                    outs[w.shape] = torch.nn.functional.linear(x, w)

        def step(layers_):
            for wl in layers_:
                for x, p in zip(xs, wl):
                    outs[p.shape] = linear(x, p)

        arms = {"bf16": step_bf16, "main": lambda: step(main_layers), "main_fb": lambda: step(main_fb),
                "units": lambda: step(units_layers), "units_fb": lambda: step(units_fb), "bf16_again": step_bf16}
        times = {label: replay_us(fn, "cuda") for label, fn in arms.items()}
        row = dict(family=family, M=m, layers=layers, times=times,
                   units_fb_shapes={k: sorted(v) for k, v in ws_slower.items()})
        b = times["bf16"][0]
        row.update({f"{arm}_speedup": b / times[arm][0] for arm in ("main", "main_fb", "units", "units_fb")})
        rows.append(row)
        print(f"stack {family:11s} M={m:2d} bf16 {b / 1e3:.2f} ms (again {times['bf16_again'][0] / 1e3:.2f})  "
              + "  ".join(f"{arm} x{row[arm + '_speedup']:.3f}" for arm in ("main", "main_fb", "units", "units_fb")),
              flush=True)
    del bf16_layers, main_layers, main_fb, units_layers, units_fb
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--deadline-s", type=float, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    props = torch.cuda.get_device_properties(0)
    result = dict(device=f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}",
                  stamp=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), gemm=[], stack=[])
    print(result["device"], result["stamp"], flush=True)
    t0 = time.time()
    for family in args.families.split(","):
        if time.time() - t0 > args.deadline_s:
            print(f"{family}: skipped (deadline)", flush=True)
            continue
        g = gemm_rows(family, ms)
        result["gemm"] += g
        slower = {}
        for r in g:
            if r["ws_us"] > r["cublas_us"]:
                slower.setdefault(r["shape"], set()).add(bucket_of(r["M"]))
        result["stack"] += stack_rows(family, ms, slower, args.layers)
        json.dump(result, open(args.out, "w"), indent=1)
        print(f"{family} done at {time.time() - t0:.0f} s", flush=True)
    for family in args.families.split(","):
        for m in ms:
            sel = [r for r in result["gemm"] if r["family"] == family and r["M"] == m]
            if sel:
                gm = {arm: torch.tensor([r["cublas_us"] / r[arm + "_us"] for r in sel]).log().mean().exp().item()
                      for arm in ("main", "triton_units", "ws")}
                print(f"geomean qkv,o {family:11s} M={m:2d} " + "  ".join(f"{a} {v:.3f}" for a, v in gm.items()))
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
