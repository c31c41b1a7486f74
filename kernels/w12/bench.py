"""GPU benchmark: cuBLAS bf16 vs the fused W12 GEMM, and a 64-layer decode stack under a CUDA graph.

    python -m w12.bench --pick --table --stack --out results.json

(w12 is installed with the repository; on a machine where it is not, such as the bare GPU device, prefix
PYTHONPATH=kernels from the repository root.)

--pick checks and times a few finalist configs per shape and M bucket under CUDA graphs and keeps the
best (the wider sweeps they came from are in BENCH.md; explore.py, which ran them, is in commit e009eac). The table and the stack are timed under CUDA graphs.

Prints markdown tables (the source of BENCH.md). Needs a CUDA GPU with torch + triton.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

from .format import W12Tensor, decode, encode
from .gemm import Config, TUNED, default_config, fused_gemm

SHAPES = {  # name: (N, K) for y[M, N] = x[M, K] @ W[N, K].T
    "qkv": (10240, 5120),
    "o": (5120, 8192),
    "gate_up": (34816, 5120),
    "down": (5120, 17408),
}
MS = (1, 2, 4, 8, 16, 32)
COPY_TBPS = 4.27          # measured device-to-device copy bandwidth (read + write), H200
BUFFERS = 3               # weight copies rotated per measurement


def llm_like_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Normal weights with a per-row sigma (log-normal around 0.02), bf16, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sigma = 0.02 * torch.exp(0.5 * torch.randn(n, 1, device="cuda", generator=g))
    return (torch.randn(n, k, device="cuda", generator=g) * sigma).to(torch.bfloat16)


def time_us(fn, rep_ms: int = 200, flush: str = "write") -> float:
    """Median time of fn. L2 is cleared before every call: flush="write" is do_bench's own (it zeroes 256 MB,
    leaving L2 full of dirty lines that fn's first kernel must write back), "read" reads 256 MB instead
    (L2 full of clean lines), "none" relies on the rotated buffers alone."""
    if flush == "write":
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    cache = torch.empty(256 * 2 ** 20 // 4, dtype=torch.int32, device="cuda").random_()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    reps = max(20, min(1000, int(rep_ms / max(1e-3, start.elapsed_time(end) / 5))))
    samples = []
    for _ in range(reps):
        if flush == "read":
            cache.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        samples.append((start, end))
    torch.cuda.synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in samples)


def graph_time_us(launch, items, launches: int = 6, flush: str = "write") -> float:
    """Median time of one launch, from a CUDA graph of `launches` back-to-back launches over rotated
    buffers (no Python launch overhead in the timing; L2 cleared before every replay, see time_us)."""
    for item in items:
        launch(item)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(items[i % len(items)])
    t = time_us(graph.replay, rep_ms=150, flush=flush) / launches
    del graph
    return t


# Finalists re-timed under CUDA graphs by --pick, per M bucket (8, 16, 32): from the earlier tile sweeps and
# the swap-orientation sweep of explore.py (BENCH.md; the script is in commit e009eac). Split K for N = 5120, where 160 row blocks of 32 would
# leave SMs idle.
def _swap(bucket, *tiles):
    return [Config(bn, bk, w, s, swap=True, block_m=bucket, split_k=sp) for bn, bk, w, s, sp in tiles]


def finalists(n: int, bucket: int) -> list[Config]:
    narrow = n <= 5120
    if bucket == 8:
        return _swap(8, *([(32, 128, 2, 3, 3), (32, 128, 2, 4, 3), (16, 128, 1, 3, 1), (16, 128, 1, 3, 2)] if narrow
                          else [(32, 128, 2, 3, 1), (32, 128, 2, 4, 1), (16, 128, 1, 3, 1), (16, 128, 1, 4, 1)]))
    if bucket == 16:
        return _swap(16, *([(32, 128, 2, 3, 3), (16, 128, 1, 3, 2)] if narrow
                           else [(32, 128, 2, 3, 1), (32, 128, 2, 4, 1), (16, 128, 1, 3, 1)])) + \
            ([Config(32, 128, 4, 3, split_k=3)] if narrow else [])
    # M = 32: the best of explore.py --m32 (2026-11-30), escape entries loaded after the main loop
    if narrow:
        return [Config(64, 128, 4, 3, split_k=3, esc_after=True), Config(64, 128, 4, 3, split_k=3)]
    return [Config(64, 128, 4, 3, esc_after=True), Config(64, 128, 4, 2, split_k=2, esc_after=True),
            Config(64, 128, 4, 3)]


BUCKETS = ((8, (1, 8)), (16, (16,)), (32, (32,)))     # M bucket, the M values it is timed at


def pick(weights: dict) -> dict:
    """Per shape and M bucket: every finalist checked for correctness, then timed under CUDA graphs at the
    bucket's M values and ranked by the product of those times."""
    best = {}
    for name, (n, k) in SHAPES.items():
        packs = weights[name]["w12"]
        for bucket, ms in BUCKETS:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in ms]
            timed = []
            for cfg in finalists(n, bucket):
                try:
                    check_correctness(name, weights[name]["bf16"][0], packs[0], cfg,
                                      ms=tuple(sorted({1, bucket // 2 + 1, bucket})))
                    times = [graph_time_us(lambda p: fused_gemm(x, p, cfg), packs) for x in xs]
                except Exception as err:
                    print(f"pick {name:8s} M<={bucket}: REJECTED {cfg}: {type(err).__name__}: {str(err)[:300]}")
                    continue
                timed.append((math.prod(times), times, cfg))
                print(f"pick {name:8s} M<={bucket:2d} " + " ".join(f"{t:7.1f}" for t in times) + f" us  {cfg}")
            best[(n, k, bucket)] = min(timed, key=lambda r: r[0])[2]
    return best


def check_correctness(name: str, w: torch.Tensor, packed: W12Tensor, cfg: Config, ms=(1, 5, 16, 32)) -> dict:
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)), f"{name}: decode not bit-exact"
    worst = 0.0
    for m in ms:
        x = torch.randn(m, w.shape[1], device="cuda").to(torch.bfloat16)
        y = fused_gemm(x, packed, cfg).double()
        assert torch.equal(fused_gemm(x, packed, cfg).double(), y), f"{name} M={m}: not deterministic"
        ref = x.double() @ w.double().T
        bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
        bad = ((y - ref).abs() > bound).sum().item()
        assert bad == 0, f"{name} M={m}: {bad} outputs off by more than one bf16 ulp"
        worst = max(worst, ((y - ref).abs() / (ref.abs() + 1e-30)).max().item())
    return {"escapes": packed.escapes, "bits_per_weight": packed.bits_per_weight(), "max_rel_err": worst}


def table(weights: dict) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        bf16s, packs = weights[name]["bf16"], weights[name]["w12"]
        w12_bytes = packs[0].nbytes()
        for m in MS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s)
            t_w12 = graph_time_us(lambda p: fused_gemm(x, p), packs)
            t_ref2 = graph_time_us(lambda w: torch.nn.functional.linear(x, w), bf16s) if m == 1 else float("nan")
            diff = (fused_gemm(x, packs[0]).float() - torch.nn.functional.linear(x, bf16s[0]).float()).abs().max()
            act = 2 * m * (n + k)
            rows.append(dict(
                shape=name, N=n, K=k, M=m, cublas_us=t_ref, cublas_us_repeat=t_ref2, w12_us=t_w12,
                speedup=t_ref / t_w12, bf16_bytes=2 * n * k + act, w12_bytes=w12_bytes + act,
                cublas_tbps=(2 * n * k + act) / t_ref / 1e6, w12_tbps=(w12_bytes + act) / t_w12 / 1e6,
                roofline_w12_us=(w12_bytes + act) / COPY_TBPS / 1e6,
                roofline_bf16_us=(2 * n * k + act) / COPY_TBPS / 1e6,
                max_abs_diff=diff.item(),
                config=vars(TUNED.get((n, k, bucket_of(m))) or default_config(n, k, bucket_of(m)))))
            r = rows[-1]
            print(f"{name:8s} M={m:2d} cuBLAS {t_ref:7.1f} us ({r['cublas_tbps']:.2f} TB/s, repeat {t_ref2:.1f})"
                  f"  W12 {t_w12:7.1f} us ({r['w12_tbps']:.2f} TB/s)  x{r['speedup']:.3f}  "
                  f"roofline {r['roofline_w12_us']:.1f} us  max|diff| {r['max_abs_diff']:.3g}")
    return rows


def bucket_of(m: int) -> int:
    return 8 if m <= 8 else 16 if m <= 16 else 32


def stack_weights(layers: int):
    """64 layers x (qkv, o, gate_up, down): distinct bf16 matrices and their W12 encodings."""
    bf16_layers, w12_layers = [], []
    for layer in range(layers):
        ws = [llm_like_weight(n, k, seed=1000 + 4 * layer + j) for j, (n, k) in enumerate(SHAPES.values())]
        bf16_layers.append(ws)
        w12_layers.append([encode(w) for w in ws])
    torch.cuda.synchronize()
    return bf16_layers, w12_layers


def replay_us(step, replays: int = 7) -> tuple[float, float, float]:
    """(median, min, max) time of one replay of a CUDA graph of step()."""
    step()  # compile / pick algorithms before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(samples), min(samples), max(samples)


def stack(layers: int, ms=(1, 8, 32)) -> list[dict]:
    """64 layers x (qkv, o, gate_up, down) per decode step, bf16 vs W12, each replayed from a CUDA graph."""
    bf16_layers, w12_layers = stack_weights(layers)
    bf16_total = sum(w.numel() * 2 for bl in bf16_layers for w in bl)
    w12_total = sum(p.nbytes() for wl in w12_layers for p in wl)
    print(f"stack: {layers} layers, bf16 {bf16_total / 1e9:.2f} GB, W12 {w12_total / 1e9:.2f} GB")
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for (_, k) in SHAPES.values()]
        outs = {}

        def step_bf16():
            for bl in bf16_layers:
                for x, w in zip(xs, bl):
                    outs[w.shape] = torch.nn.functional.linear(x, w)

        def step_w12():
            for wl in w12_layers:
                for x, p in zip(xs, wl):
                    outs[p.shape] = fused_gemm(x, p)

        times = {label: replay_us(step) for label, step in
                 (("bf16", step_bf16), ("w12", step_w12), ("bf16_again", step_bf16))}
        row = dict(M=m, layers=layers, bf16_us=times["bf16"][0], bf16_again_us=times["bf16_again"][0],
                   w12_us=times["w12"][0], spread=times, bf16_bytes=bf16_total, w12_bytes=w12_total)
        row["speedup"] = row["bf16_us"] / row["w12_us"]
        row["bf16_tbps"] = bf16_total / row["bf16_us"] / 1e6
        row["w12_tbps"] = w12_total / row["w12_us"] / 1e6
        rows.append(row)
        print(f"stack M={m:2d} bf16 {row['bf16_us'] / 1e3:.2f} ms ({row['bf16_tbps']:.2f} TB/s, again "
              f"{row['bf16_again_us'] / 1e3:.2f})  W12 {row['w12_us'] / 1e3:.2f} ms ({row['w12_tbps']:.2f} TB/s)"
              f"  x{row['speedup']:.3f}")
    return rows


