"""What a compiled packed-attention kernel needs to know about a key codec (docs/design.md,
"Kernels").

Compiled kernels (the CPU kernel, the Triton kernel) do not call a codec's ``decode``: they
decode a group's keys in registers. :func:`kernel_key_decode` describes a codec in the terms
they understand, or says why it cannot:

* ``KEYS_PER_CHANNEL``: scalars ``[scale(D) | zero(D)]`` (the pair-slot convention of
  :mod:`kvlab.pnmix.quantizers`); every rotary pair ``p`` of a row has a **pair mode** —
  ``PAIR_CARTESIAN`` (both slots ``zero + code · scale``) or ``PAIR_PHASE_NORM`` (norm in the
  first slot, phase level ``offset + c · span / L`` in the second, ``r̂ · (cos φ̂, sin φ̂)``);
  non-rotary channels are Cartesian. A mix takes ``mode_second`` where the row's mask bit is
  set and ``mode_first`` elsewhere; a single pair codec has ``mode_first == mode_second``.
* ``KEYS_PER_TOKEN``: scalars ``[scale(T) | zero(T)]``, ``zero_t + code · scale_t``.

Extension points (docs/design.md, "Kernels"): a codec class that the kernels can decode is
registered with :func:`register_pair_mode` (pair codecs) or described by a new decode kind.
Configurations without kernel support (docs/design.md, "Kernels", "Capabilities") are
recognised and refused with a reason; the dispatcher then uses the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.pnmix.codecs import CartesianCodec, KeyCodec, MixCodec, PerTokenCodec, PhaseNormCodec
from kvlab.pnmix.values import PerTokenValueCodec, ValueCodec

__all__ = [
    "KEYS_PER_CHANNEL",
    "KEYS_PER_TOKEN",
    "PAIR_CARTESIAN",
    "PAIR_PHASE_NORM",
    "KernelKeyDecode",
    "kernel_key_decode",
    "register_pair_mode",
]

KEYS_PER_CHANNEL = 0
KEYS_PER_TOKEN = 1
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
    """A codec as compiled kernels decode it (module docstring).

    Attributes:
        kind: ``KEYS_PER_CHANNEL`` or ``KEYS_PER_TOKEN``.
        mode_first: pair mode where the mix mask is False (every pair for a pair codec).
        mode_second: pair mode where the mix mask is True.
        rotate_to_position: keys are stored at position 0 (pre-RoPE) and must be rotated to
            their positions after decoding (no kernel does this yet).
        sparse_entries: exact ``(value, index)`` entries per group to add after decoding (no
            kernel does this yet).
    """

    kind: int
    mode_first: int = PAIR_CARTESIAN
    mode_second: int = PAIR_CARTESIAN
    rotate_to_position: bool = False
    sparse_entries: int = 0


def kernel_key_decode(
    codec: KeyCodec, value_codec: ValueCodec | None = None, payload_bytes: int = 0
) -> KernelKeyDecode | str:
    """The :class:`KernelKeyDecode` of a cache's key codec ``codec``, value codec
    ``value_codec`` (``None``: per-token min-max values) and key payload bytes per group
    (``codec.payload_bytes`` at the cache's geometry), or a sentence saying why compiled
    kernels cannot run that configuration (then the torch reference must). Evaluated once per
    cache (docs/design.md, "Kernels", "Capabilities"); reads no tensor."""
    if value_codec is not None and type(value_codec) is not PerTokenValueCodec:
        return f"value coding {value_codec} has no kernel step (only per-token min-max values)"
    if codec.position_aware:
        return (
            f"codec {codec} is position-aware (pre-RoPE): the kernels' rotate-to-position step "
            "is not built yet"
        )
    if payload_bytes:
        return f"codec {codec} adds exact sparse entries: the kernels' sparse step is not built yet"
    kind = type(codec)
    if kind is PerTokenCodec:
        return KernelKeyDecode(KEYS_PER_TOKEN)
    if kind in _PAIR_MODES:
        mode = _PAIR_MODES[kind]
        return KernelKeyDecode(KEYS_PER_CHANNEL, mode, mode)
    if kind is MixCodec:
        assert isinstance(codec, MixCodec)
        first, second = type(codec.first), type(codec.second)
        if first in _PAIR_MODES and second in _PAIR_MODES:
            return KernelKeyDecode(KEYS_PER_CHANNEL, _PAIR_MODES[first], _PAIR_MODES[second])
        return f"codec {codec} mixes a pair codec that no kernel decodes"
    return f"codec {codec} ({kind.__name__}) has no kernel decode step"
