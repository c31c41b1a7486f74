"""float32 projections on CPU whose rows do not depend on the rows beside them: rowgemm.c, built on first use.

MKL runs a product of few rows through other kernels than a larger one, so batch invariance used to pad every
product to MIN_ROWS (16) rows (model.py). On the AMD EPYC this runtime is measured on, MKL's GEMM of 4-16 rows
costs about as much as that many one-row products: a decode step of SmolLM2-135M paid ~16x the bandwidth-bound
cost (benchmarks/reference_runtime.md). rowgemm.c sums every output element in one fixed order whatever the
number of rows or threads, so a decode step is one pass over the weights and needs no padding.

The library is compiled with the system C compiler (`cc`, or $CC) into $XDG_CACHE_HOME/specpilot_runtime (else
~/.cache/...), named by the digest of the source and the command, and written through a temporary file so a
half-built library is never loaded. `available()` is False where that cannot work (not x86-64 with AVX2 and FMA,
no compiler, or SPECPILOT_ROWGEMM=0): the model then keeps MKL with padded rows.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("specpilot_runtime")
SOURCE = Path(__file__).with_name("rowgemm.c")
TILE = 32  # columns per tile, the unit threads split (rowgemm.c's TILE)
PANEL = 16  # columns per packed panel, two to a tile (rowgemm.c's PANEL)
FLAGS = ["-O2", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_library: ctypes.CDLL | None = None
_unavailable: str | None = None


def available() -> bool:
    """Whether the kernel can run here, building and loading it on the first call."""
    global _library, _unavailable
    if _library is not None or _unavailable is not None:
        return _library is not None
    try:
        _library = _load()
    except (_Unavailable, OSError) as exc:  # OSError: an unwritable cache, a library that will not load
        _unavailable = str(exc)
        log.warning("rowgemm unavailable (%s): float32 CPU products use MKL with padded rows", exc)
    return _library is not None


class _Unavailable(Exception):
    pass


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _load() -> ctypes.CDLL:
    if os.environ.get("SPECPILOT_ROWGEMM", "1") == "0":
        raise _Unavailable("SPECPILOT_ROWGEMM=0")
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        raise _Unavailable("needs an x86-64 CPU with AVX2 and FMA")
    return build(SOURCE)


def build(path: Path) -> ctypes.CDLL:
    """The library compiled from `path` (rowgemm.c, or an older revision of it that a benchmark compares)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise _Unavailable(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    source = path.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specpilot_runtime"
    target = cache / f"rowgemm-{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run(
                [compiler, *FLAGS, str(path), "-o", str(built)], capture_output=True, text=True, check=False
            )
            if run.returncode != 0:
                raise _Unavailable(f"{compiler} failed on {path}: {run.stderr.strip().splitlines()[-1:]}")
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    library.rowgemm.restype = None
    pointer, size = ctypes.c_void_p, ctypes.c_long
    library.rowgemm.argtypes = [pointer, size, size, pointer, size, size, size, pointer, size, size, size, size]
    return library


class Packed:
    """A float32 weight [in, out] in rowgemm's layout: panels of PANEL columns, zero-padded to whole tiles,
    [2 * ceil(out / TILE), in, PANEL]."""

    def __init__(self, weight: torch.Tensor):
        k, n = weight.shape
        panels = -(-n // TILE) * (TILE // PANEL)
        padded = torch.zeros(k, panels * PANEL, dtype=torch.float32)
        padded[:, :n] = weight
        self.data = padded.view(k, panels, PANEL).transpose(0, 1).contiguous()
        self.shape = (k, n)

    def unpacked(self) -> torch.Tensor:
        """The [in, out] weight this was made from."""
        k, n = self.shape
        return self.data.transpose(0, 1).reshape(k, -1)[:, :n]


def mm(x: torch.Tensor, weight: Packed) -> torch.Tensor:
    """x [M, in] @ weight, float32 [M, out]; each row computed alone (see rowgemm.c)."""
    assert _library is not None, "rowgemm.available() first"
    k, n = weight.shape
    x = x.contiguous()
    if x.shape[-1] != k or x.dtype != torch.float32:
        raise ValueError(f"rowgemm: x {tuple(x.shape)} {x.dtype} does not fit a float32 [{k}, {n}] weight")
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    w = weight.data
    _library.rowgemm(x.data_ptr(), rows, k, w.data_ptr(), PANEL, k * PANEL, n, out.data_ptr(), 1, 0, 0, 0)
    return out


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., M, K] @ w [..., K, N] per batch entry (same leading shape, no broadcasting), float32; w may be a
    strided view (a cache's keys) whose rows are contiguous and N a multiple of TILE, the rest as `mm`."""
    assert _library is not None, "rowgemm.available() first"
    m, k = x.shape[-2:]
    n = w.shape[-1]
    if w.shape[:-2] != x.shape[:-2] or w.shape[-2] != k or n % TILE or {w.dtype, x.dtype} != {torch.float32}:
        raise ValueError(f"rowgemm: cannot multiply {tuple(x.shape)} {x.dtype} by {tuple(w.shape)} {w.dtype}")
    x3 = x.reshape(-1, m, k).contiguous()
    w3 = w.reshape(-1, k, n)  # a view where the leading dims merge (a cache slice), else a contiguous copy
    if w3.stride(-1) != 1:
        w3 = w3.contiguous()
    batch = x3.shape[0]
    out = torch.empty(batch, m, n, dtype=torch.float32)
    _library.rowgemm(
        x3.data_ptr(), m, k, w3.data_ptr(), w3.stride(1), PANEL, n, out.data_ptr(), batch, m * k, w3.stride(0), m * n
    )
    return out.view(*x.shape[:-1], n)
