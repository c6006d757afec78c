"""Key codecs of the PN-Mix cache: one class per key coding (docs/design.md, "Key codecs").

A key codec turns the storage-rounded keys of quantized groups into small unsigned codes plus
per-group scalars and back. The cache, the byte accounting and packed attention only call the
codec; none of them branches on a coding's name. Codes are returned *unpacked*
(uint8 ``[N, T, D]``, token-major); the store packs them with
:func:`kvlab.pnmix.packing.pack_codes` (docs/design.md, "Storage format").

Codecs provided:

* :class:`CartesianCodec` — per channel min-max over the group's tokens (KIVI keys, Liu et al.
  2024). Scalars ``[scale(D) | zero(D)]``.
* :class:`PhaseNormCodec` — every rotary pair in Phase–Norm (polar) coding, the remaining
  channels Cartesian; pair-slot convention of :mod:`kvlab.pnmix.quantizers`. Scalars
  ``[scale(D) | zero(D)]`` in that convention.
* :class:`PerTokenCodec` — per token over the head's channels (like values). Scalars
  ``[scale(T) | zero(T)]``.
* :class:`MixCodec` — per (sequence, kv head, rotary pair) the coding of one of two *pair
  codecs*, chosen once by a pluggable saliency rule (default
  :func:`first_group_error_saliency`, today's rule) or, with ``query_aware=True``, by the
  expected squared logit error over the commit's queries (:func:`query_logit_saliency`), and
  held by the cache as a 1-bit mask.
* :class:`~kvlab.pnmix.width_codec.BitAllocCodec` (own module) — per-channel min-max with a
  code width per (kv head, rotary pair) and optional exact sparse outliers.

**Frames.** A pair codec with ``prerope=True`` (and a mix of two such codecs) is
*position-aware*: the cache rotates each key back to position 0 before coding it (KVQuant,
Hooper et al. 2024, arXiv:2401.18079) and attention rotates the decoded key to its position
(docs/design.md, "Key codecs"). The codec itself never sees a position: it codes whatever
frame the cache hands it.

**The seam.** Beyond :meth:`KeyCodec.encode` / :meth:`KeyCodec.decode` (the dense codes and
scalars), a codec says how its codes are packed (:meth:`KeyCodec.pack` /
:meth:`KeyCodec.unpack`), what per-group side data it stores (:meth:`KeyCodec.encode_groups`,
:meth:`KeyCodec.payload_bytes`, :meth:`KeyCodec.apply_payload`), and, for codecs with a
per-(kv head, pair) table (``table_bits > 0``), how the table is computed once per row
(:meth:`KeyCodec.compute_table`, from :class:`TableStatistics`) and stored.

A **pair codec** (:class:`PairCodec`) codes every rotary pair as two channel slots
(``first[p]``, ``second[p]``) with two codes per token and four scalars per group, and every
non-rotary channel Cartesian, so that any two pair codecs can be mixed slot by slot.

Rotary pairs are described by a :class:`KeyLayout` (head_dim and the pair channel indices of
:func:`kvlab.pnmix.quantizers.rotary_pair_indices`), passed to every call, so a codec object is
plain configuration (hashable, device-free) that any head geometry can use.

**Modules.** This module is the codecs' public face and their name registry
(:func:`key_codec_from_name`); it re-exports every codec name. The seam lives in
:mod:`kvlab.pnmix.key_codec` (below every family), the families in
:mod:`kvlab.pnmix.pair_codecs` (Cartesian, Phase–Norm, per token),
:mod:`kvlab.pnmix.mix_codec` (the mix and its saliency rules) and
:mod:`kvlab.pnmix.width_codec` (per-pair widths and outliers).
"""

from __future__ import annotations

from collections.abc import Callable

from kvlab.pnmix.key_codec import KeyCodec, KeyCodes, KeyLayout, TableStatistics
from kvlab.pnmix.mix_codec import (
    MixCodec,
    SaliencyRule,
    first_group_error_saliency,
    query_logit_saliency,
)
from kvlab.pnmix.pair_codecs import (
    CartesianCodec,
    PairCodec,
    PairCodes,
    PerTokenCodec,
    PhaseNormCodec,
)
from kvlab.pnmix.width_codec import BitAllocCodec

