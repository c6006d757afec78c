"""Decode-phase tokens of a PN-Mix storage in ONE attention call (docs/design.md, "Cache life
cycle": decode steps).

A forward's decode-phase tokens — a speculative draft being verified, an answer scored by
teacher forcing — must store and see what the one-token forwards of a plain run would: token
``j`` sees the exact sinks, the groups flushed by step ``j`` (quantized) and every later token
exact (the residual as it stood at step ``j``), itself included; never a group that a later
token flushed. :func:`append_decode_tokens` stores the tokens with the bytes of ``k`` decode
steps: a run of tokens that flushes no group (its plan, :meth:`kvlab.pnmix.store.PackedStore.
plan`, says so) in one append — it only writes sink and residual slots past the counts, the
slots ``k`` one-token appends write — and each token whose append flushes a group in an append
of its own (a flush codes the group, and a query-aware table reads that step's query). It keeps
what the attention needs: the exact tokens the appends may flush (the residual before them and
the new tokens, in the storage dtype) and, per step, the groups stored by then; and, when asked,
an undo entry per token (:class:`DecodeUndo`; :func:`rollback_decode_tokens`).
:func:`decode_steps_attention` then attends all ``k`` queries in one call: one softmax per query
over the sinks, the groups visible to it (decoded block by block as the packed attention's
torch reference decodes them, :meth:`kvlab.pnmix.PNMixCache.decode_groups`) and the exact tokens
visible to it (a causal mask over the exact residual and the groups flushed by each step).

Logits are computed in float32 against a stored key of each row (``q · (k - mu)``: the softmax
is unchanged and float32 rounding stays relative to the spread of the row's keys, as in
:mod:`kvlab.pnmix.attention`), so the outputs equal ``k`` calls of
:func:`kvlab.pnmix.pnmix_decode_step` to float32 rounding (the compiled kernels agree with the
reference to float32 rounding too). Host reads: the counts (host ints), none on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvlab.attention_logits import softcap_logits
from kvlab.pnmix import PNMixCache, pnmix_decode_step
from kvlab.pnmix.cache import UndoPoint

__all__ = [
    "DecodeTokens",
    "DecodeUndo",
    "append_decode_tokens",
    "attend_decode_tokens",
    "decode_steps_attention",
    "rollback_decode_tokens",
]

#: group slots decoded at a time (tokens: ``block * group_tokens``), as the packed reference
_BLOCK_TOKENS = 4096


@dataclass(frozen=True)
class DecodeTokens:
    """What :func:`append_decode_tokens` stored, for :func:`decode_steps_attention`.

    Attributes:
        keys, values: storage dtype ``[B, H_kv, E, D|Dv]``: the exact sinks, the residual and
            the new tokens as they stood before or entered the appends.
        positions: host int64 ``[B, H_kv, E]``: each exact slot's stream index (``-1``: an
            unused slot of a shorter row).
        first: host int64 ``[B, H_kv]``: the stream index of the first new token.
        groups: host int64 ``[k, B, H_kv]``: groups stored after step ``j``.
        sink_tokens, group_tokens: the storage's ``S`` and ``T`` (group slot ``g`` holds
            stream indices ``S + g * T ..``).
    """

    keys: Tensor
    values: Tensor
    positions: np.ndarray
    first: np.ndarray
    groups: np.ndarray
    sink_tokens: int
    group_tokens: int


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


def append_decode_tokens(
    cache: PNMixCache,
    keys: Tensor,
    values: Tensor,
    queries: Tensor,
    undo: list[Any] | None = None,
) -> DecodeTokens:
    """Store ``k`` tokens in every row with the bytes ``k`` decode steps store (``k`` calls of
    :func:`kvlab.pnmix.pnmix_decode_step`): runs that flush no group in one append, a token
    whose append flushes in an append of its own, with that step's query (a query-aware table
    computed by the flush reads it); ``checks="deferred"``.

    Args:
        cache: the layer's PN-Mix storage (non-empty or not).
        keys, values: ``[B, H_kv, k, D|Dv]`` the new tokens (rotated at their positions).
        queries: ``[B, H_q, k, D]`` their queries.
        undo: when given, a :class:`DecodeUndo` per token is appended to it (speculative
            decoding's crop: :func:`rollback_decode_tokens`).

    Returns:
        What :func:`decode_steps_attention` reads.

    Raises:
        ValueError: what :meth:`kvlab.pnmix.PNMixCache.append` raises (for the first append:
            nothing stored).
    """
    dtype = cache.config.storage_dtype
    k = keys.shape[2]
    sink_lengths, group_counts = cache.sink_lengths.copy(), cache.group_counts.copy()
    residual_lengths = cache.residual_lengths.copy()
    first = cache.seq_lengths.copy()
    # the residual is rewritten in place when a group flushes: keep it as it stands
    sinks_k, sinks_v = cache.sink_keys, cache.sink_values
    res_k, res_v = cache.residual_keys.clone(), cache.residual_values.clone()
    groups = np.empty((k, *first.shape), dtype=np.int64)
    j = 0
    while j < k:
        run = max(1, _quiet_run(cache, k - j))
        point = None if undo is None else cache.undo_point()
        run_k, run_v = keys[:, :, j : j + run], values[:, :, j : j + run]
        cache.append(run_k, run_v, checks="deferred", queries=queries[:, :, j : j + run])
        if point is not None and undo is not None:
            if run == 1:
                undo.append(DecodeUndo(point))
            else:
                undo.extend(DecodeUndo(point, run_k, run_v, i) for i in range(run))
        groups[j : j + run] = cache.group_counts
        j += run
    device = cache.device
    new_k = keys.to(device=device, dtype=dtype)
    new_v = values.to(device=device, dtype=dtype)
    s_cfg, t = cache.config.sink_tokens, cache.config.group_tokens
    n_sink, n_res = sinks_k.shape[2], res_k.shape[2]
    slot_sink = np.arange(n_sink)[None, None, :]
    slot_res = np.arange(n_res)[None, None, :]
    positions = np.concatenate(
        [
            np.where(slot_sink < sink_lengths[..., None], slot_sink, -1),
            np.where(
                slot_res < residual_lengths[..., None],
                s_cfg + group_counts[..., None] * t + slot_res,
                -1,
            ),
            first[..., None] + np.arange(k)[None, None, :],
        ],
        axis=2,
    )
    return DecodeTokens(
        keys=torch.cat([sinks_k, res_k, new_k], dim=2),
        values=torch.cat([sinks_v, res_v, new_v], dim=2),
        positions=positions,
        first=first,
        groups=groups,
        sink_tokens=s_cfg,
        group_tokens=t,
    )


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


class _Softmax:
    """Per-segment softmax partials ``(m, l, acc)``, merged once."""

    def __init__(self) -> None:
        self.m: list[Tensor] = []
        self.l: list[Tensor] = []
        self.acc: list[Tensor] = []

    def add(self, logits: Tensor, hidden: Tensor, values: Tensor | None) -> None:
        """Logits ``[B, H, M, w]`` (``hidden``: True where masked) over ``values``
        ``[B, H, w, Dv]`` (``None``: a sink logit with no value)."""
        s = logits.masked_fill(hidden, -math.inf)
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
        p = torch.exp(s - m)
        self.m.append(m)
        self.l.append(p.sum(dim=-1, keepdim=True))
        self.acc.append(p @ values if values is not None else None)  # type: ignore[arg-type]

    def merge(self) -> Tensor:
        m = torch.stack(self.m)
        w = torch.exp(m - m.amax(dim=0))
        total = (w * torch.stack(self.l)).sum(dim=0)
        acc = sum(wi * a for wi, a in zip(w, self.acc, strict=True) if a is not None)
        assert isinstance(acc, Tensor)
        return acc / total.clamp_min(torch.finfo(torch.float32).tiny)


def decode_steps_attention(
    query: Tensor,
    cache: PNMixCache,
    tokens: DecodeTokens,
    *,
    scale: float,
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Attention of the ``k`` decode-phase queries over ``cache`` after
    :func:`append_decode_tokens`, in one call, with the numbers of ``k`` decode steps (module
    docstring).

    Args:
        query: ``[B, H_q, k, D]`` (``H_q`` a multiple of ``H_kv``; query head ``i`` reads kv
            head ``i // (H_q / H_kv)``), rotated at the tokens' positions.
        cache: the storage the tokens were appended to (nothing appended since).
        tokens: what :func:`append_decode_tokens` returned.
        scale: softmax scale of the logits.
        logit_softcap: Gemma 2 soft-cap of the scaled logits, or ``None``.
        sink_logits: ``[H_q]`` GPT-OSS learned sink logits (one extra logit per query, no
            value), or ``None``.

    Returns:
        ``[B, H_q, k, Dv]`` in the query dtype.
    """
    b, hq, k, d = query.shape
    hkv = tokens.keys.shape[1]
    rep = hq // hkv
    dev = tokens.keys.device
    q = query.to(device=dev, dtype=torch.float32).reshape(b, hkv, rep, k, d) * scale
    q = q.reshape(b, hkv, rep * k, d)  # row r * k + j: query head h * rep + r, token j
    exact_k, exact_v = tokens.keys.float(), tokens.values.float()
    mu = exact_k[:, :, :1]  # a stored key of every row: logits against it (module docstring)
    true_logits = logit_softcap is not None or sink_logits is not None
    q_mu = q @ mu.mT if true_logits else None

    def logits(keys: Tensor) -> Tensor:
        s = q @ (keys - mu).mT
        if logit_softcap is None:
            return s
        return softcap_logits(s + q_mu, logit_softcap)

    def rows(mask: np.ndarray) -> Tensor:
        """A host mask ``[k, B, H, w]`` as the device mask ``[B, H, rep * k, w]``."""
        m = torch.from_numpy(np.ascontiguousarray(mask.transpose(1, 2, 0, 3))).to(dev)
        return m[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, hkv, rep * k, -1)

    s_cfg, t = tokens.sink_tokens, tokens.group_tokens
    step = np.arange(k)[:, None, None, None]
    pos = tokens.positions[None]
    flushed_end = s_cfg + tokens.groups[..., None] * t  # [k, B, H, 1]
    visible = (
        (pos >= 0)
        & (pos <= tokens.first[None, ..., None] + step)
        & ~((pos >= s_cfg) & (pos < flushed_end))
    )
    parts = _Softmax()
    parts.add(logits(exact_k), rows(~visible), exact_v)
    n_groups = int(tokens.groups.max(initial=0))
    block = max(1, _BLOCK_TOKENS // t)
    for g0 in range(0, n_groups, block):
        g1 = min(g0 + block, n_groups)
        keys, values = cache.decode_groups(g0, g1)
        slot = np.repeat(np.arange(g0, g1), t)[None, None, None, :]
        parts.add(logits(keys), rows(slot >= tokens.groups[..., None]), values)
    if sink_logits is not None:  # row r * k + j of kv head h is query head h * rep + r
        sinks = sink_logits.detach().to(device=dev, dtype=torch.float32).view(1, hkv, rep, 1)
        sinks = sinks.expand(b, hkv, rep, k).reshape(b, hkv, rep * k, 1)
        if logit_softcap is None:
            assert q_mu is not None
            sinks = sinks - q_mu  # into the centred logits' frame
        parts.add(sinks, torch.zeros_like(sinks, dtype=torch.bool), None)
    out = parts.merge()
    return out.reshape(b, hq, k, -1).to(query.dtype)


def attend_decode_tokens(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    cache: PNMixCache,
    undo: list[Any] | None,
    scale: float,
    kwargs: dict[str, Any],
) -> Tensor:
    """``k`` decode-phase tokens of a layer (``keys``/``values`` ``[B, H_kv, k, D|Dv]``,
    ``query`` ``[B, H_q, k, D]``, all at their cache positions): :func:`append_decode_tokens`
    then :func:`decode_steps_attention`; a single token is one
    :func:`kvlab.pnmix.pnmix_decode_step` (one compiled call on the CPU backend), as a plain
    decode step. ``undo`` receives a :class:`DecodeUndo` per token when given; ``kwargs`` the
    attention's ``softcap`` and ``s_aux``.

    Returns:
        ``[B, H_q, k, Dv]`` in the query dtype.
    """
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if keys.shape[2] == 1:
        if undo is not None:
            undo.append(DecodeUndo(cache.undo_point()))
        return pnmix_decode_step(
            query, keys, values, cache, scale=scale, logit_softcap=softcap, sink_logits=sinks
        )
    tokens = append_decode_tokens(cache, keys, values, query, undo)
    return decode_steps_attention(
        query, cache, tokens, scale=scale, logit_softcap=softcap, sink_logits=sinks
    )
