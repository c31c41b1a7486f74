"""Bits per weight of W12 (metadata and escapes included) on synthetic and real weights.

    python -m w12.size_report [--model path/to/model.safetensors]

Prints a markdown table (the source of SIZE.md). CPU only.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .format import decode, encode

STORIES = str(Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K" / "model.safetensors")


def normal_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sigma = 0.02 * torch.exp(0.5 * torch.randn(rows, 1, generator=g))   # sigma varies per row
    return (torch.randn(rows, cols, generator=g) * sigma).to(torch.bfloat16)


def student_t_rows(rows: int, cols: int, df: float, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    t = torch.distributions.StudentT(df).sample((rows, cols))
    sigma = 0.02 * torch.exp(0.5 * torch.randn(rows, 1))
    return (t * sigma).to(torch.bfloat16)


def measure(label: str, w: torch.Tensor) -> dict:
    packed = encode(w)
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)), f"{label}: not lossless"
    return dict(label=label, shape="x".join(map(str, w.shape)), weights=w.numel(), bytes=packed.nbytes(),
                escapes=packed.escapes, bits=packed.bits_per_weight())


def stories_rows(path: str) -> list[dict]:
    from safetensors import safe_open
    rows, total_w, total_b, total_e = [], 0, 0, 0
    with safe_open(path, "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.dim() != 2:
                continue
            r = measure(f"stories260K {name}", t.to(torch.bfloat16))
            total_w += r["weights"]
            total_b += r["bytes"]
            total_e += r["escapes"]
            rows.append(r)
    rows.append(dict(label="stories260K all 2-D tensors (fp32 -> bf16)", shape="-", weights=total_w,
                     bytes=total_b, escapes=total_e, bits=8 * total_b / total_w))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--all-tensors", action="store_true", help="list every stories260K tensor")
    args = ap.parse_args()
    results = [
        measure("Normal(0, sigma_row), sigma_row = 0.02 * exp(0.5 z)", normal_rows(4096, 5120, 0)),
        measure("Normal(0, sigma_row), K = 17408", normal_rows(1024, 17408, 1)),
        measure("Student-t df=3, sigma_row", student_t_rows(2048, 5120, 3.0, 2)),
        measure("Student-t df=5, sigma_row", student_t_rows(2048, 5120, 5.0, 3)),
        measure("Student-t df=10, sigma_row", student_t_rows(2048, 5120, 10.0, 4)),
    ]
    stories = stories_rows(args.model)
    results += stories if args.all_tensors else stories[-1:]
    print(f"W12 size report, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}\n")
    print("| weights | shape | escapes | escape rate | bits/weight |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['label']} | {r['shape']} | {r['escapes']} | {100 * r['escapes'] / r['weights']:.4f}% "
              f"| {r['bits']:.4f} |")


if __name__ == "__main__":
    main()
