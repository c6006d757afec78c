"""Per-head budgets under a global budget, and the keep mask that realizes them.

One layer at a time: the layer's budget (``total`` tokens summed over its kv heads; the
global budget is the sum over layers) is split into per-head counts ``k_h``:

* ``"uniform"``: ``total / H`` per head (remainder to the first heads), then water-filled so no
  head exceeds its cap or falls below its protected tokens.
* ``"adaptive"``: the ``total`` best slots of the whole layer, compared across heads (Ada-KV;
  Feng et al. 2024, arXiv:2407.11550): each head's scores are sorted in decreasing order,
  averaged over the batch (so every sequence of a batch gets the same per-head counts, which
  keeps the storage one tensor per head), protected slots forced first, each head limited to its
  cap, and the ``total`` highest entries of that per-head curve counted per head. Scorers whose
  raw scores do not share a scale across heads are standardized per head first.

Protected tokens — the first ``sink_tokens`` of the stream (attention sinks) and the last
``window_tokens`` (recent window) — are always kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["allocate_counts", "protected_mask", "select_keep"]

_ALLOCATIONS = ("uniform", "adaptive")


def protected_mask(
    original_positions: Tensor,
    valid: Tensor,
    *,
    stream_length: int,
    sink_tokens: int,
    window_tokens: int,
) -> Tensor:
    """Slots that must be kept: ``valid & (pos < sink_tokens | pos >= stream_length -
    window_tokens)``; all inputs ``[B, H, S]`` (positions int64), result bool ``[B, H, S]``."""
    pos = original_positions
    return valid & ((pos < sink_tokens) | (pos >= stream_length - window_tokens))


def _standardize(scores: Tensor, valid: Tensor) -> Tensor:
    """Per (b, h): (score - mean) / std over valid slots (std floored at 1e-6)."""
    x = scores.float().masked_fill(~valid, 0.0)
    n = valid.sum(-1, keepdim=True).clamp_min(1)
    mean = x.sum(-1, keepdim=True) / n
    var = ((x - mean) ** 2).masked_fill(~valid, 0.0).sum(-1, keepdim=True) / n
    return (x - mean) / var.sqrt().clamp_min(1e-6)


def allocate_counts(
    scores: Tensor,
    valid: Tensor,
    protected: Tensor,
    *,
    total: int,
    allocation: str,
    cap: int,
    comparable_across_heads: bool = True,
) -> Tensor:
    """Per-head token counts ``k_h`` summing to ``total``.

    Args:
        scores: ``[B, H, S]`` float (higher = keep).
        valid: ``[B, H, S]`` bool; every sequence of the batch has the same valid count per head.
        protected: ``[B, H, S]`` bool, a subset of ``valid``.
        total: tokens to keep in the layer, summed over heads.
        allocation: ``"uniform"`` or ``"adaptive"`` (module docstring).
        cap: most tokens a head may keep (its slots).
        comparable_across_heads: whether raw scores share a scale across heads (else the
            adaptive allocation standardizes them per head).

    Returns:
        int64 ``[H]`` with ``protected_h <= k_h <= min(cap, valid_h)`` and ``sum == total``.

    Raises:
        ValueError: unknown allocation; valid counts differing across the batch; ``total``
            below the protected tokens or above what the heads can hold.
    """
    if allocation not in _ALLOCATIONS:
        raise ValueError(f"allocation must be one of {_ALLOCATIONS}, got {allocation!r}")
    counts_valid = valid.sum(-1)  # [B, H]
    if not bool((counts_valid == counts_valid[:1]).all()):
        raise ValueError("every sequence of the batch must hold the same number of tokens per head")
    n_valid = counts_valid[0]
    n_protected = protected.sum(-1).max(0).values  # [B, H] -> [H]
    upper = torch.clamp(n_valid, max=cap)
    if bool((n_protected > upper).any()):
        raise ValueError(
            f"protected tokens per head {n_protected.tolist()} exceed the per-head cap {cap}"
        )
    low, high = int(n_protected.sum()), int(upper.sum())
    if not low <= total <= high:
        raise ValueError(
            f"layer budget {total} tokens must lie between the protected tokens ({low}: sinks "
            f"+ recent window over all heads) and what the heads can hold ({high})"
        )
    heads = n_valid.shape[0]
    if allocation == "uniform":
        base = torch.full((heads,), total // heads, dtype=torch.int64, device=n_valid.device)
        base[: total % heads] += 1
        counts = torch.minimum(torch.maximum(base, n_protected), upper)
        # water-fill: move surplus/deficit one token at a time (heads are few)
        while int(counts.sum()) != total:
            if int(counts.sum()) < total:
                room = (upper - counts).clamp_min(0)
                h = int(torch.argmax(room))
                counts[h] += 1
            else:
                slack = counts - n_protected
                h = int(torch.argmax(slack))
                counts[h] -= 1
        return counts

    s = scores.float() if comparable_across_heads else _standardize(scores, valid)
    s = s.masked_fill(~valid, float("-inf")).masked_fill(protected, float("inf"))
    curve = torch.sort(s, dim=-1, descending=True).values  # [B, H, S]
    finite_curve = torch.where(torch.isfinite(curve), curve, torch.zeros_like(curve))
    mean_curve = finite_curve.mean(0)  # [H, S]
    rank = torch.arange(curve.shape[-1], device=curve.device)
    forced = rank.unsqueeze(0) < n_protected.unsqueeze(-1)
    allowed = rank.unsqueeze(0) < upper.unsqueeze(-1)
    mean_curve = mean_curve.masked_fill(~allowed, float("-inf")).masked_fill(forced, float("inf"))
    flat = mean_curve.reshape(-1)
    chosen = torch.topk(flat, total).indices
    counts = torch.bincount(chosen // curve.shape[-1], minlength=heads).to(torch.int64)
    return counts


def select_keep(scores: Tensor, valid: Tensor, protected: Tensor, counts: Tensor) -> Tensor:
    """Keep mask with exactly ``counts[h]`` slots per (b, h): protected slots first, then the
    highest scores. All ``[B, H, S]``; ``counts`` int64 ``[H]``; returns bool ``[B, H, S]``.

    Raises:
        ValueError: a count above a head's valid tokens or below its protected tokens.
    """
    n_valid = valid.sum(-1)
    if bool((counts.unsqueeze(0) > n_valid).any()):
        raise ValueError(f"counts {counts.tolist()} exceed the valid tokens per head")
    if bool((counts.unsqueeze(0) < protected.sum(-1)).any()):
        raise ValueError(f"counts {counts.tolist()} are below the protected tokens per head")
    s = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protected, float("inf"))
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    slots = torch.arange(s.shape[-1], device=s.device).expand_as(order)
    rank.scatter_(-1, order, slots)
    return (rank < counts.view(1, -1, 1)) & valid
