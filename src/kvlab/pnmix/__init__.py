"""PN-Mix: a mixed-precision quantized KV cache for RoPE transformers (kvlab SPEC §3).

Exact sink tokens, an exact recent residual window, and packed ``bits``-bit codes for the
rest; each rotary pair of a key is coded either Cartesian (per-channel min-max, KIVI-style)
or Phase–Norm (polar: min-max norm, phase over the group's shortest covering arc), chosen
once at prefill by a saliency test; values are quantized per token. Attention
(:func:`pnmix_attention`) reads the packed codes directly.

Modules: :mod:`~kvlab.pnmix.packing` (bitstream packing), :mod:`~kvlab.pnmix.quantizers`
(min-max and Phase–Norm coding), :mod:`~kvlab.pnmix.cache` (the one-layer cache),
:mod:`~kvlab.pnmix.attention` (packed attention), :mod:`~kvlab.pnmix.allocation` (per-layer
group sizes under a byte budget).
"""

from __future__ import annotations

from kvlab.pnmix.allocation import allocate_group_tokens
from kvlab.pnmix.attention import pnmix_attention
from kvlab.pnmix.cache import KeyCoding, PackedGroup, PNMixCache, PNMixConfig
from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes

__all__ = [
    "KeyCoding",
    "PNMixCache",
    "PNMixConfig",
    "PackedGroup",
    "allocate_group_tokens",
    "pack_codes",
    "packed_length",
    "pnmix_attention",
    "unpack_codes",
]
