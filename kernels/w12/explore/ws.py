"""The warp-specialized wgmma kernel (csrc/w12_ws.cu; issue #18, BENCH.md next steps 1-5, exploration, history only):
compiled by nvcc at first use, launched through ctypes; checked against float64 (within one bf16 ulp) and for
determinism, and timed under CUDA graphs over rotated weights beside cuBLAS and the Triton kernel.

    PYTHONPATH=kernels python3 -m w12.explore.ws --families normal,student-t4,outliers --probe
    cd kernels && python3 -m w12.explore.ws --families normal,student-t3,student-t4,student-t5,outliers,\
        escapes-0.0001,escapes-0.001 --shapes qkv,o,gate_up,down --ms 1,16,32,48,64 --out ws_h200.json
Logs (H200, 2026-12-01): ws_h200.log / .json (23:41, every synthetic family and the planted-escape pair),
ws_stories_h200.log / .json (23:45, stories260k, with W12_STORIES pointing at a carried copy of the checkpoint),
ws_probe_h200.log (23:33, the parts timed alone). one.py runs one launch for ncu.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..bench import graph_time_us
from ..families import SHAPES, draw, normal_with_escapes
from ..format import W12Tensor, decode, encode
from ..gemm import linear

SOURCE = Path(__file__).with_name("csrc") / "w12_ws.cu"
ROWS, STEP = 128, 64
PROBES = {1: "loads only", 8: "no loads", 16: "no escapes", 4: "no tile end", 2: "empty", 32: "no wgmma",
          64: "no decode", 8 | 32: "decode only", 8 | 64: "wgmma only", 8 | 32 | 64: "ring only"}


class Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("planes", "base", "esc_ptr", "esc", "x", "y", "ws", "counters", "trace")] + \
               [(name, ctypes.c_int32) for name in ("n", "half", "m", "ldx", "ldy", "grid", "probe")]


def build(stages: int = 8) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = Path(tempfile.mkdtemp()) / "w12_ws.so"
    started = time.time()
    done = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared",
                           "-Xcompiler", "-fPIC", "-Xptxas", "-v", f"-DW12_STAGES={stages}", "-o", str(out),
                           str(SOURCE)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    regs = [line.split("Used ")[1].split(",")[0] for line in done.stderr.splitlines() if "Used " in line]
    notes = sorted({line.split(") ")[1].split(" in ")[0] for line in done.stderr.splitlines() if "(C75" in line})
    spills = [line.split(", ")[1] for line in done.stderr.splitlines() if "spill stores" in line]
    print(f"w12_ws (stages <= {stages}): nvcc {time.time() - started:.1f} s, {regs}, {spills}, ptxas notes: {notes}", flush=True)
    lib = ctypes.CDLL(str(out))
    lib.w12_ws_gemm.restype = ctypes.c_int
    lib.w12_ws_error.restype = ctypes.c_char_p
    assert lib.w12_ws_params_size() == ctypes.sizeof(Args)
    return lib


def k_order(width: int, device) -> torch.Tensor:
    """Source column of every stored column: within each 64, stored byte 16t + 4k + j holds column
    16k + (2t, 2t + 1, 2t + 8, 2t + 9)[j], so that lane t's four K steps of a row are 16 contiguous bytes."""
    p = torch.arange(64)
    t, k, j = p // 16, (p // 4) % 4, p % 4
    within = 16 * k + 2 * t + (j % 2) + 8 * (j // 2)
    return (torch.arange(0, width, 64).repeat_interleave(64) + within.repeat(width // 64)).to(device)


class Planes:
    """One W12 matrix as the kernel reads it: planes in wgmma K order, each unit's (128 rows x 64 columns of each
    half) contiguous, [units][128][first-half low 64 | second-half low 64 | codes 64]; escapes grouped by unit and
    warp."""

    def __init__(self, packed: W12Tensor):
        half = packed.cols_padded // 2
        assert half % STEP == 0 and packed.rows % ROWS == 0
        dev = packed.low.device
        self.rows, self.half = packed.rows, half
        ks = half // STEP
        low = packed.low[:, k_order(2 * half, dev)]
        codes = packed.codes[:, k_order(half, dev)]
        parts = [plane.reshape(packed.rows // ROWS, ROWS, ks, STEP) for plane in (low[:, :half], low[:, half:], codes)]
        self.planes = torch.cat(parts, dim=3).permute(0, 2, 1, 3).contiguous()
        self.base = packed.base
        units = packed.rows // ROWS * ks
        counts = (packed.esc_ptr[1:] - packed.esc_ptr[:-1]).long()
        row = torch.repeat_interleave(torch.arange(packed.rows, device=dev), counts)
        col = packed.esc_col.long()
        second = (col >= half).long()
        j = col - second * half
        slot = ((row // ROWS) * ks + j // STEP) * 8 + (row % ROWS) // 16
        entry = (row % ROWS) | ((j % STEP + STEP * second) << 7) | ((packed.esc_bits.long() & 0xFFFF) << 16)
        order = torch.argsort(slot, stable=True)
        entry = entry[order]
        self.esc = torch.nn.functional.pad((entry - ((entry & 0x80000000) << 1)).to(torch.int32), (0, 4))
        self.esc_ptr = torch.zeros(units * 8 + 1, dtype=torch.int32, device=dev)
        self.esc_ptr[1:] = torch.cumsum(torch.bincount(slot, minlength=units * 8), 0)
        self.units = units
        self.device = dev


class Kernel:
    def __init__(self, lib, device):
        self.lib = lib
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.ws = torch.empty(self.sms * lib.w12_ws_slot_floats(), dtype=torch.float32, device=device)
        self.counters = torch.zeros(8192, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: Planes, probe: int = 0, grid: int = 0, trace=None) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty((m, w.rows), dtype=torch.bfloat16, device=x.device)
        a = Args(w.planes.data_ptr(), w.base.data_ptr(), w.esc_ptr.data_ptr(), w.esc.data_ptr(),
                 x.data_ptr(), y.data_ptr(), self.ws.data_ptr(), self.counters.data_ptr(),
                 0 if trace is None else trace.data_ptr(), w.rows, w.half, m, x.stride(0), y.stride(0), min(grid or self.sms, w.units), probe)
        err = self.lib.w12_ws_gemm(ctypes.byref(a), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if err:
            raise RuntimeError(self.lib.w12_ws_error(err).decode())
        return y


def within_one_ulp(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def timeline(run: "Kernel", x: torch.Tensor, w: Planes, probe: int = 0) -> str:
    """One launch's per-CTA globaltimer stamps (csrc/w12_ws.cu `stamp`), in microseconds from the first CTA's start:
    medians over CTAs of the prologue, first data and each tile end's fix-up, and the last CTA's exit."""
    trace = torch.zeros(run.sms * 16, dtype=torch.int64, device=x.device)
    run(x, w, probe=probe)
    torch.cuda.synchronize()
    run(x, w, probe=probe, trace=trace)
    torch.cuda.synchronize()
    t = trace.view(run.sms, 16).double().cpu() / 1e3
    t0 = t[:, 0].min()
    med = lambda v: float(v.median())
    ends = [(t[:, 4 + 2 * j] - t[:, 3 + 2 * j])[t[:, 3 + 2 * j] > 0] for j in range(5)]
    fix = torch.cat([e for e in ends if len(e)])
    return (f"start spread {float(t[:, 0].max() - t0):4.1f}, prologue {med(t[:, 1] - t[:, 0]):4.1f}, first data "
            f"{med(t[:, 2] - t[:, 1]):4.1f}, tile ends {len(fix) / run.sms:.1f}/CTA median {med(fix):4.2f} max "
            f"{float(fix.max()):4.2f}, first tile end at {med(t[:, 3] - t0):5.1f}, exit median "
            f"{med(t[:, 15] - t0):5.1f} max {float(t[:, 15].max() - t0):5.1f}")


def weights(family: str, n: int, k: int) -> list[torch.Tensor]:
    if family.startswith("escapes-"):   # the cliff pair: normal with planted escapes at the given rate
        rate = float(family.split("-")[1])
        return [normal_with_escapes(n, k, rate, seed=s, device="cuda") for s in range(3)]
    return [draw(family, n, k, seed=s, device="cuda") for s in range(3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="normal,student-t4,outliers")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,32,64")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--probe", action="store_true", help="also time parts alone (wrong results by design)")
    ap.add_argument("--trace", action="store_true", help="also print one launch's timeline (globaltimer stamps)")
    ap.add_argument("--out", help="write every case as JSON here")
    args = ap.parse_args()
    run = Kernel(build(args.stages), "cuda")
    print(f"{torch.cuda.get_device_name()}, {run.sms} SMs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for family in args.families.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            ws = weights(family, n, k)
            packs = [encode(w) for w in ws]
            planes = [Planes(p) for p in packs]
            w0 = decode(packs[0])
            rate = packs[0].escapes / (n * k)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
                t_tri = graph_time_us(lambda p: linear(x, p), packs)
                y = run(x, planes[0])
                torch.cuda.synchronize()
                ok = within_one_ulp(x, w0, y) and torch.equal(y, run(x, planes[0]))
                t = graph_time_us(lambda p: run(x, p), planes)
                line = (f"{family:12s} {name:8s} esc {100 * rate:.3f}% M={m:2d} cuBLAS {t_ref:6.1f}  "
                        f"triton x{t_ref / t_tri:.3f}  ws {'ok' if ok else 'WRONG'} {t:6.1f} x{t_ref / t:.3f}")
                if args.probe:
                    pr = {b: graph_time_us(lambda p, b=b: run(x, p, probe=b), planes) for b in PROBES}
                    line += " (" + ", ".join(f"{PROBES[b]} {pr[b]:5.1f}" for b in PROBES) + ")"
                print(line, flush=True)
                rows.append({"family": family, "shape": name, "m": m, "escape_rate": rate, "cublas_us": t_ref,
                             "triton_us": t_tri, "ws_us": t, "ws_ok": ok})
                if args.trace:
                    print("    timeline:", timeline(run, x, planes[0]), flush=True)
                    print("    ring only:", timeline(run, x, planes[0], probe=8 | 32 | 64), flush=True)
            del ws, packs, planes, w0
            torch.cuda.empty_cache()
    summary(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "rows": rows}, indent=1))


def summary(rows: list[dict]) -> None:
    """Geomean speedups over cuBLAS per family and M group: Triton, ws, and the best of Triton / ws / cuBLAS (what a
    per-shape pick would give)."""
    def geo(v):
        return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")
    groups = {"M<=16": lambda m: m <= 16, "M=32": lambda m: m == 32, "M=48": lambda m: m == 48, "M=64": lambda m: m == 64}
    for family in dict.fromkeys(r["family"] for r in rows):
        line = f"{family:14s}"
        for label, take in groups.items():
            sel = [r for r in rows if r["family"] == family and take(r["m"])]
            if not sel:
                continue
            tri = geo([r["cublas_us"] / r["triton_us"] for r in sel])
            wsp = geo([r["cublas_us"] / r["ws_us"] for r in sel])
            best = geo([r["cublas_us"] / min(r["cublas_us"], r["triton_us"], r["ws_us"]) for r in sel])
            line += f"  {label}: triton {tri:.3f} ws {wsp:.3f} best {best:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
