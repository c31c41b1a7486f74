"""W12 encode/decode must be bit-exact for every bf16 pattern and any tensor shape."""

import pytest
import torch

from w12 import cat, decode, encode
from w12 import format as w12format
from w12.format import LAYOUTS, WINDOW, decode_planes, k_order, load_layouts, row_planes

ALL_PATTERNS = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def assert_bit_exact(w: torch.Tensor, layout: str | None = None) -> None:
    packed = encode(w, layout)
    back = decode(packed)
    assert back.shape == w.shape and back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(65536,), (256, 256), (4096, 16), (16, 4096), (2, 32768), (8, 64, 128)])
def test_every_bf16_pattern_round_trips(shape, layout):
    assert_bit_exact(ALL_PATTERNS.view(torch.bfloat16).reshape(shape), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pattern_round_trips_through_the_escape_table(layout):
    # Each row: 128 arbitrary patterns among 896 Normal weights that fix the row's window,
    # so most patterns (±inf, NaN payloads, huge, tiny) fall outside it and take the escape path.
    g = torch.Generator().manual_seed(1)
    normal = (torch.randn(512, 896, generator=g) * 0.02).to(torch.bfloat16)
    w = torch.cat([ALL_PATTERNS.view(torch.bfloat16).reshape(512, 128), normal], dim=1)
    w = w[:, torch.randperm(1024, generator=g)]
    packed = encode(w, layout)
    assert packed.escapes > 40000
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "shape", [(1,), (7,), (1, 1), (3, 5), (2, 3, 5), (1, 1031), (33, 1), (5, 130), (64, 172), (300, 200)]
)
def test_awkward_shapes_round_trip(shape, layout):
    g = torch.Generator().manual_seed(sum(shape))
    scale = torch.exp(torch.randn(shape, generator=g) * 8)  # spans ~1e-20..1e20: escapes, subnormals
    w = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    flat = w.view(-1)
    flat[::3] = 0.0
    flat[1::5] = -0.0
    assert_bit_exact(w, layout)


def test_specials_and_signed_zeros_keep_their_bits():
    bits = torch.tensor(
        [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x3F80], dtype=torch.int32
    ).to(torch.int16)
    w = torch.cat([bits.view(torch.bfloat16), torch.randn(54).to(torch.bfloat16)]).reshape(8, 8)
    assert_bit_exact(w)


def test_size_on_normal_weights_with_per_row_sigma():
    g = torch.Generator().manual_seed(2)
    sigma = 0.02 * torch.exp(torch.randn(512, 1, generator=g))
    w = (torch.randn(512, 4096, generator=g) * sigma).to(torch.bfloat16)
    packed = encode(w)
    assert packed.bits_per_weight() <= 12.1
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_view_reads_escapes_as_the_window_floor(layout):
    w = (torch.randn(4, 64) * 0.02).to(torch.bfloat16)
    w[1, 3] = 1e6
    w[2, 60] = float("inf")
    w[3, 7] = 0.0
    packed = encode(w, layout)
    planes = decode_planes(packed)
    expected = w.view(torch.int16).to(torch.int32) & 0xFFFF
    for r, c in ((1, 3), (2, 60), (3, 7)):
        expected[r, c] = int(packed.base[r]) << 8  # sign 0, low byte 0, exponent >> 1 = base
    assert torch.equal(planes, expected)
    assert packed.escapes == 3 and packed.esc_ptr.tolist() == [0, 0, 1, 2, 3]


def test_window_holds_sixteen_exponents_from_an_even_one():
    # Row 0: exponents 100..115 all in window; row 1: 100..116 -> one escapes. Row 2: 101..116 is
    # sixteen exponents too, but windows start at even exponents (the code counts exponent >> 1), so
    # one of them escapes.
    e = torch.arange(100, 117, dtype=torch.int32)
    rows = torch.stack([torch.cat([e[:16], e[:1]]), e, torch.cat([e[1:], e[1:2]])]) << 7
    w = rows.to(torch.int16).view(torch.bfloat16)
    packed = encode(w)
    assert packed.esc_ptr.tolist() == [0, 0, 1, 2]
    assert WINDOW == 8
    assert_bit_exact(w)


def test_rejects_other_dtypes():
    with pytest.raises(TypeError, match="bf16"):
        encode(torch.randn(4, 4))


