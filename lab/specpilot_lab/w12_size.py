"""Bits per weight and escape rate of W12 (metadata and escapes included) per weight family (families.py).

    python -m specpilot_lab.w12_size [--rows 1024] [--family normal,student-t4] [--model model.safetensors] [--all-tensors]

Each family is drawn at the four benchmark shapes (families.SHAPES), as a block of the first --rows rows of each
(full K: per-row metadata and the row's window are what set the size, so a row block has the bits per weight of
the whole matrix up to sampling noise; full shapes take minutes on a 2-core CPU). Then the escape-rate
controls of the cliff check and the real stories260K matrices. Every row is checked bit-exact
(decode(encode(W)) == W) before it is printed. Prints a markdown table (the source of SIZE.md). CPU only.
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot_lab.w12_families import FAMILIES, SHAPES, draw, normal_with_escapes, parse_families, stories_matrices
from w12.format import decode, encode

ESCAPE_RATES = (1e-4, 1e-3)


def measure(label: str, w: torch.Tensor, shape: str | None = None) -> dict:
    packed = encode(w)
    if not torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)):
        raise AssertionError(f"{label}: decode(encode(W)) differs from W")
    return dict(
        label=label,
        shape=shape or "x".join(map(str, w.shape)),
        weights=w.numel(),
        bytes=packed.nbytes(),
        escapes=packed.escapes,
        bits=packed.bits_per_weight(),
    )


def family_rows(family: str, rows: int) -> list[dict]:
    out = []
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        r = min(rows, n)
        out.append(measure(family, draw(family, r, k, seed=100 + i), f"{name} {r}x{k} (of {n}x{k})"))
    total = {key: sum(o[key] for o in out) for key in ("weights", "bytes", "escapes")}
    out.append(dict(label=f"{family}, the four shapes", shape="-", **total, bits=8 * total["bytes"] / total["weights"]))
    return out


def escape_control_rows(rows: int) -> list[dict]:
    n, k = SHAPES["qkv"]
    return [
        measure(
            f"normal, planted escapes at {100 * rate:g}%",
            normal_with_escapes(min(rows, n), k, rate, seed=7),
            f"qkv {min(rows, n)}x{k}",
        )
        for rate in ESCAPE_RATES
    ]


def stories_real_rows(path: str | None, every_tensor: bool) -> list[dict]:
    rows, total = [], dict(weights=0, bytes=0, escapes=0)
    for name, w in stories_matrices(path).items():
        r = measure(f"stories260K {name}", w)
        for key in total:
            total[key] += r[key]
        rows.append(r)
    whole = dict(
        label="stories260K, all 2-D tensors (real, fp32 -> bf16)",
        shape="-",
        **total,
        bits=8 * total["bytes"] / total["weights"],
    )
    return (rows if every_tensor else []) + [whole]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024, help="rows of each benchmark shape drawn (full K)")
    ap.add_argument("--family", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    ap.add_argument("--model", help="stories260K model.safetensors (default: families.stories_path())")
    ap.add_argument("--all-tensors", action="store_true", help="list every stories260K tensor")
    args = ap.parse_args(argv)
    try:
        families = parse_families(args.family)
    except ValueError as err:
        ap.error(str(err))
    results = []
    for family in families:
        results += family_rows(family, args.rows)
    results += escape_control_rows(args.rows)
    results += stories_real_rows(args.model, args.all_tensors)
    print(f"W12 size report, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.rows} rows per shape\n")
    print("| weights | shape | escapes | escape rate | bits/weight |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['label']} | {r['shape']} | {r['escapes']} | {100 * r['escapes'] / r['weights']:.4f}% "
            f"| {r['bits']:.4f} |"
        )


if __name__ == "__main__":
    main()
