"""Bits per weight, escape rate and exact zeros of W12 (metadata and escapes included) per weight family
(w12_families.py).

    python -m specpilot_lab.w12_size [--rows 1024] [--family normal,student-t4] [--model model.safetensors] [--all-tensors]

Each family is drawn at the four benchmark shapes (families.SHAPES), as a block of the first --rows rows of each
(full K: per-row metadata and the row's window are what set the size, so a row block has the bits per weight of
the whole matrix up to sampling noise; full shapes take minutes on a 2-core CPU). Then the escape-rate
controls of the cliff check, the real stories260K matrices and, when smollm2-135m is among the families, the
real SmolLM2-135M rows of its extract (w12_smollm2.py) per role. Every row is checked bit-exact
(decode(encode(W)) == W) before it is printed. Prints a markdown table (the source of benchmarks/w12_size.md).
CPU only.
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot_lab import w12_smollm2 as smollm2
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
        zeros=int((w == 0).sum()),
        bits=packed.bits_per_weight(),
    )


def family_rows(family: str, rows: int) -> list[dict]:
    out = []
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        r = min(rows, n)
        out.append(measure(family, draw(family, r, k, seed=100 + i, role=name), f"{name} {r}x{k} (of {n}x{k})"))
    return out + [total(f"{family}, the four shapes", out)]


def total(label: str, rows: list[dict]) -> dict:
    sums = {key: sum(r[key] for r in rows) for key in ("weights", "bytes", "escapes", "zeros")}
    return dict(label=label, shape="-", **sums, bits=8 * sums["bytes"] / sums["weights"])


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
    rows = [measure(f"stories260K {name}", w) for name, w in stories_matrices(path).items()]
    return (rows if every_tensor else []) + [total("stories260K, all 2-D tensors (real, fp32 -> bf16)", rows)]


def smollm2_real_rows() -> list[dict]:
    """Each role's real blocks of the smollm2-135m extract (every 8th row of all 30 layers) as they are, untiled."""
    out = []
    for role in smollm2.ROLES:
        blocks = smollm2.role_blocks(role)
        rows = [measure(f"SmolLM2-135M {role}", block) for block in blocks]
        out.append(total(f"SmolLM2-135M {role} (real, every 8th row)", rows) | {"shape": _blocks_shape(blocks)})
    projections = [r for role, r in zip(smollm2.ROLES, out, strict=True) if role != "embed"]
    return out + [total("SmolLM2-135M, the projections (real, Q4_1 -> bf16)", projections)]


def _blocks_shape(blocks) -> str:
    return f"{len(blocks)} x {blocks.shape[1]}x{blocks.shape[2]}"


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
    if "smollm2-135m" in families:
        results += smollm2_real_rows()
    print(f"W12 size report, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.rows} rows per shape\n")
    print("| weights | shape | exact zeros | escapes | escape rate | bits/weight |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['label']} | {r['shape']} | {100 * r['zeros'] / r['weights']:.4f}% | {r['escapes']} "
            f"| {100 * r['escapes'] / r['weights']:.4f}% | {r['bits']:.4f} |"
        )


if __name__ == "__main__":
    main()
