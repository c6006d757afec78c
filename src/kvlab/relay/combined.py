"""A weighted mix of scorers: each part's scores normalized to a distribution over the head's
valid slots, then summed with weights — e.g. SnapKV's observed attention (the recent queries)
with ExpectedAttention's estimate for future queries (Devoto et al. 2025, arXiv:2510.00636).

Normalizing puts parts of different scales (attention mass summed over a window, expected
probabilities times value norms) on one footing; the sum is then a per-head distribution, so
scores stay comparable across heads for the adaptive allocation whenever every part is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvlab.relay.scorers import (
    SCORERS,
    ScoreInputs,
    Scorer,
    SnapKVScorer,
    get_scorer,
    scorer_from_settings,
)

__all__ = ["CombinedScorer"]


def _part(spec: Scorer | str | Sequence[Any]) -> Scorer:
    if isinstance(spec, (Scorer, str)):
        return get_scorer(spec)
    name, kwargs = spec
    return scorer_from_settings(name, kwargs)


@dataclass(frozen=True, repr=False)
class CombinedScorer(Scorer):
    """``sum_i w_i * s_i / sum_slots s_i`` over the parts ``s_i`` (module docstring).

    Args:
        parts: scorers, names, or ``(name, kwargs)`` pairs; default ExpectedAttention and
            SnapKV with the value norm.
        weights: one non-negative weight per part (default all 1).

    Raises:
        ValueError: no parts, a part with negative scores at scoring time is clamped at 0 (its
            mass is what counts), weights of the wrong length or negative.
    """

    name = "combined"

    parts: Sequence[Scorer | str | Sequence[Any]] | None = None
    weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        specs = (
            self.parts
            if self.parts is not None
            else ["expected-attention", SnapKVScorer(value_norm=True)]
        )
        parts = tuple(_part(p) for p in specs)
        if not parts:
            raise ValueError("CombinedScorer needs at least one part")
        weights = (
            (1.0,) * len(parts) if self.weights is None else tuple(float(w) for w in self.weights)
        )
        if len(weights) != len(parts) or any(w < 0 for w in weights):
            raise ValueError(f"need one weight >= 0 per part, got {list(weights)}")
        windows = [p.observation_tokens for p in parts if p.observation_tokens is not None]
        resolved = {
            "parts": parts,  # the parts as scorers, a tuple (hashable)
            "weights": weights,
            "needs_window_attention": any(p.needs_window_attention for p in parts),
            "needs_queries": any(p.needs_queries for p in parts),
            "observation_tokens": windows[0] if windows else None,
            "comparable_across_heads": all(p.comparable_across_heads for p in parts),
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)

    def score(self, inputs: ScoreInputs) -> Tensor:
        total = torch.zeros(inputs.valid.shape, dtype=torch.float32, device=inputs.valid.device)
        for part, weight in zip(self.parts, self.weights, strict=True):
            s = part.score(inputs).float().clamp_min(0.0).masked_fill(~inputs.valid, 0.0)
            total += weight * s / s.sum(-1, keepdim=True).clamp_min(1e-30)
        return total

    def __repr__(self) -> str:
        return (
            f"CombinedScorer(parts={list(self.parts or ())!r}, weights={list(self.weights or ())})"
        )


SCORERS.setdefault(CombinedScorer.name, CombinedScorer)
