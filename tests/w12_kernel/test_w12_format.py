"""W12 encode/decode must be bit-exact for every bf16 pattern and any tensor shape."""
import pytest
import torch

from w12 import decode, encode
from w12.format import WINDOW, decode_planes

ALL_PATTERNS = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def assert_bit_exact(w: torch.Tensor) -> None:
    packed = encode(w)
    back = decode(packed)
    assert back.shape == w.shape and back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("shape", [(65536,), (256, 256), (4096, 16), (16, 4096), (2, 32768), (8, 64, 128)])
def test_every_bf16_pattern_round_trips(shape):
    assert_bit_exact(ALL_PATTERNS.view(torch.bfloat16).reshape(shape))


def test_every_pattern_round_trips_through_the_escape_table():
    # Each row: 128 arbitrary patterns among 896 Normal weights that fix the row's window,
    # so most patterns (±inf, NaN payloads, huge, tiny) fall outside it and take the escape path.
    g = torch.Generator().manual_seed(1)
    normal = (torch.randn(512, 896, generator=g) * 0.02).to(torch.bfloat16)
    w = torch.cat([ALL_PATTERNS.view(torch.bfloat16).reshape(512, 128), normal], dim=1)
    w = w[:, torch.randperm(1024, generator=g)]
    packed = encode(w)
    assert packed.escapes > 40000
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("shape", [(1,), (7,), (1, 1), (3, 5), (2, 3, 5), (1, 1031), (33, 1), (5, 130), (64, 172)])
def test_awkward_shapes_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    scale = torch.exp(torch.randn(shape, generator=g) * 8)  # spans ~1e-20..1e20: escapes, subnormals
    w = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    flat = w.view(-1)
    flat[:: 3] = 0.0
    flat[1:: 5] = -0.0
    assert_bit_exact(w)


def test_specials_and_signed_zeros_keep_their_bits():
    bits = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x3F80],
                        dtype=torch.int32).to(torch.int16)
    w = torch.cat([bits.view(torch.bfloat16), torch.randn(54).to(torch.bfloat16)]).reshape(8, 8)
    assert_bit_exact(w)


def test_size_on_normal_weights_with_per_row_sigma():
    g = torch.Generator().manual_seed(2)
    sigma = 0.02 * torch.exp(torch.randn(512, 1, generator=g))
    w = (torch.randn(512, 4096, generator=g) * sigma).to(torch.bfloat16)
    packed = encode(w)
    assert packed.bits_per_weight() <= 12.1
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16))


def test_kernel_view_reads_escapes_as_the_window_floor():
    w = (torch.randn(4, 64) * 0.02).to(torch.bfloat16)
    w[1, 3] = 1e6
    w[2, 60] = float("inf")
    w[3, 7] = 0.0
    packed = encode(w)
    planes = decode_planes(packed)
    expected = w.view(torch.int16).to(torch.int32) & 0xFFFF
    for r, c in ((1, 3), (2, 60), (3, 7)):
        expected[r, c] = int(packed.base[r]) << 8      # sign 0, low byte 0, exponent >> 1 = base
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
