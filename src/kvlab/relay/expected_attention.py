"""ExpectedAttention: score each cached token by the attention that *future* queries are expected
to pay it (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution", arXiv:2510.00636; NVIDIA kvpress ``ExpectedAttentionPress``).

The formula is kvpress 0.5.5's (``kvpress/presses/expected_attention_press.py``), per query head:

1. pre-RoPE queries ``q_t`` of the current forward, the first ``sink_tokens`` tokens of the
   stream left out: mean ``mu = mean_t q_t`` and covariance
   ``Sigma = mean_t (q_t - mu)(q_t - mu)^T`` (divided by the count, not count - 1);
2. the RoPE rotation averaged over the next ``future_positions`` positions
   ``p = next .. next + future_positions - 1``: ``R = mean_p R(p)`` (a ``[D, D]`` matrix, not
   a rotation), then ``mu' = R mu`` and ``Sigma' = R Sigma R^T``;
3. for every cached (rotated) key ``k``: ``z(k) = k . mu' / sqrt(D) + k^T Sigma' k / (2 D)``
   (``log E[exp(q . k / sqrt(D))]`` for Gaussian queries ``q ~ N(mu', Sigma')``: the mean plus
   half the variance of the logit), softmax over the head's non-sink tokens;
4. averaged over the query heads of the GQA group, then ``(score + epsilon) * ||v||_2``
   when ``value_norm`` (kvpress ``use_vnorm``).

Sink tokens get no score of their own here (kvpress pads them with the maximum); the cache
protects ``EvictionConfig.sink_tokens`` anyway. The default allocation is uniform per head, as
kvpress's ``ExpectedAttentionPress``; the adaptive one (Ada-KV) can compare the scores directly,
as kvpress's ``AdaKVPress(ExpectedAttentionPress())`` does, but measured worse on SmolLM2 in
both libraries (docs/archive/results-history.md, section 6, "Policy search").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["ExpectedAttentionScorer", "average_rotation", "expected_attention_logits"]


def average_rotation(rotary: RotaryConfig, start: int, count: int) -> Tensor:
    """``mean_p R(p)`` over positions ``start .. start + count - 1``, float64 ``[D, D]``.

    ``R(p)`` is the RoPE rotation of :func:`kvlab.rope.apply_rotary` at position ``p`` acting on
    column vectors (``apply_rotary(x, p) == x @ R(p).T``); each rotary pair ``(a, b)`` with
    frequency ``w`` contributes ``[[c, -s], [s, c]]`` with ``c = mean cos(p w)``,
    ``s = mean sin(p w)``; non-rotary channels keep the identity.

    Raises:
        ValueError: ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    positions = torch.arange(start, start + count, dtype=torch.float64)
    angles = positions.unsqueeze(-1) * rotary.inv_freq()  # [count, P]
    cos, sin = torch.cos(angles).mean(0), torch.sin(angles).mean(0)
    first, second = rotary.pair_indices()
    out = torch.eye(rotary.head_dim, dtype=torch.float64)
    out[first, first] = cos
    out[second, second] = cos
    out[first, second] = -sin
    out[second, first] = sin
    return out


def expected_attention_logits(
    keys: Tensor, pre_rope_queries: Tensor, rotation: Tensor, *, use_covariance: bool = True
) -> Tensor:
    """Step 1-3's ``z(k)`` before the softmax (module docstring).

    Args:
        keys: ``[B, H, S, D]`` rotated keys.
        pre_rope_queries: ``[B, H, G, T, D]`` queries of the ``G`` query heads of each kv head.
        rotation: ``[D, D]`` averaged rotation (:func:`average_rotation`).
        use_covariance: include the ``k^T Sigma' k / (2 D)`` term.

    Returns:
        float32 ``[B, H, G, S]`` (computed in float32, float64 for float64 inputs).
    """
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    q = pre_rope_queries.to(compute)
    k = keys.to(compute)
    r = rotation.to(compute)
    dim = k.shape[-1]
    mu = q.mean(3)  # [B, H, G, D]
    mu_r = mu @ r.T
    z = torch.einsum("bhgd,bhsd->bhgs", mu_r, k) / math.sqrt(dim)
    if use_covariance:
        centered = q - mu.unsqueeze(3)
        cov = torch.einsum("bhgti,bhgtj->bhgij", centered, centered) / q.shape[3]
        cov_r = r @ cov @ r.T
        z = z + torch.einsum("bhsi,bhgij,bhsj->bhgs", k, cov_r, k) / dim / 2
    return z


