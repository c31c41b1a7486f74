"""y = x @ W.T for a W12 weight through the warp-specialized wgmma kernel (csrc/w12_ws.cu, sm_90a, 1 <= M <= 64).

The kernel reads the weight's planes in format version 4's units layout (FORMAT.md: 128 rows x 64 columns of each
half, contiguous, in wgmma K order) and its escapes from a table of its own, grouped by unit and consumer
warp (`escape_table`), made once per weight. It is compiled by nvcc at first use, for the GPU at hand, into a
cache outside the package (an engine's files are content-addressed and re-hashed before it serves), and launched
through ctypes on torch's current stream. `WsPlan` holds one weight's launch for one M bucket, every argument that
depends only on the weight filled in, as gemm.Plan does for the Triton kernel.

It is launched as a programmatic dependent of the kernel ahead of it in the stream (PDL, `PDL`): its CTAs start as
that kernel's leave their SMs, and its producer loads the first stages' weight before waiting for that kernel to
complete (griddepcontrol.wait); x is read and y, the pieces and the counters written only after the wait. A plan
therefore synchronizes the device once when it is made, so that whatever wrote the weight is done. The Triton kernel
lets a following ws kernel launch early (gemm.TRIGGER); it is not launched as a dependent itself (that measured slower).

Imports only torch and the standard library: the GPU host may have nothing else.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import torch

from .format import UNIT_HALF, UNIT_ROWS

__all__ = ["WsPlan", "supported", "build", "escape_table", "cta_ranges", "BuildError"]

SOURCE = Path(__file__).with_name("csrc") / "w12_ws.cu"
TILE_ROWS = UNIT_ROWS  # rows per tile: the kernel's two consumer warpgroups of 64
WARP_ROWS = 16  # rows per consumer warp
MAX_M = 64
BUCKETS = (8, 16, 32, 64)  # the kernel's token tiles (8, 16, 32, 64 rows of x); a plan serves every M up to its own
MAX_UNITS_PER_CTA = 128  # csrc/w12_ws.cu kMaxUnits: a CTA stages its units' escape pointers at the start
ARCHES = {(9, 0): "sm_90a"}  # wgmma, TMA and setmaxnreg: sm_90a only
NVCC_FALLBACK = Path("/usr/local/cuda/bin/nvcc")
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
PDL = True  # launched as a programmatic dependent of the kernel ahead in the stream (csrc/w12_ws.cu grid_wait)


class Args(ctypes.Structure):
    """csrc/w12_ws.cu's Args, field for field (checked against w12_ws_params_size at load)."""

    _fields_ = [
        (name, ctypes.c_void_p) for name in ("planes", "base", "esc_ptr", "esc", "x", "y", "ws", "counters", "ranges")
    ] + [(name, ctypes.c_int32) for name in ("n", "half", "cols", "m", "ldx", "ldy", "grid", "pdl")]


# --- building ---------------------------------------------------------------------------------------------------


class BuildError(RuntimeError):
    """The kernel could not be compiled here (no nvcc, or nvcc failed): gemm runs the Triton kernel instead."""


