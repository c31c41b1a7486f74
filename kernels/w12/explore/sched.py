"""EXPLORATION (BENCH.md item 21): the split tiles' sum inside the ws kernel, judged in the model's order.

Arms: main's csrc/w12_ws.cu; item 19's probe (explore/w12_ws_nosum.cu: no wait and no sum, wrong where tiles are
split: the ceiling); explore/w12_ws_pre.cu (the summing CTA loads the other pieces W12_AHEAD units before its tile's
end) with CTA ranges from a table, `extra` more units for each CTA that sums a split tile. One device call:
  PYTHONPATH=kernels:runtimes/reference:benchmarks python3 kernels/w12/explore/sched.py --out $OUT/sched.json
1. every arm but the probe within one bf16 ulp of float64 and deterministic (the four shapes, M = 1..64), bits
   against main's where the ranges are main's; 2. GEMM times (graph, chained) of gate_up and down; 3. the model's
   step (model_ab's method: 16 layers at 27B shapes, graph-replayed, arms interleaved over rounds).
ARMS is the last run's (sched4_h200.json); each log names its arms. Runs 1-3 (sched1-3) were made before item 21
landed, with the previous ws.Args (no `ranges`): there "main" is explore/w12_ws_before.cu's kernel, and
w12_ws_pre.cu / w12_ws_pre2.cu, written against that Args, take their ranges from esc_ptr's tail."""
from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from w12 import ws
from w12.bench import graph_time_us
from w12.families import SHAPES, draw
from w12.format import encode

HERE = Path(__file__).parent
MAIN_ESCAPE_TABLE = ws.escape_table
# arm: (source, -D defines, extra units for a summing CTA)
ARMS = {
    "before": (HERE / "w12_ws_before.cu", (), None),
    "main": (ws.SOURCE, (), None),
    "ypack": (HERE / "w12_ws_ypack.cu", (), None),
    "nosum_y": (HERE / "w12_ws_nosum.cu", ("W12_NOSUM_STORE=1",), None),
}


