"""What a compiled packed-attention kernel needs to know about a cache's codecs
(docs/design.md, "Kernels", "Capabilities").

Compiled kernels (the CPU kernel, the Triton kernel) do not call a codec's ``decode``: they
decode a group's keys in registers. :func:`kernel_key_decode` describes a cache's key codec,
key payload and value codec in the terms they understand, or says why it cannot:

* ``KEYS_PER_CHANNEL``: scalars ``[scale(D) | zero(D)]`` (the pair-slot convention of
  :mod:`kvlab.pnmix.quantizers`); every rotary pair ``p`` of a row has a **pair mode** —
  ``PAIR_CARTESIAN`` (both slots ``zero + code · scale``) or ``PAIR_PHASE_NORM`` (norm in the
  first slot, phase level ``offset + c · span / L`` in the second, ``r̂ · (cos φ̂, sin φ̂)``);
  non-rotary channels are Cartesian. A mix takes ``mode_second`` where the row's mask bit is
  set and ``mode_first`` elsewhere; a single pair codec has ``mode_first == mode_second``.
* ``KEYS_PER_TOKEN``: scalars ``[scale(T) | zero(T)]``, ``zero_t + code · scale_t``.
* ``KEYS_WIDTHS``: scalars ``[scale(D) | zero(D)]``, ``zero + code · scale`` per channel, codes
  in the width layout of :class:`~kvlab.pnmix.width_codec.BitAllocCodec` (a code width per
  (row, rotary pair) from the row's table).

and three steps after the decode: the key payload's exact sparse entries written back
(:class:`~kvlab.pnmix.width_codec.BitAllocCodec` outliers), the rotation of a position-aware
(pre-RoPE) codec's keys to their positions, and the value codec's output transform
(Hadamard).

Extension points (docs/design.md, "Kernels"): a pair codec class that the kernels can decode is
registered with :func:`register_pair_mode`; anything else needs a new decode kind. Codec
classes are recognised exactly (a subclass may decode differently; a kernel never guesses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.pnmix.codecs import CartesianCodec, KeyCodec, MixCodec, PerTokenCodec, PhaseNormCodec
from kvlab.pnmix.values import (
    AutoHadamardValueCodec,
    HadamardValueCodec,
    MSEHadamardValueCodec,
    PerTokenValueCodec,
    ValueCodec,
)
from kvlab.pnmix.width_codec import BitAllocCodec

__all__ = [
    "KEYS_PER_CHANNEL",
    "KEYS_PER_TOKEN",
    "KEYS_WIDTHS",
    "PAIR_CARTESIAN",
    "PAIR_PHASE_NORM",
    "KernelKeyDecode",
    "kernel_key_decode",
    "register_pair_mode",
]

KEYS_PER_CHANNEL = 0
KEYS_PER_TOKEN = 1
KEYS_WIDTHS = 2
PAIR_CARTESIAN = 0
PAIR_PHASE_NORM = 1

# exact classes only: a subclass may change decode_pairs, and a kernel must never guess
_PAIR_MODES: dict[type, int] = {CartesianCodec: PAIR_CARTESIAN, PhaseNormCodec: PAIR_PHASE_NORM}


def register_pair_mode(codec_class: type, mode: int) -> None:
    """Declare that compiled kernels decode pair codec ``codec_class`` (exactly that class)
    with pair mode ``mode`` (``PAIR_CARTESIAN`` or ``PAIR_PHASE_NORM``).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in (PAIR_CARTESIAN, PAIR_PHASE_NORM):
        raise ValueError(f"pair mode must be PAIR_CARTESIAN or PAIR_PHASE_NORM, got {mode!r}")
    _PAIR_MODES[codec_class] = mode


