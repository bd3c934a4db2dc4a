import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.core.errors import LowbitError
from lowbit.quant.packing import LAYOUTS, pack, unpack

LEADS = st.lists(st.sampled_from([1, 2, 3, 5, 7, 99]), min_size=0, max_size=3).filter(
    lambda s: len(s) == 0 or int(torch.tensor(s).prod()) <= 2000
)


@settings(max_examples=150, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    layout=st.sampled_from(LAYOUTS),
    lead=LEADS,
    groups=st.integers(1, 37),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.uint8, torch.int32, torch.int64]),
)
def test_roundtrip(bits, layout, lead, groups, seed, dtype):
    D = groups * (8 // bits)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, D), generator=g).to(dtype)
    p = pack(codes, bits, layout)
    assert p.dtype == torch.uint8 and p.shape == (*lead, D * bits // 8)
    u = unpack(p, bits, layout)
    assert u.dtype == torch.uint8 and u.shape == codes.shape
    assert torch.equal(u, codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_byte_values_roundtrip(bits, layout):
    # every byte value unpacks to codes that pack back to the same byte
    P = 8 // bits
    b = torch.arange(256, dtype=torch.uint8).reshape(1, 256).repeat(3, 1)
    assert torch.equal(pack(unpack(b, bits, layout), bits, layout), b)
    assert unpack(b, bits, layout).shape == (3, 256 * P)


def test_noncontiguous_input():
    c = torch.randint(0, 4, (16, 12), dtype=torch.uint8).t()  # [12, 16] non-contiguous
    for layout in LAYOUTS:
        assert torch.equal(unpack(pack(c, 2, layout), 2, layout), c)


def test_interleaved_2bit_bits():
    c = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    p = pack(c, 2, "interleaved")
    # byte j = d[4j] | d[4j+1] << 2 | d[4j+2] << 4 | d[4j+3] << 6
    assert p.tolist() == [[0b00_11_10_01, 0b01_00_11_11]]


def test_interleaved_4bit_bits():
    c = torch.tensor([[0x1, 0x2, 0xA, 0xF, 0x0, 0x7]], dtype=torch.uint8)
    assert pack(c, 4, "interleaved").tolist() == [[0x21, 0xFA, 0x70]]


def test_strided_2bit_bits():
    # D = 8, S = 2: byte j = d[j] | d[j+2] << 2 | d[j+4] << 4 | d[j+6] << 6
    c = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    p = pack(c, 2, "strided")
    assert p.tolist() == [[1 | 3 << 2 | 3 << 4 | 0 << 6, 2 | 0 << 2 | 3 << 4 | 1 << 6]]
    # the documented read: shift byte row by i*bits -> the contiguous dim slice [i*S, (i+1)*S)
    for i in range(4):
        assert ((p >> (2 * i)) & 3).tolist() == [c[0, 2 * i : 2 * i + 2].tolist()]


def test_strided_4bit_bits():
    # D = 6, S = 3: byte j = d[j] | d[j+3] << 4
    c = torch.tensor([[0x1, 0x2, 0xA, 0xF, 0x0, 0x7]], dtype=torch.uint8)
    assert pack(c, 4, "strided").tolist() == [[0xF1, 0x02, 0x7A]]


def test_8bit_identity():
    c = torch.randint(0, 256, (3, 5), dtype=torch.uint8)
    for layout in LAYOUTS:
        assert torch.equal(pack(c, 8, layout), c)
        assert torch.equal(unpack(c, 8, layout), c)


def test_errors():
    with pytest.raises(LowbitError, match="out of range"):
        pack(torch.tensor([[0, 4, 1, 2]]), 2)
    with pytest.raises(LowbitError, match="out of range"):
        pack(torch.tensor([[0, -1]]), 4)
    with pytest.raises(LowbitError, match="out of range"):
        pack(torch.tensor([[0, 256]]), 8)
    with pytest.raises(LowbitError, match="not a multiple of 4"):
        pack(torch.zeros(3, 6, dtype=torch.uint8), 2)
    with pytest.raises(LowbitError, match="bits"):
        pack(torch.zeros(3, 8, dtype=torch.uint8), 3)
    with pytest.raises(LowbitError, match="bits"):
        unpack(torch.zeros(3, 8, dtype=torch.uint8), 5)
    with pytest.raises(LowbitError, match="layout"):
        pack(torch.zeros(3, 8, dtype=torch.uint8), 4, "planar")
    with pytest.raises(LowbitError, match="integer"):
        pack(torch.zeros(3, 8), 4)
    with pytest.raises(LowbitError, match="uint8"):
        unpack(torch.zeros(3, 8, dtype=torch.int32), 4)


def test_empty_leading_dim():
    c = torch.zeros(0, 8, dtype=torch.uint8)
    for layout in LAYOUTS:
        assert unpack(pack(c, 2, layout), 2, layout).shape == (0, 8)


def test_strided_1bit_bits():
    # byte j holds dims j + i * (D / 8) at bit i: what the fused kernel's residual read assumes
    D = 16
    codes = torch.zeros(1, D, dtype=torch.uint8)
    codes[0, 1 + 5 * (D // 8)] = 1
    p = pack(codes, 1, "strided")
    assert p.shape == (1, 2) and int(p[0, 1]) == 1 << 5 and int(p[0, 0]) == 0
