"""y = x @ W.T with W in W12 form, decoded tile by tile in registers (Triton).

Small M (decode and spec-decode verification, M <= 64) runs a fused kernel: the Triton one here, or for the shapes and M
buckets where the H200 found it faster the warp-specialized CUDA kernel of ws.py (`Config.kernel`, on weights stored
as units). Each Triton program streams BLOCK_N rows of the planes, in either layout (FORMAT.md; for units it reorders
the loaded activations to the planes' K order), optionally one K range of them (split K), rebuilds bf16 bit patterns
four at a time with byte-parallel integer ops (inline PTX; plain Triton ops under the interpreter) and feeds them to
tl.dot, as the B operand (x as A, m16) or, with `swap`, as the A operand with x.T as an n8/n16 B operand
(fewer instructions per weight; the H200 picks it for M <= 16). An escaped weight reads as
w_planes = 2^(2*base-127) there; the program then adds x[:, col] * (w - w_planes) for its rows'
escapes as two more small bf16 dots (exact products), so in exact arithmetic the sum is the GEMM
with the original weights; accumulation is fp32. Larger M decodes W to bf16 once and calls cuBLAS (on the kept
bf16 copy, if any).
Where the escapes are added is part of the config: after the main loop in the first K range, or a chunk
per main-loop step over every K range (`esc_step`); their activations come from x or from a transposed copy
made per call (`xt`: one contiguous run per escape). The tuned configs differ by the weight's escape count
(`heavy`), as the fastest choice does (benchmarks/w12_gemm.md).

Where even the tuned kernel is slower than cuBLAS (M buckets 32 and 64 on most shapes: benchmarks/w12_gemm.md), a weight may
keep its bf16 matrix too (`keep_dense`: memory for speed, the caller's choice); those buckets then run F.linear on
it. Which buckets fall back is measured per shape and escape class (fallback_<gpu>.json).

Tables per GPU model: `tuned_<gpu>.json` and `fallback_<gpu>.json` for the GPU this process runs on (`TABLE_GPU`:
h100 or h200, from the CUDA device's name; `W12_TABLES=<gpu>` chooses another, to measure one GPU's tables on
another). A GPU with no tables of its own runs the H200's, with a warning naming the GPU; `TABLES` records which
files are in use, for what an engine reports.

Per call, Python work is what varies: a `Plan` (one per weight and M bucket, made on the first call or by
`prepare`) holds the compiled kernel, its grid and every launch argument that depends only on the weight,
and launches through Triton's C launcher directly (no argument binding or specialisation per call).
On compute capability 9.0 and later each program signals programmatic dependent launch at its start (`TRIGGER`), so
that a ws kernel next in the stream (launched as a dependent, ws.py) starts loading its weight during this kernel's
last wave.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents

from .format import UNIT_HALF, UNIT_ROW_BYTES, UNIT_ROWS, W12Tensor, decode

FUSED_MAX_M = 64
BUCKETS = (8, 16, 32, 64)  # M buckets: a config (and a Plan) serves every M up to its bucket


@dataclass(frozen=True)
class Config:
    block_n: int = 32
    block_k: int = 256  # half-columns per main-loop step (columns of each half of K): a multiple of 64
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # accumulate y.T = W @ x.T (weights as the dot's A operand, x.T as B)
    split_k: int = 1  # programs per row block, each over a K range; the last one sums
    block_m: int = 0  # rows of x per dot: 0 = the M bucket, at least 16 (8 needs swap: MMA n = 8)
    esc_after: bool = False  # load this block's escape entries after the main loop (fewer live registers)
    esc_step: int = 0  # > 0: add this many escape entries per main-loop step, spread over the loop (and
    # over the split-K ranges) instead of all after it
    xt: bool = False  # gather the escapes' activations from a transposed copy of x (x.T [K, M bucket],
    # made per call): one contiguous run per escape instead of M scattered values
    kernel: str = "triton"  # or "ws": the CUDA kernel of ws.py where it runs (ws.supported), else the Triton
    # kernel with the fields above

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"Config.kernel is one of {', '.join(KERNELS)}, got {self.kernel!r}")


KERNELS = ("triton", "ws")


HEAVY_ESCAPES = 2e-4  # escapes per weight from which a weight takes the "heavy" configs (Student-t, outlier columns)
BLOCK_ROWS = 32  # the row blocks whose escape density decides the class


def heavy(packed: W12Tensor) -> bool:
    """Whether the weight takes the heavy configs: the 90th percentile of its escape density per 32-row block is
    at least HEAVY_ESCAPES. A program's time follows its own block's escapes, so a weight whose escapes cluster in
    a tenth of its rows (stories260K's real rows: 0.6e-4 on average, 4e-4 in the 90th-percentile block) is heavy.
    Reads the escape pointers to the host on the first call (so not inside CUDA-graph capture: a Plan is made,
    and this asked, by the eager call before it) and keeps the answer on the weight."""
    if packed.heavy_blocks is None:
        if packed.rows < BLOCK_ROWS:
            packed.heavy_blocks = packed.escapes >= HEAVY_ESCAPES * packed.rows * packed.cols
        else:
            ptr = packed.esc_ptr.to("cpu", torch.float64)
            per_block = (ptr[BLOCK_ROWS::BLOCK_ROWS] - ptr[:-BLOCK_ROWS:BLOCK_ROWS]) / (BLOCK_ROWS * packed.cols)
            packed.heavy_blocks = bool(torch.quantile(per_block, 0.9) >= HEAVY_ESCAPES)
    return packed.heavy_blocks


def tuned_key(name: str) -> tuple[int, int, int, bool]:
    """ "N,K,bucket" (weights with few escapes) or "N,K,bucket,heavy" -> (N, K, bucket, heavy)."""
    parts = name.split(",")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "heavy"):
        raise ValueError(f"a tuned config key is N,K,bucket or N,K,bucket,heavy, got {name!r}")
    return int(parts[0]), int(parts[1]), int(parts[2]), len(parts) == 4


def tuned_name(key: tuple) -> str:
    return ",".join(map(str, key[:3])) + (",heavy" if len(key) > 3 and key[3] else "")


def _load_table(name: str, value) -> dict[tuple[int, int, int, bool], object]:
    """A JSON table beside this module keyed "N,K,bucket[,heavy]" ("_" keys are comments), each entry mapped by
    `value`; empty, with a warning naming the file, when the file is absent."""
    path = Path(__file__).with_name(name)
    if not path.exists():
        warnings.warn(f"W12: {path} is missing: every shape runs untuned defaults", stacklevel=2)
        return {}
    entries = json.loads(path.read_text())
    return {tuned_key(key): value(entry) for key, entry in entries.items() if not key.startswith("_")}


TABLE_GPUS = {"H100": "h100", "H200": "h200"}  # a substring of torch.cuda.get_device_name() -> its tables' suffix
DEFAULT_TABLE_GPU = "h200"


def table_gpu() -> str:
    """Whose tables this process uses: W12_TABLES if set, else the current CUDA device's model, else the H200's."""
    forced = os.environ.get("W12_TABLES")
    if forced:
        if forced not in TABLE_GPUS.values():
            raise ValueError(f"W12_TABLES={forced!r}: tables exist for {', '.join(sorted(TABLE_GPUS.values()))}")
        return forced
    if not torch.cuda.is_available():
        return DEFAULT_TABLE_GPU
    name = torch.cuda.get_device_name()
    for part, gpu in TABLE_GPUS.items():
        if part in name:
            return gpu
    warnings.warn(f"W12: no tuned tables for {name}: running the H200's (tuned_h200.json)", stacklevel=2)
    return DEFAULT_TABLE_GPU


TABLE_GPU = table_gpu()
TABLES = {"gpu": TABLE_GPU, "tuned": f"tuned_{TABLE_GPU}.json", "fallback": f"fallback_{TABLE_GPU}.json"}
# Configs picked on TABLE_GPU, keyed by (N, K, M bucket: 8, 16, 32 or 64, heavy)
TUNED: dict[tuple[int, int, int, bool], Config] = _load_table(TABLES["tuned"], lambda cfg: Config(**cfg))
# The fused kernel's speed over cuBLAS at each bucket's largest M, measured on TABLE_GPU (written by
# `specpilot_lab.w12_bench --save-fallback`, promoted by `make w12-promote`)
SPEEDUPS: dict[tuple[int, int, int, bool], float] = _load_table(TABLES["fallback"], lambda e: float(e["speedup"]))
DEFAULT_FALLBACK = (32, 64)  # unmeasured: W12 was below cuBLAS at M = 32 on 22 of 24 shape x family cases
# and at M = 64 on all 24 (benchmarks/w12_gemm.md)


def fallback_buckets(n: int, k: int, many_escapes: bool = False) -> tuple[int, ...]:
    """The M buckets in which cuBLAS on a bf16 copy beats the fused kernel for this shape and escape class: those
    measured below 1.0 (the heavy class takes the light measurement where it has none), else DEFAULT_FALLBACK."""

    def slower(bucket: int) -> bool:
        for key in ((n, k, bucket, True), (n, k, bucket, False)) if many_escapes else ((n, k, bucket, False),):
            if key in SPEEDUPS:
                return SPEEDUPS[key] < 1.0
        return bucket in DEFAULT_FALLBACK

    return tuple(b for b in BUCKETS if slower(b))


def keep_dense(packed: W12Tensor, weight: torch.Tensor) -> bool:
    """Keep `weight` (the bf16 matrix `packed` encodes) beside it when some M bucket of this shape falls back to
    cuBLAS; returns whether it was kept. The copy must decode-equal the planes (checked here, bit for bit):
    the fallback computes with exactly the weights the kernel would."""
    buckets = fallback_buckets(packed.rows, packed.cols, heavy(packed))
    if not buckets:
        return False
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != tuple(packed.shape) or weight.device != packed.device:
        raise ValueError(
            f"a dense copy must be the bf16 {tuple(packed.shape)} matrix on {packed.device}, got "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    decoded = decode_on_device(packed) if weight.is_cuda else decode(packed)
    if not torch.equal(decoded.view(torch.int16), weight.view(torch.int16)):
        raise ValueError("the dense copy differs from the W12 matrix it is meant to stand in for")
    packed.dense, packed.dense_buckets = weight.reshape(packed.rows, packed.cols), buckets
    return True


@functools.cache
def default_config(n: int, k: int, bucket: int) -> Config:
    """For shapes not in TUNED (bucket: M <= 8, 16, 32 or 64): the tiles the H200 runs favoured on the four
    benchmark shapes, with split K so that ~480 programs stream weights when the row blocks alone are
    fewer (as for N = 5120 there). A heuristic from those runs, not measured on other shapes."""
    block_n = 32 if bucket <= 16 else 64
    blocks = -(-n // block_n)
    split = 1 if k < 4096 or blocks >= 300 else max(1, min(4, round(480 / blocks)))
    if bucket <= 16:
        return Config(block_n, 128, 2, 3, swap=True, block_m=bucket, split_k=split)
    return Config(block_n, 128, 4, 3, split_k=split, esc_after=True)


def bucket_of(m: int) -> int:
    for bucket in BUCKETS:
        if m <= bucket:
            return bucket
    raise ValueError(f"the fused W12 kernel takes at most {FUSED_MAX_M} rows, got {m}")


def pick_config(n: int, k: int, bucket: int, many_escapes: bool = False) -> Config:
    """The tuned config for the shape and bucket (the heavy one for a weight with many escapes, where tuned),
    else bucket 16's for bucket 8, else default_config."""
    for b in (bucket, 16) if bucket == 8 else (bucket,):
        cfg = (many_escapes and TUNED.get((n, k, b, True))) or TUNED.get((n, k, b, False))
        if cfg:
            return cfg
    return default_config(n, k, bucket)


def config_for(packed: W12Tensor, bucket: int) -> Config:
    return pick_config(packed.rows, packed.cols, bucket, heavy(packed))


def linear(
    x: torch.Tensor, packed: W12Tensor, bias: torch.Tensor | None = None, config: Config | None = None
) -> torch.Tensor:
    """F.linear(x, decode(packed), bias) for bf16 x of shape [..., K]."""
    if x.shape[-1] != packed.cols or len(packed.shape) != 2:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match W12 weight {packed.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.cols)
    m = x2.shape[0]
    if m <= FUSED_MAX_M and x2.is_cuda and config is None and x2.dtype == torch.bfloat16:
        bucket = bucket_of(m)
        if bucket in packed.dense_buckets:
            y = torch.nn.functional.linear(x2, packed.dense, bias)
        else:
            plan = packed.plans.get(bucket) or prepare(packed, bucket)
            y = plan(x2.contiguous(), m)
            if bias is not None:
                y = y + bias
    elif m <= FUSED_MAX_M and (x2.is_cuda or _interpreting()):
        y = fused_gemm(x2, packed, config)
        if bias is not None:
            y = y + bias
    elif packed.dense is not None:
        y = torch.nn.functional.linear(x2, packed.dense, bias)
    elif x2.is_cuda:
        y = decoded_linear(x2, packed, bias)
    else:
        y = torch.nn.functional.linear(x2, decode(packed), bias)
    return y.reshape(*lead, packed.rows)


def prepare(packed: W12Tensor, bucket: int, config: Config | None = None):
    """Compile (or find) the kernel for this weight and M bucket and keep its launch ready on the weight: the CUDA
    kernel's (ws.WsPlan) where the config names it and it runs, else the Triton kernel's (Plan)."""
    cfg = config or config_for(packed, bucket)
    plan = _ws_plan(packed, bucket, cfg) or Plan(packed, bucket, cfg)
    packed.plans[bucket] = plan
    return plan


def _ws_plan(packed: W12Tensor, bucket: int, cfg: Config):
    if cfg.kernel != "ws":
        return None
    from . import ws

    made = packed.plans.get(bucket)
    if isinstance(made, ws.WsPlan):
        return made
    if not ws.supported(packed, bucket):
        return None
    try:
        plan = ws.WsPlan(packed, bucket)
    except ws.BuildError as err:  # e.g. no nvcc on this host: the Triton kernel reads the units too, slower
        warnings.warn(
            f"W12: the ws kernel is not available ({str(err).splitlines()[0]}); running the Triton kernel instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    packed.plans.setdefault(bucket, plan)  # fused_gemm's calls make it once too, as prepare's do
    return plan


def decode_on_device(
    packed: W12Tensor,
    first: int = 0,
    end: int | None = None,
    out: torch.Tensor | None = None,
    escape_rows: torch.Tensor | None = None,
):
    """decode(packed)[first:end] in one Triton pass over those rows' planes plus an escape scatter, into `out` (rows
    end - first, or one more: escapes of other rows are written to that last row, so no escape count is read
    back to the host and the call is CUDA-graph safe) or a new tensor. `escape_rows` (_escape_rows) saves a caller
    decoding several slabs of one weight from making it per slab."""
    end = packed.rows if end is None else end
    count = end - first
    if out is None:
        out = torch.empty((count + (packed.escapes > 0), packed.cols), dtype=torch.bfloat16, device=packed.device)
    whole = first == 0 and end == packed.rows
    half = packed.cols_padded // 2
    grid = (triton.cdiv(count, 16), triton.cdiv(half, 256))
    low, nib, tile_stride = _plane_args(packed)
    _w12_decode_kernel[grid](
        low,
        nib,
        packed.base,
        out,
        first,
        end,
        half,
        packed.cols,
        tile_stride,
        BLOCK_R=16,
        BLOCK_K=256,
        UNITS=packed.units is not None,
        PTX=not _interpreting(),
        num_warps=4,
    )
    if packed.escapes:
        rows = _escape_rows(packed) if escape_rows is None else escape_rows
        if whole:
            out.view(torch.int16)[rows, packed.esc_col.long()] = packed.esc_bits
        else:
            if out.shape[0] <= count:
                raise ValueError(f"decoding rows {first}..{end} of a weight with escapes needs one spare row in out")
            local = torch.where((rows >= first) & (rows < end), rows - first, count)
            out.view(torch.int16)[local, packed.esc_col.long()] = packed.esc_bits
    return out[:count].reshape(packed.shape if whole else (count, packed.cols))


def _escape_rows(packed: W12Tensor) -> torch.Tensor:
    """The row of each escape (made per call, from esc_ptr and the host's escape count: no read-back)."""
    counts = (packed.esc_ptr[1:] - packed.esc_ptr[:-1]).long()
    return torch.repeat_interleave(torch.arange(packed.rows, device=packed.device), counts, output_size=packed.escapes)


SCRATCH_BYTES = int(os.environ.get("W12_SCRATCH_MIB", "64")) << 20
_SCRATCH: dict[torch.device, torch.Tensor] = {}


def scratch_bytes(device: torch.device | str) -> int:
    """The bytes the > 64-row path holds on `device` beside the W12 weights (0 before its first call)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _SCRATCH.get(device)
    return 0 if buf is None else buf.numel() * buf.element_size()


def slab_rows(packed: W12Tensor) -> int:
    """Rows decoded at a time by the > 64-row path: as many whole 128-row tiles as fit SCRATCH_BYTES (one at least)."""
    fit = SCRATCH_BYTES // (2 * packed.cols) // UNIT_ROWS * UNIT_ROWS
    return min(packed.rows, max(UNIT_ROWS, fit))


def decoded_linear(x2: torch.Tensor, packed: W12Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x2 [M, K] with the decoded weight, slab by slab through one scratch buffer per device (no bf16
    copy of the whole weight is ever made: at most SCRATCH_BYTES, or one 128-row slab, plus a row)."""
    slab = slab_rows(packed)
    need = (slab + 1) * packed.cols
    buf = _SCRATCH.get(packed.device)
    if buf is None or buf.numel() < need:
        buf = _SCRATCH[packed.device] = torch.empty(
            max(need, SCRATCH_BYTES // 2), dtype=torch.bfloat16, device=packed.device
        )
    out = buf[:need].view(slab + 1, packed.cols)
    y = torch.empty((x2.shape[0], packed.rows), dtype=x2.dtype, device=x2.device)
    rows = _escape_rows(packed) if packed.escapes else None
    for first in range(0, packed.rows, slab):
        end = min(first + slab, packed.rows)
        weight = decode_on_device(packed, first, end, out[: end - first + 1], rows)
        y[:, first:end] = torch.nn.functional.linear(x2, weight)
    return y if bias is None else y + bias


def fused_gemm(x: torch.Tensor, packed: W12Tensor, config: Config | None = None) -> torch.Tensor:
    m, k = x.shape
    if m > FUSED_MAX_M:
        raise ValueError(f"the fused W12 kernel takes at most {FUSED_MAX_M} rows, got {m}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"W12 GEMM takes bf16 activations, got {x.dtype}")
    x = x.contiguous()
    config = config or config_for(packed, bucket_of(m))
    ws_plan = x.is_cuda and _ws_plan(packed, bucket_of(m), config)
    if ws_plan:
        return ws_plan(x, m)
    y = torch.empty((m, packed.rows), dtype=torch.bfloat16, device=x.device)
    grid, args, meta = _launch_args(packed, bucket_of(m), config)
    args.update(
        x_ptr=x,
        y_ptr=y,
        M=m,
        stride_xm=x.stride(0),
        stride_ym=y.stride(0),
        g_ptr=transposed(x, bucket_of(m)) if config.xt else x,
    )  # x is contiguous: _launch_args' strides hold
    _w12_gemm_kernel[grid](**args, **meta)
    return y


def transposed(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """x.T as [K, bucket] (columns M .. bucket - 1 left unset: the kernel masks them)."""
    xt = torch.empty((x.shape[1], bucket), dtype=x.dtype, device=x.device)
    xt[:, : x.shape[0]].copy_(x.t())
    return xt


def _plane_args(packed: W12Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernels' low_ptr, nib_ptr and TILE_STRIDE: the two row-wise planes, or the units twice and the bytes
    from one row tile to the next."""
    if packed.units is None:
        return packed.low, packed.codes, 0
    return packed.units, packed.units, packed.units.stride(0)


def _launch_args(packed: W12Tensor, bucket: int, cfg: Config) -> tuple[tuple, dict, dict]:
    """Grid, kernel arguments (x, y and M left for the caller) and compile-time parameters."""
    n, k = packed.rows, packed.cols
    if packed.units is not None and cfg.block_k % UNIT_HALF:
        raise ValueError(
            f"block_k must be a multiple of {UNIT_HALF} half-columns (a unit's width) for the units layout, got {cfg}"
        )
    block_m = cfg.block_m if cfg.block_m >= bucket else max(16, bucket)
    half = packed.cols_padded // 2
    per_block = packed.escapes * cfg.block_n / max(1, n)
    esc_block = min(128, max(16, triton.next_power_of_2(int(1.5 * per_block) + 1)))
    row_blocks = triton.cdiv(n, cfg.block_n)
    partials, counters = _split_workspace(
        packed.device, cfg.split_k * FUSED_MAX_M * n if cfg.split_k > 1 else 0, row_blocks
    )
    low, nib, tile_stride = _plane_args(packed)
    args = dict(
        x_ptr=None,
        low_ptr=low,
        nib_ptr=nib,
        base_ptr=packed.base,
        esc_ptr_ptr=packed.esc_ptr,
        esc_col_ptr=packed.esc_col,
        esc_bits_ptr=packed.esc_bits,
        y_ptr=None,
        part_ptr=partials,
        count_ptr=counters,
        g_ptr=None,
        M=0,
        N=n,
        K=k,
        HALF=half,
        TILE_STRIDE=tile_stride,
        stride_xm=k,
        stride_ym=n,
        stride_gm=1 if cfg.xt else k,
        stride_gk=bucket if cfg.xt else 1,
    )
    meta = dict(
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        ESC_BLOCK=esc_block,
        SPLIT=cfg.split_k > 1,
        SWAP=cfg.swap,
        EVEN_K=(half % cfg.block_k == 0 and k == 2 * half),
        ESC_AFTER=cfg.esc_after,
        ESC_STEP=cfg.esc_step,
        MAX_M=FUSED_MAX_M,
        UNITS=packed.units is not None,
        PTX=not _interpreting(),
        DOT_F32=_interpreting(),
        TRIGGER=TRIGGER and _pdl_capable(packed.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return (row_blocks, cfg.split_k), args, meta


class Plan:
    """The fused kernel's launch for one weight and M bucket, prepared once. A call allocates y and hands
    Triton's C launcher the argument tuple with x, y and M filled in: pointers as integers, nothing bound,
    specialised or looked up per call. x must be contiguous, bf16, on the weight's device, 16-byte aligned."""

    def __init__(self, packed: W12Tensor, bucket: int, config: Config | None = None):
        n, k = packed.rows, packed.cols
        cfg = config or config_for(packed, bucket)
        grid, args, meta = _launch_args(packed, bucket, cfg)
        probe_x = torch.empty((bucket, k), dtype=torch.bfloat16, device=packed.device)
        probe_y = torch.empty((bucket, n), dtype=torch.bfloat16, device=packed.device)
        args.update(
            x_ptr=probe_x,
            y_ptr=probe_y,
            M=bucket,
            g_ptr=torch.empty((k, bucket), dtype=torch.bfloat16, device=packed.device) if cfg.xt else probe_x,
        )
        kernel = _w12_gemm_kernel.warmup(**args, **meta, grid=grid)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        self.config, self.bucket, self.rows, self.device = cfg, bucket, n, packed.device
        # the weight holds its plans (W12Tensor.plans); a strong reference back would make a cycle that keeps
        # freed planes on the GPU until the cycle collector runs
        self._weight = weakref.ref(packed)
        self._grid = grid
        self._launch = kernel.run
        self._head = (kernel.function, kernel.packed_metadata, None, None, None)
        values = [t.data_ptr() if isinstance(t, torch.Tensor) else t for name, t in args.items()] + [
            meta[name] for name in _CONSTEXPRS
        ]
        names = list(args) + list(_CONSTEXPRS)
        self._x, self._y, self._m = names.index("x_ptr"), names.index("y_ptr"), names.index("M")
        self._g, self._xt = names.index("g_ptr"), cfg.xt
        self._args = values
        self._stream_of = torch._C._cuda_getCurrentRawStream
        self._index = packed.device.index if packed.device.index is not None else torch.cuda.current_device()

    def __call__(self, x: torch.Tensor, m: int) -> torch.Tensor:
        packed = self._weight()  # alive while its planes, whose addresses the arguments hold, are
        if packed is None:
            raise RuntimeError("this W12 launch plan outlived its weight")
        if m > self.bucket or x.data_ptr() % 16 or _launch_hooked():
            return fused_gemm(x, packed, self.config)
        y = torch.empty((m, self.rows), dtype=torch.bfloat16, device=self.device)
        args = self._args
        args[self._x], args[self._y], args[self._m] = x.data_ptr(), y.data_ptr(), m
        xt = transposed(x, self.bucket) if self._xt else None  # held until the launch is enqueued
        args[self._g] = args[self._x] if xt is None else xt.data_ptr()
        self._launch(self._grid[0], self._grid[1], 1, self._stream_of(self._index), *self._head, *args)
        return y


def _launch_hooked() -> bool:
    """A profiler's launch hook is set (Triton 3.6: a function; later: a HookChain with calls): the plain
    launch path then runs, which feeds the hook its metadata."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


_CONSTEXPRS = (
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "ESC_BLOCK",
    "SPLIT",
    "SWAP",
    "EVEN_K",
    "ESC_AFTER",
    "ESC_STEP",
    "MAX_M",
    "UNITS",
    "PTX",
    "DOT_F32",
    "TRIGGER",
)


_WORKSPACES: dict = {}
_RETIRED: list = []


def _split_workspace(device, need_parts: int, row_blocks: int):
    """fp32 partial sums (need_parts floats) and per-row-block arrival counters (kept at zero between
    launches: the last program of a block resets its counter). Shared by all W12 GEMMs on a device,
    which is safe for launches in one stream; grown outside CUDA-graph capture (warm up first)."""
    parts, counts = _WORKSPACES.get(device, (None, None))
    if need_parts and (parts is None or parts.numel() < need_parts or counts.numel() < row_blocks):
        size_p = max(need_parts, 0 if parts is None else parts.numel())
        size_c = max(row_blocks, 0 if counts is None else counts.numel())
        _RETIRED.append(_WORKSPACES.get(device))  # a captured CUDA graph may still point at them
        parts = torch.empty(size_p, dtype=torch.float32, device=device)
        counts = torch.zeros(size_c, dtype=torch.int32, device=device)
        _WORKSPACES[device] = (parts, counts)
    if parts is None:  # no split yet: any valid pointer will do, allocated once
        parts = counts = torch.zeros(1, dtype=torch.int32, device=device)
        _WORKSPACES[device] = (parts, counts)
    return parts, counts


# Programmatic dependent launch (compute capability >= 9.0): the Triton kernel lets the kernel after it launch once all
# its programs have started; only the ws kernel is launched as a dependent (the Triton kernel as one measured slower
# in the 64-layer stack: its many programs per SM hold SMs the next kernels want).
TRIGGER = True


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


# Four weights per instance: $2 = 4 low bytes (stored as is), $3 = 4 code-plane bytes, $4 = base x4.
# The bf16 high byte is sign << 7 | (base + code): the code's sign bit moves to bit 7 and the 3-bit code
# adds to the base byte-wise (no carries: base + 7 <= 127); two byte permutes interleave the high and low
# bytes into two bf16x2 registers. Six integer ops per four weights.
_DECODE_PTX = """
{
.reg .b32 t, h;
%s
add.u32 t, t, $4;
or.b32 h, h, t;
prmt.b32 $0, $2, h, 0x5140;
prmt.b32 $1, $2, h, 0x7362;
}
"""
_PTX_LOW = tl.constexpr(_DECODE_PTX % "and.b32 t, $3, 0x07070707;\nshl.b32 h, $3, 4;\nand.b32 h, h, 0x80808080;")
_PTX_HIGH = tl.constexpr(_DECODE_PTX % "shr.b32 t, $3, 4;\nand.b32 t, t, 0x07070707;\nand.b32 h, $3, 0x80808080;")


@triton.jit
def _decode(low, nib, base, HIGH: tl.constexpr, PTX: tl.constexpr):
    """uint8 low bytes [BN, BK], uint8 code-plane bytes [BN, BK], uint8 base [BN] -> bf16."""
    if PTX:
        base_b = tl.broadcast_to(base[:, None], low.shape)
        if HIGH:
            return tl.inline_asm_elementwise(
                _PTX_HIGH, "=r,=r,r,r,r", [low, nib, base_b], dtype=tl.bfloat16, is_pure=True, pack=4
            )
        else:
            return tl.inline_asm_elementwise(
                _PTX_LOW, "=r,=r,r,r,r", [low, nib, base_b], dtype=tl.bfloat16, is_pure=True, pack=4
            )
    else:
        if HIGH:
            code = nib.to(tl.int32) >> 4
        else:
            code = nib.to(tl.int32) & 0xF
        high = (code & 0x7) + base.to(tl.int32)[:, None]
        bits = ((code & 0x8) << 12) | (high << 8) | low.to(tl.int32)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


# The units layout (format.py, FORMAT.md) as the Triton kernels see it: a unit is _U_ROWS rows of _U_ROW_BYTES bytes
# (first-half low bytes, second-half low bytes, code bytes: _U_HALF each), _U_BYTES in all.
_U_ROWS = tl.constexpr(UNIT_ROWS)
_U_HALF = tl.constexpr(UNIT_HALF)
_U_ROW_BYTES = tl.constexpr(UNIT_ROW_BYTES)
_U_BYTES = tl.constexpr(UNIT_ROWS * UNIT_ROW_BYTES)


@triton.jit
def _unit_rows(planes_ptr, rows, TILE_STRIDE):
    """Pointers [R, 1, 1] to each row's bytes in its row tile's first unit."""
    r64 = rows.to(tl.int64)
    return planes_ptr + ((r64 // _U_ROWS) * TILE_STRIDE + (r64 % _U_ROWS) * _U_ROW_BYTES)[:, None, None]


@triton.jit
def _unit_cols(k0, BLOCK_K: tl.constexpr):
    """Offsets [1, G, _U_HALF] of half-columns k0 .. k0 + BLOCK_K (k0 a multiple of _U_HALF) in their units."""
    groups = k0 // _U_HALF + tl.arange(0, BLOCK_K // _U_HALF)
    return (groups * _U_BYTES)[None, :, None] + tl.arange(0, _U_HALF)[None, None, :]


@triton.jit
def _unit_groups(k0, HALF, BLOCK_K: tl.constexpr):
    """The mask [1, G, 1] of _unit_cols' groups inside the planes (HALF half-columns)."""
    return ((k0 + tl.arange(0, BLOCK_K // _U_HALF) * _U_HALF) < HALF)[None, :, None]


@triton.jit
def _load_planes(at, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, mask, MASKED: tl.constexpr):
    """The first-half low bytes, second-half low bytes and code bytes at `at` [ROWS, G, 64], as [ROWS, BLOCK_K]
    each (stored order); with MASKED, the groups outside `mask` read 0."""
    if MASKED:
        low_a = tl.load(at, mask=mask, other=0)
        low_b = tl.load(at + _U_HALF, mask=mask, other=0)
        nib = tl.load(at + 2 * _U_HALF, mask=mask, other=0)
    else:
        low_a = tl.load(at)
        low_b = tl.load(at + _U_HALF)
        nib = tl.load(at + 2 * _U_HALF)
    return (tl.reshape(low_a, (ROWS, BLOCK_K)), tl.reshape(low_b, (ROWS, BLOCK_K)), tl.reshape(nib, (ROWS, BLOCK_K)))


@triton.jit
def _stored_order(x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [ROWS, BLOCK_K] in their natural order -> in the planes' (format.k_order): natural column
    64g + 16k + 8jb + 2t + ja is stored at 64g + 16t + 4k + 2jb + ja."""
    x = tl.reshape(x, (ROWS, BLOCK_K // 64, 4, 2, 4, 2))
    return tl.reshape(tl.permute(x, (0, 1, 4, 2, 3, 5)), (ROWS, BLOCK_K))


@triton.jit
def _natural_order(w, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """_stored_order's inverse."""
    w = tl.reshape(w, (ROWS, BLOCK_K // 64, 4, 4, 2, 2))
    return tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (ROWS, BLOCK_K))


@triton.jit
def _w12_decode_kernel(
    low_ptr,
    nib_ptr,
    base_ptr,
    out_ptr,
    FIRST,
    ROWS,
    HALF,
    COLS,
    TILE_STRIDE,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNITS: tl.constexpr,
    PTX: tl.constexpr,
):
    """Rows FIRST .. ROWS - 1 of the weight, decoded to bf16 at out_ptr's rows 0 ..; escapes are left as the planes
    read them (the caller scatters them)."""
    rows = FIRST + tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    rmask = rows < ROWS
    mask = rmask[:, None] & (offs_k < HALF)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    base = tl.load(base_ptr + rows, mask=rmask, other=0)
    if UNITS:
        at = _unit_rows(low_ptr, tl.minimum(rows, ROWS - 1), TILE_STRIDE) + _unit_cols(k0, BLOCK_K)
        low_a, low_b, nib = _load_planes(at, BLOCK_R, BLOCK_K, _unit_groups(k0, HALF, BLOCK_K), True)
        w_lo = _natural_order(_decode(low_a, nib, base, False, PTX), BLOCK_R, BLOCK_K)
        w_hi = _natural_order(_decode(low_b, nib, base, True, PTX), BLOCK_R, BLOCK_K)
    else:
        nib = tl.load(nib_ptr + r64 * HALF + offs_k[None, :], mask=mask, other=0)
        low_a = tl.load(low_ptr + r64 * (2 * HALF) + offs_k[None, :], mask=mask, other=0)
        low_b = tl.load(low_ptr + r64 * (2 * HALF) + HALF + offs_k[None, :], mask=mask, other=0)
        w_lo = _decode(low_a, nib, base, False, PTX)
        w_hi = _decode(low_b, nib, base, True, PTX)
    o64 = (rows - FIRST).to(tl.int64)[:, None]
    tl.store(out_ptr + o64 * COLS + offs_k[None, :], w_lo, mask=mask & (offs_k < COLS)[None, :])
    tl.store(out_ptr + o64 * COLS + HALF + offs_k[None, :], w_hi, mask=mask & ((HALF + offs_k) < COLS)[None, :])


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # Triton 3.9's interpreter computes bf16 dots wrongly; bf16 -> fp32 is exact, so the
    # interpreter runs the same sums in fp32. Compiled code keeps the bf16 tensor-core dot.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gather(g_ptr, xrows, xmask, stride_gm, stride_gk, col, emask):
    """x[:, col_e] as [BM, E], read from x (stride_gk 1) or from x.T (stride_gm 1)."""
    return tl.load(
        g_ptr + xrows[:, None] * stride_gm + col[None, :] * stride_gk, mask=xmask[:, None] & emask[None, :], other=0.0
    )


@triton.jit
def _add_escapes(acc, xg, wbits, emask, offs_e, row_lo, row_hi, neg_planes, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += x[:, col_e] * (w_e - w_planes) in column row_e, as two bf16 dots of [BM, E] x [E, BN]."""
    mine = (offs_e[:, None] >= row_lo[None, :]) & (offs_e[:, None] < row_hi[None, :]) & emask[:, None]
    w_e = wbits.to(tl.bfloat16, bitcast=True)
    true_w = tl.where(mine, w_e[:, None], 0.0).to(tl.bfloat16)  # [E, BN]
    undo = tl.where(mine, neg_planes[None, :], 0.0).to(tl.bfloat16)  # [E, BN]
    if SWAP:
        acc = _dot(tl.trans(true_w), tl.trans(xg), acc, DOT_F32)
        acc = _dot(tl.trans(undo), tl.trans(xg), acc, DOT_F32)
    else:
        acc = _dot(xg, true_w, acc, DOT_F32)
        acc = _dot(xg, undo, acc, DOT_F32)
    return acc


@triton.jit
def _escape_chunk(
    acc,
    e0,
    esc_end,
    g_ptr,
    xrows,
    xmask,
    stride_gm,
    stride_gk,
    esc_col_ptr,
    esc_bits_ptr,
    row_lo,
    row_hi,
    neg_planes,
    CHUNK: tl.constexpr,
    SWAP: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """_add_escapes for the entries e0 .. e0 + CHUNK - 1 (those below esc_end)."""
    offs_e = e0 + tl.arange(0, CHUNK)
    emask = offs_e < esc_end
    col = tl.load(esc_col_ptr + offs_e, mask=emask, other=0)
    wbits = tl.load(esc_bits_ptr + offs_e, mask=emask, other=0)
    xg = _gather(g_ptr, xrows, xmask, stride_gm, stride_gk, col, emask)
    return _add_escapes(acc, xg, wbits, emask, offs_e, row_lo, row_hi, neg_planes, SWAP, DOT_F32)


@triton.jit(do_not_specialize=["M"])
def _w12_gemm_kernel(
    x_ptr,
    low_ptr,
    nib_ptr,
    base_ptr,
    esc_ptr_ptr,
    esc_col_ptr,
    esc_bits_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    g_ptr,
    M,
    N,
    K,
    HALF,
    TILE_STRIDE,
    stride_xm,
    stride_ym,
    stride_gm,
    stride_gk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ESC_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    ESC_AFTER: tl.constexpr,
    ESC_STEP: tl.constexpr,
    MAX_M: tl.constexpr,
    UNITS: tl.constexpr,
    PTX: tl.constexpr,
    DOT_F32: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    if TRIGGER:  # every program has started: a ws kernel next in the stream may launch (ws.py: PDL)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped: weight loads need no row mask
    offs_m = tl.arange(0, BLOCK_M)
    xmask = offs_m < M  # masked, not clamped: no traffic for padding rows
    base = tl.load(base_ptr + rows)
    # An escaped weight reads as bits base << 8; its correction subtracts x * that value.
    neg_planes = ((base.to(tl.int32) << 8) | 0x8000).to(tl.int16).to(tl.bfloat16, bitcast=True)

    # This block's first escapes, loaded before the main loop so their latency hides behind it (or, with
    # ESC_AFTER, after it: their registers then do not stay live through the loop).
    first_row = pid * BLOCK_N
    esc_start = tl.load(esc_ptr_ptr + first_row)
    esc_end = tl.load(esc_ptr_ptr + tl.minimum(first_row + BLOCK_N, N))
    if ESC_STEP == 0:
        esc_end = tl.where(pid_k == 0, esc_end, esc_start)  # split K: the first range adds them
    row_lo = tl.load(esc_ptr_ptr + rows)
    row_hi = tl.where(offs_n < N, tl.load(esc_ptr_ptr + rows + 1), row_lo)
    offs_e = esc_start + tl.arange(0, ESC_BLOCK)
    emask = offs_e < esc_end
    if not ESC_AFTER and ESC_STEP == 0:
        col = tl.load(esc_col_ptr + offs_e, mask=emask, other=0)
        wbits = tl.load(esc_bits_ptr + offs_e, mask=emask, other=0)

    if UNITS:  # low_ptr: the units (FORMAT.md)
        unit_rows = _unit_rows(low_ptr, rows, TILE_STRIDE)
    else:
        low_rows = low_ptr + rows.to(tl.int64)[:, None] * (2 * HALF)
        nib_rows = nib_ptr + rows.to(tl.int64)[:, None] * HALF
    x_rows = x_ptr + offs_m[:, None] * stride_xm

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(tl.cdiv(HALF, BLOCK_K), splits)
    k_first = pid_k * steps * BLOCK_K
    k_last = tl.minimum(HALF, k_first + steps * BLOCK_K)
    for k0 in range(k_first, k_last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if UNITS:
            at = unit_rows + _unit_cols(k0, BLOCK_K)
            if EVEN_K:
                low_a, low_b, nib = _load_planes(at, BLOCK_N, BLOCK_K, None, False)
            else:
                low_a, low_b, nib = _load_planes(at, BLOCK_N, BLOCK_K, _unit_groups(k0, HALF, BLOCK_K), True)
        else:
            if EVEN_K:
                nib = tl.load(nib_rows + offs_k[None, :])
                low_a = tl.load(low_rows + offs_k[None, :])
                low_b = tl.load(low_rows + HALF + offs_k[None, :])
            else:
                wmask = (offs_k < HALF)[None, :]
                nib = tl.load(nib_rows + offs_k[None, :], mask=wmask, other=0)
                low_a = tl.load(low_rows + offs_k[None, :], mask=wmask, other=0)
                low_b = tl.load(low_rows + HALF + offs_k[None, :], mask=wmask, other=0)
        if EVEN_K:
            x_lo = tl.load(x_rows + offs_k[None, :], mask=xmask[:, None], other=0.0)
            x_hi = tl.load(x_rows + HALF + offs_k[None, :], mask=xmask[:, None], other=0.0)
        else:
            kmask = (offs_k < HALF) & (offs_k < K)  # (units: padding columns may reach into the first half)
            x_lo = tl.load(x_rows + offs_k[None, :], mask=xmask[:, None] & kmask[None, :], other=0.0)
            hmask = (HALF + offs_k) < K
            x_hi = tl.load(x_rows + HALF + offs_k[None, :], mask=xmask[:, None] & hmask[None, :], other=0.0)
        if UNITS:
            x_lo = _stored_order(x_lo, BLOCK_M, BLOCK_K)
            x_hi = _stored_order(x_hi, BLOCK_M, BLOCK_K)
        w_lo = _decode(low_a, nib, base, False, PTX)
        w_hi = _decode(low_b, nib, base, True, PTX)
        if SWAP:
            acc = _dot(w_lo, tl.trans(x_lo), acc, DOT_F32)
            acc = _dot(w_hi, tl.trans(x_hi), acc, DOT_F32)
        else:
            acc = _dot(x_lo, tl.trans(w_lo), acc, DOT_F32)
            acc = _dot(x_hi, tl.trans(w_hi), acc, DOT_F32)
        if ESC_STEP > 0:
            # chunk c of the block's escapes belongs to range c % splits; this range adds one per step
            e0 = esc_start + (((k0 - k_first) // BLOCK_K) * splits + pid_k) * ESC_STEP
            if e0 < esc_end:
                acc = _escape_chunk(
                    acc,
                    e0,
                    esc_end,
                    g_ptr,
                    offs_m,
                    xmask,
                    stride_gm,
                    stride_gk,
                    esc_col_ptr,
                    esc_bits_ptr,
                    row_lo,
                    row_hi,
                    neg_planes,
                    ESC_STEP,
                    SWAP,
                    DOT_F32,
                )

    if ESC_STEP > 0:  # the chunks left over when the block has more escapes than steps
        done = tl.maximum(0, tl.cdiv(k_last - k_first, BLOCK_K)) * splits
        for e0 in range(esc_start + (done + pid_k) * ESC_STEP, esc_end, splits * ESC_STEP):
            acc = _escape_chunk(
                acc,
                e0,
                esc_end,
                g_ptr,
                offs_m,
                xmask,
                stride_gm,
                stride_gk,
                esc_col_ptr,
                esc_bits_ptr,
                row_lo,
                row_hi,
                neg_planes,
                ESC_STEP,
                SWAP,
                DOT_F32,
            )
    else:
        if ESC_AFTER:
            col = tl.load(esc_col_ptr + offs_e, mask=emask, other=0)
            wbits = tl.load(esc_bits_ptr + offs_e, mask=emask, other=0)
        xg = _gather(g_ptr, offs_m, xmask, stride_gm, stride_gk, col, emask)
        acc = _add_escapes(acc, xg, wbits, emask, offs_e, row_lo, row_hi, neg_planes, SWAP, DOT_F32)
        for e0 in range(esc_start + ESC_BLOCK, esc_end, ESC_BLOCK):  # rarely taken: many escapes
            acc = _escape_chunk(
                acc,
                e0,
                esc_end,
                g_ptr,
                offs_m,
                xmask,
                stride_gm,
                stride_gk,
                esc_col_ptr,
                esc_bits_ptr,
                row_lo,
                row_hi,
                neg_planes,
                ESC_BLOCK,
                SWAP,
                DOT_F32,
            )

    if SWAP:
        acc = tl.trans(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ymask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if not SPLIT:
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=ymask)
    else:
        # Each range stores its fp32 partial; the last to arrive sums them in a fixed order.
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * (MAX_M * N), acc, mask=ymask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(part + s * (MAX_M * N), mask=ymask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(tl.bfloat16), mask=ymask)
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")
