"""The key-codec seam of the PN-Mix cache: the abstract :class:`KeyCodec` and what every codec
call passes or returns (docs/design.md, "Key codecs").

A key codec turns the storage-rounded keys of quantized groups into small unsigned codes plus
per-group scalars and back. The cache, the byte accounting and packed attention only call the
codec; none of them branches on a coding's name. Codes are returned *unpacked*
(uint8 ``[N, T, D]``, token-major); the store packs them with
:func:`kvlab.pnmix.packing.pack_codes` (docs/design.md, "Storage format").

**The seam.** Beyond :meth:`KeyCodec.encode` / :meth:`KeyCodec.decode` (the dense codes and
scalars), a codec says how its codes are packed (:meth:`KeyCodec.pack` /
:meth:`KeyCodec.unpack`), what per-group side data it stores (:meth:`KeyCodec.encode_groups`,
:meth:`KeyCodec.payload_bytes`, :meth:`KeyCodec.apply_payload`), and, for codecs with a
per-(kv head, pair) table (``table_bits > 0``), how the table is computed once per row
(:meth:`KeyCodec.compute_table`, from :class:`TableStatistics`) and stored.

Rotary pairs are described by a :class:`KeyLayout` (head_dim and the pair channel indices of
:func:`kvlab.pnmix.quantizers.rotary_pair_indices`), passed to every call, so a codec object is
plain configuration (hashable, device-free) that any head geometry can use.

This module sits below every codec family (:mod:`kvlab.pnmix.pair_codecs`,
:mod:`kvlab.pnmix.mix_codec`, :mod:`kvlab.pnmix.width_codec`) and the name registry
(:mod:`kvlab.pnmix.codecs`, which re-exports all of it), so that none of them imports another
to reach the seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix.bitalloc import pair_moment_entries, pair_moment_logit_error
from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes
from kvlab.pnmix.quantizers import minmax_dequantize, minmax_quantize, rotary_pair_indices
from kvlab.rope import rotate_by_delta

if TYPE_CHECKING:
    from kvlab.rope import RotaryConfig

__all__ = [
    "KeyCodec",
    "KeyCodes",
    "KeyLayout",
    "TableStatistics",
    "check_bits",
    "columns",
    "minmax_decode",
    "minmax_encode",
    "query_pair_moment",
]


def columns(x: Tensor, index: Tensor) -> Tensor:
    """Channels ``index`` of ``x`` (last dimension): ``x[..., index]`` as one contiguous copy."""
    return x.index_select(-1, index)


def check_bits(bits: object) -> None:
    """Raise ``ValueError`` unless ``bits`` is an int (not a bool) in ``1..8``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def minmax_encode(
    keys: Tensor, bits: int, axis: int, storage_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Asymmetric min-max codes of ``keys [N, T, D]`` reduced over ``axis`` (``-2``: per
    channel over the tokens, Cartesian; ``-1``: per token over the channels) and the scalars
    ``[scale | zero]`` (``[N, 2D]`` or ``[N, 2T]``, ``storage_dtype``; possibly non-finite:
    the caller checks). One :func:`~kvlab.pnmix.quantizers.minmax_quantize` call."""
    q = minmax_quantize(keys, bits, axis, storage_dtype)
    return q.codes, torch.cat([q.scale, q.zero], dim=-1)


def minmax_decode(codes: Tensor, scalars: Tensor, axis: int, count: int) -> Tensor:
    """Float32 ``zero + code * scale`` of :func:`minmax_encode`'s codes ``[..., T, D]`` and
    scalars ``[..., 2 * count]`` (``count`` scales, then ``count`` zero points; ``count = D``
    for ``axis=-2``, ``T`` for ``axis=-1``)."""
    return minmax_dequantize(codes, scalars[..., :count], scalars[..., count:], axis)


@dataclass(frozen=True, eq=False)
class KeyLayout:
    """Channel geometry of one key head.

    Attributes:
        head_dim: channels ``D`` of a key.
        first, second: int64 ``[P]`` channel indices of the rotary pairs (``P = rotary_dim / 2``),
            on the device the codes live on.
        rotary_layout: the pairing convention of ``first`` / ``second`` (``"half"`` or
            ``"interleaved"``, docs/design.md "Rotary pairs") as host metadata, set by
            :meth:`for_rotary`, so that a kernel's capability check needs no device read;
            ``None`` when not known (then only the index tensors say it).
    """

    head_dim: int
    first: Tensor
    second: Tensor
    rotary_layout: str | None = None

    @classmethod
    def for_rotary(
        cls,
        head_dim: int,
        rotary_dim: int,
        layout: str = "half",
        device: torch.device | str | None = None,
    ) -> KeyLayout:
        """The layout of a head with ``rotary_dim`` rotary channels in ``layout`` ("half" or
        "interleaved", docs/design.md "Rotary pairs").

        Raises:
            ValueError: ``rotary_dim`` not even, not positive or larger than ``head_dim``.
        """
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
        first, second = rotary_pair_indices(rotary_dim, layout)
        return cls(head_dim, first.to(device), second.to(device), layout)

    @property
    def num_pairs(self) -> int:
        """Rotary pairs ``P``."""
        return self.first.numel()

    def pair_channels(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The first and second channels of every rotary pair of ``x [..., D]``: ``[..., P]``
        each, as views for the ``"half"`` and ``"interleaved"`` layouts (else gathered)."""
        p = self.num_pairs
        if self.rotary_layout == "half":
            return x[..., :p], x[..., p : 2 * p]
        if self.rotary_layout == "interleaved":
            return x[..., 0 : 2 * p : 2], x[..., 1 : 2 * p : 2]
        return x[..., self.first.to(x.device)], x[..., self.second.to(x.device)]

    def to(self, device: torch.device | str) -> KeyLayout:
        """The same layout with its index tensors on ``device``."""
        return KeyLayout(
            self.head_dim, self.first.to(device), self.second.to(device), self.rotary_layout
        )


def query_pair_moment(queries: Tensor, layout: KeyLayout, count: Tensor) -> Tensor:
    """The entries of the query second moment ``E[q q^T]`` that the pair rules read
    (:func:`~kvlab.pnmix.bitalloc.pair_moment_entries`) without forming the ``D x D``
    product: float64 ``[n, 3, P]``, ``(Σ q_a², Σ q_b², Σ q_a q_b) / count`` of every rotary
    pair ``(a, b)`` over the ``K`` queries of each of ``n`` rows.

    Args:
        queries: float64 ``[n, K, D]`` (a row's queries, padding zeroed).
        layout: the head's pairs.
        count: float64 ``[n]``: the queries each mean divides by.

    Returns:
        float64 ``[n, 3, P]``: sums of exact float64 products in torch's reduction order over
        ``K`` (they agree with a BLAS ``q^T q`` to float64 rounding). No device read.
    """
    square = (queries * queries).sum(1)  # [n, D]
    qa, qb = layout.pair_channels(queries)
    cross = (qa * qb).sum(1)  # [n, P]
    first, second = layout.first.to(queries.device), layout.second.to(queries.device)
    total = torch.stack([square[:, first], square[:, second], cross], 1)
    return total / count[:, None, None]


class KeyCodes(NamedTuple):
    """Everything a codec stores for ``N`` groups: ``codes`` uint8 ``[N, T, D]`` (unpacked),
    ``scalars`` ``[N, S_k]`` (storage dtype), ``payload`` uint8 ``[N, E]`` (per-group side
    data, ``E = payload_bytes``; ``E = 0`` for most codecs)."""

    codes: Tensor
    scalars: Tensor
    payload: Tensor


@dataclass(frozen=True, eq=False)
class TableStatistics:
    """What a per-pair table rule reads (docs/design.md, "Per-pair tables"): the groups that
    ``N`` rows flush in the commit that computes their tables, and that commit's queries.

    Attributes:
        keys: storage-rounded keys ``[G, T, D]`` of every group those rows flush in the commit,
            in the codec's frame (pre-RoPE for a position-aware codec), rows in order.
        owner: int64 ``[G]``: the row (``0 .. N - 1``) of each group.
        first: int64 ``[N]``: index into ``keys`` of each row's first group (stream tokens
            ``S .. S + T - 1``).
        storage_dtype: the storage dtype.
        layout: the head's channel geometry.
        moment: float64 ``[N, D, D]``: per row, the mean of ``q q^T`` over the commit's real
            (RoPE-rotated) queries of the row's GQA group; ``None`` when the commit brought no
            queries (then rules use the identity: plain squared key errors) or when
            :attr:`pair_moment` gives it.
        positions: ``[G, T]`` RoPE positions (tokens) of the keys, for position-aware codecs
            (``None`` otherwise): a pre-RoPE error is rotated to its position before it meets
            the queries.
        rotary: the layer's RoPE (with ``positions``).
        pair_moment: float64 ``[N, 3, P]``: the moment's entries the rules read, ``(M_aa,
            M_bb, M_ab)`` of every rotary pair (:func:`query_pair_moment`;
            what a cache passes), in place of :attr:`moment`; ``None``: :attr:`moment`'s.
    """

    keys: Tensor
    owner: Tensor
    first: Tensor
    storage_dtype: torch.dtype
    layout: KeyLayout
    moment: Tensor | None = None
    positions: Tensor | None = None
    rotary: RotaryConfig | None = None
    pair_moment: Tensor | None = None

    @property
    def num_rows(self) -> int:
        """``N``."""
        return int(self.first.shape[0])

    def first_group_keys(self) -> Tensor:
        """Keys ``[N, T, D]`` of each row's first group."""
        return self.keys.index_select(0, self.first)

    def moment_entries(self) -> Tensor | None:
        """float64 ``[N, 3, P]``: :attr:`pair_moment`, else the pair entries of :attr:`moment`
        (:func:`~kvlab.pnmix.bitalloc.pair_moment_entries`), else ``None``."""
        if self.pair_moment is not None:
            return self.pair_moment.double()
        if self.moment is None:
            return None
        return pair_moment_entries(self.moment, self.layout.first, self.layout.second)

    def logit_error(self, error: Tensor, *, query_weighted: bool = True) -> Tensor:
        """Per row and rotary pair, float64 ``[N, P]``: ``Σ_groups Σ_t E_q[(q_pair ·
        e_pair)²]`` (the issue-8 criterion; :func:`kvlab.pnmix.bitalloc.pair_logit_error`)
        for coding errors ``error [G, T, D]`` (decoded minus ``keys``, in the codec's frame;
        rotated to the keys' positions first when :attr:`positions` is set). Without a moment
        (or ``query_weighted=False``) the plain squared error ``Σ e_a² + e_b²``. Reads nothing
        back from the device."""
        lay = self.layout
        e = error.double()
        moment = self.moment_entries() if query_weighted else None
        if moment is not None and self.positions is not None and self.rotary is not None:
            e = rotate_by_delta(e, self.positions.to(e.device), self.rotary)
        m = None if moment is None else moment.index_select(0, self.owner).unsqueeze(1)
        per_group = pair_moment_logit_error(e.unsqueeze(1), m, lay.first, lay.second)[:, 0]
        out = per_group.new_zeros((self.num_rows, lay.num_pairs))
        return out.index_add_(0, self.owner, per_group)


class KeyCodec:
    """A key coding (abstract). Subclasses are frozen dataclasses with at least ``bits``.

    Attributes:
        name: the coding's name (``PNMixConfig(key_coding=name)`` builds it).
        bits: code width of every coded key element (for per-pair widths, the average).
        position_aware: True when codes hold keys rotated back to position 0 (pre-RoPE); the
            cache rotates keys into that frame before :meth:`encode` and attention rotates
            decoded keys to their positions.
        table_bits: bits per (kv head, rotary pair) of the per-row table the codec needs
            (0: none; 1: a mix mask; 2: a width index).
        table_dtype: dtype of the table on the device (bool for a mask, uint8 for widths).
        min_group_tokens: the smallest group a coding can use (2 for codings that take a
            per-channel min-max over a group's tokens).
    """

    name: str = "abstract"
    bits: int
    position_aware: bool = False
    table_bits: int = 0
    table_dtype: torch.dtype = torch.bool
    min_group_tokens: int = 2

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        """Storage-dtype scalars per (sequence, kv head, group)."""
        raise NotImplementedError

    def payload_bytes(
        self, group_tokens: int, head_dim: int, storage_dtype: torch.dtype = torch.float16
    ) -> int:
        """Bytes of per-group side data per (sequence, kv head, group) (0: none).

        Raises:
            ValueError: a group the payload cannot address (see subclasses).
        """
        return 0

    @property
    def uniform_code_width(self) -> bool:
        """Whether every code has ``bits`` bits in the plain token-major bitstream (so packed
        codes unpack without the table)."""
        return True

    def code_bytes(self, group_tokens: int, head_dim: int) -> int:
        """Packed code bytes per (sequence, kv head, group): ``ceil(T * D * bits / 8)``."""
        return packed_length(group_tokens * head_dim, self.bits)

    def pack(self, codes: Tensor, layout: KeyLayout, table: Tensor | None = None) -> Tensor:
        """Pack codes ``[N, T, D]`` (uint8, in range by construction) into ``[N,
        code_bytes]``: the token-major little-endian bitstream of docs/design.md, "Storage
        format" (no device read)."""
        return pack_codes(codes.reshape(codes.shape[0], -1), self.bits, check=False)

    def unpack(
        self, packed: Tensor, group_tokens: int, layout: KeyLayout, table: Tensor | None = None
    ) -> Tensor:
        """Codes ``[..., T, D]`` (uint8) of packed groups ``[..., code_bytes]``; ``table``
        (codecs with a table) broadcasts to ``packed``'s leading dimensions plus ``[P]``."""
        d = layout.head_dim
        codes = unpack_codes(packed, self.bits, group_tokens * d)
        return codes.reshape(*codes.shape[:-1], group_tokens, d)

    def encode_groups(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> KeyCodes:
        """Everything stored for ``N`` groups (:class:`KeyCodes`): :meth:`encode`'s codes and
        scalars plus the payload (none by default)."""
        codes, scalars = self.encode(keys, storage_dtype, layout, table)
        return KeyCodes(codes, scalars, codes.new_zeros((codes.shape[0], 0)))

    def apply_payload(self, keys: Tensor, payload: Tensor, storage_dtype: torch.dtype) -> Tensor:
        """Decoded keys ``[..., T, D]`` (float32, from :meth:`decode`) with the payload
        ``[..., E]`` applied (e.g. exact sparse entries written back); identity by default."""
        return keys

    def compute_table(self, stats: TableStatistics) -> Tensor:
        """The per-pair tables ``[N, P]`` (:attr:`table_dtype`) of ``stats.num_rows`` rows,
        computed once per row (docs/design.md, "Per-pair tables"); no device read.

        Raises:
            NotImplementedError: codecs without a table.
        """
        raise NotImplementedError(f"{self} keeps no per-pair table")

    def table_entries(self, table: Tensor) -> Tensor:
        """Stored entries (uint8 ``< 2 ** table_bits``) of a table ``[..., P]``."""
        return table.to(torch.uint8)

    def table_from_entries(self, entries: Tensor) -> Tensor:
        """The table (:attr:`table_dtype`) of stored entries ``[..., P]``."""
        return entries.to(self.table_dtype)

    def check_table(self, table: Tensor, layout: KeyLayout) -> None:
        """Raise ``ValueError`` unless ``table [..., P]`` is a valid table of this codec
        (reads it on the host: for tables set by a caller)."""
        if self.table_bits == 0:
            raise ValueError(f"{self} keeps no per-pair table")
        if table.shape[-1] != layout.num_pairs:
            raise ValueError(f"a table has {layout.num_pairs} entries per row, got {table.shape}")

    def without_positions(self) -> KeyCodec:
        """The same coding in the keys' own frame (for layers whose keys carry no RoPE: there
        the two frames coincide)."""
        return self

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Code ``N`` groups (the dense part: codes and scalars; see :meth:`encode_groups`).

        Args:
            keys: storage-rounded keys ``[N, T, D]`` (any floating dtype holding storage-dtype
                values), in the codec's frame.
            storage_dtype: dtype of the stored scalars.
            layout: the head's channel geometry.
            table: ``[N, P]`` per-pair table of each group's row (codecs with a table only:
                a mix's bool mask, True = second codec; per-pair widths).

        Returns:
            ``(codes, scalars)``: uint8 ``[N, T, D]`` codes in ``0 .. 2**bits - 1`` (per
            channel: ``2**width - 1``) and ``[N, scalar_count(T, D)]`` scalars in
            ``storage_dtype``. A scalar may be non-finite when a value exceeds the storage
            range; the caller checks.
        """
        raise NotImplementedError

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        """Float32 keys ``[N, T, D]`` (the codec's frame, payload not applied) from ``codes``
        (uint8 or float32 holding the integer codes, ``[N, T, D]``) and ``scalars`` ``[N,
        S]``. ``table`` as in :meth:`encode`; ``active_pairs`` (mix codecs): int64 ``[U]``
        pairs whose mask bit may be set in any of the ``N`` groups (a superset is fine;
        ``None`` = all), so that the second codec is decoded on those pairs only. Every
        element is computed by the same float32 operations whatever ``N``, block or
        ``active_pairs`` (docs/design.md, "Attention")."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name
