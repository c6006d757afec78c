"""Decode-phase tokens of a PN-Mix storage, attended with the numbers of one-token decode
steps (docs/design.md, "Cache life cycle": decode steps).

A forward's decode-phase tokens — a speculative draft being verified, an answer scored by
teacher forcing — must store and see what the one-token forwards of a plain run would: token
``j`` sees the exact sinks, the groups flushed by step ``j`` (quantized, its own step's flush
included) and every later token exact (the residual as it stood at step ``j``), itself
included; never a group that a later token flushed.

:func:`attend_decode_tokens` cuts the ``k`` tokens into runs at the group flushes: a run of
tokens whose append flushes no group in any row (:meth:`kvlab.pnmix.store.PackedStore.plan`
says so) is ONE append — it writes only the sink and residual slots past the counts, the slots
its one-token appends would write — and ONE causal call of the packed attention
(:func:`kvlab.pnmix.pnmix_attention`: query ``i`` of the run sees the stream up to itself, which
is exactly the decode steps' view, nothing being quantized between them; the compiled kernel on
the CPU backend); a token whose append flushes a group is one fused decode step
(:func:`kvlab.pnmix.pnmix_decode_step`, with its own query: a query-aware table computed by the
flush reads it). A verification forward flushes at most once per ``group_tokens`` tokens, so it
is one call in the usual case and ``1 + 2f`` calls with ``f`` flushes. The outputs equal ``k``
calls of :func:`kvlab.pnmix.pnmix_decode_step` to float32 rounding (the compiled kernels agree
with the torch reference to float32 rounding) and the stored bytes are theirs. When asked, it
keeps an undo entry per token (:class:`DecodeUndo`; :func:`rollback_decode_tokens`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix import PNMixCache, pnmix_attention, pnmix_decode_step
from kvlab.pnmix.cache import UndoPoint

__all__ = ["DecodeUndo", "attend_decode_tokens", "rollback_decode_tokens"]


class DecodeUndo(NamedTuple):
    """What puts a PN-Mix storage back as it was before one decode-phase token.

    Attributes:
        point: the storage's undo point before the append that stored the token
            (:meth:`kvlab.pnmix.PNMixCache.undo_point`).
        keys, values: ``[B, H_kv, m, D|Dv]`` the tokens of that append when it stored a run of
            ``m`` tokens (``None``: it stored this token alone).
        offset: the token's index in the run: the ``offset`` tokens before it are appended
            again after the rollback (the run flushed nothing, so neither do they).
    """

    point: UndoPoint
    keys: Tensor | None = None
    values: Tensor | None = None
    offset: int = 0


def _quiet_run(cache: PNMixCache, tokens: int) -> int:
    """The most of the next ``tokens`` tokens (0 .. ``tokens``) one append stores without
    flushing a group in any row."""
    if not cache.store.plan(tokens).num_groups:
        return tokens
    low, high = 0, tokens  # plan(low) flushes nothing, plan(high) flushes
    while high - low > 1:
        mid = (low + high) // 2
        if cache.store.plan(mid).num_groups:
            high = mid
        else:
            low = mid
    return low


def rollback_decode_tokens(cache: PNMixCache, entries: list[DecodeUndo]) -> None:
    """Put ``cache`` back as it was before the tokens of ``entries`` (the last ``len(entries)``
    undo entries of one forward's decode-phase tokens, in order): the storage rolls back to the
    first entry's undo point (:meth:`kvlab.pnmix.PNMixCache.rollback` with every distinct
    point, in order: a group a removed token flushed is un-flushed), then the tokens of the
    first entry's run before it are appended again — the bytes they had (they flushed
    nothing)."""
    points: list[UndoPoint] = []
    for entry in entries:
        if not points or entry.point is not points[-1]:
            points.append(entry.point)
    cache.rollback(points)
    first = entries[0]
    if first.offset:
        assert first.keys is not None and first.values is not None
        keys, values = first.keys[:, :, : first.offset], first.values[:, :, : first.offset]
        cache.append(keys, values, checks="deferred")


def attend_decode_tokens(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    cache: PNMixCache,
    undo: list[Any] | None,
    scale: float,
    kwargs: dict[str, Any],
) -> Tensor:
    """Store and attend ``k`` decode-phase tokens of a layer (``keys``/``values``
    ``[B, H_kv, k, D|Dv]``, ``query`` ``[B, H_q, k, D]``, all at their cache positions): runs
    between group flushes in one append and one causal packed-attention call each, a flushing
    token as one fused decode step (module docstring); a single token is one
    :func:`kvlab.pnmix.pnmix_decode_step`, as a plain decode step. ``undo`` receives a
    :class:`DecodeUndo` per token when given; ``kwargs`` the attention's ``softcap`` and
    ``s_aux``.

    Returns:
        ``[B, H_q, k, Dv]`` in the query dtype.
    """
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    k = keys.shape[2]
    outs: list[Tensor] = []
    j = 0
    while j < k:
        run = _quiet_run(cache, k - j)
        end = j + max(run, 1)
        q, key, value = query[:, :, j:end], keys[:, :, j:end], values[:, :, j:end]
        if run <= 1:  # a token that flushes a group (or a lone quiet one): one decode step
            if undo is not None:
                undo.append(DecodeUndo(cache.undo_point()))
            outs.append(
                pnmix_decode_step(
                    q, key, value, cache, scale=scale, logit_softcap=softcap, sink_logits=sinks
                )
            )
            j += 1
            continue
        point = None if undo is None else cache.undo_point()
        cache.append(key, value, checks="deferred", queries=q)
        if point is not None and undo is not None:
            undo.extend(DecodeUndo(point, key, value, i) for i in range(run))
        outs.append(
            pnmix_attention(
                q, cache, scale=scale, causal=True, logit_softcap=softcap, sink_logits=sinks
            )
        )
        j += run
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
