"""TOVA: keep the tokens the newest query attends to most (Oren et al. 2024, "Transformers are
Multi-State RNNs", arXiv:2401.06104, Sec. 3.3 "Token Omission Via Attention").

Score of a cached token = the softmax attention the current forward's *last* query pays it,
averaged over every query head of the layer (TOVA's default: one score per token shared by all
heads, so every kv head keeps the same tokens). ``head_reduction="group"`` averages over the
GQA group of each kv head only (a per-head variant; then budgets may differ across heads).
kvpress 0.5.5's ``TOVAPress`` computes the same layer average and always keeps the last token;
here the cache's protected recent window keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer

__all__ = ["TOVAScorer"]

_REDUCTIONS = ("layer", "group")


@dataclass(frozen=True, repr=False)
class TOVAScorer(Scorer):
    """Last-query attention (TOVA).

    Args:
        head_reduction: ``"layer"`` (mean over all query heads, the paper's) or ``"group"``
            (mean over each kv head's GQA group).

    Raises:
        ValueError: an unknown ``head_reduction``; at scoring time, missing ``window_last``.
    """

    name = "tova"
    needs_window_attention = True
    observation_tokens = 1

    head_reduction: str = "layer"

    def __post_init__(self) -> None:
        head_reduction = self.head_reduction
        if head_reduction not in _REDUCTIONS:
            raise ValueError(f"head_reduction must be one of {_REDUCTIONS}, got {head_reduction!r}")

    @property  # type: ignore[override]
    def default_allocation(self) -> str:
        """Uniform budgets for the layer-wide reduction (equal scores across heads), else
        adaptive."""
        return "uniform" if self.head_reduction == "layer" else "adaptive"

    def score(self, inputs: ScoreInputs) -> Tensor:
        if inputs.window_last is None:
            raise ValueError("the tova scorer needs window_last (last-query attention)")
        last = inputs.window_last.float()  # [B, H, G, S]
        per_head = last.mean(2)  # [B, H, S]
        if self.head_reduction == "group":
            return per_head.masked_fill(~inputs.valid, 0.0)
        # mean over all query heads of the layer, token by token: heads may hold different
        # tokens at a slot (after a heterogeneous eviction), so sum by stream index; a token a
        # head does not hold gets no attention from that head's queries
        b, h, s = per_head.shape
        pos = inputs.original_positions.clamp_min(0)
        size = int(pos.max()) + 1 if pos.numel() else 1
        total = per_head.new_zeros(b, size)
        masked = per_head.masked_fill(~inputs.valid, 0.0)
        total.scatter_add_(1, pos.reshape(b, -1), masked.reshape(b, -1))
        shared = total.gather(1, pos.reshape(b, -1)).reshape(b, h, s) / h
        return shared.masked_fill(~inputs.valid, 0.0)

    def __repr__(self) -> str:
        return f"TOVAScorer(head_reduction={self.head_reduction!r})"


SCORERS.setdefault(TOVAScorer.name, TOVAScorer)
