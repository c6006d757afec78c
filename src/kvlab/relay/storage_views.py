"""Read forms of a :class:`~kvlab.relay.storage.RelayStore`'s flat buffers, and the index ramps
its writes are built from: this module owns the view types (:class:`Segment`, one segment's
stored tokens; :class:`PaddedView`, every segment padded to the longest as strided views of the
buffers, what attention reads; :class:`PaddedSegments`, left-aligned padded copies, what
eviction scorers read), the functions that build the padded forms from the buffers and the
host segment table (:func:`gather_index`, :func:`strided_view`, :func:`gather_padded`: host
ints in, no device read-back) and the int64 ramps (:func:`ramps`, :func:`arange_segments`)
that both the reads and the store's writes index with. It holds no state: the buffers, the
segment table and their growth stay in :mod:`kvlab.relay.storage` (docs/design.md, "RoPE-Relay:
Storage format" and "RoPE-Relay: Segment layout and growth").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PAD_POSITION",
    "PaddedSegments",
    "PaddedView",
    "Segment",
    "arange_segments",
    "gather_index",
    "gather_padded",
    "ramps",
    "strided_view",
]


#: ``original_positions`` of the padding slots of a :class:`PaddedSegments` view.
PAD_POSITION: int = -1


@dataclass(frozen=True)
class Segment:
    """Views (no copies) of one (sequence, kv head) segment's ``n`` stored tokens.

    Attributes:
        keys: ``[n, D]``; values: ``[n, Dv]``; original_positions, rotary_positions: int64
            ``[n]``. Writing to them writes to the store.
    """

    keys: Tensor
    values: Tensor
    original_positions: Tensor
    rotary_positions: Tensor


@dataclass(frozen=True)
class PaddedSegments:
    """Left-aligned padded copies of some rows' segments (what eviction scorers read).

    Shapes: ``R`` rows, ``H`` kv heads, ``S`` the longest of those segments.

    Attributes:
        keys: ``[R, H, S, D]``; values: ``[R, H, S, Dv]`` (padding slots zero).
        valid: bool ``[R, H, S]``, True for the first ``lengths`` slots of each segment.
        original_positions: int64 ``[R, H, S]`` (``-1`` in padding slots).
        rotary_positions: int64 ``[R, H, S]`` (``0`` in padding slots).
    """

    keys: Tensor
    values: Tensor
    valid: Tensor
    original_positions: Tensor
    rotary_positions: Tensor


@dataclass(frozen=True)
class PaddedView:
    """Views (no copies) of every segment of a store, padded to the longest and broadcast over
    a GQA group (what attention reads): ``M = B * H`` segments, ``G`` the group, ``S`` the
    longest segment (at least 1).

    Attributes:
        keys: ``[M, G, S, D]``; values: ``[M, G, S, Dv]`` (the group axis has stride 0). Slots
            at and past a segment's length hold stale finite data (headroom): read them only
            through ``valid``.
        bias: ``[M, 1, 1, S]`` in the store dtype, ``0`` on the first ``lengths[s]`` slots of
            segment ``s`` and ``-inf`` after them (the key-padding mask as SDPA applies it), or
            ``None`` when every segment holds exactly ``S`` tokens (nothing to mask).
        longest: ``S``.
    """

    keys: Tensor
    values: Tensor
    bias: Tensor | None
    longest: int

    @property
    def valid(self) -> Tensor | None:
        """bool ``[M, 1, 1, S]``: True where :attr:`bias` is ``0`` (a new tensor per call), or
        ``None`` with it."""
        return None if self.bias is None else self.bias == 0


def ramps(
    starts: Sequence[Sequence[int]], counts: Sequence[int], device: torch.device | None = None
) -> Tensor:
    """int64 ``[len(starts), sum(counts)]`` on ``device`` (default CPU): row ``i`` is
    ``starts[i][k] + 0 .. starts[i][k] + counts[k] - 1`` concatenated over ``k`` (one tensor
    built from host ints for small sizes)."""
    total = int(sum(counts))
    if total <= 4096:  # decode steps: one small tensor from host ints
        flat = [a + j for row in starts for a, c in zip(row, counts, strict=True) for j in range(c)]
        return torch.tensor(flat, dtype=torch.int64, device=device).view(len(starts), total)
    counts_t = torch.tensor(list(counts), dtype=torch.int64)
    first = torch.cumsum(counts_t, 0) - counts_t  # where each run begins in the output
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(first, counts_t)
    starts_t = torch.tensor([list(row) for row in starts], dtype=torch.int64)
    return (torch.repeat_interleave(starts_t, counts_t, dim=1) + within).to(device)


def arange_segments(starts: Sequence[int], counts: Sequence[int]) -> Tensor:
    """int64 CPU ``[sum(counts)]``: ``starts[i] + 0 .. starts[i] + counts[i] - 1`` concatenated."""
    return ramps([starts], counts)[0]


def gather_index(
    offsets: Sequence[int],
    lengths: Sequence[int],
    slots: Callable[[int], Tensor],
    device: torch.device,
) -> tuple[Tensor, Tensor, int]:
    """Flat-buffer rows of the padded view of the segments whose first rows are ``offsets``
    and whose stored tokens are ``lengths`` (host ints, one per segment, capacities >= 1).

    Args:
        offsets, lengths: the segments' entries of the host segment table.
        slots: ``count -> int64 [count]`` ``0 .. count - 1`` on ``device``
            (:meth:`~kvlab.relay.storage.RelayStore.slots`).
        device: where the buffers live.

    Returns:
        ``(index, lengths, S)``: index int64 ``[len(offsets), S]`` on ``device`` (slot ``i`` of
        segment ``s`` reads row ``offsets[s] + min(i, lengths[s] - 1)``; always a valid row),
        lengths int64 ``[len(offsets)]`` on ``device``, ``S`` the longest segment (at least 1).
    """
    longest = max(max(lengths, default=0), 1)
    # one host tensor for both: [offsets; last slot of each segment (0 when empty)]
    table = torch.tensor(
        [list(offsets), [max(n - 1, 0) for n in lengths], list(lengths)],
        dtype=torch.int64,
        device=device,
    )
    slot = slots(longest)
    # capacities >= 1 after any append, and a fresh store's one row is row 0: always valid
    index = table[0].unsqueeze(-1) + torch.minimum(slot.unsqueeze(0), table[1].unsqueeze(-1))
    return index, table[2], longest


def strided_view(
    keys: Tensor,
    values: Tensor,
    key_bias: Tensor,
    lengths: Sequence[int],
    stride: int,
    group: int = 1,
) -> PaddedView:
    """Every segment of flat buffers laid out at a common ``stride`` (``keys`` ``[N, D]``,
    ``values`` ``[N, Dv]``, ``key_bias`` ``[N]``; ``len(lengths)`` segments, ``offsets[s] == s *
    stride``) padded to the longest and broadcast over ``group`` query heads, as views (one
    view op per tensor: no copy, no device read-back); see :class:`PaddedView`. Slot ``i`` of
    segment ``s`` is row ``s * stride + i``."""
    longest = max(max(lengths, default=0), 1)  # <= stride: every segment has a row
    segments = len(lengths)
    d, dv = keys.shape[-1], values.shape[-1]
    bias = None
    if min(lengths) != longest:
        bias = key_bias.as_strided((segments, 1, 1, longest), (stride, 0, 0, 1))
    return PaddedView(
        keys=keys.as_strided((segments, group, longest, d), (stride * d, 0, d, 1)),
        values=values.as_strided((segments, group, longest, dv), (stride * dv, 0, dv, 1)),
        bias=bias,
        longest=longest,
    )


def gather_padded(
    buffers: tuple[Tensor, Tensor, Tensor, Tensor],
    index: Tensor,
    lengths: Tensor,
    shape: tuple[int, int, int],
) -> PaddedSegments:
    """Left-aligned padded copies of segments (see :class:`PaddedSegments`).

    Args:
        buffers: the flat ``(keys [N, D], values [N, Dv], original_positions [N],
            rotary_positions [N])`` (int64 positions).
        index, lengths: :func:`gather_index` of those segments.
        shape: ``(R, H, S)`` with ``R * H`` the segments and ``S`` the longest.
    """
    keys_buf, values_buf, original_positions, rotary_positions = buffers
    longest = shape[2]
    flat = index.reshape(-1)
    valid = (
        torch.arange(longest, device=keys_buf.device).unsqueeze(0) < lengths.unsqueeze(-1)
    ).view(shape)
    keys = keys_buf.index_select(0, flat).view(*shape, keys_buf.shape[-1])
    values = values_buf.index_select(0, flat).view(*shape, values_buf.shape[-1])
    pad = ~valid.unsqueeze(-1)
    return PaddedSegments(
        keys=keys.masked_fill(pad, 0),
        values=values.masked_fill(pad, 0),
        valid=valid,
        original_positions=original_positions[flat].view(shape).masked_fill(~valid, PAD_POSITION),
        rotary_positions=rotary_positions[flat].view(shape).masked_fill(~valid, 0),
    )
