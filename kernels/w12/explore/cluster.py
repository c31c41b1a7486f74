"""The cluster kernel (csrc/w12_cluster.cu; issue #18 item 2, history only): compiled by nvcc at first use, launched
through ctypes; checked against float64 and timed under CUDA graphs over rotated weights beside cuBLAS and the
Triton kernel.

    PYTHONPATH=kernels python3 -m w12.explore.cluster            # check and time (log: cluster_h200.log)
    PYTHONPATH=kernels python3 -m w12.explore.cluster --probe    # parts left out (wrong results by design)
"""
from __future__ import annotations

import ctypes
import os
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

SOURCE = Path(__file__).with_name("csrc") / "w12_cluster.cu"


class Params(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("low", "codes", "base", "esc_ptr", "esc_col", "esc_bits", "x", "y")] + \
               [(name, ctypes.c_int32) for name in ("n", "half", "m", "ldx", "ldy", "clusters", "probe")]


def build() -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = Path(tempfile.mkdtemp()) / "w12_cluster.so"
    started = time.time()
    subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared",
                    "-Xcompiler", "-fPIC", "-o", str(out), str(SOURCE)], check=True)
    print(f"nvcc: {time.time() - started:.1f} s", flush=True)
    lib = ctypes.CDLL(str(out))
    lib.w12_cluster_gemm.restype = ctypes.c_int
    lib.w12_cluster_error.restype = ctypes.c_char_p
    assert lib.w12_cluster_params_size() == ctypes.sizeof(Params)
    return lib


def cluster_gemm(lib, x: torch.Tensor, packed: W12Tensor, clusters: int, probe: int = 0) -> torch.Tensor:
    m = x.shape[0]
    y = torch.empty((m, packed.rows), dtype=torch.bfloat16, device=x.device)
    p = Params(packed.low.data_ptr(), packed.codes.data_ptr(), packed.base.data_ptr(), packed.esc_ptr.data_ptr(),
               packed.esc_col.data_ptr(), packed.esc_bits.data_ptr(), x.data_ptr(), y.data_ptr(),
               packed.rows, packed.cols_padded // 2, m, x.stride(0), y.stride(0), clusters, probe)
    err = lib.w12_cluster_gemm(ctypes.byref(p), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if err:
        raise RuntimeError(lib.w12_cluster_error(err).decode())
    return y


def within_one_ulp(x, w, y) -> bool:
    ref = x.double() @ w.double().T
    bound = 2.0 ** -7 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(torch.all((y.double() - ref).abs() <= bound))


def probes(lib) -> None:
    """Where the time goes: the full kernel, without the cluster reduction (1), without decode and MMA (2), both."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("qkv", "gate_up"):
        n, k = SHAPES[name]
        ws = [draw("normal", n, k, seed=s, device="cuda") for s in range(3)]
        packs = [encode(w) for w in ws]
        clusters = min(sms // 8, -(-n // 128))
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
            times = [graph_time_us(lambda p, pr=pr: cluster_gemm(lib, x, p, clusters, pr), packs) for pr in range(4)]
            print(f"probe {name:8s} M={m:2d} cuBLAS {t_ref:6.1f}  full {times[0]:6.1f}  no reduction {times[1]:6.1f}  "
                  f"no decode/MMA {times[2]:6.1f}  loads only {times[3]:6.1f}", flush=True)
        del ws, packs
        torch.cuda.empty_cache()


def main() -> None:
    lib = build()
    if "--probe" in os.sys.argv:
        probes(lib)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for family in ("normal", "student-t4"):
        for name in ("qkv", "o", "gate_up"):
            n, k = SHAPES[name]
            ws = [draw(family, n, k, seed=s, device="cuda") for s in range(3)]
            packs = [encode(w) for w in ws]
            clusters = min(sms // 8, -(-n // 128))
            for m in (1, 16, 32, 64):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                y = cluster_gemm(lib, x, packs[0], clusters)
                torch.cuda.synchronize()
                ok = within_one_ulp(x, decode(packs[0]), y)
                again = torch.equal(y, cluster_gemm(lib, x, packs[0], clusters))
                diff = (y.float() - linear(x, packs[0]).float()).abs().max().item()
                t_ref = graph_time_us(lambda w: torch.nn.functional.linear(x, w), ws)
                t_tri = graph_time_us(lambda p: linear(x, p), packs)
                t_clu = graph_time_us(lambda p: cluster_gemm(lib, x, p, clusters), packs)
                print(f"{family:10s} {name:8s} M={m:2d} ulp-ok {ok} deterministic {again} |cluster-triton| {diff:.3g}  "
                      f"cuBLAS {t_ref:6.1f}  triton {t_tri:6.1f} (x{t_ref / t_tri:.3f})  "
                      f"cluster {t_clu:6.1f} (x{t_ref / t_clu:.3f})", flush=True)
            del ws, packs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    main()
