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
  ``value_scalars [B, H, G_cap, 2 * T]`` (``[scale(T) | zero(T)]`` per token); group ``g`` of a
  row is the slice ``[b, h, g]`` and starts at stream index ``S + g * T``;
* residual — the most recent tokens, exact: ``residual_keys [B, H, R + T - 1, D]``,
  ``residual_values`` likewise, oldest first;
* for a codec with a per-pair table (a mix's mask, per-pair widths), the packed table
  ``mask [B, ceil(H * P * table_bits / 8)]`` uint8 (entry ``h * P + p`` of row ``b``'s
  little-endian bitstream of ``table_bits``-bit entries).

Per-row counts live on the host (numpy int64 ``[3, B, H]`` :attr:`counts`, also as a CPU tensor
sharing its memory for kernels; views :attr:`sink_lengths`, :attr:`group_counts`,
:attr:`residual_lengths`), never read back from the device, and so do the rows' RoPE position
offsets (:attr:`position_offsets`): the token at stream index ``i`` of row ``(b, h)`` sits at
position ``position_offsets[b, h] + i``. Group buffers
grow by doubling; slots beyond a row's count hold zeros or stale finite data and are never read
as tokens. Flush rule (per row): when the residual reaches ``residual_tokens + group_tokens``
tokens the oldest ``group_tokens`` become one group; which tokens form which group depends only
on the row's total length, and written codes are never rewritten, so any split of the same
tokens into appends gives byte-identical used regions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.packing import packed_length

__all__ = ["GROUP_BUFFERS", "AppendPlan", "EncodedGroups", "PackedStore", "StoreGeometry"]


@dataclass(frozen=True)
class StoreGeometry:
    """Sizes of a :class:`PackedStore` (tokens, channels, bytes).

    Attributes:
        batch_size: sequences ``B``.
        num_key_value_heads: kv heads ``H``.
        head_dim, value_head_dim: key / value channels ``D`` / ``Dv``.
        bits: code width of keys and values.
        sink_tokens, residual_tokens, group_tokens: ``S``, ``R``, ``T`` (tokens).
        key_scalar_count: storage-dtype key scalars per row and group ``S_k``.
        storage_dtype: dtype of exact tokens and scalars.
        mask_bytes: bytes of the packed per-pair table per sequence (0: no table).
        key_payload_bytes: ``E``, bytes of the key codec's per-group payload per row.
        table_bits: bits per entry of the packed per-pair table (0: no table).
        key_code_bytes: ``Kb`` (default ``ceil(T * D * bits / 8)``).
        value_choice_bytes: bytes of a row's recorded value-coding choice (0: the value codec
            makes none; 1 for ``"hadamard_auto"``), counted once the row has flushed a group.
    """

    batch_size: int
    num_key_value_heads: int
    head_dim: int
    value_head_dim: int
    bits: int
    sink_tokens: int
    residual_tokens: int
    group_tokens: int
    key_scalar_count: int
    storage_dtype: torch.dtype
    mask_bytes: int = 0
    key_payload_bytes: int = 0
    table_bits: int = 0
    key_code_bytes: int = -1
    value_choice_bytes: int = 0

    def __post_init__(self) -> None:
        if self.key_code_bytes < 0:
            kb = packed_length(self.group_tokens * self.head_dim, self.bits)
            object.__setattr__(self, "key_code_bytes", kb)
        if self.mask_bytes and not self.table_bits:
            object.__setattr__(self, "table_bits", 1)

    @property
    def value_code_bytes(self) -> int:
        """``Vb``: packed value-code bytes of one row's group."""
        return packed_length(self.group_tokens * self.value_head_dim, self.bits)

    @property
    def residual_capacity(self) -> int:
        """Most tokens a residual holds between appends: ``R + T - 1``."""
        return self.residual_tokens + self.group_tokens - 1


class EncodedGroups(NamedTuple):
    """Coded groups, one row per flushed group (``N`` rows, in the plan's order):
    ``key_codes`` uint8 ``[N, Kb]`` (packed), ``key_scalars`` ``[N, S_k]``, ``value_codes``
    uint8 ``[N, Vb]``, ``value_scalars`` ``[N, 2 * T]`` (storage dtype), ``key_payload``
    uint8 ``[N, E]`` (``None`` when ``E = 0``)."""

    key_codes: Tensor
    key_scalars: Tensor
    value_codes: Tensor
    value_scalars: Tensor
    key_payload: Tensor | None = None


#: The per-group buffers of a store, in :class:`EncodedGroups` order.
GROUP_BUFFERS = ("key_codes", "key_scalars", "value_codes", "value_scalars", "key_payload")


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


class PackedStore:
    """Contiguous buffers of one layer (module docstring; docs/design.md, "Storage format").

    Buffers are public attributes; treat them as read-only outside this class.

    Args:
        geometry: the sizes.
        device: where the buffers live.
    """

    def __init__(self, geometry: StoreGeometry, device: torch.device | str) -> None:
        g = geometry
        self.geometry = g
        dev = torch.device(device)
        b, h, dt = g.batch_size, g.num_key_value_heads, g.storage_dtype
        self.sink_keys = torch.zeros((b, h, g.sink_tokens, g.head_dim), dtype=dt, device=dev)
        self.sink_values = torch.zeros(
            (b, h, g.sink_tokens, g.value_head_dim), dtype=dt, device=dev
        )
        r = g.residual_capacity
        self.residual_keys = torch.zeros((b, h, r, g.head_dim), dtype=dt, device=dev)
        self.residual_values = torch.zeros((b, h, r, g.value_head_dim), dtype=dt, device=dev)
        self.key_codes: Tensor
        self.key_scalars: Tensor
        self.value_codes: Tensor
        self.value_scalars: Tensor
        self.key_payload: Tensor
        self._set_group_buffers(self._group_buffers(b, 0, dev))
        self.mask: Tensor | None = (
            torch.zeros((b, g.mask_bytes), dtype=torch.uint8, device=dev) if g.mask_bytes else None
        )
        self._set_counts(np.zeros((3, b, h), dtype=np.int64))
        self.mask_rows = np.zeros((b, h), dtype=bool)
        #: rows whose value-coding choice is recorded (``value_choice_bytes`` each)
        self.value_choice_rows = np.zeros((b, h), dtype=bool)
        self.position_offsets = np.zeros((b, h), dtype=np.int64)

    # ------------------------------------------------------------------ counts
    def _set_counts(self, counts: np.ndarray) -> None:
        self.counts = counts
        self._update_room()

    @property
    def counts_tensor(self) -> Tensor:
        """``counts`` as an int64 tensor sharing its memory (the CPU kernel's fused decode
        step writes the new counts through it). Made on each access, so a copy of the store
        (``copy.deepcopy``) never reads another store's counts."""
        return torch.from_numpy(self.counts)

    def _update_room(self) -> None:
        g = self.geometry
        full = int(self.counts[0].min(initial=g.sink_tokens)) == g.sink_tokens
        used = int(self.counts[2].max(initial=0))
        self.single_token_room = g.residual_capacity - used if full else 0

    @property
    def sink_lengths(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): sink tokens per row (a view of :attr:`counts`)."""
        return self.counts[0]

    @sink_lengths.setter
    def sink_lengths(self, value: np.ndarray) -> None:
        self.counts[0] = value

    @property
    def group_counts(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): quantized groups per row (a view of :attr:`counts`)."""
        return self.counts[1]

    @group_counts.setter
    def group_counts(self, value: np.ndarray) -> None:
        self.counts[1] = value

    @property
    def residual_lengths(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): residual tokens per row (a view of :attr:`counts`)."""
        return self.counts[2]

    @residual_lengths.setter
    def residual_lengths(self, value: np.ndarray) -> None:
        self.counts[2] = value

    def note_residual_token(self) -> None:
        """Count one token per row that a kernel wrote at residual slot ``residual_lengths``
        (only while :attr:`single_token_room` > 0: sinks full, no flush)."""
        assert self.single_token_room > 0
        self.counts[2] += 1
        self.single_token_room -= 1

    # ------------------------------------------------------------------ description
    @property
    def device(self) -> torch.device:
        return self.sink_keys.device

    @property
    def batch_size(self) -> int:
        return self.geometry.batch_size

    @property
    def group_capacity(self) -> int:
        """``G_cap``: allocated group slots per row."""
        return self.key_codes.shape[2]

    @property
    def seq_lengths(self) -> np.ndarray:
        """int64 ``[B, H]``: tokens stored per row (sinks + groups + residual)."""
        return (
            self.sink_lengths
            + self.group_counts * self.geometry.group_tokens
            + self.residual_lengths
        )

    def stream_positions(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """RoPE positions (host int64 ``[n, T]``) of the tokens of group slots ``slots [n]`` of
        rows ``rows [n, 2]`` (``(b, h)``): ``position_offsets[b, h] + S + slot * T + t``."""
        g = self.geometry
        t = g.group_tokens
        base = self.position_offsets[rows[:, 0], rows[:, 1]] + g.sink_tokens + slots * t
        return base[:, None] + np.arange(t)[None, :]

    def is_uniform(self) -> bool:
        """Whether every row holds the same counts (then slices address every row alike)."""
        return all(
            int(a.min()) == int(a.max(initial=0))
            for a in (self.sink_lengths, self.group_counts, self.residual_lengths)
        )

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> dict[str, int]:
        """USED bytes by component, from the host counts (docs/design.md, "Byte accounting"):
        ``key_sink``, ``key_residual``, ``key_codes``, ``key_scales``, ``key_mask`` (the packed
        per-pair table of every sequence that has one), ``value_sink``, ``value_residual``,
        ``value_codes``, ``value_scales``, and ``key_payload`` (the key codec's per-group side
        data, e.g. exact outliers) for codecs that store one."""
        g = self.geometry
        es = torch.finfo(g.storage_dtype).bits // 8
        sinks = int(self.sink_lengths.sum())
        groups = int(self.group_counts.sum())
        res = int(self.residual_lengths.sum())
        masked = int(self.mask_rows.any(axis=1).sum())
        out = {
            "key_sink": sinks * g.head_dim * es,
            "key_residual": res * g.head_dim * es,
            "key_codes": groups * g.key_code_bytes,
            "key_scales": groups * g.key_scalar_count * es,
            "key_mask": masked * g.mask_bytes,
            "value_sink": sinks * g.value_head_dim * es,
            "value_residual": res * g.value_head_dim * es,
            "value_codes": groups * g.value_code_bytes,
            "value_scales": groups * 2 * g.group_tokens * es,
        }
        if g.key_payload_bytes:  # only codecs that store one (the seed's dict is pinned)
            out["key_payload"] = groups * g.key_payload_bytes
        if g.value_choice_bytes:  # only value codecs that choose per row
            out["value_choice"] = int(self.value_choice_rows.sum()) * g.value_choice_bytes
        return out

    def reserved_bytes(self) -> dict[str, int]:
        """ALLOCATED bytes by buffer (capacity, including unused slots)."""
        out = {
            name: t.numel() * t.element_size()
            for name, t in (
                ("sink_keys", self.sink_keys),
                ("sink_values", self.sink_values),
                ("key_codes", self.key_codes),
                ("key_scalars", self.key_scalars),
                ("value_codes", self.value_codes),
                ("value_scalars", self.value_scalars),
                ("key_payload", self.key_payload),
                ("residual_keys", self.residual_keys),
                ("residual_values", self.residual_values),
            )
        }
        out["mask"] = 0 if self.mask is None else self.mask.numel()
        return out

    # ------------------------------------------------------------------ capacity
    def _group_buffers(
        self, batch: int, capacity: int, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Zero buffers in :data:`GROUP_BUFFERS` order."""
        g = self.geometry
        h, dt, u8 = g.num_key_value_heads, g.storage_dtype, torch.uint8
        return (
            torch.zeros((batch, h, capacity, g.key_code_bytes), dtype=u8, device=device),
            torch.zeros((batch, h, capacity, g.key_scalar_count), dtype=dt, device=device),
            torch.zeros((batch, h, capacity, g.value_code_bytes), dtype=u8, device=device),
            torch.zeros((batch, h, capacity, 2 * g.group_tokens), dtype=dt, device=device),
            torch.zeros((batch, h, capacity, g.key_payload_bytes), dtype=u8, device=device),
        )

    def _group_tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in GROUP_BUFFERS)

    def _set_group_buffers(self, buffers: tuple[Tensor, ...]) -> None:
        for name, t in zip(GROUP_BUFFERS, buffers, strict=True):
            setattr(self, name, t)

    def reserve_groups(self, groups: int) -> None:
        """Make room for ``groups`` group slots per row (capacity at least doubles)."""
        cap = self.group_capacity
        if groups <= cap:
            return
        new_cap = max(groups, 2 * cap, 4)
        used = int(self.group_counts.max(initial=0))
        fresh = self._group_buffers(self.batch_size, new_cap, self.device)
        for new, cur in zip(fresh, self._group_tensors(), strict=True):
            new[:, :, :used] = cur[:, :, :used]
        self._set_group_buffers(fresh)

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

    # ------------------------------------------------------------------ per-pair table
    def write_mask(self, rows: np.ndarray, entries: Tensor) -> None:
        """Set the per-pair table of rows ``(b, h)`` (int64 ``[n, 2]``) to ``entries`` (``[n,
        P]``, bool or uint8 ``< 2 ** table_bits``; a mix mask is its bool mask)."""
        from kvlab.pnmix.packing import pack_codes, unpack_codes

        assert self.mask is not None
        if rows.shape[0] == 0:
            return
        h = self.geometry.num_key_value_heads
        nbits = self.geometry.table_bits
        p = entries.shape[-1]
        seqs = np.unique(rows[:, 0])
        pos = np.searchsorted(seqs, rows[:, 0])
        dev = self.mask.device
        seq_idx = torch.from_numpy(seqs).to(dev)
        current = unpack_codes(self.mask[seq_idx], nbits, h * p).reshape(len(seqs), h, p)
        current[torch.from_numpy(pos).to(dev), torch.from_numpy(rows[:, 1]).to(dev)] = entries.to(
            device=dev, dtype=torch.uint8
        )
        self.mask[seq_idx] = pack_codes(current.reshape(len(seqs), h * p), nbits, check=False)
        self.mask_rows[rows[:, 0], rows[:, 1]] = True

    def read_table_entries(self, num_pairs: int) -> Tensor:
        """The stored table entries, uint8 ``[B, H, P]`` (rows without a table read 0)."""
        from kvlab.pnmix.packing import unpack_codes

        assert self.mask is not None
        h = self.geometry.num_key_value_heads
        entries = unpack_codes(self.mask, self.geometry.table_bits, h * num_pairs)
        return entries.reshape(self.batch_size, h, num_pairs)

    # ------------------------------------------------------------------ positions
    def shift_positions(self, delta: np.ndarray, rotary: Any) -> None:
        """Move every token of row ``(b, h)`` by ``delta[b, h]`` positions (host int64 ``[B,
        H]``): the position offsets change and the exact sink and residual keys (stored
        rotated at their positions) are rotated by ``delta`` (:func:`kvlab.rope.
        rotate_by_delta`, float32, rounded to the storage dtype). Codes are not touched: a
        position-aware codec's codes hold position-0 keys (docs/design.md, "Positions")."""
        from kvlab.rope import rotate_by_delta

        delta = np.asarray(delta, dtype=np.int64)
        if not delta.any():
            return
        d = torch.from_numpy(delta).to(self.device)[..., None]  # [B, H, 1]
        for name in ("sink_keys", "residual_keys"):
            buf = getattr(self, name)
            if buf.shape[2]:
                buf.copy_(rotate_by_delta(buf.float(), d, rotary).to(buf.dtype))
        self.position_offsets = self.position_offsets + delta

    # ------------------------------------------------------------------ beams
    def select_batch(self, index: np.ndarray) -> None:
        """Row-select every buffer and count by ``index`` (host int64 ``[B']``, entries in range,
        already validated): sequence ``i`` becomes old ``index[i]``; bytes are copied exactly."""
        idx = torch.from_numpy(np.ascontiguousarray(index)).to(self.device)
        for name in (
            "sink_keys",
            "sink_values",
            "residual_keys",
            "residual_values",
            *GROUP_BUFFERS,
        ):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
        self.mask_rows = self.mask_rows[index].copy()
        self.value_choice_rows = self.value_choice_rows[index].copy()
        self.position_offsets = self.position_offsets[index].copy()
        self.geometry = dataclasses.replace(self.geometry, batch_size=int(index.shape[0]))
        self._set_counts(self.counts[:, index].copy())
