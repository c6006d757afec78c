"""The attention of an eviction's observation window (docs/design.md, "RoPE-Relay: Eviction
policy"): the softmax probabilities that the last ``w`` queries of a forward pay to every stored
token of each kv head, reduced as the scorers read them (:class:`WindowAttention`: summed over
the window per query head and over the GQA group, the last query's, the largest).

The probabilities ``[B, H, G*w, S]`` are never all held at once beyond
:data:`ONE_PIECE_LOGITS` logits: a larger window is computed in chunks of its queries of about
:data:`CHUNK_LOGITS` logits each (memory bounded by the chunk: 16 MiB of float32 logits, and the
softmax's copy), and the sums over a chunk's queries (float32) accumulate chunk by chunk in
float64. A chunk holds dozens of queries per head even at 16K tokens, so each key block is read
for many queries (chunks of a few queries re-read every key per chunk; docs/benchmarks.md,
"Prefill CPU time"). Up to
:data:`ONE_PIECE_LOGITS` the window is one piece and every reduction is the one of a single
``[B, H, G, w, S]`` tensor; in chunks the sums are formed in another order (float32 rounding
apart, the same values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CHUNK_LOGITS",
    "FILL_BY_ROWS",
    "ONE_PIECE_LOGITS",
    "WindowAttention",
    "window_attention",
    "window_attention_from_lse",
]

#: Logits ``B * H * G * w * S`` up to which the observation window is computed in one piece.
ONE_PIECE_LOGITS = 1 << 22
#: Logits per chunk of queries beyond :data:`ONE_PIECE_LOGITS` (16 MiB of float32).
CHUNK_LOGITS = 1 << 22
#: Heads of one count on the CPU: fill each window query's causally masked slots with a row
#: slice (a few thousand small fills per layer at 8K) instead of building and applying a
#: boolean mask over the window's last ``w`` columns; ``False``: always the mask. The same
#: entries either way (tests/relay/test_observation.py); the rows take 13-19 % less time for
#: the whole window at 4K-8K (docs/benchmarks.md, "Prefill CPU time").
FILL_BY_ROWS = True


@dataclass(frozen=True)
class WindowAttention:
    """The observation window's attention, reduced (:func:`window_attention`).

    Attributes:
        total: float32 ``[B, H, S]``: summed over the window's queries and the GQA group.
        groups: float32 ``[B, H, G, S]``: summed over the window's queries, per query head.
        last: float32 ``[B, H, G, S]``: the window's last query's (the newest token's).
        peak: float32 ``[B, H, S]``: the largest over the window's queries and the group, or
            ``None`` when not asked for.
    """

    total: Tensor
    groups: Tensor
    last: Tensor
    peak: Tensor | None = None


def _fill_late(per_query: Tensor, count: int, w: int, j0: int) -> None:
    """Set ``-inf``, in place, the slots each window query may not see: ``per_query``
    ``[B, H, G, n, C]`` holds window queries ``j0 .. j0 + n - 1`` (of ``w``) of every query
    head over the first ``C`` slots of heads that each hold ``count``; query ``j`` sees slots
    ``i <= count - w + j`` (causal). A row slice at a time: no mask is built or read."""
    width = per_query.shape[-1]
    for r in range(per_query.shape[3]):
        first_late = count - w + j0 + r + 1
        if first_late < width:
            per_query[:, :, :, r, first_late:].fill_(float("-inf"))


def _causal_logits(
    q: Tensor,
    keys_t: Tensor,
    scaling: float,
    limit: Tensor,
    valid: Tensor | None,
    slot: Tensor,
    start: int,
    rows: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """Logits ``[B, H, R, S]`` of queries ``q`` ``[B, H, R, D]`` (float32) over ``keys_t``
    ``[B, H, D, S]``, ``-inf`` where a slot lies past the query's ``limit`` ``[H, R]`` (only
    slots from ``start`` on can) or is not ``valid`` ``[B, H, S]`` (``None``: all are).
    ``rows`` ``(j0, G, count, w)``: every head holds ``count`` slots and the ``R = G * n``
    queries are window queries ``j0 .. j0 + n - 1`` of each of ``G`` query heads; the late
    slots are then filled row by row instead of through ``limit`` (the same entries)."""
    logits = torch.matmul(q, keys_t)
    logits.mul_(scaling)  # in place: the bits of ``q @ keys_t * scaling``, one buffer fewer
    if rows is not None:
        # every head holds the same count: fill each window query's late slots, a row slice at
        # a time (the same entries as the mask below, without building or reading a mask)
        j0, group, count, w = rows
        _fill_late(logits.view(*logits.shape[:2], group, -1, logits.shape[-1]), count, w, j0)
    else:
        tail = logits[..., start:]
        late = (slot[start:].view(1, 1, -1) > limit.unsqueeze(-1)).unsqueeze(0)
        tail.masked_fill_(late, float("-inf"))
    if valid is not None:
        logits.masked_fill_(~valid.unsqueeze(2), float("-inf"))
    return logits


def window_attention(
    query: Tensor,
    scaling: float,
    keys: Tensor,
    valid: Tensor,
    window: int,
    *,
    peak: bool = False,
) -> WindowAttention:
    """The attention of the last ``w = min(window, Q)`` queries of ``query`` ``[B, H_q, Q, D]``
    over the padded ``keys`` ``[B, H, S, D]`` (``valid`` bool ``[B, H, S]``): float32 softmax
    probabilities per query head ``g`` of each GQA group, reduced (:class:`WindowAttention`;
    ``peak``: also the largest). The queries are the newest tokens of every head, rotated at
    cache positions, and see the slots up to their own (causal: query ``j`` of the window sees
    slot ``i`` of head ``h`` when ``i <= count_h - w + j``, ``count_h`` the head's valid slots
    in row 0). Computed in one piece up to :data:`ONE_PIECE_LOGITS` logits, else in chunks of
    queries (module docstring). Reads the heads' fewest and most counts and whether every slot
    is valid to the host (one device read each)."""
    batch, hq, q_len, dim = query.shape
    heads, s = keys.shape[1], keys.shape[2]
    group = hq // heads
    w = max(1, min(window, q_len))
    q = query[:, :, q_len - w :].float().reshape(batch, heads, group, w, dim)
    keys_t = keys.float().transpose(-1, -2)
    counts = valid[0].sum(-1)  # [H]
    slot = torch.arange(s, device=query.device)
    # every query sees the slots before the shortest head's count - w + 1 (one host read)
    fewest, most = (int(c) for c in counts.aminmax())
    start = max(0, min(fewest - w + 1, s))
    # heads of one count on the CPU: the late slots filled row by row (_causal_logits)
    by_rows = FILL_BY_ROWS and fewest == most and query.device.type == "cpu"
    every = bool(valid.all())
    mask = None if every else valid
    logits_per_query = batch * heads * group * s
    if logits_per_query * w <= ONE_PIECE_LOGITS:
        j = torch.arange(w, device=query.device).repeat(group)  # [G*w]
        limit = counts.view(heads, 1) - w + j.view(1, -1)  # [H, G*w]
        logits = _causal_logits(
            q.reshape(batch, heads, group * w, dim),
            keys_t,
            scaling,
            limit,
            mask,
            slot,
            start,
            (0, group, most, w) if by_rows else None,
        )
        probs = torch.softmax(logits, dim=-1).reshape(batch, heads, group, w, s)
        return WindowAttention(
            total=probs.sum((2, 3)),
            groups=probs.sum(3),
            last=probs[:, :, :, -1],
            peak=probs.amax(dim=(2, 3)) if peak else None,
        )
    step = max(1, CHUNK_LOGITS // logits_per_query)
    sums = torch.zeros(batch, heads, group, s, dtype=torch.float64, device=query.device)
    top = torch.zeros(batch, heads, s, device=query.device) if peak else None
    last = sums.new_zeros(())
    for j0 in range(0, w, step):
        j1 = min(w, j0 + step)
        j = torch.arange(j0, j1, device=query.device).repeat(group)
        limit = counts.view(heads, 1) - w + j.view(1, -1)
        part = q[:, :, :, j0:j1].reshape(batch, heads, group * (j1 - j0), dim)
        rows = (j0, group, most, w) if by_rows else None
        logits = _causal_logits(part, keys_t, scaling, limit, mask, slot, start, rows)
        probs = torch.softmax(logits, dim=-1).view(batch, heads, group, j1 - j0, s)
        sums += probs.sum(3).double()  # float32 within a chunk, float64 across chunks
        if top is not None:
            top = torch.maximum(top, probs.amax(dim=(2, 3)))
        if j1 == w:
            last = probs[:, :, :, -1].clone()
    return WindowAttention(total=sums.sum(2).float(), groups=sums.float(), last=last, peak=top)


def window_attention_from_lse(
    query: Tensor,
    scaling: float,
    keys: Tensor,
    window: int,
    lse: Tensor,
    columns: int,
    *,
    peak: bool = False,
) -> WindowAttention:
    """:func:`window_attention` of a prefill whose attention already gave each query's
    normaliser: the probabilities ``exp(scaling * q . k - lse)`` (computed as ``exp2`` of the
    logits times ``log2(e)``, the cheaper function on the CPU) of the last
    ``w = min(window, Q)`` queries over the first ``columns`` slots only, zero from there on.

    For a scorer that reads the window's attention only at the slots it may evict and a few
    beyond (SnapKV: the slots before the protected recent window, plus half its pooling
    kernel), the logits of the protected window itself — which the softmax needs only for its
    normaliser — are never computed, nor the softmax's max and sum passes: a third to a half
    of the window's cost at the default policy (docs/benchmarks.md, "Prefill CPU time"). The
    probabilities agree with :func:`window_attention`'s to float32 rounding (another
    normalisation of the same logits), not bit for bit.

    Args:
        query: ``[B, H_q, Q, D]``, the forward's queries at cache positions.
        keys: ``[B, H, S, D]``: every slot valid, every head holding the same ``S`` tokens (a
            prompt's prefill before its eviction); query ``j`` of the window sees slots
            ``i <= S - w + j``.
        lse: ``[B, H_q, Q]`` float32 natural-log logsumexp of each query's scaled causal logits
            (what a fused attention returns beside its output).
        columns: slots whose probabilities are computed, ``1 <= columns <= S``.

    Returns:
        :class:`WindowAttention` with zeros at slots ``>= columns`` (``total``, ``groups``,
        ``last``, ``peak``).
    """
    batch, hq, q_len, dim = query.shape
    heads, s = keys.shape[1], keys.shape[2]
    group = hq // heads
    w = max(1, min(window, q_len))
    c = max(1, min(columns, s))
    # one product gives (scaling * q . k - lse) * log2(e): the queries scaled and extended by
    # -lse, the keys by a column of ones (no separate scale and subtract passes over the
    # logits), in base 2 because exp2 costs half of exp on the CPU (docs/benchmarks.md)
    q = torch.cat(
        [
            query[:, :, q_len - w :].float() * (scaling * math.log2(math.e)),
            lse[:, :, q_len - w :].float().unsqueeze(-1) * -math.log2(math.e),
        ],
        dim=-1,
    ).reshape(batch, heads, group, w, dim + 1)
    ones = keys.new_ones((), dtype=torch.float32).expand(batch, heads, c, 1)
    keys_t = torch.cat([keys[:, :, :c].float(), ones], dim=-1).transpose(-1, -2)
    per_query = batch * heads * group * c
    step = w if per_query * w <= ONE_PIECE_LOGITS else max(1, CHUNK_LOGITS // per_query)
    sums = torch.zeros(batch, heads, group, s, dtype=torch.float64, device=query.device)
    top = torch.zeros(batch, heads, s, device=query.device) if peak else None
    last = torch.zeros(batch, heads, group, s, device=query.device)
    for j0 in range(0, w, step):
        j1 = min(w, j0 + step)
        part = q[:, :, :, j0:j1].reshape(batch, heads, group * (j1 - j0), dim + 1)
        probs = torch.matmul(part, keys_t).view(batch, heads, group, j1 - j0, c)
        _fill_late(probs, s, w, j0)
        probs.exp2_()
        sums[..., :c] += probs.sum(3).double()  # float32 within a chunk, float64 across chunks
        if top is not None:
            top[..., :c] = torch.maximum(top[..., :c], probs.amax(dim=(2, 3)))
        if j1 == w:
            last[..., :c] = probs[:, :, :, -1]
    return WindowAttention(total=sums.sum(2).float(), groups=sums.float(), last=last, peak=top)
