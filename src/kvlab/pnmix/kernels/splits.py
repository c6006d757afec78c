"""How many context splits a split-K decode launch uses (docs/benchmarks.md, "Split-K decode
kernel"). No Triton import: the bytes model and the benchmarks read it too."""

from __future__ import annotations

import math

__all__ = ["choose_splits"]


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