@dataclass(frozen=True, repr=False, kw_only=True)
class ExpectedAttentionScorer(Scorer):
    """Expected attention of future queries (module docstring; kvpress defaults).

    Args:
        future_positions: future query positions averaged over (kvpress: 512).
        sink_tokens: first stream tokens left out of the query statistics and the softmax
            (kvpress ``n_sink``: 4).
        use_covariance: include the query covariance term (kvpress: True).
        value_norm: multiply by the value norm (kvpress ``use_vnorm``: True).
        epsilon: added before the value-norm rescaling (kvpress: 0).

    Raises:
        ValueError: ``future_positions < 1`` or ``sink_tokens < 0``; at scoring time, inputs
            without queries or their positions, or no query past the sinks. Inputs without a
            rotary config (a NoPE layer) use the queries as they are and ``R = I``.
    """

    name = "expected-attention"
    needs_queries = True
    # kvpress's uniform per-head budgets beat its AdaKV wrapper on this scorer
    # (docs/archive/results-history.md, section 6, "Policy search")
    default_allocation = "uniform"

    future_positions: int = 512
    sink_tokens: int = 4
    use_covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        if self.future_positions < 1:
            raise ValueError(f"future_positions must be >= 1, got {self.future_positions}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")

    def score(self, inputs: ScoreInputs) -> Tensor:
        if inputs.queries is None or inputs.query_positions is None:
            raise ValueError("the expected-attention scorer needs queries and their positions")
        if inputs.next_position is None:
            raise ValueError("the expected-attention scorer needs next_position")
        queries, positions = inputs.queries, inputs.query_positions
        batch, hq, q_len, dim = queries.shape
        heads = inputs.keys.shape[1]
        group = hq // heads
        # undo RoPE (a pure rotation), then drop the stream's sink tokens from the statistics;
        # a layer without RoPE (rotary None, NoPE) has pre-RoPE queries and R = identity
        compute = torch.float64 if inputs.keys.dtype == torch.float64 else torch.float32
        raw = queries.to(compute)
        if inputs.rotary is not None:
            raw = rotate_by_delta(raw, -positions.to(queries.device), inputs.rotary)
        first_stream = inputs.next_position - q_len  # stream index of the first query
        keep_from = max(0, self.sink_tokens - first_stream)
        if keep_from >= q_len:
            raise ValueError("no query of this forward lies past the sink tokens")
        raw = raw[:, :, keep_from:].reshape(batch, heads, group, q_len - keep_from, dim)
        if inputs.rotary is None:
            rotation = torch.eye(dim, dtype=torch.float64)
        else:
            rotation = average_rotation(inputs.rotary, inputs.next_position, self.future_positions)
        z = expected_attention_logits(
            inputs.keys, raw, rotation.to(raw.device), use_covariance=self.use_covariance
        )
        scored = inputs.valid & (inputs.original_positions >= self.sink_tokens)
        z = z.masked_fill(~scored.unsqueeze(2), float("-inf"))
        probs = torch.softmax(z, dim=-1).nan_to_num(0.0).mean(2)  # [B, H, S]
        if self.value_norm:
            probs = (probs + self.epsilon) * torch.linalg.vector_norm(
                inputs.values.to(probs.dtype), dim=-1
            )
        return probs.float().masked_fill(~scored, 0.0)

    def __repr__(self) -> str:
        return (
            f"ExpectedAttentionScorer(future_positions={self.future_positions}, "
            f"sink_tokens={self.sink_tokens}, use_covariance={self.use_covariance}, "
            f"value_norm={self.value_norm}, epsilon={self.epsilon})"
        )


SCORERS.setdefault(ExpectedAttentionScorer.name, ExpectedAttentionScorer)
