"""Token scorers for KV-cache eviction: which cached tokens each (layer, kv head) should keep.

A scorer maps the padded per-head view of one layer's cache to a score per slot; higher means
"keep". Protection of attention sinks and of the recent window, budget allocation across heads
and the selection itself live in :mod:`kvlab.relay.budgets`.

Scorers (``SCORERS``):

* ``"recency"`` — the token's original stream index: with protected sinks this is
  StreamingLLM's sinks + recent window (Xiao et al. 2023, "Efficient Streaming Language Models
  with Attention Sinks", arXiv:2309.17453). Scores are equal across heads, so budgets are
  uniform.
* ``"keynorm"`` — minus the L2 norm of the key over all ``head_dim`` channels: keys with a
  *low* norm draw high attention, so they are kept (Devoto et al. 2024, "A Simple and Effective
  L2 Norm-Based Strategy for KV Cache Compression", arXiv:2406.11430). RoPE rotations preserve
  the norm, so the score does not depend on positions. Norms are not on a common scale across
  heads, so the adaptive allocation compares per-head standardized scores.
* ``"snapkv"`` — the softmax attention that the last ``window`` queries of the current forward
  (the observation window) pay to each cached token, summed over those queries and over the
  query heads of the GQA group, then max-pooled over neighbouring tokens with ``kernel_size``
  7 (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
  arXiv:2404.14469, Alg. 1). Probabilities share one scale across heads, which lets the
  adaptive allocation give concentrated heads fewer tokens (Feng et al. 2024, "Ada-KV",
  arXiv:2407.11550).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "SCORERS",
    "KeyNormScorer",
    "RecencyScorer",
    "ScoreInputs",
    "Scorer",
    "SnapKVScorer",
    "get_scorer",
]


@dataclass
class ScoreInputs:
    """One layer's cache in padded per-head form, as scorers see it.

    Shapes: ``B`` batch, ``H`` kv heads, ``S`` slots (the longest head), ``D``/``Dv`` head dims.

    Attributes:
        keys: ``[B, H, S, D]`` rotated keys (invalid slots zero), the cache dtype.
        values: ``[B, H, S, Dv]``.
        valid: ``[B, H, S]`` bool; each head's valid slots are its tokens in stream order.
        original_positions: ``[B, H, S]`` int64 stream index of each token (-1 when invalid).
        window_attention: ``[B, H, S]`` float32 attention mass from the observation window's
            queries (summed over queries and the GQA group), or ``None`` when not computed.
    """

    keys: Tensor
    values: Tensor
    valid: Tensor
    original_positions: Tensor
    window_attention: Tensor | None = None


class Scorer:
    """Base class. Attributes: ``name``; ``needs_window_attention`` (the cache then computes
    :attr:`ScoreInputs.window_attention`); ``comparable_across_heads`` (whether raw scores of
    different heads share a scale); ``default_allocation`` (``"adaptive"`` or ``"uniform"``)."""

    name: str = "base"
    needs_window_attention: bool = False
    comparable_across_heads: bool = True
    default_allocation: str = "adaptive"

    def score(self, inputs: ScoreInputs) -> Tensor:
        """Scores ``[B, H, S]`` float32 (higher = keep); values at invalid slots are ignored."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RecencyScorer(Scorer):
    """Score = original stream index (StreamingLLM's recent window, with protected sinks)."""

    name = "recency"
    default_allocation = "uniform"

    def score(self, inputs: ScoreInputs) -> Tensor:
        return inputs.original_positions.to(torch.float32)


class KeyNormScorer(Scorer):
    """Score = ``-||k||_2`` over the head's channels (keep low-norm keys; Devoto et al. 2024)."""

    name = "keynorm"
    comparable_across_heads = False

    def score(self, inputs: ScoreInputs) -> Tensor:
        return -torch.linalg.vector_norm(inputs.keys.float(), dim=-1)


class SnapKVScorer(Scorer):
    """Observation-window attention, max-pooled over ``kernel_size`` neighbours (SnapKV).

    Args:
        kernel_size: odd pooling width in tokens (SnapKV uses 7); 1 disables pooling.

    Raises:
        ValueError: an even or non-positive ``kernel_size``.
    """

    name = "snapkv"
    needs_window_attention = True

    def __init__(self, kernel_size: int = 7) -> None:
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd int >= 1, got {kernel_size}")
        self.kernel_size = kernel_size

    def score(self, inputs: ScoreInputs) -> Tensor:
        if inputs.window_attention is None:
            raise ValueError("the snapkv scorer needs window_attention (observation-window probs)")
        attn = inputs.window_attention.float().masked_fill(~inputs.valid, 0.0)
        if self.kernel_size == 1:
            return attn
        b, h, s = attn.shape
        pooled = F.max_pool1d(
            attn.reshape(b * h, 1, s), self.kernel_size, stride=1, padding=self.kernel_size // 2
        )
        return pooled.reshape(b, h, s)

    def __repr__(self) -> str:
        return f"SnapKVScorer(kernel_size={self.kernel_size})"


SCORERS: dict[str, type[Scorer]] = {
    "recency": RecencyScorer,
    "keynorm": KeyNormScorer,
    "snapkv": SnapKVScorer,
}


def get_scorer(scorer: str | Scorer) -> Scorer:
    """A scorer instance from its name (``SCORERS``) or the instance itself.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(scorer, Scorer):
        return scorer
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; choose one of {sorted(SCORERS)}")
    return SCORERS[scorer]()
