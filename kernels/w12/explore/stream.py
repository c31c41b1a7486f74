"""The stream-K kernels (csrc/w12_stream.cu with cp.async loads, csrc/w12_tma.cu with TMA loads; issue #18 item 2,
exploration, history only): compiled by nvcc at first use, launched through ctypes; checked against float64 (within
one bf16 ulp) and for determinism, and timed under CUDA graphs over rotated weights beside cuBLAS and the Triton kernel.

    PYTHONPATH=kernels python3 -m w12.explore.stream --variants tma-s3 --families normal,student-t4,outliers
    PYTHONPATH=kernels python3 -m w12.explore.stream --variants tma-s3-probes --probe   # parts left out
Logs: tma_h200.log (the 11:28 run), tma_probe_h200.log (the probe runs), wgmma_probe_h200.log (11:34: the TMA
kernel beside w12_wgmma.cu before its metadata was staged), wgmma_staged_h200.log (11:37: w12_wgmma.cu with each
unit's bases and escape entries in its stage and the CTA's escape pointers in shared memory).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..bench import graph_time_us
from ..families import SHAPES, draw
from ..format import W12Tensor, decode, encode
from ..gemm import linear

SOURCE = Path(__file__).with_name("csrc") / "w12_stream.cu"
VARIANTS = {   # name: (rows per tile, half-columns per K step, L2 prefetch hint of the plane loads)
    "t128k64": (128, 64, 0), "t128k64-l2p128": (128, 64, 128), "t128k64-l2p256": (128, 64, 256),
    "t64k128": (64, 128, 0), "t64k128-l2p256": (64, 128, 256),
    "tma": (64, 128, -1),   # w12_tma.cu: the same kernel with its loads done by TMA
    "tma-s3": (64, 128, -3),   # at most 3 stages: two CTAs per SM where they fit
    "tma-s3-probes": (64, 128, -103),   # the same with the ablations 16 and 32 compiled in
    "wgmma": (64, 128, -206),   # w12_wgmma.cu: the TMA kernel with wgmma (register A, shared-memory x as B)
    "wgmma-s3": (64, 128, -203),
}


class Params(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("low", "codes", "base", "esc_ptr", "esc", "x", "y", "ws", "counters")] + \
               [(name, ctypes.c_int32) for name in ("n", "half", "m", "ldx", "ldy", "grid", "probe")]


def build(variant: str) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = Path(tempfile.mkdtemp()) / "w12_stream.so"
    rows, step, hint = VARIANTS[variant]
    source = SOURCE.with_name("w12_wgmma.cu" if hint <= -200 else "w12_tma.cu") if hint < 0 else SOURCE
    extra = [f"-DW12_MAXSTAGES={(-hint) % 100}", f"-DW12_PROBES={int(-200 < hint <= -100)}"] if hint < -1 else []
    started = time.time()
    done = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared",
                           "-Xcompiler", "-fPIC", "-Xptxas", "-v", f"-DW12_BN={rows}", f"-DW12_BKH={step}",
                           f"-DW12_HINT={hint}", *extra, "-o", str(out), str(source)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    regs = [line.split("Used ")[1].split(",")[0] for line in done.stderr.splitlines() if "registers" in line]
    spills = [line.split(", ")[1] for line in done.stderr.splitlines() if "spill stores" in line]
    print(f"{variant}: nvcc {time.time() - started:.1f} s, {regs}, {spills}", flush=True)
    lib = ctypes.CDLL(str(out))
    lib.w12_stream_gemm.restype = ctypes.c_int
    lib.w12_stream_error.restype = ctypes.c_char_p
    assert lib.w12_stream_params_size() == ctypes.sizeof(Params)
    return lib


def unit_escapes(packed: W12Tensor, ROWS: int, STEP: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The escapes regrouped by unit (tile * ksteps + kstep) and warp (the half, then the row group): CSR pointers
    [units * 8 + 1] and packed entries."""
    half = packed.cols_padded // 2
    ks = half // STEP
    units = -(-packed.rows // ROWS) * ks
    counts = (packed.esc_ptr[1:] - packed.esc_ptr[:-1]).long()
    row = torch.repeat_interleave(torch.arange(packed.rows, device=packed.device), counts)
    col = packed.esc_col.long()
    second = (col >= half).long()
    j = col - second * half
    unit = (row // ROWS) * ks + j // STEP
    slot = unit * 8 + second * 4 + (row % ROWS) // (ROWS // 4)
    entry = (row % ROWS) | ((j % STEP + STEP * second) << 7) | ((packed.esc_bits.long() & 0xFFFF) << 16)
    order = torch.argsort(slot, stable=True)
    entry = entry[order]
    entry = (entry - ((entry & 0x80000000) << 1)).to(torch.int32)
    entry = torch.nn.functional.pad(entry, (0, 8))   # the TMA kernels copy whole 16-byte runs of entries
    ptr = torch.zeros(units * 8 + 1, dtype=torch.int32, device=packed.device)
    ptr[1:] = torch.cumsum(torch.bincount(slot, minlength=units * 8), 0)
    return ptr, entry


class Stream:
    def __init__(self, lib, device, variant):
        self.lib = lib
        self.rows, self.step, _ = VARIANTS[variant]
        self.per_sm = getattr(lib, "w12_stream_ctas_per_sm", None)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.ws = torch.empty(self.sms * 8 * lib.w12_stream_piece_floats(64), dtype=torch.float32, device=device)
        self.counters = torch.zeros(4096, dtype=torch.int32, device=device)
        self.esc = {}

    def ctas(self, m: int) -> int:
        return self.per_sm(m) if self.per_sm else 1

    def __call__(self, x: torch.Tensor, packed: W12Tensor, probe: int = 0, grid: int = 0) -> torch.Tensor:
        key = id(packed)
        if key not in self.esc:
            self.esc[key] = (packed, *unit_escapes(packed, self.rows, self.step))
        _, ptr, entry = self.esc[key]
        m = x.shape[0]
        half = packed.cols_padded // 2
        units = -(-packed.rows // self.rows) * (half // self.step)
        y = torch.empty((m, packed.rows), dtype=torch.bfloat16, device=x.device)
        p = Params(packed.low.data_ptr(), packed.codes.data_ptr(), packed.base.data_ptr(), ptr.data_ptr(),
                   entry.data_ptr(), x.data_ptr(), y.data_ptr(), self.ws.data_ptr(), self.counters.data_ptr(),
                   packed.rows, half, m, x.stride(0), y.stride(0), min(grid or self.sms * self.ctas(m), units), probe)
        err = self.lib.w12_stream_gemm(ctypes.byref(p), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if err:
            raise RuntimeError(self.lib.w12_stream_error(err).decode())
        return y


def within_one_ulp(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="t128k64")
    ap.add_argument("--families", default="normal,student-t4")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,32,48,64")
    ap.add_argument("--probe", action="store_true", help="also time the loads alone (wrong results by design)")
    args = ap.parse_args()
    runs = {}
    for variant in args.variants.split(","):
        runs[variant] = Stream(build(variant), "cuda", variant)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for family in args.families.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            ws = [draw(family, n, k, seed=s, device="cuda") for s in range(3)]
            packs = [encode(w) for w in ws]
            w0 = decode(packs[0])
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
                t_tri = graph_time_us(lambda p: linear(x, p), packs)
                line = f"{family:10s} {name:8s} M={m:2d} cuBLAS {t_ref:6.1f}  triton x{t_ref / t_tri:.3f}"
                for variant, run in runs.items():
                    y = run(x, packs[0])
                    torch.cuda.synchronize()
                    ok = within_one_ulp(x, w0, y) and torch.equal(y, run(x, packs[0]))
                    t = graph_time_us(lambda p: run(x, p), packs)
                    line += f"  {variant} {'ok' if ok else 'WRONG'} {t:6.1f} x{t_ref / t:.3f}"
                    if args.probe:
                        probes = {pr: graph_time_us(lambda p, pr=pr: run(x, p, probe=pr), packs) for pr in (1, 8)}
                        line += f" ({run.ctas(m)}/SM; loads only {probes[1]:5.1f}, compute only {probes[8]:5.1f})"
                print(line, flush=True)
            del ws, packs, w0
            for run in runs.values():
                run.esc.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
