"""What the split-K decode kernel covers and how many context splits a launch uses
(docs/benchmarks.md, "Decode bytes model and the split-K kernel"; docs/design.md, "Kernels").
No Triton import: the dispatch table (:mod:`kvlab.pnmix.kernels.dispatch`), the bytes model
and the benchmarks read it without the ``triton`` package."""

from __future__ import annotations

import math

from kvlab.pnmix.kernels.spec import (
    KEYS_PER_CHANNEL,
    KEYS_WIDTHS,
    PAIR_PHASE_NORM,
    KernelKeyDecode,
)
from kvlab.pnmix.key_codec import KeyLayout
from kvlab.pnmix.store import PackedKV

__all__ = ["choose_splits", "rotary_pairs_kind", "splitk_unsupported"]


def choose_splits(
    batch: int, kv_heads: int, tokens: int, sm_count: int, *, min_tokens: int = 512
) -> int:
    """Context splits per (sequence, kv head) for a decode step: enough programs for about
    four per SM (``4 · sm_count / (batch · kv_heads)``, rounded up), at most one split per
    ``min_tokens`` context tokens (a split's partial costs ``(Dv + 2)`` floats per query row:
    negligible beside 512 tokens of codes), at least 1.

    Raises:
        ValueError: a non-positive ``batch``, ``kv_heads`` or ``sm_count``.
    """
    if batch < 1 or kv_heads < 1 or sm_count < 1:
        raise ValueError(f"batch, kv_heads, sm_count must be >= 1: {batch, kv_heads, sm_count}")
    wanted = math.ceil(4 * sm_count / (batch * kv_heads))
    return max(1, min(wanted, tokens // max(1, min_tokens)))


def rotary_pairs_kind(layout: KeyLayout) -> str | None:
    """``"half"``, ``"interleaved"`` or ``None`` (rotary pairs not covering the head in one of
    the two layouts). Host metadata when the layout carries its name (every cache's does:
    :meth:`~kvlab.pnmix.key_codec.KeyLayout.for_rotary`); else the index tensors are read (a
    copy to the host when on a GPU)."""
    d = layout.head_dim
    p = layout.num_pairs
    if 2 * p != d:
        return None
    if layout.rotary_layout is not None:
        return layout.rotary_layout
    first = layout.first.cpu().tolist()
    second = layout.second.cpu().tolist()
    if first == list(range(p)) and second == list(range(p, d)):
        return "half"
    if first == list(range(0, d, 2)) and second == list(range(1, d, 2)):
        return "interleaved"
    return None


def splitk_unsupported(kv: PackedKV, decode: KernelKeyDecode | str) -> str | None:
    """``None`` when the split-K kernel (:func:`~kvlab.pnmix.kernels.triton_splitk.
    splitk_launcher`) runs this store, else why not (what is covered: docs/benchmarks.md,
    "Decode bytes model and the split-K kernel"). Reads host metadata only (no device read):
    the dispatch table asks it on every call."""
    if isinstance(decode, str):
        return decode
    if decode.kind not in (KEYS_PER_CHANNEL, KEYS_WIDTHS):
        return "split-K kernel: per-channel keys or per-pair widths only (no per-token keys)"
    pn = PAIR_PHASE_NORM in (decode.mode_first, decode.mode_second)
    if decode.payload_bytes and pn:
        return "split-K kernel: outliers over Phase-Norm pairs are not decoded"
    if decode.kind == KEYS_WIDTHS and kv.mask is None:
        return "split-K kernel: per-pair widths without a width table"
    if kv.bits not in (2, 4):
        return f"split-K kernel: 2- or 4-bit codes only, got {kv.bits}"
    d, dv = kv.layout.head_dim, kv.sink_values.shape[-1]
    cpw = 32 // kv.bits
    for name, x, lo in (("head_dim", d, 32), ("value head_dim", dv, 16)):
        if x < lo or x & (x - 1) or x % cpw:
            return f"split-K kernel: {name} must be a power of two >= {lo}, got {x}"
    if (d // cpw) % 2:
        return "split-K kernel: a token's key codes must fill an even number of words"
    t = kv.group_tokens
    if t < 16 or t & (t - 1):
        return f"split-K kernel: group_tokens must be a power of two >= 16, got {t}"
    if rotary_pairs_kind(kv.layout) is None:
        return "split-K kernel: rotary pairs must cover the head (rotary_dim = head_dim)"
    for buf in (kv.key_codes, kv.value_codes):
        if not buf.is_contiguous() or buf.storage_offset() % 4:
            return "split-K kernel: code buffers must be contiguous and 4-byte aligned"
    return None