@dataclass(frozen=True)
class KernelKeyDecode:
    """A cache's codecs as compiled kernels run them (module docstring).

    Attributes:
        kind: ``KEYS_PER_CHANNEL``, ``KEYS_PER_TOKEN`` or ``KEYS_WIDTHS``.
        mode_first: pair mode where the mix mask is False (every pair for a pair codec).
        mode_second: pair mode where the mix mask is True.
        rotate_to_position: keys are stored at position 0 (pre-RoPE) and are rotated to their
            positions after decoding (and after the payload).
        payload_bytes: bytes of exact sparse entries per group (``K`` storage-dtype values,
            then ``K`` int16 flat indices ``t * D + d``), written over the decoded keys; 0 =
            none.
        value_hadamard: values are coded in the Hadamard frame; the quantized groups'
            weighted sums are mapped back with ``H^T`` once per query row.
    """

    kind: int
    mode_first: int = PAIR_CARTESIAN
    mode_second: int = PAIR_CARTESIAN
    rotate_to_position: bool = False
    payload_bytes: int = 0
    value_hadamard: bool = False


def _value_step(value_codec: ValueCodec | None) -> bool | str:
    if value_codec is None or type(value_codec) is PerTokenValueCodec:
        return False
    if type(value_codec) in (HadamardValueCodec, MSEHadamardValueCodec, AutoHadamardValueCodec):
        return True
    return f"value coding {value_codec} has no kernel step"


def _key_decode(codec: KeyCodec, payload_bytes: int) -> KernelKeyDecode | str:
    kind = type(codec)
    rotate = bool(codec.position_aware)
    if kind is BitAllocCodec:
        assert isinstance(codec, BitAllocCodec)
        if codec.table_bits == 0:  # one width: per-channel min-max at `bits`
            return KernelKeyDecode(KEYS_PER_CHANNEL, rotate_to_position=rotate)
        return KernelKeyDecode(KEYS_WIDTHS, rotate_to_position=rotate)
    if payload_bytes:
        return f"codec {codec} stores a payload that no kernel reads"
    if kind is PerTokenCodec:
        if rotate:
            return f"codec {codec}: per-token keys are not position-aware in any kernel"
        return KernelKeyDecode(KEYS_PER_TOKEN)
    if kind in _PAIR_MODES:
        mode = _PAIR_MODES[kind]
        return KernelKeyDecode(KEYS_PER_CHANNEL, mode, mode, rotate_to_position=rotate)
    if kind is MixCodec:
        assert isinstance(codec, MixCodec)
        first, second = type(codec.first), type(codec.second)
        if first in _PAIR_MODES and second in _PAIR_MODES:
            return KernelKeyDecode(
                KEYS_PER_CHANNEL,
                _PAIR_MODES[first],
                _PAIR_MODES[second],
                rotate_to_position=rotate,
            )
        return f"codec {codec} mixes a pair codec that no kernel decodes"
    return f"codec {codec} ({kind.__name__}) has no kernel decode step"


def kernel_key_decode(
    codec: KeyCodec, value_codec: ValueCodec | None = None, payload_bytes: int = 0
) -> KernelKeyDecode | str:
    """The :class:`KernelKeyDecode` of a cache's key codec ``codec``, value codec
    ``value_codec`` (``None``: per-token min-max values) and key payload bytes per group
    (``codec.payload_bytes`` at the cache's geometry), or a sentence saying why compiled
    kernels cannot run that configuration (then the torch reference must). Evaluated once per
    cache (docs/design.md, "Kernels", "Capabilities"); reads no tensor.

    Supported: :class:`~kvlab.pnmix.codecs.CartesianCodec`, :class:`~kvlab.pnmix.codecs.
    PhaseNormCodec` (and classes added by :func:`register_pair_mode`) and mixes of two of
    them, rotated or pre-RoPE; :class:`~kvlab.pnmix.codecs.PerTokenCodec`;
    :class:`~kvlab.pnmix.width_codec.BitAllocCodec` (any widths, pre-RoPE or not, with or
    without outliers); values per-token min-max or Hadamard, with or without channel groups
    (``group_channels``: the kernels read the group count from the scalars' width, ``2·T·G``).
    Exact classes only.
    """
    hadamard = _value_step(value_codec)
    if isinstance(hadamard, str):
        return hadamard
    described = _key_decode(codec, int(payload_bytes))
    if isinstance(described, str):
        return described
    return dataclasses.replace(described, payload_bytes=int(payload_bytes), value_hadamard=hadamard)
