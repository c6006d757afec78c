"""Little-endian bitstream packing of small unsigned integer codes.

Layout (docs/design.md, "Storage format"): the codes along the last dimension form one
little-endian bitstream per row. Code ``i`` occupies stream bits ``[i * bits, (i + 1) * bits)``
and stream bit ``k`` is bit ``k % 8`` (least significant first) of byte ``k // 8``. For ``bits
= 2`` this is "four codes per byte, code i of a byte in bits 2i..2i+1"; for ``bits = 3`` a code
may straddle two bytes. A row of ``n`` codes takes exactly ``ceil(n * bits / 8)`` bytes; the
unused high bits of the last byte are zero. Rows are packed independently, so selecting or
reordering leading indices (e.g. sequences of a batch) of a packed tensor equals packing the
selected codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_codes", "packed_length", "unpack_codes"]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def packed_length(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits each: ``ceil(n * bits / 8)``.

    Raises:
        ValueError: ``bits`` not an int in 1..8 or ``n`` negative.
    """
    _check_bits(bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"number of codes must be a non-negative int, got {n!r}")
    return (n * bits + 7) // 8


def pack_codes(codes: Tensor, bits: int, *, check: bool = True) -> Tensor:
    """Pack ``bits``-bit codes along the last dimension into a little-endian bitstream.

    Args:
        codes: uint8 tensor ``[..., N]`` (at least 1-D), every entry ``< 2 ** bits``.
        bits: code width in bits, 1..8.
        check: verify that every code is ``< 2 ** bits`` (reads a maximum back from the
            device: a host sync). ``False`` is the internal fast path for codes that are in
            range by construction (codecs clamp them); out-of-range codes then corrupt their
            neighbours' bits.

    Returns:
        uint8 tensor ``[..., ceil(N * bits / 8)]`` on the same device (see module docstring
        for the bit layout). Padding bits are zero; no code is dropped.

    Raises:
        ValueError: ``bits`` outside 1..8, ``codes`` not a uint8 tensor of at least one
            dimension, or a code ``>= 2 ** bits``.
    """
    _check_bits(bits)
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise ValueError(f"codes must be a torch.uint8 tensor, got {got}")
    if codes.dim() == 0:
        raise ValueError("codes must have at least one dimension (the code axis)")
    if check and codes.numel() > 0 and int(codes.max()) >= 1 << bits:
        raise ValueError(
            f"codes must be < 2**bits = {1 << bits} for bits={bits}, got max {int(codes.max())}"
        )
    lead = codes.shape[:-1]
    n = codes.shape[-1]
    nbytes = packed_length(n, bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        pad = nbytes * per_byte - n
        if pad:
            codes = torch.cat([codes, codes.new_zeros((*lead, pad))], dim=-1)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        grouped = codes.reshape(*lead, nbytes, per_byte).to(torch.int32)
        return (grouped << shifts).sum(dim=-1).to(torch.uint8)
    # General widths (3, 5, 6, 7): expand to single bits, regroup the stream by bytes.
    bit_idx = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.unsqueeze(-1).to(torch.int32) >> bit_idx) & 1).reshape(*lead, n * bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = torch.cat([stream, stream.new_zeros((*lead, pad))], dim=-1)
    byte_idx = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.reshape(*lead, nbytes, 8) << byte_idx).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes of each packed row.

    Args:
        packed: uint8 tensor ``[..., ceil(n * bits / 8)]``.
        bits: code width in bits, 1..8.
        n: number of codes per row.

    Returns:
        uint8 tensor ``[..., n]`` with entries in ``0 .. 2 ** bits - 1``.

    Raises:
        ValueError: ``bits`` outside 1..8, ``n`` negative, ``packed`` not a uint8 tensor of
            at least one dimension, or its last dimension is not ``ceil(n * bits / 8)``.
    """
    nbytes = packed_length(n, bits)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, Tensor) else type(packed).__name__
        raise ValueError(f"packed must be a torch.uint8 tensor, got {got}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension (the byte axis)")
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"packed has {packed.shape[-1]} bytes per row; {n} codes of {bits} bits need {nbytes}"
        )
    lead = packed.shape[:-1]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
        codes = (packed.unsqueeze(-1).to(torch.int32) >> shifts) & mask
        return codes.reshape(*lead, nbytes * per_byte)[..., :n].to(torch.uint8)
    byte_idx = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.unsqueeze(-1).to(torch.int32) >> byte_idx) & 1).reshape(*lead, nbytes * 8)
    bit_idx = torch.arange(bits, device=packed.device, dtype=torch.int32)
    stream = stream[..., : n * bits].reshape(*lead, n, bits)
    return (stream << bit_idx).sum(dim=-1).to(torch.uint8)
