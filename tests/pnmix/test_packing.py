"""Bitstream packing of codes: layout, exact round trip, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """Pure-Python little-endian bitstream: code i in stream bits [i*bits, (i+1)*bits)."""
    out = [0] * math.ceil(len(codes) * bits / 8)
    for i, c in enumerate(codes):
        for j in range(bits):
            k = i * bits + j
            out[k // 8] |= ((c >> j) & 1) << (k % 8)
    return out


@settings(max_examples=150, deadline=None)
@given(
    bits=st.integers(1, 8),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(0, 37),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_and_reference_layout(bits: int, lead: list[int], n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=gen).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, math.ceil(n * bits / 8)) == (*lead, packed_length(n, bits))
    rows = codes.reshape(math.prod(lead), n).tolist()
    expected = [reference_pack(r, bits) for r in rows]
    assert packed.reshape(len(rows), -1).tolist() == expected
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_two_bit_layout_is_code_i_in_bits_2i() -> None:
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    # byte 0: 1 | 2<<2 | 3<<4 | 0<<6 = 57; byte 1: code 4 in bits 0..1, padding zero
    assert pack_codes(codes, 2).tolist() == [57, 3]


def test_three_bit_codes_straddle_bytes() -> None:
    codes = torch.tensor([7, 0, 5], dtype=torch.uint8)
    # stream: 111 000 101 -> byte0 bits 0..7 = 1,1,1,0,0,0,1,0 = 71; byte1 bit 0 = 1
    assert pack_codes(codes, 3).tolist() == [71, 1]
    assert unpack_codes(torch.tensor([71, 1], dtype=torch.uint8), 3, 3).tolist() == [7, 0, 5]


def test_rows_pack_independently() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8, (4, 2, 11), generator=gen).to(torch.uint8)
    packed = pack_codes(codes, 3)
    idx = torch.tensor([3, 1, 1])
    assert torch.equal(packed[idx], pack_codes(codes[idx], 3))


@pytest.mark.parametrize("bits", [0, 9, -1, True, 2.0])
def test_bad_bits(bits: object) -> None:
    codes = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits"):
        pack_codes(codes, bits)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits"):
        unpack_codes(codes, bits, 4)  # type: ignore[arg-type]


def test_code_too_large_for_bits() -> None:
    with pytest.raises(ValueError, match=r"< 2\*\*bits = 4"):
        pack_codes(torch.tensor([0, 4], dtype=torch.uint8), 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.float32, torch.bool])
def test_wrong_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=dtype), 2)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(torch.zeros(1, dtype=dtype), 2, 4)


def test_scalar_and_wrong_length() -> None:
    with pytest.raises(ValueError, match="at least one dimension"):
        pack_codes(torch.tensor(1, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="need 2"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, 5)
    with pytest.raises(ValueError, match="non-negative"):
        unpack_codes(torch.zeros(0, dtype=torch.uint8), 2, -1)
