"""Exploration: the ws kernel's split tiles summed by the next kernel (BENCH.md item 19's next step 0). With
`enabled(lib)`, a W12Linear whose ws plan comes from `lib` (explore/w12_ws_defer.cu: split tiles leave their pieces
in slots, nothing waits) returns a PendingSum, and the runtime's SiLU product and residual norm sum a tile's pieces
in CTA order (fp32, then bf16, as the summing CTA does) where they read it. Only for model_ab.py's A/B."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from specpilot_runtime import fused
from specpilot_runtime.fused import _pdl_capable, _weighted, gdc_launch_dependents, libdevice
from triton.language.extra.cuda import gdc_wait
from w12 import gemm, module, ws

KSLOT = 64 * 64    # floats per warpgroup slot (csrc Cfg<8>::kSlot)


class PendingSum:
    def __init__(self, y, pieces, cnt, slots, maxp, kacc, lead):
        self.y, self.pieces, self.cnt, self.slots, self.maxp, self.kacc, self.lead = y, pieces, cnt, slots, maxp, kacc, lead
        self.shape = (*lead, y.shape[1])


def _table(plan):
    """Per row tile: how many pieces (0: stored whole in y) and their slots' float offsets, in CTA order."""
    if getattr(plan, "_pending", None) is None:
        ks = plan._args.half // 64
        tiles = plan.rows // 128
        units, grid = tiles * ks, plan.grid
        start = lambda c: c * units // grid
        owner = lambda u: next(c for c in range(grid) if start(c) <= u < start(c + 1))
        cnt, slots = [], []
        for t in range(tiles):
            c0, c1 = owner(t * ks), owner((t + 1) * ks - 1)
            if c0 == c1:
                cnt.append(0), slots.append([])
                continue
            cnt.append(c1 - c0 + 1)
            slots.append([((c * 2 + (0 if t == start(c) // ks else 1)) * 2) * KSLOT for c in range(c0, c1 + 1)])
        maxp = max(1, max(cnt))
        table = torch.zeros(tiles, maxp, dtype=torch.int32)
        for t, s in enumerate(slots):
            table[t, :len(s)] = torch.tensor(s, dtype=torch.int32)
        pieces = plan._held[2]
        plan._pending = (pieces, torch.tensor(cnt, dtype=torch.int32, device=plan.device), table.to(plan.device), maxp)
        plan._split_tiles = torch.tensor([t for t, c in enumerate(cnt) if c], dtype=torch.int32, device=plan.device)
    return plan._pending


@triton.jit
def _pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, j, mask, n, KACC: tl.constexpr, MAXP: tl.constexpr):
    tile = j // 128
    ri = j % 128
    wg = ri // 64
    warp = (ri % 64) // 16
    rr = ri % 16
    lane = (rr % 8) * 4 + (r % 8) // 2
    within = wg * 4096 + (warp * 32 + lane) * KACC + (r // 8) * 4 + (rr // 8) * 2 + r % 2
    cnt = tl.load(cnt_ptr + tile, mask=mask, other=0)
    y = tl.load(y_ptr + r * n + j, mask=mask & (cnt == 0), other=0.0).to(tl.float32)
    split = mask & (cnt > 0)
    acc = tl.load(ws_ptr + tl.load(slot_ptr + tile * MAXP, mask=split, other=0) + within, mask=split, other=0.0)
    for p in tl.static_range(1, MAXP):
        has = mask & (cnt > p)
        v = tl.load(ws_ptr + tl.load(slot_ptr + tile * MAXP + p, mask=has, other=0) + within, mask=has, other=0.0)
        acc = tl.where(has, acc + v, acc)
    return tl.where(cnt > 0, acc.to(tl.bfloat16).to(tl.float32), y)


@triton.jit
def _resolve_kernel(y_ptr, ws_ptr, cnt_ptr, slot_ptr, split_ptr, n, KACC: tl.constexpr, MAXP: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (split tile, token): the tile's 128 values of y, summed from its pieces in CTA order."""
    if PDL:   # launched as a programmatic dependent of the ws kernel: its pieces are complete after the wait
        gdc_wait()
    tile = tl.load(split_ptr + tl.program_id(0))
    r = tl.program_id(1).to(tl.int64)
    j = tile * 128 + tl.arange(0, 128)
    mask = j < n
    v = _pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, j, mask, n, KACC, MAXP)
    tl.store(y_ptr + r * n + j, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_kernel(x_ptr, y_ptr, ws_ptr, cnt_ptr, slot_ptr, total_ptr, w_ptr, out_ptr, n, inv_n, eps,
                 BLOCK: tl.constexpr, KACC: tl.constexpr, MAXP: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + r * n + cols, mask=mask, other=0.0)
    delta = _pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, cols, mask, n, KACC, MAXP)
    x = (x.to(tl.float32) + delta).to(x.dtype)
    tl.store(total_ptr + r * n + cols, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
    tl.store(out_ptr + r * n + cols, _weighted(x, scale, w, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_kernel(y_ptr, ws_ptr, cnt_ptr, slot_ptr, out_ptr, inter, BLOCK: tl.constexpr, KACC: tl.constexpr,
                 MAXP: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = _pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, cols, mask, 2 * inter, KACC, MAXP)
    up = _pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, cols + inter, mask, 2 * inter, KACC, MAXP)
    silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * inter + cols, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


_ORIGINAL = {"forward": module.W12Linear.forward, "silu_mul": fused.silu_mul, "add_rms_norm": fused.add_rms_norm}
_LIB = []
MODE = ["pending"]   # "pending": the consumers sum; "resolve" / "resolve_pdl": a wide kernel right after the GEMM


def _forward(self, x):
    x2 = x.reshape(-1, self.packed.cols)
    m = x2.shape[0]
    if _LIB and x2.is_cuda and m <= 64 and self.bias is None:
        bucket = gemm.bucket_of(m)
        if bucket not in self.packed.dense_buckets:
            plan = self.packed.plans.get(bucket) or gemm.prepare(self.packed, bucket)
            if isinstance(plan, ws.WsPlan) and plan._lib is _LIB[0]:
                y = plan(x2.to(torch.bfloat16).contiguous(), m)
                pieces, cnt, slots, maxp = _table(plan)
                if MODE[0] == "pending":
                    return PendingSum(y, pieces, cnt, slots, maxp, plan.bucket // 2, x.shape[:-1])
                split = plan._split_tiles
                _resolve_kernel[(split.numel(), m)](y, pieces, cnt, slots, split, plan.rows, KACC=plan.bucket // 2,
                                                    MAXP=maxp, PDL=MODE[0] == "resolve_pdl",
                                                    launch_pdl=MODE[0] == "resolve_pdl", num_warps=1)
                return y.reshape(*x.shape[:-1], plan.rows)
    return _ORIGINAL["forward"](self, x)


def _silu_mul(gate_up):
    if not isinstance(gate_up, PendingSum):
        return _ORIGINAL["silu_mul"](gate_up)
    p = gate_up
    inter = p.y.shape[1] // 2
    out = torch.empty((*p.lead, inter), dtype=torch.bfloat16, device=p.y.device)
    _silu_kernel[(p.y.shape[0], triton.cdiv(inter, fused.SILU_BLOCK))](
        p.y, p.pieces, p.cnt, p.slots, out, inter, BLOCK=fused.SILU_BLOCK, KACC=p.kacc, MAXP=p.maxp,
        TRIGGER=_pdl_capable(p.y.device), num_warps=4)
    return out


def _add_rms_norm(x, delta, weight, eps):
    if not isinstance(delta, PendingSum):
        return _ORIGINAL["add_rms_norm"](x, delta, weight, eps)
    p = delta
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _norm_kernel[(x.numel() // n,)](
        x, p.y, p.pieces, p.cnt, p.slots, total, weight, out, n, 1.0 / n, eps, BLOCK=block, KACC=p.kacc,
        MAXP=p.maxp, TRIGGER=_pdl_capable(x.device), num_warps=max(4, min(16, block // 1024)), enable_fp_fusion=False)
    return total, out


@contextlib.contextmanager
def enabled(lib):
    _LIB.append(lib)
    module.W12Linear.forward, fused.silu_mul, fused.add_rms_norm = _forward, _silu_mul, _add_rms_norm
    try:
        yield
    finally:
        _LIB.clear()
        module.W12Linear.forward = _ORIGINAL["forward"]
        fused.silu_mul, fused.add_rms_norm = _ORIGINAL["silu_mul"], _ORIGINAL["add_rms_norm"]
