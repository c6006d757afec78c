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
  (the observation window) pay to each cached token, summed over those queries, reduced over
  the query heads of the GQA group (sum by default; kvpress averages, which only rescales),
  then pooled over neighbouring tokens (max-pooling with ``kernel_size`` 7 by default; Li et
  al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469,
  Alg. 1, whose reference code and kvpress average-pool with 5), optionally times the value
  norm. Probabilities share one scale across heads, which lets the adaptive allocation give
  concentrated heads fewer tokens (Feng et al. 2024, "Ada-KV", arXiv:2407.11550).

More scorers live in their own modules and register here when :mod:`kvlab.relay` is
imported: ``"expected-attention"`` (:mod:`kvlab.relay.expected_attention`), ``"tova"``
(:mod:`kvlab.relay.tova`), ``"combined"`` (:mod:`kvlab.relay.combined`) and ``"kvzip"``
(:mod:`kvlab.relay.kvzip`, scored by a reconstruction pass after the prefill).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, fields, is_dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.rope import RotaryConfig

__all__ = [
    "SCORERS",
    "KeyNormScorer",
    "RecencyScorer",
    "ScoreInputs",
    "Scorer",
    "SnapKVScorer",
    "get_scorer",
    "pool_scores",
    "scorer_from_settings",
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
        window_groups: ``[B, H, G, S]`` float32 softmax probabilities of the observation
            window's ``w`` queries summed over them, per query head ``g`` of the GQA group
            (zero at invalid and causally masked slots); ``window_attention`` is their sum over
            ``G`` (:class:`kvlab.relay.observation.WindowAttention`).
        window_last: ``[B, H, G, S]`` float32 probabilities of the window's last query (the
            newest token), per query head.
        queries: ``[B, H_q, Q, D]`` the current forward's queries, rotated at
            ``query_positions`` (for scorers with ``needs_queries``), or ``None``.
        query_positions: ``[Q]`` int64 rotary positions of ``queries``.
        rotary: the layer's :class:`~kvlab.rope.RotaryConfig` (to undo or average RoPE), or
            ``None`` for a layer without RoPE (NoPE: queries and keys are not rotated).
        next_position: rotary position the next token will get (where future queries start).
        reconstruction: ``[B, H, S]`` float32 per-slot scores of a reconstruction pass (KVzip,
            :mod:`kvlab.relay.kvzip`; for scorers with ``needs_reconstruction``), or ``None``.
    """

    keys: Tensor
    values: Tensor
    valid: Tensor
    original_positions: Tensor
    window_attention: Tensor | None = None
    window_groups: Tensor | None = None
    window_last: Tensor | None = None
    queries: Tensor | None = None
    query_positions: Tensor | None = None
    rotary: RotaryConfig | None = None
    next_position: int | None = None
    reconstruction: Tensor | None = None


class Scorer:
    """Base class; each scorer is a frozen dataclass whose fields are its options
    (:meth:`settings`: the ``scorer_options`` of a policy, :func:`scorer_from_settings`).
    Attributes: ``name``; ``needs_window_attention`` (the cache then computes
    :attr:`ScoreInputs.window_attention`, ``window_groups`` and ``window_last``);
    ``observation_tokens`` (the observation window this scorer needs, or ``None`` for the
    cache's setting);
    ``needs_queries`` (the cache then passes the forward's queries and positions);
    ``needs_reconstruction`` (the cache then defers a ratio eviction until a reconstruction
    pass scored its tokens: :mod:`kvlab.relay.kvzip`);
    ``comparable_across_heads`` (whether raw scores of different heads share a scale);
    ``default_allocation`` (``"adaptive"`` or ``"uniform"``);
    ``window_reach`` (for a window-attention scorer whose score of a slot reads the window's
    attention only up to this many slots past it — SnapKV: half its pooling kernel — so that
    the protected recent window's own columns may be left uncomputed at a prefill,
    :func:`kvlab.relay.observation.window_attention_from_lse`; ``None``: it reads them all)."""

    name: str = "base"
    needs_window_attention: bool = False
    window_reach: int | None = None
    observation_tokens: int | None = None
    needs_queries: bool = False
    needs_reconstruction: bool = False
    comparable_across_heads: bool = True
    default_allocation: str = "adaptive"

    def score(self, inputs: ScoreInputs) -> Tensor:
        """Scores ``[B, H, S]`` float32 (higher = keep); values at invalid slots are ignored."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """The scorer's options: its dataclass fields by name (``SCORERS[name](**settings())``
        rebuilds an equal scorer)."""
        if not is_dataclass(self):
            return {}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True, repr=False)
class RecencyScorer(Scorer):
    """Score = original stream index (StreamingLLM's recent window, with protected sinks)."""

    name = "recency"
    default_allocation = "uniform"

    def score(self, inputs: ScoreInputs) -> Tensor:
        return inputs.original_positions.to(torch.float32)


@dataclass(frozen=True, repr=False)
class KeyNormScorer(Scorer):
    """Score = ``-||k||_2`` over the head's channels (keep low-norm keys; Devoto et al. 2024)."""

    name = "keynorm"
    comparable_across_heads = False

    def score(self, inputs: ScoreInputs) -> Tensor:
        return -torch.linalg.vector_norm(inputs.keys.float(), dim=-1)


_POOLINGS = ("max", "avg")
_GROUP_REDUCTIONS = ("sum", "mean")


def pool_scores(scores: Tensor, valid: Tensor, kernel_size: int, pooling: str) -> Tensor:
    """Pool ``[B, H, S]`` scores over ``kernel_size`` neighbouring slots (stride 1, same size).

    ``"max"``: max-pooling; ``"avg"``: the mean over the window, invalid slots and the padding
    beyond the ends counting as 0 (``F.avg_pool1d`` with ``count_include_pad``, as SnapKV's code
    and kvpress). ``kernel_size`` 1 returns the masked scores unchanged.
    """
    x = scores.float().masked_fill(~valid, 0.0)
    if kernel_size == 1:
        return x
    b, h, s = x.shape
    flat = x.reshape(b * h, 1, s)
    pad = kernel_size // 2
    if pooling == "max":
        out = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return out.reshape(b, h, s)


@dataclass(frozen=True, repr=False)
class SnapKVScorer(Scorer):
    """Observation-window attention, pooled over ``kernel_size`` neighbours (SnapKV).

    Args:
        kernel_size: odd pooling width in tokens (SnapKV's paper uses 7); 1 disables pooling.
        pooling: ``"max"`` (SnapKV's paper) or ``"avg"`` (SnapKV's code, kvpress).
        group_reduction: ``"sum"`` or ``"mean"`` over the query heads of a GQA group.
        value_norm: multiply the pooled score by ``||v||_2`` of the token (the value-norm
            rescaling of ExpectedAttention / CriticalKV).
        observation_tokens: the observation window in queries, or ``None`` for the cache's
            ``EvictionConfig`` setting.

    Raises:
        ValueError: an even or non-positive ``kernel_size``, an unknown ``pooling`` or
            ``group_reduction``, or ``observation_tokens < 1``.
    """

    name = "snapkv"
    needs_window_attention = True

    kernel_size: int = 7
    _: KW_ONLY
    pooling: str = "max"
    group_reduction: str = "sum"
    value_norm: bool = False
    observation_tokens: int | None = None

    def __post_init__(self) -> None:
        kernel_size, pooling = self.kernel_size, self.pooling
        group_reduction, observation_tokens = self.group_reduction, self.observation_tokens
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd int >= 1, got {kernel_size}")
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        if group_reduction not in _GROUP_REDUCTIONS:
            raise ValueError(
                f"group_reduction must be one of {_GROUP_REDUCTIONS}, got {group_reduction!r}"
            )
        if observation_tokens is not None and observation_tokens < 1:
            raise ValueError(f"observation_tokens must be >= 1, got {observation_tokens}")

    @property
    def window_reach(self) -> int:  # type: ignore[override]
        """A slot's pooled score reads the window's attention up to ``kernel_size // 2``
        slots past it (:class:`Scorer`)."""
        return self.kernel_size // 2

    def score(self, inputs: ScoreInputs) -> Tensor:
        if inputs.window_attention is None:
            raise ValueError("the snapkv scorer needs window_attention (observation-window probs)")
        attn = inputs.window_attention.float()
        if self.group_reduction == "mean":
            if inputs.window_groups is None:
                raise ValueError("group_reduction='mean' needs window_groups")
            attn = inputs.window_groups.float().mean(2)
        out = pool_scores(attn, inputs.valid, self.kernel_size, self.pooling)
        if self.value_norm:
            out = out * torch.linalg.vector_norm(inputs.values.float(), dim=-1)
        return out

    def __repr__(self) -> str:
        return (
            f"SnapKVScorer(kernel_size={self.kernel_size}, pooling={self.pooling!r}, "
            f"group_reduction={self.group_reduction!r}, value_norm={self.value_norm}, "
            f"observation_tokens={self.observation_tokens})"
        )


SCORERS: dict[str, type[Scorer]] = {
    "recency": RecencyScorer,
    "keynorm": KeyNormScorer,
    "snapkv": SnapKVScorer,
}


def scorer_from_settings(name: str, options: Mapping[str, Any] | None = None) -> Scorer:
    """The scorer ``SCORERS[name](**options)`` (a policy's ``"scorer"`` and
    ``"scorer_options"``; :meth:`Scorer.settings` gives the options back).

    Raises:
        ValueError: unknown name, or options the scorer refuses.
    """
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {sorted(SCORERS)}")
    return SCORERS[name](**(options or {}))


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