def summary(rows: list[dict], stack_rows: list[dict]) -> None:
    small = [r["speedup"] for r in rows if r["M"] <= 16]
    m32 = [r["speedup"] for r in rows if r["M"] == 32]
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
    print(f"geomean speedup M<=16: {gm(small):.3f} (target 1.30)   M=32: {gm(m32):.3f} (target 1.15)")
    for r in stack_rows:
        print(f"stack M={r['M']}: x{r['speedup']:.3f} (target 1.25 at M=1, 8)")


def render(result: dict) -> str:
    """Markdown tables from a results JSON written by this script."""
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
    out = ["| shape (N x K) | M | cuBLAS us | cuBLAS TB/s | W12 us | W12 TB/s | speedup | W12 roofline us "
           "| W12 % of roofline | bf16 MB | W12 MB | max abs diff |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result.get("table", []):
        out.append(f"| {r['shape']} ({r['N']} x {r['K']}) | {r['M']} | {r['cublas_us']:.1f} | {r['cublas_tbps']:.2f} "
                   f"| {r['w12_us']:.1f} | {r['w12_tbps']:.2f} | **{r['speedup']:.3f}** | {r['roofline_w12_us']:.1f} "
                   f"| {100 * r['roofline_w12_us'] / r['w12_us']:.0f}% | {r['bf16_bytes'] / 1e6:.1f} "
                   f"| {r['w12_bytes'] / 1e6:.1f} | {r['max_abs_diff']:.3g} |")
    rows = result.get("table", [])
    small = [r["speedup"] for r in rows if r["M"] <= 16]
    m32 = [r["speedup"] for r in rows if r["M"] == 32]
    out += ["", f"Geometric-mean speedup, 4 shapes x M in {{1,2,4,8,16}}: **{gm(small):.3f}** (target 1.30); "
                f"M = 32: **{gm(m32):.3f}** (target 1.15).", ""]
    out += ["| decode stack, 64 layers | M | bf16 ms | bf16 TB/s | W12 ms | W12 TB/s | speedup | W12 roofline ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result.get("stack", []):
        out.append(f"| qkv+o+gate_up+down, bf16 {r['bf16_bytes'] / 1e9:.2f} GB / W12 {r['w12_bytes'] / 1e9:.2f} GB "
                   f"| {r['M']} | {r['bf16_us'] / 1e3:.2f} | {r['bf16_tbps']:.2f} | {r['w12_us'] / 1e3:.2f} "
                   f"| {r['w12_tbps']:.2f} | **{r['speedup']:.3f}** | {r['w12_bytes'] / COPY_TBPS / 1e9:.2f} |")
    return "\n".join(out)


def save_tuned(result: dict) -> None:
    keep = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "swap", "block_m", "esc_after")
    entries = {key: {f: cfg[f] for f in keep} for key, cfg in result["tuned"].items()}
    path = Path(__file__).with_name("tuned_h200.json")
    comment = "Picked on an H200 by `python -m w12.bench --pick` (see BENCH.md); key: N,K,M bucket (8, 16, 32)"
    path.write_text(json.dumps({"_comment": comment, **entries}, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pick", action="store_true", help="time the FINALISTS under CUDA graphs, keep the best")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--stack", action="store_true")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--configs", help="JSON of configs keyed N,K,bucket (the format of tuned_h200.json)")
    ap.add_argument("--out", default="w12_bench.json")
    ap.add_argument("--render", help="print the markdown tables of an earlier --out JSON and exit")
    ap.add_argument("--save-tuned", help="write the picked configs of an earlier --out JSON to tuned_h200.json")
    args = ap.parse_args()
    if args.render:
        print(render(json.load(open(args.render))))
        return
    if args.save_tuned:
        save_tuned(json.load(open(args.save_tuned)))
        return

    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.configs:
        for key, cfg in json.load(open(args.configs)).items():
            TUNED[tuple(int(v) for v in key.split(","))] = Config(**cfg)

    weights, checks = {}, {}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        bf16s = [llm_like_weight(n, k, seed=10 * i + b) for b in range(BUFFERS)]
        packs = [encode(w) for w in bf16s]
        weights[name] = {"bf16": bf16s, "w12": packs}
        checks[name] = check_correctness(name, bf16s[0], packs[0], Config())
        print(f"check {name}: {checks[name]}")

    result = {"device": props.name, "checks": checks}
    save = lambda: json.dump(result, open(args.out, "w"), indent=1, default=str)  # noqa: E731
    rows, stack_rows = [], []
    try:
        if args.pick:
            best = pick(weights)
            TUNED.update(best)
            result["tuned"] = {",".join(map(str, k)): vars(v) for k, v in best.items()}
            save()
        if args.table:
            rows = table(weights)
            result["table"] = rows
            save()
    except Exception:
        traceback.print_exc()
    del weights
    torch.cuda.empty_cache()
    try:
        if args.stack:
            stack_rows = stack(args.layers)
            result["stack"] = stack_rows
    except Exception:
        traceback.print_exc()
    save()
    summary(rows, stack_rows)

if __name__ == "__main__":
    main()