def test_units_hold_each_byte_where_format_md_says():
    # FORMAT.md, "Storage": unit (t, u), row r, byte 16a + 4k + j of run p holds column 64u + 16k + (2a, 2a+1, 2a+8,
    # 2a+9)[j] of row 128t + r; runs p = 0, 1, 2: first-half low bytes, second-half low bytes, code bytes.
    rows, cols = 200, 256
    col = torch.arange(cols)
    low = (col * 7 + torch.arange(rows)[:, None] * 3) % 128  # a low byte to recognise each weight
    w = ((0x3C << 8) | (0 << 7) | low).to(torch.int16).view(torch.bfloat16)  # one exponent: the window holds all
    packed = encode(w, "units")
    assert packed.layout == "units" and tuple(packed.units.shape) == (2, 2, 128, 192)
    half = 128
    for t, u, r, p, pos in [(0, 0, 0, 0, 0), (0, 1, 5, 0, 17), (1, 0, 71, 1, 63), (1, 1, 3, 1, 38), (0, 1, 127, 0, 44)]:
        a, k, j = pos // 16, (pos // 4) % 4, pos % 4
        c = 64 * u + 16 * k + 2 * a + (j % 2) + 8 * (j // 2) + (half if p == 1 else 0)
        assert packed.units[t, u, r, 64 * p + pos].item() == low[128 * t + r, c].item()
    assert torch.all(packed.units[1, :, rows - 128 :] == 0)  # padding rows
    assert k_order(64).tolist()[:8] == [0, 1, 8, 9, 16, 17, 24, 25]


@pytest.mark.parametrize("cols", [64, 200, 256, 1031])
def test_both_layouts_hold_the_same_planes(cols):
    g = torch.Generator().manual_seed(cols)
    w = (torch.randn(130, cols, generator=g) * torch.exp(torch.randn(130, 1, generator=g) * 3)).to(torch.bfloat16)
    rows, units = encode(w, "rows"), encode(w, "units")
    assert torch.equal(decode_planes(rows), decode_planes(units))
    low, codes = row_planes(units, rows.cols_padded)
    assert torch.equal(low, rows.low) and torch.equal(codes, rows.codes)
    assert torch.equal(rows.esc_col, units.esc_col) and torch.equal(rows.esc_bits, units.esc_bits)
    assert units.cols_padded % 128 == 0 and rows.cols_padded == cols + cols % 2


def test_cat_stacks_parts_of_either_layout_as_encode_would(monkeypatch):
    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(n, 320, generator=g) * 0.02 * 4.0**i).to(torch.bfloat16) for i, n in enumerate((64, 96, 200))]
    parts[1][5, 7] = float("nan")
    monkeypatch.setattr(w12format, "_layout_table", lambda: {(360, 320): "units"})
    monkeypatch.setattr(w12format, "_runs_units", lambda device: True)
    joined = cat([encode(parts[0], "rows"), encode(parts[1], "units"), encode(parts[2], "rows")])
    direct = encode(torch.cat(parts))
    assert joined.layout == direct.layout == "units"
    assert torch.equal(joined.units, direct.units) and torch.equal(joined.esc_ptr, direct.esc_ptr)
    assert torch.equal(decode(joined).view(torch.int16), torch.cat(parts).view(torch.int16))


def test_the_layout_table_picks_the_default_and_names_bad_entries(tmp_path, monkeypatch):
    assert w12format._layout_table()[34816, 5120] == "units"  # layouts_h200.json: gate_up
    assert w12format.preferred_layout(34816, 5120, "cpu") == "rows"  # units only where the ws kernel runs
    monkeypatch.setattr(w12format, "_runs_units", lambda device: True)
    assert w12format.preferred_layout(34816, 5120, "cuda") == "units"
    assert w12format.preferred_layout(10240, 5120, "cuda") == "rows"
    monkeypatch.setattr(w12format, "_layout_table", lambda: {(128, 256): "units"})
    assert encode(torch.zeros(128, 256, dtype=torch.bfloat16)).layout == "units"
    assert encode(torch.zeros(4, 8, dtype=torch.bfloat16)).layout == "rows"
    bad = tmp_path / "layouts.json"
    bad.write_text('{"_comment": "x", "128,256": "tiles"}')
    with pytest.raises(ValueError, match=r"layouts.json: 128,256 has layout 'tiles'"):
        load_layouts(bad)
    bad.write_text('{"128x256": "units"}')
    with pytest.raises(ValueError, match=r"key '128x256' is not rows,cols"):
        load_layouts(bad)
    with pytest.raises(ValueError, match="W12 layout is one of rows, units"):
        encode(torch.zeros(4, 8, dtype=torch.bfloat16), "tiles")
