"""W12: a lossless 12-bit container for bf16 weights (see FORMAT.md).

Each bf16 weight keeps its low byte (the exponent's last bit and the 7-bit mantissa) in a byte plane,
and its sign plus a 3-bit code for the high byte's 7 exponent bits, relative to its row's base, in a
nibble plane (a window of 16 exponents starting at an even one). A weight whose exponent lies outside
its row's window is stored as code 0 with sign and low byte 0 (it reads as 2^(2*base-127)) and recorded
exactly in a row-sorted side table.

The planes are stored in one of two layouts (FORMAT.md, version 4): "rows" (row by row, columns in their
natural order: the Triton kernel's) or "units" (128 rows x 64 columns of each half of K, each unit
contiguous and, within every 64 columns, in the order the CUDA kernel's wgmma fragments take them). Which one a
matrix gets is measured per shape, for GPUs that run the CUDA kernel (`preferred_layout`, layouts_h200.json).

Works on CPU and GPU tensors alike (plain PyTorch integer ops).
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

WINDOW = 8  # exponent >> 1 in base .. base+7 is coded 0..7 (16 exponents)
MIN_BASE, MAX_BASE = 0, 120  # base + 7 <= 127: a byte-wise add of base and code never reaches the sign bit
LAYOUTS = ("rows", "units")
UNIT_ROWS = 128  # rows of a unit (the planes' rows are padded up to a multiple)
UNIT_HALF = 64  # columns of each half of K in a unit (cols are padded up to a multiple of 2 * UNIT_HALF)
UNIT_ROW_BYTES = 3 * UNIT_HALF  # one row of a unit: first-half low bytes | second-half low bytes | code bytes


def k_order(width: int, device=None) -> torch.Tensor:
    """The column stored at each position, for `width` (a multiple of 64) columns: within every 64, stored byte
    16t + 4k + j holds column 16k + (2t, 2t + 1, 2t + 8, 2t + 9)[j] (t, k, j in 0..3), so that lane t of a wgmma
    finds its four K steps of a row in 16 contiguous bytes."""
    p = torch.arange(UNIT_HALF, device=device)
    t, k, j = p // 16, (p // 4) % 4, p % 4
    within = 16 * k + 2 * t + (j % 2) + 8 * (j // 2)
    return (torch.arange(0, width, UNIT_HALF, device=device)[:, None] + within[None, :]).reshape(-1)


def load_layouts(path: Path) -> dict[tuple[int, int], str]:
    """A layout table: JSON {"rows,cols": layout} ("_" keys are comments); ValueError naming the file and key. An
    absent file is an empty table, with a warning naming it (every matrix then keeps the row layout)."""
    if not path.exists():
        warnings.warn(f"W12: {path} is missing: every matrix keeps the row layout", stacklevel=2)
        return {}
    entries = json.loads(path.read_text())
    table = {}
    for key, layout in entries.items():
        if key.startswith("_"):
            continue
        parts = key.split(",")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"{path}: key {key!r} is not rows,cols")
        if layout not in LAYOUTS:
            raise ValueError(f"{path}: {key} has layout {layout!r}, not one of {', '.join(LAYOUTS)}")
        table[int(parts[0]), int(parts[1])] = layout
    return table


@functools.cache
def _layout_table() -> dict[tuple[int, int], str]:
    return load_layouts(Path(__file__).with_name("layouts_h200.json"))


def preferred_layout(rows: int, cols: int, device=None) -> str:
    """The layout measured faster for a [rows, cols] matrix on the H200 (layouts_h200.json), for a matrix on a GPU
    that runs the ws kernel (compute capability 9.0); "rows" otherwise (the Triton kernel reads rows faster)."""
    layout = _layout_table().get((rows, cols), "rows")
    return layout if layout == "rows" or _runs_units(device) else "rows"


def _runs_units(device) -> bool:
    device = torch.device(device) if device is not None else None
    return device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@dataclass
class W12Tensor:
    """A bf16 matrix [rows, cols] in W12 form. `shape` is the original tensor's shape. The planes are held either
    row by row (`low` and `codes`; layout "rows") or as units (`units`; layout "units"), never both."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    low: torch.Tensor | None  # "rows": uint8 [rows, cols_padded], the bf16 low byte, exponent & 1 << 7 | mantissa
    codes: torch.Tensor | None  # "rows": uint8 [rows, cols_padded // 2]: byte j = nib[j] | nib[j + half] << 4,
    # nib = sign << 3 | code
    units: torch.Tensor | None  # "units": uint8 [row tiles, half // 64, 128, 192]: unit (tile, u) holds rows
    # 128 tile .. +127, for each the low bytes of columns 64 u .. +63 of both halves,
    # then their code bytes, all in k_order (tile_planes)
    base: torch.Tensor  # uint8 [rows]: the value of exponent >> 1 that code 0 stands for
    esc_ptr: torch.Tensor  # int32 [rows + 1]: escapes of row r are esc_ptr[r] .. esc_ptr[r+1]-1
    esc_col: torch.Tensor  # int32 [escapes]: column, ascending within a row
    esc_bits: torch.Tensor  # int16 [escapes]: the weight's exact bf16 bit pattern
    plans: dict = field(default_factory=dict, repr=False, compare=False)  # GEMM launches by M bucket (gemm.Plan)
    # The same matrix in bf16, kept only where the GEMM falls back to cuBLAS for some M buckets
    # (gemm.keep_dense); those buckets run F.linear on it.
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)
    dense_buckets: tuple[int, ...] = field(default=(), repr=False, compare=False)
    heavy_blocks: bool | None = field(default=None, repr=False, compare=False)  # gemm.heavy's answer, once known

    def __post_init__(self):
        if (self.units is None) == (self.low is None or self.codes is None):
            raise ValueError("a W12Tensor holds its planes either as low and codes (rows) or as units, not both")

    @property
    def layout(self) -> str:
        return "units" if self.units is not None else "rows"

    @property
    def half(self) -> int:
        return self.codes.shape[1] if self.units is None else self.units.shape[1] * UNIT_HALF

    @property
    def cols_padded(self) -> int:
        return 2 * self.half

    @property
    def escapes(self) -> int:
        return self.esc_col.numel()

    @property
    def device(self) -> torch.device:
        return self.base.device

    def nbytes(self) -> int:
        """Bytes stored, metadata and escapes included (the shape tuple aside)."""
        parts = [getattr(self, name) for name in _TENSOR_FIELDS]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes() / max(1, self.rows * self.cols)

    def to(self, device) -> W12Tensor:
        moved = {
            name: None if getattr(self, name) is None else getattr(self, name).to(device) for name in _TENSOR_FIELDS
        }
        dense = None if self.dense is None else self.dense.to(device)
        return W12Tensor(self.shape, self.rows, self.cols, **moved, dense=dense, dense_buckets=self.dense_buckets)


