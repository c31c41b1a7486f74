"""W12: a lossless 12-bit container for bf16 weights (see FORMAT.md).

Each bf16 weight keeps its low byte (the exponent's last bit and the 7-bit mantissa) in a byte plane,
and its sign plus a 3-bit code for the high byte's 7 exponent bits, relative to its row's base, in a
nibble plane (a window of 16 exponents starting at an even one). A weight whose exponent lies outside
its row's window is stored as code 0 with sign and low byte 0 (it reads as 2^(2*base-127)) and recorded
exactly in a row-sorted side table.

Works on CPU and GPU tensors alike (plain PyTorch integer ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

WINDOW = 8           # exponent >> 1 in base .. base+7 is coded 0..7 (16 exponents)
MIN_BASE, MAX_BASE = 0, 120   # base + 7 <= 127: a byte-wise add of base and code never reaches the sign bit


@dataclass
class W12Tensor:
    """A bf16 matrix [rows, cols] in W12 form. `shape` is the original tensor's shape."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    low: torch.Tensor        # uint8 [rows, cols_padded]: the bf16 low byte, exponent & 1 << 7 | mantissa
    codes: torch.Tensor      # uint8 [rows, cols_padded // 2]: byte j = nib[j] | nib[j + half] << 4,
                             # nib = sign << 3 | code
    base: torch.Tensor       # uint8 [rows]: the value of exponent >> 1 that code 0 stands for
    esc_ptr: torch.Tensor    # int32 [rows + 1]: escapes of row r are esc_ptr[r] .. esc_ptr[r+1]-1
    esc_col: torch.Tensor    # int32 [escapes]: column, ascending within a row
    esc_bits: torch.Tensor   # int16 [escapes]: the weight's exact bf16 bit pattern
    plans: dict = field(default_factory=dict, repr=False, compare=False)   # GEMM launches by M bucket (gemm.Plan)
    # The same matrix in bf16, kept only where the GEMM falls back to cuBLAS for some M buckets
    # (gemm.keep_dense); those buckets run F.linear on it.
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)
    dense_buckets: tuple[int, ...] = field(default=(), repr=False, compare=False)
    heavy_blocks: bool | None = field(default=None, repr=False, compare=False)   # gemm.heavy's answer, once known

    @property
    def cols_padded(self) -> int:
        return self.low.shape[1]

    @property
    def escapes(self) -> int:
        return self.esc_col.numel()

    @property
    def device(self) -> torch.device:
        return self.low.device

    def nbytes(self) -> int:
        """Bytes stored, metadata and escapes included (the shape tuple aside)."""
        parts = (self.low, self.codes, self.base, self.esc_ptr, self.esc_col, self.esc_bits)
        return sum(t.numel() * t.element_size() for t in parts)

    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes() / max(1, self.rows * self.cols)

    def to(self, device) -> "W12Tensor":
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        dense = None if self.dense is None else self.dense.to(device)
        return W12Tensor(self.shape, self.rows, self.cols, **moved, dense=dense, dense_buckets=self.dense_buckets)


_TENSOR_FIELDS = ("low", "codes", "base", "esc_ptr", "esc_col", "esc_bits")


def encode(weight: torch.Tensor) -> W12Tensor:
    """Encode a bf16 tensor (any shape; the last dim is the GEMM's K) losslessly."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"W12 encodes bf16 tensors, got {weight.dtype}")
    shape = tuple(weight.shape)
    cols = shape[-1] if len(shape) >= 1 else 1
    rows = weight.numel() // cols if cols else 0
    if cols == 0 or rows == 0:
        raise ValueError(f"W12 cannot encode an empty tensor of shape {shape}")
    bits = weight.contiguous().view(torch.int16).reshape(rows, cols).to(torch.int32) & 0xFFFF
    cols_padded = cols + (cols % 2)
    if cols_padded != cols:     # a padding column, dropped again by decode
        bits = torch.nn.functional.pad(bits, (0, 1))

    low = bits & 0xFF
    high = (bits >> 8) & 0x7F           # exponent >> 1
    base = _best_base(high[:, :cols])
    code = high - base[:, None]
    escaped = (code < 0) | (code >= WINDOW)
    escaped[:, cols:] = True            # the padding column: stored like an escape, but not listed
    nib = ((bits >> 12) & 0x8) | code
    nib = torch.where(escaped, torch.zeros_like(nib), nib)
    low = torch.where(escaped, torch.zeros_like(low), low)

    half = cols_padded // 2
    packed_codes = nib[:, :half] | (nib[:, half:] << 4)

    escaped[:, cols:] = False
    esc_row, esc_col = escaped.nonzero(as_tuple=True)   # row-major order: sorted by row, then column
    esc_bits = bits[esc_row, esc_col]
    counts = torch.bincount(esc_row, minlength=rows)
    esc_ptr = torch.zeros(rows + 1, dtype=torch.int32, device=weight.device)
    esc_ptr[1:] = torch.cumsum(counts, 0)
    return W12Tensor(
        shape=shape,
        rows=rows,
        cols=cols,
        low=low.to(torch.uint8),
        codes=packed_codes.to(torch.uint8),
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
    """Stack W12 matrices along rows (e.g. q, k, v into one qkv), as encode(torch.cat(weights)) would."""
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
    return W12Tensor(
        shape=(rows, cols), rows=rows, cols=cols,
        low=torch.cat([p.low for p in parts]),
        codes=torch.cat([p.codes for p in parts]),
        base=torch.cat([p.base for p in parts]),
        esc_ptr=torch.cat(ptrs).to(torch.int32),
        esc_col=torch.cat([p.esc_col for p in parts]),
        esc_bits=torch.cat([p.esc_bits for p in parts]),
    )


def decode_planes(packed: W12Tensor) -> torch.Tensor:
    """int32 bit patterns [rows, cols_padded] as the GEMM kernel sees them (escapes: base << 8)."""
    codes = packed.codes.to(torch.int32)
    nib = torch.cat([codes & 0xF, codes >> 4], dim=1)
    high = (nib & 0x7) + packed.base.to(torch.int32)[:, None]
    return ((nib & 0x8) << 12) | (high << 8) | packed.low.to(torch.int32)


def _best_base(high: torch.Tensor) -> torch.Tensor:
    """Per row, the base whose window of WINDOW values of exponent >> 1 holds the most weights."""
    rows = high.shape[0]
    hist = torch.zeros(rows, 128, dtype=torch.int32, device=high.device)
    hist.scatter_add_(1, high, torch.ones_like(high))
    csum = torch.nn.functional.pad(torch.cumsum(hist, 1), (1, 0))   # csum[:, v] = count below v
    starts = torch.arange(MIN_BASE, MAX_BASE + 1, device=high.device)
    covered = csum[:, starts + WINDOW] - csum[:, starts]
    return starts[torch.argmax(covered, dim=1)]         # first maximum: deterministic


def _as_int16(bits32: torch.Tensor) -> torch.Tensor:
    """Low 16 bits of int32 values as int16 (two's complement wrap)."""
    return (bits32 - ((bits32 & 0x8000) << 1)).to(torch.int16)
