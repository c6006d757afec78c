"""The reconstruction pass of a layer's stored tokens (KVzip, :mod:`kvlab.relay.kvzip`;
docs/design.md, "RoPE-Relay: Reconstruction scoring"), per sequence, on its
:class:`~kvlab.relay.storage.RelayStore`. Torch only: no ``transformers`` import.

After a prefill, a ratio eviction whose scorer needs a reconstruction pass waits: the pass's
queries attend over each sequence's stored tokens (:func:`reconstruct_row`), every layer
max-accumulates the per-slot scores, the prefill's last queries may join them by a max
(:func:`observe`), and the eviction then reads them — with ``layer_budget="scores"`` after the
model's budget is split across layers by the scores (:func:`split_by_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.relay.kvzip_attention import reconstruction_attention
from kvlab.relay.observation import window_attention
from kvlab.relay.storage import RelayStore

__all__ = ["ReconstructionSpan", "join_max", "observe", "reconstruct_row", "split_by_scores"]


@dataclass(frozen=True)
class ReconstructionSpan:
    """What a reconstruction pass rebuilds in one sequence: the stored tokens with stream
    indices ``start .. end - 1`` (scored in this pass), and the first ``sinks`` tokens that
    join the scores' normalization when ``start > 0`` (KVzip's chunked scoring,
    :mod:`kvlab.relay.kvzip`)."""

    start: int
    end: int
    sinks: int = 4


def join_max(previous: Tensor | None, scores: Tensor) -> Tensor:
    """``scores``, or their elementwise max with ``previous`` (same shape)."""
    return scores if previous is None else torch.maximum(previous, scores)


def observe(store: RelayStore, row: int, query: Tensor, scaling: float, queries: int) -> Tensor:
    """The attention of the last ``queries`` of ``query`` (``[1, H_q, Q, D]``, sequence
    ``row``'s real queries at cache positions) over the row's stored tokens, max over those
    queries and the GQA group: float32 ``[1, H, S]`` (padded view), which the eviction joins to
    the reconstruction scores by a max (``KVzipScorer(prefill_queries=...)``)."""
    view = store.padded([row])
    peak = window_attention(query, scaling, view.keys, view.valid, queries, peak=True).peak
    assert peak is not None
    return peak


def reconstruct_row(
    store: RelayStore,
    row: int,
    span: ReconstructionSpan,
    stream_length: int,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sequence ``row``'s part of a reconstruction pass: its real queries ``query``
    ``[1, H_q, R, D]`` attend over its stored tokens and, causally, the pass's own ``keys`` /
    ``values`` ``[1, H_kv, R, D|Dv]``
    (:func:`kvlab.relay.kvzip_attention.reconstruction_attention`); the scores are those of
    the stored tokens in ``span`` (normalized with the span's sinks when the span is a chunk of
    the ``stream_length`` tokens), zero elsewhere.

    Returns:
        ``(out [1, H_q, R, Dv], scores float32 [1, H, S])`` (padded view of the row).
    """
    view = store.padded([row])
    pos = view.original_positions
    chunk = view.valid & (pos >= span.start) & (pos < span.end)
    columns = None
    if span.start > 0 or span.end < stream_length:
        columns = chunk | (view.valid & (pos < min(span.sinks, span.start)))
    out, scores = reconstruction_attention(
        query,
        view.keys,
        view.values,
        view.valid,
        keys,
        values,
        scale=scale,
        score_columns=columns,
        softcap=softcap,
        s_aux=s_aux,
    )
    return out, scores.masked_fill(~chunk, 0.0)


def split_by_scores(keys: Sequence[Tensor], budget: int, share: float) -> list[int]:
    """Per layer, the tokens (summed over kv heads) a sequence keeps under
    ``layer_budget="scores"``: the model's ``budget`` goes to the top entries of every layer's
    ranking ``keys`` (flat float32 tensors; protected tokens ``+inf``: they always win) —
    KVzip's cross-layer selection — then ``share`` of each layer's count follows the scores and
    the rest the uniform split: ``s * won + (1 - s) * budget / L``, to integers by largest
    remainder (same total)."""
    sizes = [k.numel() for k in keys]
    top = torch.topk(torch.cat(list(keys)), budget, sorted=False).indices
    owner = torch.bucketize(top, torch.tensor(sizes, device=top.device).cumsum(0), right=True)
    won = [int(n) for n in torch.bincount(owner, minlength=len(keys)).tolist()]
    if share == 1.0:
        return won
    # each layer stays between its protected tokens and what it holds (both splits do)
    want = [share * w + (1.0 - share) * budget / len(keys) for w in won]
    out = [int(w) for w in want]
    order = sorted(range(len(want)), key=lambda i: want[i] - out[i], reverse=True)
    for i in order[: budget - sum(out)]:
        out[i] += 1
    return out