def bounds(units: int, ks: int, grid: int, extra: float) -> list[int]:
    """CTA c's units are [b[c], b[c + 1]). extra = 0: main's c * units // grid. Otherwise a CTA whose range reaches a
    tile's first unit (it will sum that tile if it ends inside it) takes L + extra units, the others L, with L
    chosen (bisection) so that the last CTA ends at `units`."""
    if not extra:
        return [c * units // grid for c in range(grid + 1)]

    def scan(length: float) -> tuple[list[int], float]:
        pos, b = 0.0, [0]
        for _ in range(grid):
            s = b[-1]
            first_tile_start = -(-s // ks) * ks
            pos += length + extra if first_tile_start < s + length + extra else length
            b.append(min(units, max(b[-1] + 1, round(pos))))
        return b, pos

    lo, hi = 1.0, units / grid
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if scan(mid)[1] < units else (lo, mid)
    b, _ = scan(hi)
    b[-1] = units
    assert all(b[i] < b[i + 1] for i in range(grid)), "a CTA without units"
    return b


def table_with_bounds(extra: float, sms: int, tiles_too: bool):
    """escape_table's pair with esc_ptr followed by the CTA ranges (grid + 1 boundaries) and, with tiles_too, per
    tile its first and last CTA (explore/w12_ws_pre2.cu)."""
    def table(packed):
        esc, esc_ptr = MAIN_ESCAPE_TABLE(packed)
        ks = packed.half // 64
        tiles = -(-packed.rows // 128)
        units = tiles * ks
        b = bounds(units, ks, min(sms, units), extra)
        rest = list(b)
        if tiles_too:
            for t in range(tiles):
                rest += [bisect.bisect_right(b, t * ks) - 1, bisect.bisect_right(b, (t + 1) * ks - 1) - 1]
        return esc, torch.cat([esc_ptr, torch.tensor(rest, dtype=torch.int32, device=esc_ptr.device)])
    return table


def compile_arm(name: str, source: Path, defines, cache: Path) -> Path:
    out = cache / f"sched-{name}.so"
    cmd = ws.nvcc_command(ws.find_nvcc(), "sm_90a", out)[:-1] + [f"-D{d}" for d in defines] + [str(source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def libraries(names) -> dict:
    cache = Path("/tmp/w12sched")
    cache.mkdir(exist_ok=True)
    wanted = {}
    for name in names:   # one library per (source, defines)
        source, defines, _ = ARMS[name]
        wanted.setdefault((source, defines), name)
    with concurrent.futures.ThreadPoolExecutor(len(wanted)) as pool:
        built = dict(zip(wanted, pool.map(lambda kv: compile_arm(kv[1], kv[0][0], kv[0][1], cache), wanted.items())))
    libs = {}
    for name in names:
        source, defines, _ = ARMS[name]
        lib = ctypes.CDLL(str(built[source, defines]))
        lib.w12_ws_gemm.argtypes = [ctypes.POINTER(ws.Args), ctypes.c_void_p]
        lib.w12_ws_gemm.restype = ctypes.c_int
        lib.w12_ws_error.argtypes = [ctypes.c_int]
        lib.w12_ws_error.restype = ctypes.c_char_p
        assert lib.w12_ws_params_size() == ctypes.sizeof(ws.Args)
        libs[name] = lib
    return libs


def use(name: str, lib, sms: int) -> None:
    extra = ARMS[name][2]
    ws.build = lambda device=None: lib
    source = ARMS[name][0]
    ws.escape_table = MAIN_ESCAPE_TABLE if extra is None else \
        table_with_bounds(extra, sms, tiles_too=source.name == "w12_ws_pre2.cu")


def exact(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def gemm_part(libs, sms, families, ms, rows):
    for family in families:
        for shape, (n, k) in SHAPES.items():
            w = draw(family, n, k, seed=7, device="cuda")
            packed = encode(w, layout="units")
            torch.cuda.synchronize()
            for m in ms:
                bucket = next(b for b in ws.BUCKETS if m <= b)
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ys, times = {}, {}
                for name, lib in libs.items():
                    use(name, lib, sms)
                    plan = ws.WsPlan(packed, bucket)
                    y = plan(x, m)
                    again = plan(x, m)
                    ys[name] = (y, exact(x, w, y), torch.equal(y, again))
                    if shape in ("gate_up", "down") and m in (1, 8, 16, 32):
                        times[name] = graph_time_us(lambda p: p(x, m), [plan])
                    del plan
                row = dict(family=family, shape=shape, M=m, exact={a: v[1] for a, v in ys.items()},
                           deterministic={a: v[2] for a, v in ys.items()},
                           bits_equal_first={a: torch.equal(v[0], ys[next(iter(ys))][0]) for a, v in ys.items()}, us=times)
                rows.append(row)
                bad = [a for a in libs if a != "nosum" and not (row["exact"][a] and row["deterministic"][a])]
                print(f"gemm {family:8s} {shape:7s} M={m:2d} " + " ".join(f"{a} {t:.1f}" for a, t in times.items())
                      + f"  bits=first: {[a for a, e in row['bits_equal_first'].items() if e]}"
                      + (f"  NOT EXACT/DETERMINISTIC: {bad}" if bad else ""), flush=True)
            del w, packed
            torch.cuda.empty_cache()


def model_part(libs, sms, families, batches, layers, rounds, rows):
    from qwen3_e2e import drawn_model
    from specpilot_runtime.decode import DecodeStep, prefill
    from specpilot_runtime.qwen3 import Qwen3Shape

    shape = Qwen3Shape(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=layers,
                       num_heads=64, num_kv_heads=8, head_dim=128, max_positions=4096)

    def step_us(model, packed, name, batch, prompts, replays=40):
        for p in packed:
            p.plans.clear()
        use(name, libs[name], sms)
        cache = model.new_cache(batch, 192)
        logits = prefill(model, prompts, cache)
        step = DecodeStep(model, cache, logits.argmax(-1), torch.full((batch,), 64, device="cuda"), True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        top = step.top.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            step()
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / replays, top

    for family in families:
        model = drawn_model(shape, family, 0, torch.device("cuda"))
        model.to_w12(dense_fallback=True)
        torch.cuda.empty_cache()
        packed = [layer.packed for _, layer in model.projections()]
        for batch in batches:
            prompts = torch.randint(0, shape.vocab_size, (batch, 64),
                                    generator=torch.Generator().manual_seed(batch)).cuda()
            times = {a: [] for a in libs}
            tops = {}
            for r in range(rounds):
                for name in (list(libs) if r % 2 == 0 else list(reversed(libs))):
                    t, top = step_us(model, packed, name, batch, prompts)
                    times[name].append(t)
                    tops.setdefault(name, top)
            med = {a: statistics.median(v) for a, v in times.items()}
            first = next(iter(libs))
            row = dict(family=family, batch=batch, layers=layers, step_us=med, all_us=times,
                       top_equal_first={a: torch.equal(tops[a], tops[first]) for a in libs},
                       per_layer_gain_us={a: (med[first] - med[a]) / layers for a in libs})
            rows.append(row)
            print(f"model {family:8s} batch {batch:2d}: " + ", ".join(
                f"{a} {med[a]:.1f} ({row['per_layer_gain_us'][a]:+.2f}{'' if row['top_equal_first'][a] else ' top≠'})"
                for a in libs) + "  spread " + " ".join(f"{max(v) - min(v):.0f}" for v in times.values()), flush=True)
        del model, packed
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--gemm-families", default="normal,outliers")
    ap.add_argument("--ms", default="1,8,16,32,48,64")
    ap.add_argument("--family", default="normal,outliers")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.time()
    libs = libraries(args.arms.split(","))
    print(f"compiled {len(libs)} arms in {time.time() - t0:.0f} s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm_rows, model_rows = [], []
    out = lambda: args.out and Path(args.out).write_text(json.dumps(dict(
        when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=torch.cuda.get_device_name(),
        arms={a: [str(ARMS[a][0].name), list(ARMS[a][1]), ARMS[a][2]] for a in libs}, gemm=gemm_rows,
        model=model_rows), indent=1))
    if args.gemm_families:
        gemm_part(libs, sms, args.gemm_families.split(","), [int(m) for m in args.ms.split(",")], gemm_rows)
        out()
    if not args.skip_model:
        model_part(libs, sms, args.family.split(","), [int(b) for b in args.batches.split(",")], args.layers,
                   args.rounds, model_rows)
        out()
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