__all__ = [
    "KEY_CODING_NAMES",
    "BitAllocCodec",
    "CartesianCodec",
    "KeyCodec",
    "KeyCodes",
    "KeyLayout",
    "MixCodec",
    "PairCodec",
    "PairCodes",
    "PerTokenCodec",
    "PhaseNormCodec",
    "SaliencyRule",
    "TableStatistics",
    "first_group_error_saliency",
    "key_codec_from_name",
    "query_logit_saliency",
]


def _bit_alloc(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    return BitAllocCodec(bits, outlier_fraction=outlier_fraction)


def _prerope_cartesian(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    if outlier_fraction:
        return BitAllocCodec(bits, widths=(bits,), outlier_fraction=outlier_fraction)
    return CartesianCodec(bits, prerope=True)


def _cartesian(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    if outlier_fraction:
        return BitAllocCodec(bits, widths=(bits,), outlier_fraction=outlier_fraction, prerope=False)
    return CartesianCodec(bits)


_NAMED: dict[str, Callable[[int], KeyCodec]] = {
    "mix": lambda bits: MixCodec(CartesianCodec(bits), PhaseNormCodec(bits)),
    "cartesian": CartesianCodec,
    "phase_norm": PhaseNormCodec,
    "per_token": PerTokenCodec,
    "prerope_cartesian": lambda bits: CartesianCodec(bits, prerope=True),
    "prerope_phase_norm": lambda bits: PhaseNormCodec(bits, prerope=True),
    "prerope_mix": lambda bits: MixCodec(
        CartesianCodec(bits, prerope=True), PhaseNormCodec(bits, prerope=True)
    ),
    "qmix": lambda bits: MixCodec(CartesianCodec(bits), PhaseNormCodec(bits), query_aware=True),
    "prerope_qmix": lambda bits: MixCodec(
        CartesianCodec(bits, prerope=True), PhaseNormCodec(bits, prerope=True), query_aware=True
    ),
    "bit_alloc": _bit_alloc,
}
# names whose codec keeps a fraction of exact sparse key outliers when asked
_WITH_OUTLIERS: dict[str, Callable[[int, float], KeyCodec]] = {
    "bit_alloc": _bit_alloc,
    "prerope_cartesian": _prerope_cartesian,
    "cartesian": _cartesian,
}

#: Every ``key_coding`` name (:func:`key_codec_from_name`).
KEY_CODING_NAMES: tuple[str, ...] = tuple(_NAMED)


def key_codec_from_name(name: str, bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    """The codec a ``key_coding`` name stands for (docs/design.md, "Key codecs").

    ``"mix"``: Cartesian/Phase–Norm mix with :func:`first_group_error_saliency`;
    ``"cartesian"``, ``"phase_norm"``, ``"per_token"``; ``"prerope_cartesian"``,
    ``"prerope_phase_norm"``, ``"prerope_mix"``: the same pair codings on pre-RoPE keys;
    ``"qmix"`` / ``"prerope_qmix"``: the Cartesian/Phase–Norm mix chosen by
    :func:`query_logit_saliency`; ``"bit_alloc"``: pre-RoPE keys with a width in {0, 2, 3, 4}
    bits per (kv head, rotary pair) (:class:`~kvlab.pnmix.width_codec.BitAllocCodec`).

    Args:
        name: one of :data:`KEY_CODING_NAMES`.
        bits: code width (average width for ``"bit_alloc"``).
        outlier_fraction: fraction of each group's key elements kept exact (``"bit_alloc"``,
            ``"cartesian"``, ``"prerope_cartesian"``; the latter two become a
            :class:`~kvlab.pnmix.width_codec.BitAllocCodec` with the single width ``bits``).

    Raises:
        ValueError: an unknown name, or outliers for a coding without them.
    """
    if name not in _NAMED:
        raise ValueError(f"key_coding must be one of {tuple(_NAMED)} or a KeyCodec, got {name!r}")
    if outlier_fraction:
        if name not in _WITH_OUTLIERS:
            raise ValueError(
                f"key_coding {name!r} keeps no sparse outliers; key_outlier_fraction needs one "
                f"of {tuple(_WITH_OUTLIERS)}"
            )
        return _WITH_OUTLIERS[name](bits, outlier_fraction)
    return _NAMED[name](bits)
