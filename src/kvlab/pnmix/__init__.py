"""PN-Mix: a mixed-precision quantized KV cache for RoPE transformers (docs/design.md, "PN-Mix").

Exact sink tokens, an exact recent residual window, and packed ``bits``-bit codes for the
rest. Key codecs: Cartesian (per-channel min-max, KIVI-style), Phase–Norm (polar: min-max
norm, phase over the group's shortest covering arc) and their per-pair mix (by first-group
saliency or by query-weighted logit error), on rotated or pre-RoPE keys, and per-pair code
widths with exact sparse outliers (:class:`~kvlab.pnmix.width_codec.BitAllocCodec`, the
recommended ``pn-mix``); values per token, optionally of Hadamard-rotated channels. Attention
(:func:`pnmix_attention`) reads the packed codes directly.

Modules: :mod:`~kvlab.pnmix.packing` (bitstream packing), :mod:`~kvlab.pnmix.quantizers` (elementary
min-max and Phase–Norm quantizers), :mod:`~kvlab.pnmix.codecs` (key codecs: the name registry,
re-exporting the seam :mod:`~kvlab.pnmix.key_codec` every key coding goes through and the families
:mod:`~kvlab.pnmix.pair_codecs` and :mod:`~kvlab.pnmix.mix_codec`), :mod:`~kvlab.pnmix.store`
(contiguous per-layer buffers — their counts and accounting in :mod:`~kvlab.pnmix.store_buffers`
— and :class:`~kvlab.pnmix.store.PackedKV`, what attention and its kernels read),
:mod:`~kvlab.pnmix.config` (the configuration), :mod:`~kvlab.pnmix.cache` (the one-layer cache:
construction and writes; its state and views in :mod:`~kvlab.pnmix.cache_state`, its per-row
tables in :mod:`~kvlab.pnmix.cache_tables`, its flush path in :mod:`~kvlab.pnmix.cache_flush`,
its read path in :mod:`~kvlab.pnmix.cache_decode`), :mod:`~kvlab.pnmix.attention` (the entry
points: dispatch and the fused decode step), :mod:`~kvlab.pnmix.reference` (the torch reference
of packed attention), :mod:`~kvlab.pnmix.kernels` (the compiled backends and their dispatch
table: a C++ CPU kernel, two Triton kernels), :mod:`~kvlab.pnmix.allocation` (per-layer group
sizes under a byte budget), :mod:`~kvlab.pnmix.width_codec` (per-pair widths and outliers),
:mod:`~kvlab.pnmix.values` (value codecs), :mod:`~kvlab.pnmix.bitalloc`,
:mod:`~kvlab.pnmix.outliers`, :mod:`~kvlab.pnmix.prerope`, :mod:`~kvlab.pnmix.hadamard` (the
functions those build on).

The package exports what a user needs — the configuration and its codecs, the cache, the
attention entry points, the per-layer group allocation; everything else is imported from the
module that defines it.
"""

from __future__ import annotations

from kvlab.pnmix.allocation import allocate_group_tokens
from kvlab.pnmix.attention import pnmix_attention, pnmix_decode_step
from kvlab.pnmix.cache import PNMixCache
from kvlab.pnmix.codecs import (
    CartesianCodec,
    KeyCodec,
    MixCodec,
    PerTokenCodec,
    PhaseNormCodec,
)
from kvlab.pnmix.config import KeyCoding, PNMixConfig
from kvlab.pnmix.values import HadamardValueCodec, PerTokenValueCodec, ValueCodec
from kvlab.pnmix.width_codec import BitAllocCodec

__all__ = [
    "BitAllocCodec",
    "CartesianCodec",
    "HadamardValueCodec",
    "KeyCodec",
    "KeyCoding",
    "MixCodec",
    "PNMixCache",
    "PNMixConfig",
    "PerTokenCodec",
    "PerTokenValueCodec",
    "PhaseNormCodec",
    "ValueCodec",
    "allocate_group_tokens",
    "pnmix_attention",
    "pnmix_decode_step",
]
