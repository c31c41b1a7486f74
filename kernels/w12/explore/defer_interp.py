import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton
from specpilot_runtime import fused
from w12.explore import defer
import types, triton.language as tl
shim = types.SimpleNamespace(rsqrt=lambda v: 1.0 / tl.sqrt(v), exp=lambda v: tl.exp(v))
defer.libdevice = shim; fused.libdevice = shim

torch.manual_seed(0)
TRUNC = True
n, m, KACC, MAXP = 384, 8, 4, 3          # 3 tiles: tile 0 complete, tile 1 split in 3, tile 2 split in 2
tiles = n // 128
pieces = torch.zeros(8 * 4 * 4096)        # slots (float offsets multiple of KSLOT*2)
cnt = torch.tensor([0, 3, 2], dtype=torch.int32)
slots = torch.tensor([[0, 0, 0], [2 * 4096 * 1, 2 * 4096 * 3, 2 * 4096 * 5], [2 * 4096 * 6, 2 * 4096 * 2, 0]], dtype=torch.int32)
true = torch.empty(m, n)
y = torch.full((m, n), float("nan")).to(torch.bfloat16)
def off(ri, r):
    wg, warp, rr = ri // 64, (ri % 64) // 16, ri % 16
    lane = (rr % 8) * 4 + (r % 8) // 2
    return wg * 4096 + (warp * 32 + lane) * KACC + (r // 8) * 4 + (rr // 8) * 2 + r % 2
for t in range(tiles):
    for ri in range(128):
        for r in range(m):
            j = t * 128 + ri
            if cnt[t] == 0:
                v = torch.randn(()).to(torch.bfloat16); y[r, j] = v; true[r, j] = v.float(); continue
            vals = torch.randn(int(cnt[t])) * 10
            acc = vals[0].clone()
            for k in range(int(cnt[t])):
                pieces[int(slots[t, k]) + off(ri, r)] = vals[k]
                if k: acc = acc + vals[k]
            true[r, j] = (acc.view(torch.int32) & -65536).view(torch.float32) if TRUNC else acc.to(torch.bfloat16).float()
true = true.to(torch.bfloat16)
p = defer.PendingSum(y, pieces, cnt, slots, MAXP, KACC, (m,))
x = torch.randn(m, n).to(torch.bfloat16)
w = (torch.rand(n) + 0.5).to(torch.bfloat16)
total, out = torch.empty_like(x), torch.empty_like(x)
defer._norm_kernel[(m,)](x, y, pieces, cnt, slots, total, w, out, n, 1.0 / n, 1e-6, BLOCK=512, KACC=KACC, MAXP=MAXP, TRIGGER=False)
t2, o2 = torch.empty_like(x), torch.empty_like(x)
fused._rms_norm_kernel[(m,)](x, true, t2, w, o2, n, 1.0 / n, 1e-6, BLOCK=512, ADD=True, TRIGGER=False)
print("norm total equal", torch.equal(total.view(torch.int16), t2.view(torch.int16)), "out equal", torch.equal(out.view(torch.int16), o2.view(torch.int16)))
inter = n // 2
s1 = torch.empty(m, inter, dtype=torch.bfloat16); s2 = torch.empty_like(s1)
defer._silu_kernel[(m, triton.cdiv(inter, 128))](y, pieces, cnt, slots, s1, inter, BLOCK=128, KACC=KACC, MAXP=MAXP, TRIGGER=False)
fused._silu_mul_kernel[(m, triton.cdiv(inter, 128))](true, s2, inter, BLOCK=128, TRIGGER=False)
print("silu equal", torch.equal(s1.view(torch.int16), s2.view(torch.int16)))
import triton.language as tl
@triton.jit
def _probe(y_ptr, ws_ptr, cnt_ptr, slot_ptr, out_ptr, n, BLOCK: tl.constexpr, KACC: tl.constexpr, MAXP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    v = defer._pending_load(y_ptr, ws_ptr, cnt_ptr, slot_ptr, r, cols, mask, n, KACC, MAXP)
    tl.store(out_ptr + r * n + cols, v, mask=mask)
got = torch.empty(m, n)
_probe[(m,)](y, pieces, cnt, slots, got, n, BLOCK=512, KACC=KACC, MAXP=MAXP)
d = (got != true.float())
print("mismatches", int(d.sum()), "of", d.numel(), "per tile", [int(d[:, t*128:(t+1)*128].sum()) for t in range(tiles)])
idx = d.nonzero()[:5]; print(idx.tolist(), got[d][:5].tolist(), true.float()[d][:5].tolist())
y2 = y.clone()
split = torch.tensor([1, 2], dtype=torch.int32)
defer._resolve_kernel[(2, m)](y2, pieces, cnt, slots, split, n, KACC=KACC, MAXP=MAXP, PDL=False)
print("resolve equal", torch.equal(y2.view(torch.int16), true.view(torch.int16)))
