"""Contiguous per-layer storage of a PN-Mix cache (docs/design.md, "Storage format").

One :class:`PackedStore` per attention layer holds, for every row ``(b, h)`` (sequence ``b``
of the batch, kv head ``h``), its stream of tokens in order:

* sinks — the first ``sink_tokens`` tokens, exact: ``sink_keys [B, H, S, D]``,
  ``sink_values [B, H, S, Dv]`` (storage dtype);
* quantized groups of ``T = group_tokens`` tokens: ``key_codes [B, H, G_cap, Kb]`` uint8
  (``Kb = ceil(T * D * bits / 8)``, the token-major codes ``[T, D]`` of one group packed by
  :func:`~kvlab.pnmix.packing.pack_codes`), ``key_scalars [B, H, G_cap, S_k]`` (storage dtype,
  ``S_k`` = the key codec's :meth:`~kvlab.pnmix.codecs.KeyCodec.scalar_count`),
  ``value_codes [B, H, G_cap, Vb]`` (``Vb = ceil(T * Dv * bits / 8)``) and
  ``value_scalars [B, H, G_cap, S_v]`` (``[scale(T) | zero(T)]`` per token, ``S_v = 2 * T``;
  ``[scale(T, G) | zero(T, G)]`` for a value codec with ``G`` channel groups); group ``g`` of a
  row is the slice ``[b, h, g]`` and starts at stream index ``S + g * T``;
* residual — the most recent tokens, exact: ``residual_keys [B, H, R + T - 1, D]``,
  ``residual_values`` likewise, oldest first;
* for a codec with a per-pair table (a mix's mask, per-pair widths), the packed table
  ``mask [B, ceil(H * P * table_bits / 8)]`` uint8 (entry ``h * P + p`` of row ``b``'s
  little-endian bitstream of ``table_bits``-bit entries).

Per-row counts live on the host (numpy int64 ``[3, B, H]`` :attr:`counts`; views
:attr:`sink_lengths`, :attr:`group_counts`, :attr:`residual_lengths`), never read back from the
device, and so do the rows' RoPE position
offsets (:attr:`position_offsets`): the token at stream index ``i`` of row ``(b, h)`` sits at
position ``position_offsets[b, h] + i``. Group buffers
grow by doubling; slots beyond a row's count hold zeros or stale finite data and are never read
as tokens. Flush rule (per row): when the residual reaches ``residual_tokens + group_tokens``
tokens the oldest ``group_tokens`` become one group; which tokens form which group depends only
on the row's total length, and written codes are never rewritten, so any split of the same
tokens into appends gives byte-identical used regions.

:class:`PackedKV` is what attention reads of a store — its buffers, host counts and the codec
description — and the input of every packed-attention backend: the torch reference
(:mod:`kvlab.pnmix.reference`) and the compiled kernels (:mod:`kvlab.pnmix.kernels`), which
import it from here, below the cache. Modules: this one holds the append path (plan, gather,
write) and that view; the buffers, counts and byte accounting are
:class:`~kvlab.pnmix.store_buffers.StoreBuffers` (:mod:`kvlab.pnmix.store_buffers`), the base
of :class:`PackedStore`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.key_codec import KeyCodec, KeyLayout
from kvlab.pnmix.store_buffers import GROUP_BUFFERS, StoreBuffers, StoreGeometry
from kvlab.pnmix.values import ValueCodec
from kvlab.rope import RotaryConfig

__all__ = [
    "GROUP_BUFFERS",
    "AppendPlan",
    "EncodedGroups",
    "GroupEncoder",
    "PackedKV",
    "PackedStore",
    "StoreGeometry",
]


class EncodedGroups(NamedTuple):
    """Coded groups, one row per flushed group (``N`` rows, in the plan's order):
    ``key_codes`` uint8 ``[N, Kb]`` (packed), ``key_scalars`` ``[N, S_k]``, ``value_codes``
    uint8 ``[N, Vb]``, ``value_scalars`` ``[N, S_v]`` (storage dtype), ``key_payload``
    uint8 ``[N, E]`` (``None`` when ``E = 0``)."""

    key_codes: Tensor
    key_scalars: Tensor
    value_codes: Tensor
    value_scalars: Tensor
    key_payload: Tensor | None = None


@dataclass(frozen=True, eq=False)
class AppendPlan:
    """What one append does to each row, computed on the host before anything changes.

    Attributes:
        tokens: ``T_in``, the input's token axis (real tokens are its last ``lengths``).
        lengths: int64 ``[B, H]`` real tokens per row.
        sink_take: int64 ``[B, H]`` of them entering the sinks.
        flush: int64 ``[B, H]`` groups each row flushes.
        residual_after: int64 ``[B, H]`` residual length afterwards.
        group_rows: int64 ``[N, 3]`` ``(b, h, slot)`` of every flushed group, ordered by
            ``b``, then ``h``, then slot.
        uniform: every row has the same counts and length (slices replace index tensors).
    """

    tokens: int
    lengths: np.ndarray
    sink_take: np.ndarray
    flush: np.ndarray
    residual_after: np.ndarray
    group_rows: np.ndarray
    uniform: bool

    @property
    def num_groups(self) -> int:
        """``N``: groups flushed by the append, all rows together."""
        return int(self.group_rows.shape[0])


GroupEncoder = Callable[[AppendPlan, "tuple[Tensor, Tensor] | None"], "EncodedGroups | None"]
"""``encode(plan, groups) -> EncodedGroups | None``: ``groups`` is ``(keys [N, T, D], values
[N, T, Dv])`` of the flushed groups, or ``None`` when the append flushes none (then return
``None``); it may raise to abort the append (nothing is written before it returns)."""


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For flat counts ``c[r]``: each row index ``r`` repeated ``c[r]`` times, and the offsets
    ``0 .. c[r] - 1`` beside them."""
    rows = np.repeat(np.arange(counts.size), counts)
    offs = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows, offs


def _host_lengths(lengths: Any, batch: int, heads: int, tokens: int) -> np.ndarray:
    """``lengths`` as int64 ``[B, H]`` (validated), without reading any device tensor."""
    if lengths is None:
        return np.full((batch, heads), tokens, dtype=np.int64)
    if isinstance(lengths, Tensor):
        if lengths.device.type != "cpu":
            raise ValueError(
                "lengths must be host integers (a list, numpy array or CPU tensor); reading a "
                f"{lengths.device.type} tensor would force a device sync"
            )
        lengths = lengths.numpy()
    arr = np.asarray(lengths)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must hold integers, got dtype {arr.dtype}")
    if arr.shape == (batch,):
        arr = np.repeat(arr[:, None], heads, axis=1)
    if arr.shape != (batch, heads):
        raise ValueError(
            f"lengths must have shape [B] or [B, H] = [{batch}, {heads}], got {arr.shape}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > tokens):
        raise ValueError(
            f"lengths must lie in 0..{tokens} (the input's tokens), got {arr.min()}..{arr.max()}"
        )
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class PackedKV:
    """Everything packed attention reads: buffers, host counts and the codec description
    (built by :meth:`PackedStore.packed_kv`; the cache's
    :meth:`~kvlab.pnmix.cache_decode.CacheDecode.packed_kv`).

    The tensors are the store's own buffers, not copies: a kernel reads them in place (how it
    reads the bytes — words, tiles — is the kernel's own business), and the one that writes
    (the CPU decode step's residual token) writes the store. The host arrays are copies.

    Attributes:
        sink_keys, sink_values: storage dtype ``[B, H, S, D|Dv]``.
        key_codes: uint8 ``[B, H, G_cap, ceil(T * D * bits / 8)]`` (token-major ``[T, D]``
            codes per group, little-endian bitstream).
        key_scalars: storage dtype ``[B, H, G_cap, S_k]`` (the codec's layout).
        value_codes: uint8 ``[B, H, G_cap, ceil(T * Dv * bits / 8)]``.
        value_scalars: storage dtype ``[B, H, G_cap, S_v]`` (``[scale(T) | zero(T)]``, or
            ``[scale(T, G) | zero(T, G)]`` with channel groups).
        residual_keys, residual_values: storage dtype ``[B, H, R_cap, D|Dv]``.
        sink_lengths, group_counts, residual_lengths: host int64 ``[B, H]``.
        bits, group_tokens: code width and ``T``.
        codec, layout: the key codec and the head's rotary pairs.
        mask: the codec's per-pair table ``[B, H, P]``: a mix's bool mask, per-pair widths
            (uint8 bits); ``None`` for codecs without a table.
        active_pairs: int64 ``[U]`` pairs set in some row's mask (``None`` = all pairs).
        key_payload: uint8 ``[B, H, G_cap, E]`` per-group key side data (exact outliers), or
            ``None`` / ``E = 0``.
        position_offsets: host int64 ``[B, H]`` RoPE position offsets of the rows (a token at
            stream index ``i`` sits at ``offset + i``); read for position-aware codecs.
        sink_tokens: ``S``: group slot ``g`` starts at stream index ``S + g * T``.
        rotary: the layer's RoPE (position-aware codecs), or ``None``.
        value_codec: the value codec (``None``: per-token min-max of the values themselves).
    """

    sink_keys: Tensor
    sink_values: Tensor
    key_codes: Tensor
    key_scalars: Tensor
    value_codes: Tensor
    value_scalars: Tensor
    residual_keys: Tensor
    residual_values: Tensor
    sink_lengths: np.ndarray
    group_counts: np.ndarray
    residual_lengths: np.ndarray
    bits: int
    group_tokens: int
    codec: KeyCodec
    layout: KeyLayout
    mask: Tensor | None = None
    active_pairs: Tensor | None = None
    key_payload: Tensor | None = None
    position_offsets: np.ndarray | None = None
    sink_tokens: int = 0
    rotary: RotaryConfig | None = None
    value_codec: ValueCodec | None = None

    @property
    def seq_lengths(self) -> np.ndarray:
        """int64 ``[B, H]``: tokens per row."""
        return self.sink_lengths + self.group_counts * self.group_tokens + self.residual_lengths

    def counts_tensor(self) -> Tensor:
        """The host counts as one int64 CPU tensor ``[3, B, H]`` (sinks, groups, residual):
        what the compiled CPU kernel reads."""
        return torch.from_numpy(
            np.stack([self.sink_lengths, self.group_counts, self.residual_lengths])
        )


class PackedStore(StoreBuffers):
    """Contiguous buffers of one layer (module docstring; docs/design.md, "Storage format"):
    :class:`~kvlab.pnmix.store_buffers.StoreBuffers` plus the append path and the
    :class:`PackedKV` view.

    Buffers are public attributes; treat them as read-only outside the store.

    Args:
        geometry: the sizes.
        device: where the buffers live.
    """

    # ------------------------------------------------------------------ appending
    def plan(self, tokens: int, lengths: Any = None) -> AppendPlan:
        """The host-side plan of appending ``tokens`` (input token axis) with ``lengths`` real
        tokens per row (``None`` = all; a ``[B]`` or ``[B, H]`` sequence of ints, right-aligned:
        the LAST ``lengths[b][h]`` tokens of row ``(b, h)`` are real).

        Raises:
            ValueError: ``lengths`` of the wrong shape, dtype or range, or a device tensor.
        """
        g = self.geometry
        b, h = g.batch_size, g.num_key_value_heads
        lens = _host_lengths(lengths, b, h, tokens)
        take = np.minimum(lens, g.sink_tokens - self.sink_lengths)
        total = self.residual_lengths + lens - take
        over = total - g.residual_tokens
        flush = np.where(over >= 0, over // g.group_tokens, 0)
        after = total - flush * g.group_tokens
        rows, offs = _expand(flush.reshape(-1))
        slots = self.group_counts.reshape(-1)[rows] + offs
        group_rows = np.stack([rows // h, rows % h, slots], axis=1).astype(np.int64)
        uniform = self.is_uniform() and int(lens.min()) == int(lens.max(initial=0))
        return AppendPlan(tokens, lens, take, flush, after, group_rows, uniform)

    def _source(self, plan: AppendPlan, x: Tensor, res: Tensor) -> tuple[Tensor, np.ndarray]:
        """Stream source ``cat(residual[:, :, :r_max], x)`` and, per row, the source index of
        virtual position 0 of the row's new (non-sink) tokens."""
        r_max = int(self.residual_lengths.max(initial=0))
        src = torch.cat([res[:, :, :r_max], x], dim=2) if r_max else x
        new_start = r_max + (plan.tokens - plan.lengths) + plan.sink_take
        return src, new_start

    def _virtual_index(
        self,
        plan: AppendPlan,
        new_start: np.ndarray,
        rows_b: np.ndarray,
        rows_h: np.ndarray,
        v: np.ndarray,
    ) -> np.ndarray:
        """Source index of virtual positions ``v`` ``[n, k]`` of rows ``(rows_b, rows_h)``: the
        row's residual first, then its new tokens."""
        n_res = self.residual_lengths[rows_b, rows_h][:, None]
        start = new_start[rows_b, rows_h][:, None]
        return np.where(v < n_res, v, start + v - n_res)

    def gather(
        self, plan: AppendPlan, keys: Tensor, values: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """The tokens of the groups ``plan`` flushes: ``(keys [N, T, D], values [N, T, Dv])``
        in the plan's order, from the storage-rounded input ``[B, H, T_in, D|Dv]``; ``None``
        when the plan flushes no group."""
        g = self.geometry
        t = g.group_tokens
        n = plan.num_groups
        if n == 0:
            return None
        if plan.uniform:
            f = int(plan.flush[0, 0])
            n_res = int(self.residual_lengths[0, 0])
            start = plan.tokens - int(plan.lengths[0, 0]) + int(plan.sink_take[0, 0])
            out = []
            for x, res in ((keys, self.residual_keys), (values, self.residual_values)):
                stream = (
                    torch.cat([res[:, :, :n_res], x[:, :, start:]], dim=2)
                    if n_res
                    else x[:, :, start:]
                )
                grouped = stream[:, :, : f * t]
                out.append(grouped.reshape(-1, t, x.shape[-1]))
            return out[0], out[1]
        rows_b, rows_h, slots = plan.group_rows.T
        first = self.group_counts[rows_b, rows_h]
        v = (slots - first)[:, None] * t + np.arange(t)[None, :]
        out = []
        for x, res in ((keys, self.residual_keys), (values, self.residual_values)):
            src, new_start = self._source(plan, x, res)
            idx = self._virtual_index(plan, new_start, rows_b, rows_h, v)
            dev = x.device
            bi = torch.from_numpy(rows_b).to(dev)[:, None]
            hi = torch.from_numpy(rows_h).to(dev)[:, None]
            out.append(src[bi, hi, torch.from_numpy(idx).to(dev)])
        return out[0], out[1]

    def write(
        self, plan: AppendPlan, keys: Tensor, values: Tensor, encoded: EncodedGroups | None
    ) -> None:
        """Write sinks, groups and residual of ``plan`` (input as in :meth:`gather`) and
        update the counts. Nothing here raises on valid plans."""
        g = self.geometry
        if plan.num_groups:
            self.reserve_groups(int((self.group_counts + plan.flush).max()))
        if plan.uniform:
            self._write_uniform(plan, keys, values, encoded)
        else:
            self._write_rows(plan, keys, values, encoded)
        self.sink_lengths = self.sink_lengths + plan.sink_take
        self.group_counts = self.group_counts + plan.flush
        self.residual_lengths = plan.residual_after
        self._update_room()
        assert int(self.sink_lengths.max(initial=0)) <= g.sink_tokens

    def _write_uniform(
        self, plan: AppendPlan, keys: Tensor, values: Tensor, enc: EncodedGroups | None
    ) -> None:
        g = self.geometry
        t = g.group_tokens
        n_sink = int(self.sink_lengths[0, 0])
        n_res = int(self.residual_lengths[0, 0])
        n_g = int(self.group_counts[0, 0])
        take = int(plan.sink_take[0, 0])
        f = int(plan.flush[0, 0])
        start = plan.tokens - int(plan.lengths[0, 0])
        b, h = g.batch_size, g.num_key_value_heads
        if take:
            self.sink_keys[:, :, n_sink : n_sink + take] = keys[:, :, start : start + take]
            self.sink_values[:, :, n_sink : n_sink + take] = values[:, :, start : start + take]
        if f:
            assert enc is not None
            for buf, data in zip(self._group_tensors(), enc, strict=True):
                if data is not None:
                    buf[:, :, n_g : n_g + f] = data.reshape(b, h, f, -1)
        new = start + take
        for x, res in ((keys, self.residual_keys), (values, self.residual_values)):
            if f == 0:
                rest = x.shape[2] - new
                if rest:
                    res[:, :, n_res : n_res + rest] = x[:, :, new:]
            else:
                stream = (
                    torch.cat([res[:, :, :n_res], x[:, :, new:]], dim=2) if n_res else x[:, :, new:]
                )
                kept = stream[:, :, f * t :]
                res[:, :, : kept.shape[2]] = kept

    def _write_rows(
        self, plan: AppendPlan, keys: Tensor, values: Tensor, enc: EncodedGroups | None
    ) -> None:
        g = self.geometry
        t = g.group_tokens
        dev = keys.device
        h = g.num_key_value_heads

        def dev_index(a: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        # sinks: row (b, h) takes input tokens [T_in - len, T_in - len + take)
        rows, offs = _expand(plan.sink_take.reshape(-1))
        if rows.size:
            rb, rh = rows // h, rows % h
            dst = self.sink_lengths[rb, rh] + offs
            src = plan.tokens - plan.lengths[rb, rh] + offs
            ib, ih, idst, isrc = (dev_index(a) for a in (rb, rh, dst, src))
            self.sink_keys[ib, ih, idst] = keys[ib, ih, isrc]
            self.sink_values[ib, ih, idst] = values[ib, ih, isrc]
        # groups
        if plan.num_groups:
            assert enc is not None
            rb, rh, slot = (dev_index(a) for a in plan.group_rows.T)
            for buf, data in zip(self._group_tensors(), enc, strict=True):
                if data is not None:
                    buf[rb, rh, slot] = data
        # residual: every row's new residual = virtual positions [flush * T, flush * T + after)
        rows, offs = _expand(plan.residual_after.reshape(-1))
        if rows.size == 0:
            return
        rb, rh = rows // h, rows % h
        v = (plan.flush[rb, rh] * t + offs)[:, None]
        ib, ih, ioff = (dev_index(a) for a in (rb, rh, offs))
        for x, res in ((keys, self.residual_keys), (values, self.residual_values)):
            src, new_start = self._source(plan, x, res)
            idx = dev_index(self._virtual_index(plan, new_start, rb, rh, v)[:, 0])
            kept = src[ib, ih, idx]  # a copy: src may alias the residual buffer
            res[ib, ih, ioff] = kept

    def append(
        self, keys: Tensor, values: Tensor, lengths: Any = None, *, encode: GroupEncoder
    ) -> AppendPlan:
        """Append right-aligned tokens: plan, gather the flushed groups, ``encode`` them (ONE
        call for all groups), then write. Atomic: if :meth:`plan` or ``encode`` raises,
        nothing changes.

        Args:
            keys: storage-dtype ``[B, H, T_in, D]`` (rows' real tokens are the last
                ``lengths``).
            values: storage-dtype ``[B, H, T_in, Dv]``.
            lengths: see :meth:`plan`.
            encode: :data:`GroupEncoder`.

        Returns:
            The executed plan.
        """
        plan = self.plan(keys.shape[2], lengths)
        encoded = encode(plan, self.gather(plan, keys, values))
        self.write(plan, keys, values, encoded)
        return plan

    # ------------------------------------------------------------------ the attention view
    def packed_kv(
        self,
        *,
        codec: KeyCodec,
        layout: KeyLayout,
        mask: Tensor | None,
        active_pairs: Tensor | None,
        rotary: RotaryConfig | None,
        value_codec: ValueCodec | None,
    ) -> PackedKV:
        """The :class:`PackedKV` of this store: views of its buffers, copies of its host counts
        and position offsets, and the codec description (its fields) that the cache holds."""
        g = self.geometry
        return PackedKV(
            sink_keys=self.sink_keys,
            sink_values=self.sink_values,
            key_codes=self.key_codes,
            key_scalars=self.key_scalars,
            value_codes=self.value_codes,
            value_scalars=self.value_scalars,
            residual_keys=self.residual_keys,
            residual_values=self.residual_values,
            sink_lengths=self.sink_lengths.copy(),
            group_counts=self.group_counts.copy(),
            residual_lengths=self.residual_lengths.copy(),
            bits=g.bits,
            group_tokens=g.group_tokens,
            codec=codec,
            layout=layout,
            mask=mask,
            active_pairs=active_pairs,
            key_payload=self.key_payload if g.key_payload_bytes else None,
            position_offsets=self.position_offsets.copy(),
            sink_tokens=g.sink_tokens,
            rotary=rotary,
            value_codec=value_codec,
        )