_TENSOR_FIELDS = ("low", "codes", "units", "base", "esc_ptr", "esc_col", "esc_bits")


def encode(weight: torch.Tensor, layout: str | None = None) -> W12Tensor:
    """Encode a bf16 tensor (any shape; the last dim is the GEMM's K) losslessly, its planes in `layout` (default:
    preferred_layout for its [rows, cols] on its device)."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"W12 encodes bf16 tensors, got {weight.dtype}")
    shape = tuple(weight.shape)
    cols = shape[-1] if len(shape) >= 1 else 1
    rows = weight.numel() // cols if cols else 0
    if cols == 0 or rows == 0:
        raise ValueError(f"W12 cannot encode an empty tensor of shape {shape}")
    layout = layout or preferred_layout(rows, cols, weight.device)
    if layout not in LAYOUTS:
        raise ValueError(f"W12 layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    bits = weight.contiguous().view(torch.int16).reshape(rows, cols).to(torch.int32) & 0xFFFF
    cols_padded = padded_cols(cols, layout)
    if cols_padded != cols:  # padding columns, dropped again by decode
        bits = torch.nn.functional.pad(bits, (0, cols_padded - cols))

    low = bits & 0xFF
    high = (bits >> 8) & 0x7F  # exponent >> 1
    base = _best_base(high[:, :cols])
    code = high - base[:, None]
    escaped = (code < 0) | (code >= WINDOW)
    escaped[:, cols:] = True  # padding columns: stored like escapes, but not listed
    nib = ((bits >> 12) & 0x8) | code
    nib = torch.where(escaped, torch.zeros_like(nib), nib)
    low = torch.where(escaped, torch.zeros_like(low), low)

    half = cols_padded // 2
    packed_codes = nib[:, :half] | (nib[:, half:] << 4)

    escaped[:, cols:] = False
    esc_row, esc_col = escaped.nonzero(as_tuple=True)  # row-major order: sorted by row, then column
    esc_bits = bits[esc_row, esc_col]
    counts = torch.bincount(esc_row, minlength=rows)
    esc_ptr = torch.zeros(rows + 1, dtype=torch.int32, device=weight.device)
    esc_ptr[1:] = torch.cumsum(counts, 0)
    return W12Tensor(
        shape=shape,
        rows=rows,
        cols=cols,
        **_stored(low.to(torch.uint8), packed_codes.to(torch.uint8), layout),
        base=base.to(torch.uint8),
        esc_ptr=esc_ptr,
        esc_col=esc_col.to(torch.int32),
        esc_bits=_as_int16(esc_bits),
    )


def decode(packed: W12Tensor) -> torch.Tensor:
    """Rebuild the original bf16 tensor, bit for bit."""
    bits = decode_planes(packed)
    if packed.escapes:
        row = torch.repeat_interleave(
            torch.arange(packed.rows, device=packed.device),
            (packed.esc_ptr[1:] - packed.esc_ptr[:-1]).long(),
        )
        bits[row, packed.esc_col.long()] = packed.esc_bits.to(torch.int32) & 0xFFFF
    bits = bits[:, : packed.cols]
    return _as_int16(bits).contiguous().view(torch.bfloat16).reshape(packed.shape)


def cat(parts: list[W12Tensor]) -> W12Tensor:
    """Stack W12 matrices along rows (e.g. q, k, v into one qkv), as encode(torch.cat(weights)) would (in the
    layout preferred for the stacked shape)."""
    if not parts:
        raise ValueError("w12.cat needs at least one tensor")
    cols = parts[0].cols
    if any(p.cols != cols or len(p.shape) != 2 for p in parts):
        raise ValueError(f"w12.cat needs 2-D tensors of equal width, got {[p.shape for p in parts]}")
    offsets, ptrs = 0, []
    for p in parts:
        ptrs.append(p.esc_ptr[:-1] + offsets)
        offsets += p.escapes
    ptrs.append(torch.tensor([offsets], dtype=torch.int32, device=parts[0].device))
    rows = sum(p.rows for p in parts)
    layout = preferred_layout(rows, cols, parts[0].device)
    rowwise = [row_planes(p, padded_cols(cols, layout)) for p in parts]
    return W12Tensor(
        shape=(rows, cols),
        rows=rows,
        cols=cols,
        **_stored(torch.cat([low for low, _ in rowwise]), torch.cat([codes for _, codes in rowwise]), layout),
        base=torch.cat([p.base for p in parts]),
        esc_ptr=torch.cat(ptrs).to(torch.int32),
        esc_col=torch.cat([p.esc_col for p in parts]),
        esc_bits=torch.cat([p.esc_bits for p in parts]),
    )


def _stored(low: torch.Tensor, codes: torch.Tensor, layout: str) -> dict:
    """W12Tensor's plane fields for row-wise planes in `layout`."""
    if layout == "rows":
        return dict(low=low, codes=codes, units=None)
    return dict(low=None, codes=None, units=tile_planes(low, codes))


