"""The CUDA C++ W12 GEMM (csrc/w12_gemm.cu) for M <= 64: compiled with nvcc at first use, cached per
source, compiler and GPU architecture, loaded with ctypes and launched with the weight's arguments packed once.

Cache: $W12_CACHE_DIR or ~/.cache/w12, one folder per digest of (source, `nvcc --version`, sm_XY); the
library is built in a temporary folder and renamed into place, so concurrent first uses never see half a file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .format import W12Tensor

SOURCE = Path(__file__).with_name("csrc") / "w12_gemm.cu"
STEP = 64           # half-columns per kernel step: the kernel needs half % 64 == 0
ROWS = 128          # rows of W per CTA
STAGES = (2, 3, 4, 5)   # cp.async pipeline depths compiled in


class Params(ctypes.Structure):
    _fields_ = [("low", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("base", ctypes.c_void_p),
                ("esc_ptr", ctypes.c_void_p), ("esc_col", ctypes.c_void_p), ("esc_bits", ctypes.c_void_p),
                ("partials", ctypes.c_void_p), ("counters", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("half", ctypes.c_int32), ("splits", ctypes.c_int32),
                ("stages", ctypes.c_int32)]


class CudaKernelUnavailable(RuntimeError):
    pass


def nvcc() -> str:
    for candidate in (os.environ.get("W12_NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                 "bin", "nvcc"), shutil.which("nvcc")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise CudaKernelUnavailable("nvcc not found (set W12_NVCC or CUDA_HOME)")


def supported(packed: W12Tensor) -> bool:
    """The CUDA kernel's shape rules: even K, K/2 a multiple of 64, a CUDA weight."""
    half = packed.cols_padded // 2
    return packed.device.type == "cuda" and packed.cols == 2 * half and half % STEP == 0


@functools.lru_cache(maxsize=None)
def library(arch: str) -> ctypes.CDLL:
    compiler = nvcc()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    flags = os.environ.get("W12_NVCC_FLAGS", "").split()
    digest = hashlib.sha256(source + version.encode() + arch.encode() + " ".join(flags).encode()).hexdigest()[:20]
    folder = Path(os.environ.get("W12_CACHE_DIR", Path.home() / ".cache" / "w12")) / f"{arch}-{digest}"
    lib_path = folder / "libw12_gemm.so"
    if not lib_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / lib_path.name
            cmd = [compiler, "-O3", f"-arch={arch}", *flags, "--shared", "-Xcompiler", "-fPIC", "-o", str(out), str(SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise CudaKernelUnavailable(f"nvcc failed on {SOURCE.name}:\n{done.stderr[-2000:]}")
            os.replace(out, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    lib.w12_gemm.argtypes = [ctypes.POINTER(Params), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.w12_gemm.restype = ctypes.c_int
    lib.w12_error_string.restype = ctypes.c_char_p
    if lib.w12_params_size() != ctypes.sizeof(Params):
        raise CudaKernelUnavailable("w12_gemm.cu's Params does not match cuda.Params")
    return lib


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class CudaPlan:
    """The CUDA kernel's launch for one weight: the weight's pointers packed once in a Params struct; a call
    passes x, y, M and the stream. x: contiguous bf16 [M, K], 16-byte aligned, M <= 64."""

    def __init__(self, packed: W12Tensor, splits: int, stages: int, partials: torch.Tensor,
                 counters: torch.Tensor):
        if stages not in STAGES:
            raise ValueError(f"the CUDA W12 kernel runs {STAGES} pipeline stages, not {stages}")
        if not supported(packed):
            raise CudaKernelUnavailable(f"the CUDA W12 kernel needs K/2 % {STEP} == 0, got K = {packed.cols}")
        self._lib = library(arch_of(packed.device))
        self._keep = (packed, partials, counters)
        self.params = Params(packed.low.data_ptr(), packed.codes.data_ptr(), packed.base.data_ptr(),
                             packed.esc_ptr.data_ptr(), packed.esc_col.data_ptr(), packed.esc_bits.data_ptr(),
                             partials.data_ptr(), counters.data_ptr(), packed.rows, packed.cols,
                             packed.cols_padded // 2, splits, stages)
        self._params_ref = ctypes.byref(self.params)
        self.rows, self.cols, self.device = packed.rows, packed.cols, packed.device
        self._stream_of = torch._C._cuda_getCurrentRawStream
        self._index = packed.device.index if packed.device.index is not None else torch.cuda.current_device()

    def __call__(self, x: torch.Tensor, m: int) -> torch.Tensor:
        y = torch.empty((m, self.rows), dtype=torch.bfloat16, device=self.device)
        err = self._lib.w12_gemm(self._params_ref, x.data_ptr(), y.data_ptr(), m, self.cols, self.rows,
                                 self._stream_of(self._index))
        if err:
            raise RuntimeError(f"w12 CUDA GEMM launch failed: {self._lib.w12_error_string(err).decode()}")
        return y
