"""Per-pair bit widths and exact sparse outliers: the key codec of the recommended ``pn-mix``
(issue 8; docs/design.md, "Key codecs" and "Per-pair tables").

:class:`BitAllocCodec` codes every key channel by asymmetric min-max over the group's tokens
(KIVI keys), in the pre-RoPE frame by default (KVQuant, Hooper et al. 2024, arXiv:2401.18079,
§3.2), with a code width per (sequence, kv head, rotary pair) taken from ``widths`` (default
0, 2, 3 or 4 bits): each row's widths average exactly ``bits`` over its pairs, so every row
stores the same code bytes. The widths are the row's per-pair table, computed once
(:meth:`BitAllocCodec.compute_table`) by greedy reverse water-filling
(:func:`kvlab.pnmix.bitalloc.greedy_pair_bits`) of the expected squared logit error over the
queries of the commit that computes it (:meth:`kvlab.pnmix.key_codec.TableStatistics.logit_error`)
and stored as a packed width index. A 0-bit channel stores no codes; its zero point holds the
mean of the channel's group tokens that are not outliers (its scale slot holds 0). Channels
beyond ``rotary_dim`` always get ``bits``.

Optionally a fixed count of the group's elements per (sequence, kv head) — those farthest from
their channel's median (KVQuant §3.3, :func:`kvlab.pnmix.outliers.select_outliers`) — is kept
exact in a per-group payload (storage-dtype values, then int16 flat indices ``t * D + d``),
left out of their channel's min and max, and written back exactly after decoding.

**Code layout** (docs/design.md, "Storage format"): a group's codes form one little-endian
bitstream; token ``t`` occupies bits ``[t * S, (t + 1) * S)`` with ``S = bits * D`` (the same
for every token and row); inside a token the channels come in a fixed per-row order — widths
descending, then channel index ascending — each code least significant bit first; 0-bit
channels take no bits. With every width equal to ``bits`` this is exactly the fixed-width
layout of :func:`kvlab.pnmix.packing.pack_codes`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvlab.pnmix.bitalloc import greedy_pair_bits
from kvlab.pnmix.key_codec import KeyCodec, KeyCodes, KeyLayout, TableStatistics, minmax_decode
from kvlab.pnmix.outliers import minmax_excluding, outlier_count, select_outliers
from kvlab.pnmix.packing import packed_length

__all__ = ["BitAllocCodec", "channel_bit_offsets"]

_INDEX_BYTES = 2  # int16 outlier indices
_MAX_GROUP_ELEMENTS = 1 << 15


@dataclass(frozen=True)
class _SharedCoding:
    """The table-independent part of encoding one set of groups (:meth:`BitAllocCodec._shared`):
    flat outlier indices ``[N, K]`` and mask ``[N, T, D]`` (``None`` without outliers), and
    each nonzero width's :class:`~kvlab.pnmix.quantizers.MinMaxCodes`."""

    index: Tensor | None
    exclude: Tensor | None
    minmax: dict[int, Any]


def channel_bit_offsets(widths: Tensor) -> Tensor:
    """Bit offset of every channel inside a token of the width layout (module docstring).

    Args:
        widths: int ``[..., D]`` channel widths (bits).

    Returns:
        int64 ``[..., D]``: channel ``d`` starts at the sum of the widths of the channels that
        precede it — those of larger width, and those of equal width and smaller index.
    """
    w = widths.long()
    d = w.shape[-1]
    # sort key: width descending, then channel ascending (exact in int64)
    key = (64 - w) * d + torch.arange(d, device=w.device)
    order = torch.argsort(key, dim=-1)
    sorted_w = torch.gather(w, -1, order)
    starts = torch.cumsum(sorted_w, dim=-1) - sorted_w
    return torch.empty_like(w).scatter_(-1, order, starts)


