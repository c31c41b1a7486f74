"""Roofline of every GEMM kernel a decode step runs: how far each is from the bytes it must move.

    python benchmarks/roofline.py [--family normal,student-t4] [--ms 1,8,16,32,64] [--out roofline.json]
    python benchmarks/roofline.py --dry-run          # CPU: tiny shapes, checks the plumbing, measures nothing

(w12 and specpilot_lab are installed with the repository; on the bare GPU device prefix PYTHONPATH=lab:kernels.)

Per weight shape (the seed's 27B linears) and M, for each kernel:
- `cuBLAS bf16`: F.linear on the bf16 weight (what a bf16 engine runs);
- `W12 (picked)`: w12.linear as an engine calls it (the tuned table's kernel for this GPU: the Triton kernel, the
  ws CUDA kernel, or cuBLAS on a kept bf16 copy where the fallback table says so; decode + cuBLAS above M = 64);
- `W12 Triton`: the fused Triton kernel forced (the ws kernel's configs replaced by the Triton default), where
  the picked kernel is not already Triton;
- `W12 decode`: decoding the whole weight to bf16 in one pass (the M > 64 path's first half).
Each is timed as the median of CUDA-graph replays over rotated buffers (> L2), like lab/specpilot_lab/w12_bench.py.

Bytes moved: what the kernel must read and write at the least (the weight as stored, x, y; for the decode, the
stored weight read and the bf16 weight written). `pure read` is the time a plain read kernel takes over the same
number of bytes on this GPU (one Triton load-and-reduce pass, timed the same way): the attainable floor.
`% of pure read` = pure read time / kernel time, `% of peak` = achieved bytes/s over the datasheet bandwidth in
conf/ceilings/<gpu>.yaml. Rows are printed furthest from the floor first (largest time above it): the list a
kernel tuner works down. The results page is benchmarks/roofline.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

DRY_SHAPES = {"qkv": (160, 128), "o": (64, 256), "gate_up": (352, 128), "down": (64, 448)}
BUFFERS = 3
READ_BLOCK = 8192


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from specpilot_lab.w12_families import SHAPES, draw, parse_families

    device = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    gpu = "cpu" if args.dry_run else torch.cuda.get_device_name()
    peak = peak_bandwidth(gpu)
    rows = []
    for family in parse_families(args.family):
        for name, (n, k) in shapes.items():
            bf16s = [draw(family, n, k, seed=10 * i, device=device, role=name) for i in range(BUFFERS)]
            rows += shape_rows(family, name, bf16s, args.ms, device, peak)
            del bf16s
            if device == "cuda":
                torch.cuda.empty_cache()
    rows.sort(key=lambda r: -r["gap_us"] if not math.isnan(r["gap_us"]) else 0.0)
    header = f"{gpu}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    print(f"\n## Roofline ({header}; peak {peak / 1e12:.2f} TB/s)\n")
    print(render(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": gpu, "peak_bytes_per_s": peak, "rows": rows}, indent=1))
    return rows


def shape_rows(family: str, name: str, bf16s: list, ms, device: str, peak: float) -> list[dict]:
    import w12
    from w12.gemm import Config, config_for, decode_on_device, fused_gemm

    n, k = bf16s[0].shape
    packs = [w12.encode(w) for w in bf16s]
    stored = packs[0].nbytes()
    if device == "cuda":
        for pack, weight in zip(packs, bf16s):
            w12.keep_dense(pack, weight)  # where the fallback table says cuBLAS wins, the picked path is the copy
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        act = 2 * m * (n + k)
        kernels = {
            "cuBLAS bf16": (lambda w: torch.nn.functional.linear(x, w), bf16s, 2 * n * k + act),
            "W12 (picked)": (lambda p: w12.linear(x, p), packs, stored + act),
        }
        if m <= 64 and device == "cuda":
            from w12.gemm import bucket_of

            picked = config_for(packs[0], bucket_of(m))
            if picked.kernel != "triton" or bucket_of(m) in packs[0].dense_buckets:
                forced = picked if picked.kernel == "triton" else Config()
                kernels["W12 Triton"] = (lambda p, c=forced: fused_gemm(x, p, c), packs, stored + act)
        if m == ms[0]:
            kernels["W12 decode"] = (
                lambda p: decode_on_device(p) if device == "cuda" else None,
                packs,
                stored + 2 * n * k,
            )
        for kernel, (launch, items, nbytes) in kernels.items():
            if kernel == "W12 decode" and device != "cuda":
                continue
            t = graph_time_us(launch, items)
            t_read = read_time_us(nbytes, device)
            rows.append(
                dict(
                    family=family,
                    shape=name,
                    N=n,
                    K=k,
                    M=m if kernel != "W12 decode" else None,
                    kernel=kernel,
                    bytes=nbytes,
                    us=t,
                    tbps=nbytes / t / 1e6,
                    peak_fraction=nbytes / (t * 1e-6) / peak,
                    read_us=t_read,
                    read_fraction=t_read / t,
                    gap_us=t - t_read,
                )
            )
            print(
                f"{family:10s} {name:8s} M={m:2d} {kernel:13s} {t:8.1f} us {rows[-1]['tbps']:5.2f} TB/s "
                f"read {t_read:7.1f} us ({100 * rows[-1]['read_fraction']:.0f}%)",
                flush=True,
            )
    return rows


def graph_time_us(launch, items, launches: int = 6) -> float:
    from specpilot_lab.w12_bench import graph_time_us as timed

    return timed(launch, items, launches=launches)


_READ_BUFFERS: dict[int, list] = {}


def read_time_us(nbytes: int, device: str) -> float:
    """A plain read of `nbytes` (rotated buffers, the same timing): the floor for a kernel that must read them."""
    if device != "cuda":
        return float("nan")
    words = -(-nbytes // 4)
    bufs = _READ_BUFFERS.get(words)
    if bufs is None:
        _READ_BUFFERS.clear()
        torch.cuda.empty_cache()
        bufs = _READ_BUFFERS[words] = [
            torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda") for _ in range(BUFFERS)
        ]
    out = torch.empty(-(-words // READ_BLOCK), dtype=torch.int32, device="cuda")
    return graph_time_us(lambda b: _read(b, out), bufs)


def _read(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    import triton

    grid = (triton.cdiv(buf.numel(), READ_BLOCK),)
    _read_kernel()[grid](buf, out, buf.numel(), BLOCK=READ_BLOCK, num_warps=8)
    return out


_KERNEL = None


def _read_kernel():
    """One load of every word and an xor per block: memory-bound by construction (made lazily: Triton on CUDA)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def read_kernel(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            words = tl.load(src + offs, mask=offs < n, other=0)
            tl.store(dst + tl.program_id(0), tl.xor_sum(words, axis=0))

        _KERNEL = read_kernel
    return _KERNEL


def peak_bandwidth(gpu: str) -> float:
    """Datasheet bytes/s of this GPU from conf/ceilings/ (matched by name), NaN where none matches."""
    for path in sorted((REPO / "conf" / "ceilings").glob("*.yaml")):
        if path.stem.replace("-", " ").lower() in gpu.replace("-", " ").lower():
            found = re.search(r"^memory_bandwidth_gbs:\s*([0-9.]+)", path.read_text(), re.M)
            if found:
                return float(found.group(1)) * 1e9
    return float("nan")


def render(rows: list[dict]) -> str:
    lines = [
        "| family | shape (N x K) | M | kernel | MB moved | us | TB/s | % of peak | pure read us | % of pure read "
        "| above the floor us |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['shape']} ({r['N']} x {r['K']}) | {r['M'] if r['M'] is not None else 'all'} "
            f"| {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['tbps']:.2f} "
            f"| {100 * r['peak_fraction']:.0f}% | {r['read_us']:.1f} | {100 * r['read_fraction']:.0f}% "
            f"| {r['gap_us']:.1f} |"
        )
    by_kernel: dict[str, list[float]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r["read_fraction"])
    lines += ["", "| kernel | cells | median % of pure read | lowest |", "|---|---:|---:|---:|"]
    for kernel, fractions in sorted(by_kernel.items(), key=lambda kv: statistics.median(kv[1])):
        lines.append(
            f"| {kernel} | {len(fractions)} | {100 * statistics.median(fractions):.0f}% | {100 * min(fractions):.0f}% |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="normal", help="comma-separated weight families (w12_families)")
    parser.add_argument("--ms", default="1,8,16,32,64", type=lambda s: tuple(int(v) for v in s.split(",")))
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