def tile_planes(low: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Row-wise planes (low uint8 [rows, cols_padded], codes uint8 [rows, half], half a multiple of 64, columns in
    their natural order) -> units [row tiles, half // 64, 128, 192], padding rows zero."""
    rows, half = codes.shape
    tiles, ks = -(-rows // UNIT_ROWS), half // UNIT_HALF
    pad = (0, 0, 0, tiles * UNIT_ROWS - rows)
    order = k_order(half, low.device)
    parts = [
        torch.nn.functional.pad(plane[:, order], pad).reshape(tiles, UNIT_ROWS, ks, UNIT_HALF)
        for plane in (low[:, :half], low[:, half:], codes)
    ]
    return torch.cat(parts, dim=3).permute(0, 2, 1, 3).contiguous()


def padded_cols(cols: int, layout: str) -> int:
    """The planes' width: even for "rows", a multiple of 2 * UNIT_HALF for "units"."""
    step = 2 if layout == "rows" else 2 * UNIT_HALF
    return -(-cols // step) * step


def row_planes(packed: W12Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes row by row, columns in their natural order: (low [rows, width], codes [rows, width // 2]), width
    (default cols_padded; at least cols, even) reached by adding or dropping padding columns."""
    if packed.units is None:
        low, codes = packed.low, packed.codes
    else:
        tiles, ks = packed.units.shape[:2]
        rowwise = packed.units.permute(0, 2, 1, 3).reshape(tiles * UNIT_ROWS, ks, UNIT_ROW_BYTES)[: packed.rows]
        natural = torch.argsort(k_order(packed.half, packed.device))
        low1, low2, codes = (
            rowwise[:, :, i * UNIT_HALF : (i + 1) * UNIT_HALF].reshape(packed.rows, -1)[:, natural] for i in range(3)
        )
        low = torch.cat([low1, low2], dim=1)
    width = width or packed.cols_padded
    if width == packed.cols_padded:
        return low, codes
    if width < packed.cols or width % 2:
        raise ValueError(f"planes of {packed.cols} columns cannot be {width} wide")
    # low is indexed by column whatever the half; codes pair column j with j + half, so they are paired anew
    nib = torch.cat([codes & 0xF, codes >> 4], dim=1)
    grow = (0, width - packed.cols_padded)
    low, nib = torch.nn.functional.pad(low, grow), torch.nn.functional.pad(nib, grow)
    return low, nib[:, : width // 2] | (nib[:, width // 2 :] << 4)


def decode_planes(packed: W12Tensor) -> torch.Tensor:
    """int32 bit patterns [rows, cols] as the GEMM kernels see them (escapes: base << 8)."""
    low, codes = row_planes(packed)
    codes = codes.to(torch.int32)
    nib = torch.cat([codes & 0xF, codes >> 4], dim=1)
    high = (nib & 0x7) + packed.base.to(torch.int32)[:, None]
    return (((nib & 0x8) << 12) | (high << 8) | low.to(torch.int32))[:, : packed.cols]


def _best_base(high: torch.Tensor) -> torch.Tensor:
    """Per row, the base whose window of WINDOW values of exponent >> 1 holds the most weights."""
    rows = high.shape[0]
    hist = torch.zeros(rows, 128, dtype=torch.int32, device=high.device)
    hist.scatter_add_(1, high, torch.ones_like(high))
    csum = torch.nn.functional.pad(torch.cumsum(hist, 1), (1, 0))  # csum[:, v] = count below v
    starts = torch.arange(MIN_BASE, MAX_BASE + 1, device=high.device)
    covered = csum[:, starts + WINDOW] - csum[:, starts]
    return starts[torch.argmax(covered, dim=1)]  # first maximum: deterministic


def _as_int16(bits32: torch.Tensor) -> torch.Tensor:
    """Low 16 bits of int32 values as int16 (two's complement wrap)."""
    return (bits32 - ((bits32 & 0x8000) << 1)).to(torch.int16)