@dataclass(frozen=True)
class BitAllocCodec(KeyCodec):
    """Per-channel min-max keys with a width per (kv head, rotary pair) (module docstring).

    Attributes:
        bits: the average code width (bits per key element); channels beyond ``rotary_dim``
            always use it.
        widths: allowed pair widths, strictly increasing ints in ``0..8`` with
            ``widths[0] <= bits <= widths[-1]``; one width (``(bits,)``) = no table (plain
            per-channel min-max, e.g. Cartesian with outliers).
        outlier_fraction: fraction of each group's ``T * D`` key elements kept exact, in
            ``[0, 1)`` (``round(fraction * T * D)`` per group and row).
        prerope: code keys rotated back to position 0 (:attr:`position_aware`).
        query_aware: choose widths by the expected squared logit error over the commit's
            queries (False: by the plain squared key error).

    Raises:
        ValueError: any attribute out of its domain.
    """

    bits: int = 2
    widths: tuple[int, ...] = (0, 2, 3, 4)
    outlier_fraction: float = 0.0
    prerope: bool = True
    query_aware: bool = True

    name = "bit_alloc"
    table_dtype = torch.uint8

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an int in 1..8, got {self.bits!r}")
        w = tuple(self.widths)
        if (
            not w
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= 8 for x in w)
            or any(b <= a for a, b in itertools.pairwise(w))
        ):
            raise ValueError(
                f"widths must be strictly increasing ints in 0..8, got {self.widths!r}"
            )
        if not w[0] <= self.bits <= w[-1]:
            raise ValueError(f"bits={self.bits} lies outside the widths {w[0]}..{w[-1]}")
        object.__setattr__(self, "widths", w)
        fraction = self.outlier_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"outlier_fraction must be a number, got {fraction!r}")
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"outlier_fraction must lie in [0, 1), got {fraction!r}")
        for flag in ("prerope", "query_aware"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")

    # ------------------------------------------------------------------ description
    @property
    def position_aware(self) -> bool:  # type: ignore[override]
        return self.prerope

    @property
    def table_bits(self) -> int:  # type: ignore[override]
        """Bits of a stored width index: ``ceil(log2(len(widths)))`` (0 for one width)."""
        return (len(self.widths) - 1).bit_length()

    @property
    def uniform_code_width(self) -> bool:  # type: ignore[override]
        return self.table_bits == 0

    def without_positions(self) -> BitAllocCodec:
        return dataclasses.replace(self, prerope=False)

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * head_dim

    def outlier_count(self, group_tokens: int, head_dim: int) -> int:
        """Outliers per group and row: ``round(outlier_fraction * T * D)``."""
        return outlier_count(float(self.outlier_fraction), group_tokens, head_dim)

    def payload_bytes(
        self, group_tokens: int, head_dim: int, storage_dtype: torch.dtype = torch.float16
    ) -> int:
        """``K * (element size + 2)`` bytes: ``K`` storage-dtype values and ``K`` int16
        indices per group and row.

        Raises:
            ValueError: outliers in a group of more than ``2**15`` elements (int16 indices)
                or a count of at least ``T * D``.
        """
        k = self.outlier_count(group_tokens, head_dim)
        if k == 0:
            return 0
        if group_tokens * head_dim > _MAX_GROUP_ELEMENTS:
            raise ValueError(
                f"a group of {group_tokens * head_dim} key elements exceeds the int16 outlier "
                f"indices ({_MAX_GROUP_ELEMENTS})"
            )
        if k >= group_tokens * head_dim:
            raise ValueError(f"{k} outliers leave no element of a {group_tokens}-token group")
        return k * (torch.finfo(storage_dtype).bits // 8 + _INDEX_BYTES)

    def code_bytes(self, group_tokens: int, head_dim: int) -> int:
        return packed_length(group_tokens * head_dim, self.bits)

    def __str__(self) -> str:
        parts = [("prerope_" if self.prerope else "") + self.name]
        if self.widths != (0, 2, 3, 4):
            parts.append("widths=" + "/".join(map(str, self.widths)))
        if self.outlier_fraction:
            parts.append(f"outliers={self.outlier_fraction:g}")
        if not self.query_aware:
            parts.append("key-error")
        return parts[0] + ("(" + ", ".join(parts[1:]) + ")" if len(parts) > 1 else "")

    # ------------------------------------------------------------------ tables
    def channel_widths(self, table: Tensor | None, layout: KeyLayout) -> Tensor:
        """int64 ``[..., D]`` widths of every channel from a width table ``[..., P]`` (``None``
        for a one-width codec: every channel ``bits``)."""
        d = layout.head_dim
        if table is None:
            return torch.full((d,), self.bits, dtype=torch.int64, device=layout.first.device)
        out = torch.full((*table.shape[:-1], d), self.bits, dtype=torch.int64, device=table.device)
        w = table.long()
        return out.index_copy_(-1, layout.first, w).index_copy_(-1, layout.second, w)

    def table_entries(self, table: Tensor) -> Tensor:
        lv = torch.tensor(self.widths, dtype=torch.int64, device=table.device)
        return torch.searchsorted(lv, table.long()).to(torch.uint8)

    def table_from_entries(self, entries: Tensor) -> Tensor:
        lv = torch.tensor(self.widths, dtype=torch.uint8, device=entries.device)
        return lv[entries.long()]

    def check_table(self, table: Tensor, layout: KeyLayout) -> None:
        super().check_table(table, layout)
        if table.is_floating_point() or table.dtype == torch.bool:
            raise ValueError(f"a width table holds integers, got {table.dtype}")
        allowed = torch.tensor(self.widths, device=table.device)
        if not bool(torch.isin(table.long(), allowed).all()):
            raise ValueError(f"table widths must be in {self.widths}")
        used = 2 * table.long().sum(-1) + (layout.head_dim - 2 * layout.num_pairs) * self.bits
        if bool((used > self.bits * layout.head_dim).any()):
            raise ValueError(
                f"a row's widths exceed its budget of {self.bits} bits per key element "
                f"({self.bits * layout.head_dim} bits per token)"
            )

    def compute_table(self, stats: TableStatistics) -> Tensor:
        """Widths ``[N, P]`` (uint8): per row, :func:`~kvlab.pnmix.bitalloc.greedy_pair_bits`
        of the distortion of each width on every group the row flushes in the commit
        (query-weighted logit error, or the plain key error), with a budget of ``bits * P``
        bits per row (each row's own kv head): :meth:`table_from_distortion` of
        :meth:`table_distortion`."""
        return self.table_from_distortion(self.table_distortion(stats))

    def table_distortion(self, stats: TableStatistics) -> Tensor:
        """float64 ``[W, N, P]``: per candidate width ``widths[w]`` (a table of it for every
        pair), row and rotary pair, the error of coding the row's groups at that width
        (:meth:`~kvlab.pnmix.key_codec.TableStatistics.logit_error`: query-weighted logit
        error, or the plain key error), outliers written back. No device read. The compiled
        CPU statistics (:func:`kvlab.pnmix.kernels.cpu_tables.table_distortion_cpu`) give the
        same bits.

        Raises:
            NotImplementedError: a one-width codec (no table).
        """
        if self.table_bits == 0:
            raise NotImplementedError(f"{self} keeps no per-pair table")
        keys, lay, dt = stats.keys, stats.layout, stats.storage_dtype
        g = keys.shape[0]
        dist = []
        # the outliers and each width's min-max codes do not depend on the table: once for
        # every candidate (the same tensors encode_groups computes for each)
        shared = self._shared(keys, dt)
        for w in self.widths:
            table = torch.full((g, lay.num_pairs), w, dtype=torch.uint8, device=keys.device)
            coded = self.encode_groups(keys, dt, lay, table, shared=shared)
            decoded = self.decode(coded.codes, coded.scalars, lay, table)
            decoded = self.apply_payload(decoded, coded.payload, dt)
            error = decoded.double() - keys.double()
            dist.append(stats.logit_error(error, query_weighted=self.query_aware))
        return torch.stack(dist)

    def table_from_distortion(self, distortion: Tensor) -> Tensor:
        """Widths ``[N, P]`` (uint8) from :meth:`table_distortion`'s ``[W, N, P]``: per row,
        :func:`~kvlab.pnmix.bitalloc.greedy_pair_bits` with a budget of ``bits * P`` bits."""
        return greedy_pair_bits(distortion.unsqueeze(2), self.widths, self.bits)[:, 0].to(
            torch.uint8
        )

    # ------------------------------------------------------------------ coding
    def _outliers(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Flat outlier indices ``[N, K]`` and the bool mask ``[N, T, D]`` (``None`` if K=0)."""
        t, d = x.shape[-2:]
        k = self.outlier_count(t, d)
        if k == 0:
            return None, None
        index = select_outliers(x, k)
        mask = torch.zeros_like(x, dtype=torch.bool).flatten(-2).scatter_(-1, index, True)
        return index, mask.view_as(x)

    def _shared(self, x: Tensor, storage_dtype: torch.dtype) -> _SharedCoding:
        """What encoding ``x [N, T, D]`` computes whatever the width table: the outliers and
        each nonzero width's min-max codes of every channel."""
        index, exclude = self._outliers(x)
        x64 = x.double()
        no = torch.zeros_like(x64, dtype=torch.bool) if exclude is None else exclude
        minmax = {
            b: minmax_excluding(x64, no, b, storage_dtype)
            for b in sorted(set(self.widths) | {self.bits})
            if b != 0
        }
        return _SharedCoding(index, exclude, minmax)

    def _dense(
        self,
        x: Tensor,
        exclude: Tensor | None,
        widths: Tensor,
        storage_dtype: torch.dtype,
        minmax: dict[int, Any] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Codes, scale, zero of ``x [N, T, D]`` with channel ``widths [N|1, D]``
        (``minmax``: each width's codes of ``x``, :meth:`_shared`, else computed here)."""
        x64 = x.double()
        no = torch.zeros_like(x64, dtype=torch.bool) if exclude is None else exclude
        codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        scale = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=storage_dtype, device=x.device)
        # a 0-bit channel: the mean of its group tokens that are not outliers (float64; the
        # constant closest to them in squared error), scale 0, codes 0
        kept = (~no).double()
        count = kept.sum(dim=-2)
        mean = (x64 * kept).sum(dim=-2) / count.clamp(min=1.0)
        zero = torch.where(count > 0, mean, torch.zeros_like(mean)).to(storage_dtype)
        for b in sorted(set(self.widths) | {self.bits}):
            if b == 0:
                continue
            sel = widths == b
            q = minmax[b] if minmax is not None else minmax_excluding(x64, no, b, storage_dtype)
            codes = torch.where(sel.unsqueeze(-2), q.codes, codes)
            scale = torch.where(sel, q.scale, scale)
            zero = torch.where(sel, q.zero, zero)
        return codes, scale, zero

    def encode_groups(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
        *,
        shared: _SharedCoding | None = None,
    ) -> KeyCodes:
        """Codes ``[N, T, D]``, scalars ``[N, 2D]`` (``[scale | zero]``) and the payload
        ``[N, K * (es + 2)]`` (outlier values, then int16 indices, little-endian bytes) of
        ``N`` groups with width tables ``table [N, P]`` (``shared``: :meth:`_shared` of
        ``keys``, reused across tables; the same codes). No device read."""
        if self.table_bits and table is None:
            raise ValueError("BitAllocCodec.encode needs the per-pair width table [N, P]")
        widths = self.channel_widths(table if self.table_bits else None, layout)
        if shared is None:
            index, exclude = self._outliers(keys)
            codes, scale, zero = self._dense(keys, exclude, widths, storage_dtype)
        else:
            index, exclude = shared.index, shared.exclude
            codes, scale, zero = self._dense(
                keys, exclude, widths, storage_dtype, minmax=shared.minmax
            )
        scalars = torch.cat([scale, zero], dim=-1)
        n = keys.shape[0]
        if index is None:
            return KeyCodes(codes, scalars, codes.new_zeros((n, 0)))
        values = torch.gather(keys.to(storage_dtype).flatten(-2), -1, index)
        payload = torch.cat(
            [values.view(torch.uint8), index.to(torch.int16).view(torch.uint8)], dim=-1
        )
        return KeyCodes(codes, scalars, payload)

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The dense part of :meth:`encode_groups` (outliers excluded from the ranges)."""
        coded = self.encode_groups(keys, storage_dtype, layout, table)
        return coded.codes, coded.scalars

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        """``zero + code * scale`` per channel, float32 (a 0-bit channel: its zero point, the
        group mean); the widths are implied by the codes and scalars."""
        return minmax_decode(codes, scalars, -2, layout.head_dim)

    def apply_payload(self, keys: Tensor, payload: Tensor, storage_dtype: torch.dtype) -> Tensor:
        """``keys [..., T, D]`` with the payload's exact outliers written back (their
        storage-dtype values, exactly)."""
        if payload.shape[-1] == 0:
            return keys
        es = torch.finfo(storage_dtype).bits // 8
        k = payload.shape[-1] // (es + _INDEX_BYTES)
        values = payload[..., : k * es].contiguous().view(storage_dtype)
        index = payload[..., k * es :].contiguous().view(torch.int16).long()
        flat = keys.flatten(-2).clone()
        flat.scatter_(-1, index, values.float())
        return flat.view_as(keys)

    # ------------------------------------------------------------------ packing
    def _layout_index(self, table: Tensor | None, layout: KeyLayout) -> tuple[Tensor, Tensor]:
        """Per channel and code bit ``k < max width``: the bit position inside a token
        (int64 ``[..., D * W]``, clamped into the token) and the bit's weight ``2**k`` where
        ``k < width`` (else 0) (float32, same shape)."""
        widths = self.channel_widths(table if self.table_bits else None, layout)
        offsets = channel_bit_offsets(widths)
        top = max(max(self.widths), self.bits)
        k = torch.arange(top, device=widths.device)
        pos = offsets.unsqueeze(-1) + k
        valid = k < widths.unsqueeze(-1)
        stride = self.bits * layout.head_dim
        pos = torch.where(valid, pos, torch.zeros_like(pos)).clamp(max=stride - 1)
        weight = torch.where(valid, torch.ones_like(pos) << k, torch.zeros_like(pos))
        return pos.flatten(-2), weight.flatten(-2)

    def pack(self, codes: Tensor, layout: KeyLayout, table: Tensor | None = None) -> Tensor:
        """Pack codes ``[N, T, D]`` with width tables ``table [N, P]`` (module docstring's
        layout) into ``[N, code_bytes]``. No device read."""
        n, t, d = codes.shape
        stride = self.bits * d
        pos, weight = self._layout_index(table, layout)  # [N|..., D * W]
        top = weight.shape[-1] // d
        k = torch.arange(top, device=codes.device)
        bits = (codes.long().unsqueeze(-1) >> k) & 1  # [N, T, D, W]
        bits = bits * (weight.reshape(*weight.shape[:-1], 1, d, top) > 0)
        stream = torch.zeros((n, t, stride), dtype=torch.int64, device=codes.device)
        index = pos.reshape(*pos.shape[:-1], 1, d * top).expand(n, t, d * top)
        stream.scatter_add_(-1, index, bits.reshape(n, t, d * top))
        nbytes = self.code_bytes(t, d)
        flat = stream.reshape(n, t * stride)
        pad = nbytes * 8 - t * stride
        if pad:
            flat = torch.cat([flat, flat.new_zeros((n, pad))], dim=-1)
        shifts = torch.arange(8, device=codes.device)
        return (flat.reshape(n, nbytes, 8) << shifts).sum(-1).to(torch.uint8)

    def unpack(
        self, packed: Tensor, group_tokens: int, layout: KeyLayout, table: Tensor | None = None
    ) -> Tensor:
        """Float32 codes ``[..., T, D]`` of packed groups ``[..., code_bytes]``; ``table``
        ``[..., P]`` broadcasts to ``packed``'s leading dimensions. No device read."""
        return self.unpack_float(packed, group_tokens, layout, table).to(torch.uint8)

    def unpack_float(
        self, packed: Tensor, group_tokens: int, layout: KeyLayout, table: Tensor | None = None
    ) -> Tensor:
        """:meth:`unpack` as float32 (what attention multiplies)."""
        d, t = layout.head_dim, group_tokens
        stride = self.bits * d
        lead = packed.shape[:-1]
        shifts = torch.arange(8, device=packed.device)
        stream = ((packed.long().unsqueeze(-1) >> shifts) & 1).reshape(*lead, 8 * packed.shape[-1])
        tokens = stream[..., : t * stride].reshape(*lead, t, stride).float()
        pos, weight = self._layout_index(table, layout)  # [L'..., D * W]
        pos = pos.unsqueeze(-2).expand(*lead, t, pos.shape[-1])
        gathered = torch.gather(tokens, -1, pos)  # [..., T, D * W]
        top = weight.shape[-1] // d
        weighted = gathered * weight.float().unsqueeze(-2)
        return weighted.reshape(*lead, t, d, top).sum(-1)
