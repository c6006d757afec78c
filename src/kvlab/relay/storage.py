"""Ragged KV storage of one attention layer: one flat buffer, one segment per (sequence, kv head).

Layout (docs/design.md, "RoPE-Relay: Storage format"): a layer holds ``B`` sequences of
``H`` kv heads, i.e. ``B * H`` *segments*; segment ``s = b * H + h`` owns the rows
``offsets[s] .. offsets[s] + capacities[s] - 1`` of four flat buffers:

* ``keys`` ``[N, D]`` and ``values`` ``[N, Dv]`` in the cache dtype (keys stored rotated, as the
  model rotated them, or relayed);
* ``original_positions`` int64 ``[N]``: each token's stream index in its sequence (pads excluded);
* ``rotary_positions`` int64 ``[N]``: the position its key is rotated at;
* ``key_bias`` ``[N]`` in the cache dtype: the key-padding mask of attention as an additive bias
  (``0`` on used rows, ``-inf`` on headroom), kept up to date by every write instead of being
  rebuilt per call; ``valid`` (bool ``[N]``) is derived from it on demand.

Decode steps defer their position writes (docs/design.md, "RoPE-Relay: Segment layout and
growth"): a run of single-token appends at consecutive stream indices and positions writes only
keys, values and ``key_bias``; the run's positions (a ramp per segment, known from host ints)
are written the first time anything reads or rewrites the position buffers.

The first ``lengths[s]`` rows of a segment are its tokens, in stream order; the rest is headroom
for future tokens. ``offsets``, ``lengths`` and ``capacities`` are host-side Python ints (never
read back from the device), like ``cu_seqlens`` of varlen attention kernels. Segments are
contiguous, in order and of one common capacity, the ``stride`` (``offsets[s] == s * stride``,
``capacities[s] == stride``), so ``keys.view(B * H, stride, D)[:, :S]`` is a padded view of
every segment without a copy (:meth:`RelayStore.padded_view`; docs/design.md, "RoPE-Relay:
Segment layout and growth").

Growth (docs/design.md, "RoPE-Relay: Segment layout and growth"): when a segment runs out of
headroom the whole buffer is re-laid out with ``stride = longest segment + headroom``,
``headroom = max(min_headroom, ceil(growth * mean length))``, so a re-layout (one copy of the
used rows) happens at most once per ``headroom`` appended tokens per segment: amortized O(1)
per token. Eviction compacts a segment in place (kept tokens moved to its front;
docs/design.md, "RoPE-Relay: Compaction"); :meth:`RelayStore.shrink` gives back memory when the
buffer is mostly headroom.

Bytes (docs/design.md, "RoPE-Relay: Byte accounting"): :meth:`RelayStore.nbytes` counts the used
key/value elements exactly, :meth:`RelayStore.reserved_bytes` the allocation,
:meth:`RelayStore.index_bytes` the used position bookkeeping (two int64 per stored token).

This module owns the buffers, the segment table and every write (append, re-layout, compaction,
crop, row selection); the view types it hands out (:class:`Segment`, :class:`PaddedView`,
:class:`PaddedSegments`, re-exported here) and the functions that build them and the index
ramps live in :mod:`kvlab.relay.storage_views`. No ``transformers`` import here: the model glue
is :mod:`kvlab.integrations.relay_cache`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.relay.storage_views import (
    PaddedSegments,
    PaddedView,
    Segment,
    arange_segments,
    gather_index,
    gather_padded,
    ramps,
    strided_view,
)

__all__ = ["PaddedSegments", "PaddedView", "RelayStore", "Segment"]


@dataclass
class _PositionRun:
    """Decode steps whose positions are not written yet: ``count`` single-token appends, the
    first at row ``rows[s]`` of segment ``s`` with stream index ``original[s]`` and rotary
    position ``rotary[s]``, each next one a row, an index and a position further."""

    rows: list[int]
    original: list[int]
    rotary: list[int]
    count: int = 0


class RelayStore:
    """Ragged per-(sequence, kv head) key/value storage of one layer (module docstring).

    Args:
        batch: sequences ``B``.
        heads: kv heads ``H`` (``num_key_value_heads``).
        head_dim: key channels ``D``; value_dim: value channels ``Dv``.
        dtype: storage dtype of keys and values; device: where the buffers live.
        min_headroom: free rows (tokens) a segment gets at least when the buffer is re-laid out.
        growth: headroom as a fraction of the mean segment length (``> 0``; amortized O(1)
            appends need it to be a fixed fraction).

    Attributes:
        offsets, lengths, capacities: the host segment table (``B * H`` ints each).
        stride: the common capacity of every segment in rows (``offsets[s] == s * stride``).
        keys, values, original_positions, rotary_positions, key_bias: the flat buffers (module
            docstring; reading a position buffer writes the positions of deferred decode steps
            first); valid: bool ``[N]`` derived from ``key_bias``.
        relayouts: re-layouts so far.

    Raises:
        ValueError: non-positive sizes, ``min_headroom < 1`` or ``growth <= 0``.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        min_headroom: int = 16,
        growth: float = 0.5,
    ) -> None:
        if min(batch, heads, head_dim, value_dim) < 1:
            raise ValueError(
                f"batch, heads, head_dim and value_dim must be >= 1, got {batch}, {heads}, "
                f"{head_dim}, {value_dim}"
            )
        if min_headroom < 1 or not growth > 0:
            raise ValueError(f"need min_headroom >= 1 and growth > 0, got {min_headroom}, {growth}")
        self.batch = batch
        self.heads = heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.min_headroom = min_headroom
        self.growth = growth
        segments = batch * heads
        self.offsets: list[int] = [0] * segments
        self.lengths: list[int] = [0] * segments
        self.capacities: list[int] = [0] * segments
        self.stride = 1
        self.relayouts = 0
        # decode steps (docs/design.md, "RoPE-Relay: Segment layout and growth"): the rows of
        # the next single-token appends as one device tensor (a row per step), the host state
        # the next step must match to use it, and the positions those steps deferred
        self._ahead: Tensor | None = None  # int64 [room, B * H]: row i = rows of step i
        self._ahead_step = 0  # the next row of _ahead to use
        self._next_key: tuple | None = None
        self._run: _PositionRun | None = None
        self._ramp = torch.arange(64, dtype=torch.int64, device=self.device)
        self._allocate(segments)  # one (unused) row per segment
        self._lay_out(1)

    # ------------------------------------------------------------------ layout
    @property
    def num_segments(self) -> int:
        """``B * H``."""
        return self.batch * self.heads

    @property
    def rows_allocated(self) -> int:
        """Rows ``N`` of the flat buffers (used + headroom; at least 1)."""
        return int(self.keys.shape[0])

    def segment_id(self, row: int, head: int) -> int:
        """Index ``row * H + head`` of a segment."""
        if not (0 <= row < self.batch and 0 <= head < self.heads):
            raise IndexError(f"segment ({row}, {head}) outside batch {self.batch} x {self.heads}")
        return row * self.heads + head

    def counts(self, row: int) -> list[int]:
        """Tokens stored per kv head of sequence ``row`` (host ints)."""
        return self.lengths[row * self.heads : (row + 1) * self.heads]

    def segment(self, row: int, head: int) -> Segment:
        """Views of segment ``(row, head)``'s stored tokens (no copy)."""
        s = self.segment_id(row, head)
        lo, hi = self.offsets[s], self.offsets[s] + self.lengths[s]
        return Segment(
            self.keys[lo:hi],
            self.values[lo:hi],
            self.original_positions[lo:hi],
            self.rotary_positions[lo:hi],
        )

    def slots(self, count: int) -> Tensor:
        """int64 ``[count]`` ``0 .. count - 1`` on the store's device (a view of a cached
        ramp, grown by doubling; do not write to it)."""
        if count > self._ramp.numel():
            size = max(count, 2 * self._ramp.numel())
            self._ramp = torch.arange(size, dtype=torch.int64, device=self.device)
        return self._ramp[:count]

    def _allocate(self, rows: int) -> None:
        rows = max(1, rows)
        self.keys = torch.zeros(rows, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(rows, self.value_dim, dtype=self.dtype, device=self.device)
        self._original_positions = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._rotary_positions = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.key_bias = torch.full((rows,), -math.inf, dtype=self.dtype, device=self.device)

    def _lay_out(self, stride: int) -> None:
        """Set the segment table for segments of ``stride`` rows each (``offsets[s] = s *
        stride``)."""
        self.stride = stride
        self._next_key = self._ahead = None
        self.capacities = [stride] * self.num_segments
        self.offsets = [s * stride for s in range(self.num_segments)]

    def _mark_bias(self, segments: slice) -> None:
        """Rewrite ``key_bias`` for the segments ``segments`` from the host ``lengths``."""
        lengths = torch.tensor(self.lengths[segments], dtype=torch.int64, device=self.device)
        valid = self.slots(self.stride).view(1, -1) < lengths.view(-1, 1)
        bias = self.key_bias.view(-1, self.stride)[segments]
        bias.copy_(torch.zeros_like(bias).masked_fill_(~valid, -math.inf))

    # ------------------------------------------------------------------ positions
    @property
    def original_positions(self) -> Tensor:
        """int64 ``[N]``: each row's stream index (deferred decode steps written first)."""
        self._write_positions()
        return self._original_positions

    @property
    def rotary_positions(self) -> Tensor:
        """int64 ``[N]``: each row's rotary position (deferred decode steps written first)."""
        self._write_positions()
        return self._rotary_positions

    @property
    def valid(self) -> Tensor:
        """bool ``[N]``: True exactly on the used rows (``key_bias == 0``; a new tensor)."""
        return self.key_bias == 0

    def _write_positions(self) -> None:
        """Write the positions of the deferred decode steps (one ramp per segment)."""
        run, self._run = self._run, None
        if run is None:
            return
        table = ramps([run.rows, run.original, run.rotary], [run.count] * len(run.rows))
        dst, original, rotary = table.to(self.device).unbind(0)
        self._original_positions.index_copy_(0, dst, original)
        self._rotary_positions.index_copy_(0, dst, rotary)

    def headroom(self) -> int:
        """Free rows each segment gets at a re-layout: ``max(min_headroom, ceil(growth *
        mean length))``."""
        mean = sum(self.lengths) / self.num_segments
        return max(self.min_headroom, math.ceil(self.growth * mean))

    def relayout(self, extra: Sequence[int] | None = None, room: int | None = None) -> None:
        """Copy the used rows into a new buffer whose common segment capacity (``stride``) fits
        the longest ``lengths[s] + extra[s]`` plus ``room`` free rows (default
        :meth:`headroom`; one gather and one scatter per buffer)."""
        self._write_positions()
        extra = [0] * self.num_segments if extra is None else list(extra)
        room = self.headroom() if room is None else max(self.min_headroom, int(room))
        stride = max(n + e for n, e in zip(self.lengths, extra, strict=True)) + room
        src = arange_segments(self.offsets, self.lengths).to(self.device)
        old = (self.keys, self.values, self.original_positions, self.rotary_positions)
        self._allocate(stride * self.num_segments)
        self._lay_out(stride)
        dst = arange_segments(self.offsets, self.lengths).to(self.device)
        for new, buf in zip(
            (self.keys, self.values, self._original_positions, self._rotary_positions),
            old,
            strict=True,
        ):
            new.index_copy_(0, dst, buf.index_select(0, src))
        self._mark_bias(slice(None))
        self.relayouts += 1

    def shrink(self, slack: float = 2.0, room: int | None = None) -> bool:
        """Re-lay out (freeing memory) when the allocation exceeds ``slack`` times what a fresh
        layout with ``room`` free rows per segment (default :meth:`headroom`, at least
        ``min_headroom``) would reserve; returns whether it did."""
        free = self.headroom() if room is None else max(self.min_headroom, int(room))
        target = self.num_segments * (max(self.lengths, default=0) + free)
        if self.rows_allocated > slack * target:
            self.relayout(room=free)
            return True
        return False

    # ------------------------------------------------------------------ writes
    def append(
        self,
        keys: Tensor,
        values: Tensor,
        *,
        real: Sequence[int],
        original_start: Sequence[int],
        rotary_start: Sequence[int],
    ) -> None:
        """Append the last ``real[b]`` tokens of row ``b`` of ``keys`` ``[B, H, T, D]`` and
        ``values`` ``[B, H, T, Dv]`` to every segment of row ``b``, at stream indices
        ``original_start[b] + j`` and rotary positions ``rotary_start[b] + j``.

        The first ``T - real[b]`` tokens of a row (left padding) are dropped. Host ints only;
        no device read-back. Re-lays out first if a segment lacks room. A single-token append
        (a decode step) whose rows and positions follow the previous one's takes the next row
        of the device table of destination rows the run's first step built, and defers its
        positions (module docstring): no tensor is built from host ints.

        Raises:
            ValueError: shapes that do not match the store, or ``real[b]`` outside ``[0, T]``.
        """
        batch, heads, t = keys.shape[:3]
        if (batch, heads, keys.shape[3]) != (self.batch, self.heads, self.head_dim) or tuple(
            values.shape
        ) != (batch, heads, t, self.value_dim):
            raise ValueError(
                f"append got keys {tuple(keys.shape)} / values {tuple(values.shape)}; the store "
                f"holds [B={self.batch}, H={self.heads}, T, D={self.head_dim}] keys and "
                f"Dv={self.value_dim} values"
            )
        real = list(real)
        if len(real) != batch or any(not 0 <= r <= t for r in real):
            raise ValueError(f"real tokens per row {real} must be {batch} ints in [0, {t}]")
        single = t == 1 and min(real) == 1  # a decode step: one token per segment
        if single and self._next_key == (
            self.stride,
            tuple(self.lengths),
            tuple(original_start),
            tuple(rotary_start),
        ):
            self._decode_step(keys, values)
            return
        per_segment = [r for r in real for _ in range(heads)]
        if any(n + r > self.stride for n, r in zip(self.lengths, per_segment, strict=True)):
            self.relayout(per_segment)
        if sum(per_segment) == 0:
            return
        self._write_positions()
        flat_k = keys.reshape(batch * heads * t, self.head_dim)
        flat_v = values.reshape(batch * heads * t, self.value_dim)
        if all(r == t for r in real):
            new_k, new_v = flat_k, flat_v
        else:
            src = arange_segments(
                [s * t + t - r for s, r in enumerate(per_segment)], per_segment
            ).to(self.device)
            new_k, new_v = flat_k.index_select(0, src), flat_v.index_select(0, src)
        if new_k.dtype != self.dtype or new_v.dtype != self.dtype:
            new_k, new_v = new_k.to(self.dtype), new_v.to(self.dtype)
        rows = [o + n for o, n in zip(self.offsets, self.lengths, strict=True)]
        original = [original_start[s // heads] for s in range(self.num_segments)]
        rotary = [rotary_start[s // heads] for s in range(self.num_segments)]
        if single:
            # the destination rows of this step and of every later one that fits the headroom
            # ([room, B * H], one device tensor); positions deferred (a run)
            room = self.stride - max(self.lengths)
            first = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self._ahead = first + self.slots(room).view(-1, 1)
            self._ahead_step = 1
            dst = self._ahead[0]
            self._run = _PositionRun(rows, original, rotary, count=1)
        else:
            # destination rows, stream indices and rotary positions: one tensor from host ints
            table = ramps([rows, original, rotary], per_segment, self.device)
            dst, positions = table[0], table[1:]
            self._original_positions.index_copy_(0, dst, positions[0])
            self._rotary_positions.index_copy_(0, dst, positions[1])
        self.keys.index_copy_(0, dst, new_k)
        self.values.index_copy_(0, dst, new_v)
        self.key_bias.index_fill_(0, dst, 0.0)
        self.lengths = [n + r for n, r in zip(self.lengths, per_segment, strict=True)]
        self._expect_next(original_start, rotary_start, single)

    def _expect_next(
        self, original_start: Sequence[int], rotary_start: Sequence[int], single: bool
    ) -> None:
        """After an append: whether the next one may take :meth:`_decode_step` — a single token
        per segment at the next stream index and position of every sequence, the layout
        unchanged, and a row of ``_ahead`` left for it."""
        if not single or self._ahead is None or self._ahead_step >= self._ahead.shape[0]:
            self._next_key = None
            return
        self._next_key = (
            self.stride,
            tuple(self.lengths),
            tuple(o + 1 for o in original_start),
            tuple(r + 1 for r in rotary_start),
        )

    def _decode_step(self, keys: Tensor, values: Tensor) -> None:
        """The single-token append :meth:`_expect_next` allowed: keys, values and
        ``key_bias`` at the next row of ``_ahead``; positions join the deferred run."""
        assert self._ahead is not None and self._next_key is not None
        dst = self._ahead[self._ahead_step]
        self._ahead_step += 1
        _, _, original_start, rotary_start = self._next_key
        if self._run is None:  # the positions were read since the last step: a new run
            heads = self.heads
            self._run = _PositionRun(
                [o + n for o, n in zip(self.offsets, self.lengths, strict=True)],
                [original_start[s // heads] for s in range(self.num_segments)],
                [rotary_start[s // heads] for s in range(self.num_segments)],
            )
        new_k = keys.reshape(self.num_segments, self.head_dim)
        new_v = values.reshape(self.num_segments, self.value_dim)
        if new_k.dtype != self.dtype or new_v.dtype != self.dtype:
            new_k, new_v = new_k.to(self.dtype), new_v.to(self.dtype)
        self.keys.index_copy_(0, dst, new_k)
        self.values.index_copy_(0, dst, new_v)
        self.key_bias.index_fill_(0, dst, 0.0)
        self._run.count += 1
        self.lengths = [n + 1 for n in self.lengths]
        self._expect_next(original_start, rotary_start, True)

    def write_front(
        self,
        row: int,
        counts: Sequence[int],
        first_slot: Sequence[int],
        keys: Tensor,
        values: Tensor,
        original_positions: Tensor,
        rotary_positions: Tensor,
    ) -> None:
        """Compaction after an eviction: segment ``(row, h)`` becomes the ``counts[h]`` tokens at
        slots ``first_slot[h] .. first_slot[h] + counts[h] - 1`` of the padded per-head inputs
        ``keys`` ``[H, S, D]``, ``values`` ``[H, S, Dv]``, positions int64 ``[H, S]``, written
        in place at the front of the segment (no reallocation).

        Raises:
            ValueError: a count above the segment's capacity or slots outside the inputs.
        """
        self._write_positions()
        heads, slots = keys.shape[:2]
        counts, first_slot = list(counts), list(first_slot)
        if heads != self.heads or len(counts) != heads or len(first_slot) != heads:
            raise ValueError(f"write_front needs {self.heads} heads, got {heads}")
        base = row * self.heads
        for h in range(heads):
            if not (0 <= counts[h] <= self.capacities[base + h] and first_slot[h] >= 0):
                raise ValueError(f"head {h}: {counts[h]} tokens do not fit its segment")
            if first_slot[h] + counts[h] > slots:
                raise ValueError(f"head {h}: slots {first_slot[h]} + {counts[h]} exceed {slots}")
        src = arange_segments([h * slots + f for h, f in enumerate(first_slot)], counts)
        dst = arange_segments(self.offsets[base : base + heads], counts)
        src, dst = src.to(keys.device), dst.to(self.device)
        self.keys.index_copy_(0, dst, keys.reshape(-1, self.head_dim).index_select(0, src))
        self.values.index_copy_(0, dst, values.reshape(-1, self.value_dim).index_select(0, src))
        self.original_positions.index_copy_(0, dst, original_positions.reshape(-1)[src])
        self.rotary_positions.index_copy_(0, dst, rotary_positions.reshape(-1)[src])
        self.lengths[base : base + heads] = counts
        self._next_key = None
        self._mark_bias(slice(base, base + heads))

    def truncate(self, tokens: int) -> None:
        """Drop the last ``tokens`` rows of every segment (speculative decoding's crop: they
        must be the tokens appended last, after any eviction); their slots become empty
        (``key_bias`` ``-inf``) and the decode fast path restarts.

        Raises:
            ValueError: ``tokens`` negative or above a segment's length.
        """
        if tokens < 0 or tokens > min(self.lengths, default=0):
            raise ValueError(
                f"cannot drop {tokens} tokens from segments of {min(self.lengths, default=0)}"
            )
        if tokens == 0:
            return
        self._write_positions()
        self.lengths = [n - tokens for n in self.lengths]
        self._next_key = self._ahead = None
        self._mark_bias(slice(None))

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep sequences ``rows`` (host ints, repeats allowed) in that order (beam search,
        ``batch_select_indices``, ``batch_repeat_interleave``): a re-layout into a new buffer."""
        rows = list(rows)
        if any(not 0 <= b < self.batch for b in rows):
            raise IndexError(f"rows {rows} outside batch {self.batch}")
        self._write_positions()
        segs = [b * self.heads + h for b in rows for h in range(self.heads)]
        lengths = [self.lengths[s] for s in segs]
        src = arange_segments([self.offsets[s] for s in segs], lengths).to(self.device)
        old = (self.keys, self.values, self.original_positions, self.rotary_positions)
        self.batch = len(rows)
        self.lengths = lengths
        room = self.headroom() if self.num_segments else self.min_headroom
        stride = max(lengths, default=0) + room
        self._allocate(stride * len(segs))
        self._lay_out(stride)
        dst = arange_segments(self.offsets, lengths).to(self.device)
        for new, buf in zip(
            (self.keys, self.values, self._original_positions, self._rotary_positions),
            old,
            strict=True,
        ):
            new.index_copy_(0, dst, buf.index_select(0, src))
        if self.num_segments:
            self._mark_bias(slice(None))

    # ------------------------------------------------------------------ reads
    def gather_index(self, rows: Sequence[int] | None = None) -> tuple[Tensor, Tensor, int]:
        """Flat-buffer rows of the padded view of sequences ``rows`` (default all):
        :func:`~kvlab.relay.storage_views.gather_index` of their segments.

        Returns:
            ``(index, lengths, S)``: index int64 ``[R * H, S]`` on the store's device (slot
            ``i`` of segment ``s`` reads row ``offsets[s] + min(i, lengths[s] - 1)``; always a
            valid row), lengths int64 ``[R * H]`` on the device, ``S`` the longest segment
            (at least 1). Built from host ints: no device read-back.
        """
        segs = (
            range(self.num_segments)
            if rows is None
            else [b * self.heads + h for b in rows for h in range(self.heads)]
        )
        offsets = [self.offsets[s] for s in segs]
        lengths = [self.lengths[s] for s in segs]
        return gather_index(offsets, lengths, self.slots, self.device)

    def padded_view(self, group: int = 1) -> PaddedView:
        """Every segment padded to the longest and broadcast over ``group`` query heads, as
        views of the buffers (one view op per tensor: no copy, no device read-back); see
        :class:`PaddedView`. Slot ``i`` of segment ``s`` is row ``offsets[s] + i``."""
        return strided_view(self.keys, self.values, self.key_bias, self.lengths, self.stride, group)

    def padded(self, rows: Sequence[int] | None = None) -> PaddedSegments:
        """Left-aligned padded copies of sequences ``rows`` (default all): see
        :class:`PaddedSegments`."""
        rows = list(range(self.batch)) if rows is None else list(rows)
        index, lengths, longest = self.gather_index(rows)
        buffers = (self.keys, self.values, self.original_positions, self.rotary_positions)
        return gather_padded(buffers, index, lengths, (len(rows), self.heads, longest))

    # ------------------------------------------------------------------ sizes
    def numel(self) -> int:
        """Stored (used) key and value elements: ``sum(lengths) * (D + Dv)``."""
        return sum(self.lengths) * (self.head_dim + self.value_dim)

    def nbytes(self) -> int:
        """Bytes of the stored (used) keys and values, exactly: ``sum(lengths) * (D + Dv) *
        element size``; headroom is not counted (see :meth:`reserved_bytes`)."""
        used = sum(self.lengths)
        return used * (
            self.head_dim * self.keys.element_size() + self.value_dim * self.values.element_size()
        )

    def reserved_bytes(self) -> int:
        """Bytes allocated for the key and value buffers (used + headroom)."""
        return (
            self.keys.numel() * self.keys.element_size()
            + self.values.numel() * self.values.element_size()
        )

    def index_bytes(self) -> int:
        """Bytes of the used bookkeeping: per stored token two int64 (stream index, rotary
        position) and its ``key_bias`` element (cache dtype) — the host-side segment table,
        ``3 * B * H`` ints, is not counted."""
        return sum(self.lengths) * (2 * 8 + self.key_bias.element_size())

    def held_bytes(self) -> int:
        """Bytes of every device buffer the store holds (used rows and headroom): keys, values,
        both position buffers and ``key_bias``."""
        buffers = (
            self.keys,
            self.values,
            self.original_positions,
            self.rotary_positions,
            self.key_bias,
        )
        return sum(t.numel() * t.element_size() for t in buffers)

    def reserved_index_bytes(self) -> int:
        """Bytes allocated for the position buffers and ``key_bias``."""
        return (
            self.original_positions.numel() + self.rotary_positions.numel()
        ) * 8 + self.key_bias.numel() * self.key_bias.element_size()