def cache_dir() -> Path:
    """Where compiled kernels are kept: $SPECPILOT_W12_CACHE, else $XDG_CACHE_HOME/specpilot/w12, else
    ~/.cache/specpilot/w12."""
    if os.environ.get("SPECPILOT_W12_CACHE"):
        return Path(os.environ["SPECPILOT_W12_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specpilot" / "w12"


def find_nvcc() -> Path:
    """nvcc from $CUDA_HOME/bin, else PATH, else /usr/local/cuda/bin."""
    home = os.environ.get("CUDA_HOME")
    tried = []
    if home:
        tried.append(Path(home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        tried.append(Path(on_path))
    tried.append(NVCC_FALLBACK)
    for candidate in tried:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    looked = [
        f"$CUDA_HOME/bin/nvcc ({tried[0]})" if home else "$CUDA_HOME/bin/nvcc ($CUDA_HOME unset)",
        "nvcc on PATH (none)" if not on_path else f"PATH ({on_path})",
        str(NVCC_FALLBACK),
    ]
    raise BuildError(
        "the W12 ws kernel is compiled at first use and needs nvcc (CUDA 12.3 or later); tried " + ", ".join(looked)
    )


def arch_of(device=None) -> str:
    """The nvcc arch for a CUDA device (default: the current one); only compute capability 9.0 is taken."""
    capability = torch.cuda.get_device_capability(device)
    if capability not in ARCHES:
        raise RuntimeError(
            f"the W12 ws kernel runs on sm_90a only (compute capability 9.0: it uses wgmma, TMA and "
            f"setmaxnreg); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    return ARCHES[capability]


def nvcc_command(nvcc: Path, arch: str, out: Path) -> list[str]:
    number = arch.removeprefix("sm_")
    return [str(nvcc), *NVCC_FLAGS, f"-gencode=arch=compute_{number},code={arch}", "-o", str(out), str(SOURCE)]


@functools.cache
def _nvcc_version(nvcc: Path) -> str:
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout


def compiled(arch: str) -> Path:
    """The kernel's shared library for `arch`, compiled into cache_dir() unless already there. The name is keyed by
    the source, the nvcc version and the arch; a build goes to a temporary file in the same directory and is renamed
    into place, so concurrent builders never see a partial file."""
    nvcc = find_nvcc()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, _nvcc_version(nvcc).encode(), arch.encode(), " ".join(NVCC_FLAGS).encode()])
    ).hexdigest()
    directory = cache_dir()
    target = directory / f"w12_ws-{arch}-{key[:32]}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    try:
        done = subprocess.run(nvcc_command(nvcc, arch, Path(partial)), capture_output=True, text=True)
        if done.returncode:
            raise BuildError(f"nvcc failed on {SOURCE} (exit {done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _load(arch: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compiled(arch)))
    lib.w12_ws_gemm.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p]
    lib.w12_ws_gemm.restype = ctypes.c_int
    lib.w12_ws_error.argtypes = [ctypes.c_int]
    lib.w12_ws_error.restype = ctypes.c_char_p
    if lib.w12_ws_params_size() != ctypes.sizeof(Args):
        raise RuntimeError(
            f"{SOURCE.name}'s Args is {lib.w12_ws_params_size()} bytes, ws.Args "
            f"{ctypes.sizeof(Args)}: the two have drifted apart"
        )
    if lib.w12_ws_max_units() != MAX_UNITS_PER_CTA:
        raise RuntimeError(
            f"{SOURCE.name} takes {lib.w12_ws_max_units()} units per CTA, ws.py assumes {MAX_UNITS_PER_CTA}"
        )
    return lib


_BUILD_FAILED: dict[str, BuildError] = {}


def build(device=None) -> ctypes.CDLL:
    """The kernel's library for a CUDA device (default: the current one): compiled at first use (cache_dir()),
    loaded once per process. A failed build is not retried in this process (every weight and M bucket would run
    nvcc again): its BuildError is raised again."""
    arch = arch_of(device)
    if arch in _BUILD_FAILED:
        raise _BUILD_FAILED[arch]
    try:
        return _load(arch)
    except BuildError as err:
        _BUILD_FAILED[arch] = err
        raise


# --- the weight's side ------------------------------------------------------------------------------------------


@functools.cache
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _units(packed) -> int:
    return -(-packed.rows // TILE_ROWS) * (packed.half // UNIT_HALF)


def supported(packed, m: int) -> bool:
    """Whether the kernel takes this weight (format version 4) at M = m: M in 1..64, a CUDA weight on a device of
    compute capability 9.0, rows a multiple of 128, half a multiple of 64, cols a multiple of 8 (x's rows must start
    16 bytes apart for TMA), the planes in the units layout (contiguous), and at most MAX_UNITS_PER_CTA units
    per CTA with one CTA per SM."""
    planes = packed.units
    if not 1 <= m <= MAX_M or planes is None or not planes.is_cuda:
        return False
    capability, sms = _device_info(_index(planes.device))
    if capability not in ARCHES:
        return False
    rows, half = packed.rows, packed.half
    if rows % TILE_ROWS or half < UNIT_HALF or half % UNIT_HALF or packed.cols % 8 or packed.cols > 2 * half:
        return False
    layout = (rows // TILE_ROWS, half // UNIT_HALF, TILE_ROWS, 3 * UNIT_HALF)
    if (
        tuple(planes.shape) != layout
        or planes.dtype != torch.uint8
        or not planes.is_contiguous()
        or planes.data_ptr() % 16
    ):
        return False
    units = _units(packed)
    return -(-units // min(sms, units)) <= MAX_UNITS_PER_CTA


def escape_table(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The escapes as the kernel reads them: (esc int32 [escapes + 4], esc_ptr int32 [units * 8 + 1]). Entries are
    grouped by (unit, consumer warp): those of unit u = tile * (half / 64) + column block and warp w (rows 16 w ..
    16 w + 15 of the tile) are esc[esc_ptr[8 u + w] : esc_ptr[8 u + w + 1]], in the CSR's order (by row, then
    column). An entry is row in tile | column in unit << 7 | the weight's bf16 bits << 16, where column in unit is
    0..63 for the first half of K and 64..127 for the second (a column c >= half is c - half of the second). The 4
    zero entries at the end let the kernel copy whole 16-byte chunks."""
    rows, half = packed.rows, packed.half
    ks = half // UNIT_HALF
    slots = _units(packed) * (TILE_ROWS // WARP_ROWS)
    device = packed.esc_ptr.device
    counts = (packed.esc_ptr[1:] - packed.esc_ptr[:-1]).long()
    row = torch.repeat_interleave(torch.arange(rows, device=device), counts, output_size=packed.escapes)
    col = packed.esc_col.long()
    second = (col >= half).long()
    j = col - second * half
    in_tile = row % TILE_ROWS
    slot = ((row // TILE_ROWS) * ks + j // UNIT_HALF) * (TILE_ROWS // WARP_ROWS) + in_tile // WARP_ROWS
    entry = in_tile | ((j % UNIT_HALF + UNIT_HALF * second) << 7) | ((packed.esc_bits.long() & 0xFFFF) << 16)
    entry = entry[torch.argsort(slot, stable=True)]
    esc = torch.nn.functional.pad((entry - ((entry & 0x80000000) << 1)).to(torch.int32), (0, 4))
    esc_ptr = torch.zeros(slots + 1, dtype=torch.int32, device=device)
    esc_ptr[1:] = torch.cumsum(torch.bincount(slot, minlength=slots), 0)
    return esc, esc_ptr


def cta_ranges(tiles: int, ks: int, grid: int, device=None) -> torch.Tensor:
    """The kernel's stream-K split of tiles * ks units over grid CTAs, as int32 [grid + 1 + 2 * tiles]: first the
    boundaries (CTA c takes units c * units // grid up to (c + 1) * units // grid), then per tile the first and last
    CTA holding one of its units (equal for a tile done whole by one CTA; otherwise the first sums the pieces). Made
    on `device` by torch ops alone, so a plan can be made during CUDA-graph capture."""
    units = tiles * ks
    bounds = torch.arange(grid + 1, dtype=torch.int64, device=device) * units // grid
    firsts = torch.arange(tiles, dtype=torch.int64, device=device) * ks
    ctas = torch.stack(
        [
            torch.searchsorted(bounds, firsts, right=True) - 1,
            torch.searchsorted(bounds, firsts + ks - 1, right=True) - 1,
        ],
        1,
    )
    return torch.cat([bounds, ctas.flatten()]).to(torch.int32)


_WORKSPACES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(lib: ctypes.CDLL, index: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split tiles' fp32 pieces (w12_ws_slot_floats per SM) and 2 arrival counters per row tile (kept at zero
    between launches: the CTA that sums a tile resets them), shared by every plan on a device, which is safe for
    launches in one stream. Grown (outside CUDA-graph capture) when a weight has more tiles than any before it; a
    plan keeps the tensors it was made with, so a captured graph's stay alive."""
    pieces, counters = _WORKSPACES.get(index, (None, None))
    if pieces is None or counters.numel() < 2 * tiles:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the W12 ws workspace would grow inside CUDA-graph capture: make the plan (WsPlan) before capturing"
            )
        _, sms = _device_info(index)
        if pieces is None:
            pieces = torch.empty(sms * lib.w12_ws_slot_floats(), dtype=torch.float32, device=f"cuda:{index}")
        counters = torch.zeros(
            max(2 * tiles, 0 if counters is None else counters.numel()), dtype=torch.int32, device=f"cuda:{index}"
        )
        _WORKSPACES[index] = (pieces, counters)
    return pieces, counters


class WsPlan:
    """The ws kernel's launch for one weight and M bucket (8, 16, 32 or 64), prepared once: the escape table, the
    workspace and every weight-only argument. A call allocates y and fills in x, y and M. x is bf16 [m, cols] on
    the weight's device; one whose rows TMA cannot read in place (a stride along K other than 1, a row pitch not a
    multiple of 8 elements, an address not 16-byte aligned) is copied first. Not safe for concurrent calls from
    several threads (the arguments are filled in place) nor across streams running at once (the workspace is
    shared)."""

    def __init__(self, packed, bucket: int):
        if bucket not in BUCKETS:
            raise ValueError(f"a ws plan's bucket is one of {BUCKETS}, got {bucket}")
        if not supported(packed, bucket):
            raise ValueError(
                f"the W12 ws kernel does not take a {packed.rows} x {packed.cols} weight (half "
                f"{packed.half}) on {packed.device} at M <= {bucket} (see ws.supported)"
            )
        device = packed.units.device
        index = _index(device)
        self._lib = build(index)
        esc, esc_ptr = escape_table(packed)
        pieces, counters = _workspace(self._lib, index, -(-packed.rows // TILE_ROWS))
        base = packed.base if packed.base.data_ptr() % 16 == 0 else packed.base.clone()  # a bulk copy's source
        units = _units(packed)
        self.bucket, self.rows, self.cols, self.device = bucket, packed.rows, packed.cols, device
        self.grid = min(_device_info(index)[1], units)
        ranges = cta_ranges(-(-packed.rows // TILE_ROWS), packed.half // UNIT_HALF, self.grid, device)
        # the weight holds its plans (W12Tensor.plans): a strong reference back would make a cycle
        self._weight = weakref.ref(packed)
        self._held = (esc, esc_ptr, pieces, counters, base, ranges)  # what the arguments point at
        # cols is x's tensor-map width: TMA reads columns cols .. 2 * half - 1 (padding) as zeros
        self._args = Args(
            planes=packed.units.data_ptr(),
            base=base.data_ptr(),
            esc_ptr=esc_ptr.data_ptr(),
            esc=esc.data_ptr(),
            ws=pieces.data_ptr(),
            counters=counters.data_ptr(),
            ranges=ranges.data_ptr(),
            n=packed.rows,
            half=packed.half,
            cols=packed.cols,
            ldy=packed.rows,
            grid=self.grid,
            pdl=int(PDL),
        )
        # Launched as a programmatic dependent, the kernel reads the weight before the kernels ahead of it in the
        # stream are done: whatever wrote the planes and the escape table must be finished now.
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(device)
        self._ref = ctypes.byref(self._args)
        self._index = index
        self._stream_of = torch._C._cuda_getCurrentRawStream

    def __call__(self, x: torch.Tensor, m: int) -> torch.Tensor:
        if self._weight() is None:  # alive while its planes, whose address the arguments hold, are
            raise RuntimeError("this W12 ws plan outlived its weight")
        if (
            not 1 <= m <= self.bucket
            or x.shape != (m, self.cols)
            or x.dtype != torch.bfloat16
            or x.device != self.device
        ):
            raise ValueError(
                f"a ws plan for M <= {self.bucket} of a {self.rows} x {self.cols} weight takes bf16 x "
                f"[m, {self.cols}] on {self.device} with 1 <= m <= {self.bucket}, got m = {m} and "
                f"{x.dtype} {list(x.shape)} on {x.device}"
            )
        ldx = x.stride(0) if m > 1 else self.cols
        if x.stride(1) != 1 or ldx % 8 or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
            ldx = self.cols
        y = torch.empty((m, self.rows), dtype=torch.bfloat16, device=self.device)
        args = self._args
        args.x, args.y, args.m, args.ldx = x.data_ptr(), y.data_ptr(), m, ldx
        if torch.cuda.current_device() == self._index:
            err = self._lib.w12_ws_gemm(self._ref, self._stream_of(self._index))
        else:
            with torch.cuda.device(self._index):
                err = self._lib.w12_ws_gemm(self._ref, self._stream_of(self._index))
        if err:
            raise RuntimeError(f"W12 ws kernel: {self._lib.w12_ws_error(err).decode()}")
        return y
