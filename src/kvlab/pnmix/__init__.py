"""PN-Mix: a mixed-precision quantized KV cache for RoPE transformers (docs/design.md, "PN-Mix").

Exact sink tokens, an exact recent residual window, and packed ``bits``-bit codes for the
rest; each rotary pair of a key is coded either Cartesian (per-channel min-max, KIVI-style)
or Phase–Norm (polar: min-max norm, phase over the group's shortest covering arc), chosen
once at prefill by a saliency test; values are quantized per token. Attention
(:func:`pnmix_attention`) reads the packed codes directly.

Modules: :mod:`~kvlab.pnmix.packing` (bitstream packing), :mod:`~kvlab.pnmix.quantizers`
(elementary min-max and Phase–Norm quantizers), :mod:`~kvlab.pnmix.codecs` (key codecs, the one
seam every key coding goes through), :mod:`~kvlab.pnmix.store` (contiguous per-layer buffers),
:mod:`~kvlab.pnmix.config` (the configuration), :mod:`~kvlab.pnmix.cache` (the one-layer
cache), :mod:`~kvlab.pnmix.attention` (packed attention: the torch reference, the dispatch and
the fused decode step), :mod:`~kvlab.pnmix.kernels` (the compiled backends: a C++ CPU kernel and
a Triton kernel), :mod:`~kvlab.pnmix.allocation` (per-layer group sizes under a byte budget).
"""

from __future__ import annotations

from kvlab.pnmix.allocation import allocate_group_tokens
from kvlab.pnmix.attention import (
    PackedKV,
    packed_attention_reference,
    pnmix_attention,
    pnmix_decode_step,
)
from kvlab.pnmix.cache import PackedGroup, PNMixCache
from kvlab.pnmix.codecs import (
    CartesianCodec,
    KeyCodec,
    KeyLayout,
    MixCodec,
    PairCodec,
    PerTokenCodec,
    PhaseNormCodec,
    first_group_error_saliency,
)
from kvlab.pnmix.config import KeyCoding, PNMixConfig
from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes
from kvlab.pnmix.store import PackedStore, StoreGeometry

__all__ = [
    "CartesianCodec",
    "KeyCodec",
    "KeyCoding",
    "KeyLayout",
    "MixCodec",
    "PNMixCache",
    "PNMixConfig",
    "PackedGroup",
    "PackedKV",
    "PackedStore",
    "PairCodec",
    "PerTokenCodec",
    "PhaseNormCodec",
    "StoreGeometry",
    "allocate_group_tokens",
    "first_group_error_saliency",
    "pack_codes",
    "packed_attention_reference",
    "packed_length",
    "pnmix_attention",
    "pnmix_decode_step",
    "unpack_codes",
]
