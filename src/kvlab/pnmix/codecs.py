"""Key codecs of the PN-Mix cache: one class per key coding (docs/design.md, "Key codecs").

A key codec turns the storage-rounded keys of quantized groups into small unsigned codes plus
per-group scalars and back. The cache, the byte accounting and packed attention only call the
codec; none of them branches on a coding's name. Codes are returned *unpacked*
(uint8 ``[N, T, D]``, token-major); the store packs them with
:func:`kvlab.pnmix.packing.pack_codes` (docs/design.md, "Storage format").

Codecs provided:

* :class:`CartesianCodec` — per channel min-max over the group's tokens (KIVI keys, Liu et al.
  2024). Scalars ``[scale(D) | zero(D)]``.
* :class:`PhaseNormCodec` — every rotary pair in Phase–Norm (polar) coding, the remaining
  channels Cartesian; pair-slot convention of :mod:`kvlab.pnmix.quantizers`. Scalars
  ``[scale(D) | zero(D)]`` in that convention.
* :class:`PerTokenCodec` — per token over the head's channels (like values). Scalars
  ``[scale(T) | zero(T)]``.
* :class:`MixCodec` — per (sequence, kv head, rotary pair) the coding of one of two *pair
  codecs*, chosen once by a pluggable saliency rule (default
  :func:`first_group_error_saliency`, today's rule) or, with ``query_aware=True``, by the
  expected squared logit error over the commit's queries (:func:`query_logit_saliency`), and
  held by the cache as a 1-bit mask.
* :class:`~kvlab.pnmix.width_codec.BitAllocCodec` (own module) — per-channel min-max with a
  code width per (kv head, rotary pair) and optional exact sparse outliers.

**Frames.** A pair codec with ``prerope=True`` (and a mix of two such codecs) is
*position-aware*: the cache rotates each key back to position 0 before coding it (KVQuant,
Hooper et al. 2024, arXiv:2401.18079) and attention rotates the decoded key to its position
(docs/design.md, "Key codecs"). The codec itself never sees a position: it codes whatever
frame the cache hands it.

**The seam.** Beyond :meth:`KeyCodec.encode` / :meth:`KeyCodec.decode` (the dense codes and
scalars), a codec says how its codes are packed (:meth:`KeyCodec.pack` /
:meth:`KeyCodec.unpack`), what per-group side data it stores (:meth:`KeyCodec.encode_groups`,
:meth:`KeyCodec.payload_bytes`, :meth:`KeyCodec.apply_payload`), and, for codecs with a
per-(kv head, pair) table (``table_bits > 0``), how the table is computed once per row
(:meth:`KeyCodec.compute_table`, from :class:`TableStatistics`) and stored.

A **pair codec** (:class:`PairCodec`) codes every rotary pair as two channel slots
(``first[p]``, ``second[p]``) with two codes per token and four scalars per group, and every
non-rotary channel Cartesian, so that any two pair codecs can be mixed slot by slot.

Rotary pairs are described by a :class:`KeyLayout` (head_dim and the pair channel indices of
:func:`kvlab.pnmix.quantizers.rotary_pair_indices`), passed to every call, so a codec object is
plain configuration (hashable, device-free) that any head geometry can use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix.bitalloc import pair_logit_error_unchecked
from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes
from kvlab.pnmix.quantizers import (
    minmax_dequantize,
    minmax_quantize,
    phase_norm_dequantize,
    phase_norm_quantize,
    rotary_pair_indices,
)
from kvlab.rope import rotate_by_delta

if TYPE_CHECKING:
    from kvlab.rope import RotaryConfig

__all__ = [
    "KEY_CODING_NAMES",
    "CartesianCodec",
    "KeyCodec",
    "KeyCodes",
    "KeyLayout",
    "MixCodec",
    "PairCodec",
    "PairCodes",
    "PerTokenCodec",
    "PhaseNormCodec",
    "SaliencyRule",
    "TableStatistics",
    "first_group_error_saliency",
    "key_codec_from_name",
    "query_logit_saliency",
]


def _cols(x: Tensor, index: Tensor) -> Tensor:
    """Channels ``index`` of ``x`` (last dimension): ``x[..., index]`` as one contiguous copy."""
    return x.index_select(-1, index)


def _check_bits(bits: object) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


@dataclass(frozen=True, eq=False)
class KeyLayout:
    """Channel geometry of one key head.

    Attributes:
        head_dim: channels ``D`` of a key.
        first, second: int64 ``[P]`` channel indices of the rotary pairs (``P = rotary_dim / 2``),
            on the device the codes live on.
    """

    head_dim: int
    first: Tensor
    second: Tensor

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
        return cls(head_dim, first.to(device), second.to(device))

    @property
    def num_pairs(self) -> int:
        """Rotary pairs ``P``."""
        return self.first.numel()

    def to(self, device: torch.device | str) -> KeyLayout:
        """The same layout with its index tensors on ``device``."""
        return KeyLayout(self.head_dim, self.first.to(device), self.second.to(device))


class PairCodes(NamedTuple):
    """Codes and scalars of the rotary pairs of ``N`` groups: ``code_a``/``code_b`` uint8
    ``[N, T, U]`` (first/second slot of each pair), ``scale_a``, ``zero_a``, ``scale_b``,
    ``zero_b`` ``[N, U]`` in the storage dtype (possibly non-finite: the caller checks)."""

    code_a: Tensor
    code_b: Tensor
    scale_a: Tensor
    zero_a: Tensor
    scale_b: Tensor
    zero_b: Tensor


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
            queries (then rules use the identity: plain squared key errors).
        positions: ``[G, T]`` RoPE positions (tokens) of the keys, for position-aware codecs
            (``None`` otherwise): a pre-RoPE error is rotated to its position before it meets
            the queries.
        rotary: the layer's RoPE (with ``positions``).
    """

    keys: Tensor
    owner: Tensor
    first: Tensor
    storage_dtype: torch.dtype
    layout: KeyLayout
    moment: Tensor | None = None
    positions: Tensor | None = None
    rotary: RotaryConfig | None = None

    @property
    def num_rows(self) -> int:
        """``N``."""
        return int(self.first.shape[0])

    def first_group_keys(self) -> Tensor:
        """Keys ``[N, T, D]`` of each row's first group."""
        return self.keys.index_select(0, self.first)

    def logit_error(self, error: Tensor, *, query_weighted: bool = True) -> Tensor:
        """Per row and rotary pair, float64 ``[N, P]``: ``Σ_groups Σ_t E_q[(q_pair ·
        e_pair)²]`` (the issue-8 criterion; :func:`kvlab.pnmix.bitalloc.pair_logit_error`)
        for coding errors ``error [G, T, D]`` (decoded minus ``keys``, in the codec's frame;
        rotated to the keys' positions first when :attr:`positions` is set). Without a moment
        (or ``query_weighted=False``) the plain squared error ``Σ e_a² + e_b²``. Reads nothing
        back from the device."""
        lay = self.layout
        e = error.double()
        moment = self.moment if query_weighted else None
        if moment is not None and self.positions is not None and self.rotary is not None:
            e = rotate_by_delta(e, self.positions.to(e.device), self.rotary)
        m = None if moment is None else moment.index_select(0, self.owner).unsqueeze(1)
        per_group = pair_logit_error_unchecked(e.unsqueeze(1), m, lay.first, lay.second)[:, 0]
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


@dataclass(frozen=True)
class PairCodec(KeyCodec):
    """A channel-wise key codec whose rotary pairs use two slots and four scalars each.

    Scalars are ``[scale(D) | zero(D)]`` in the pair-slot convention of
    :mod:`kvlab.pnmix.quantizers`; non-rotary channels are Cartesian (per-channel min-max).
    Subclasses define how a pair is coded: :meth:`encode_pairs` / :meth:`decode_pairs`.

    Attributes:
        bits: code width.
        prerope: code keys rotated back to position 0 (pre-RoPE; :attr:`position_aware`).
    """

    bits: int = 2
    prerope: bool = False

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if not isinstance(self.prerope, bool):
            raise ValueError(f"prerope must be a bool, got {self.prerope!r}")

    @property
    def position_aware(self) -> bool:  # type: ignore[override]
        return self.prerope

    def without_positions(self) -> PairCodec:
        return dataclasses.replace(self, prerope=False)

    def __str__(self) -> str:
        return ("prerope_" if self.prerope else "") + self.name

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * head_dim

    def encode_pairs(self, a: Tensor, b: Tensor, storage_dtype: torch.dtype) -> PairCodes:
        """Code pairs ``(a, b)`` (``[N, T, U]`` each, storage-rounded) over the tokens."""
        raise NotImplementedError

    def decode_pairs(
        self,
        code_a: Tensor,
        code_b: Tensor,
        scale_a: Tensor,
        zero_a: Tensor,
        scale_b: Tensor,
        zero_b: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Float32 ``(a_hat, b_hat)`` ``[N, T, U]`` from pair codes (see :class:`PairCodes`)."""
        raise NotImplementedError

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        cart = minmax_quantize(keys, self.bits, -2, storage_dtype)
        codes, scale, zero = cart.codes, cart.scale, cart.zero
        if layout.num_pairs:
            f, s = layout.first, layout.second
            pc = self.encode_pairs(_cols(keys, f), _cols(keys, s), storage_dtype)
            codes.index_copy_(-1, f, pc.code_a).index_copy_(-1, s, pc.code_b)
            scale.index_copy_(-1, f, pc.scale_a).index_copy_(-1, s, pc.scale_b)
            zero.index_copy_(-1, f, pc.zero_a).index_copy_(-1, s, pc.zero_b)
        return codes, torch.cat([scale, zero], dim=-1)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        d = layout.head_dim
        scale, zero = scalars[..., :d], scalars[..., d:]
        out = minmax_dequantize(codes, scale, zero, -2)
        if layout.num_pairs:
            f, s = layout.first, layout.second
            a_hat, b_hat = self.decode_pairs(
                _cols(codes, f),
                _cols(codes, s),
                _cols(scale, f),
                _cols(zero, f),
                _cols(scale, s),
                _cols(zero, s),
            )
            out.index_copy_(-1, f, a_hat).index_copy_(-1, s, b_hat)
        return out


@dataclass(frozen=True)
class CartesianCodec(PairCodec):
    """Per-channel asymmetric min-max over the group's tokens (KIVI keys, Liu et al. 2024)."""

    name = "cartesian"

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        q = minmax_quantize(keys, self.bits, -2, storage_dtype)
        return q.codes, torch.cat([q.scale, q.zero], dim=-1)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        d = layout.head_dim
        return minmax_dequantize(codes, scalars[..., :d], scalars[..., d:], -2)

    def encode_pairs(self, a: Tensor, b: Tensor, storage_dtype: torch.dtype) -> PairCodes:
        qa = minmax_quantize(a, self.bits, -2, storage_dtype)
        qb = minmax_quantize(b, self.bits, -2, storage_dtype)
        return PairCodes(qa.codes, qb.codes, qa.scale, qa.zero, qb.scale, qb.zero)

    def decode_pairs(
        self,
        code_a: Tensor,
        code_b: Tensor,
        scale_a: Tensor,
        zero_a: Tensor,
        scale_b: Tensor,
        zero_b: Tensor,
    ) -> tuple[Tensor, Tensor]:
        return (
            minmax_dequantize(code_a, scale_a, zero_a, -2),
            minmax_dequantize(code_b, scale_b, zero_b, -2),
        )


@dataclass(frozen=True)
class PhaseNormCodec(PairCodec):
    """Phase–Norm on every rotary pair: min-max norm in the first slot, the phase over the
    group's shortest covering arc in the second (docs/design.md, "Key codecs")."""

    name = "phase_norm"

    def encode_pairs(self, a: Tensor, b: Tensor, storage_dtype: torch.dtype) -> PairCodes:
        pn = phase_norm_quantize(a, b, self.bits, -2, storage_dtype)
        return PairCodes(
            pn.norm_codes,
            pn.phase_codes,
            pn.norm_scale,
            pn.norm_zero,
            pn.phase_span,
            pn.phase_offset,
        )

    def decode_pairs(
        self,
        code_a: Tensor,
        code_b: Tensor,
        scale_a: Tensor,
        zero_a: Tensor,
        scale_b: Tensor,
        zero_b: Tensor,
    ) -> tuple[Tensor, Tensor]:
        return phase_norm_dequantize(
            code_a, code_b, scale_a, zero_a, scale_b, zero_b, self.bits, -2
        )


@dataclass(frozen=True)
class PerTokenCodec(KeyCodec):
    """Keys per token over the head's channels (asymmetric min-max, like values)."""

    name = "per_token"
    min_group_tokens = 1
    bits: int = 2

    def __post_init__(self) -> None:
        _check_bits(self.bits)

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * group_tokens

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        q = minmax_quantize(keys, self.bits, -1, storage_dtype)
        return q.codes, torch.cat([q.scale, q.zero], dim=-1)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        t = codes.shape[-2]
        return minmax_dequantize(codes, scalars[..., :t], scalars[..., t:], -1)


SaliencyRule = Callable[["MixCodec", Tensor, torch.dtype, KeyLayout], Tensor]
"""``rule(codec, keys [N, T, D], storage_dtype, layout) -> bool [N, P]`` (True = the mix's
second codec): the mix mask of ``N`` (sequence, kv head) rows from the storage-rounded keys of
each row's first quantized group."""


def _pair_errors(codec: PairCodec, a: Tensor, b: Tensor, storage_dtype: torch.dtype) -> Tensor:
    """Float64 ``[N, U]`` sum over tokens and both slots of the squared reconstruction error of
    ``codec`` on pairs ``(a, b)``; ``+inf`` where a scalar would not be finite in storage."""
    pc = codec.encode_pairs(a, b, storage_dtype)
    a_hat, b_hat = codec.decode_pairs(*pc)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    err = ((a_hat.double() - a64) ** 2 + (b_hat.double() - b64) ** 2).sum(dim=-2)
    finite = torch.stack([torch.isfinite(t) for t in pc[2:]]).all(0)
    return torch.where(finite, err, torch.full_like(err, math.inf))


def first_group_error_saliency(
    codec: MixCodec, keys: Tensor, storage_dtype: torch.dtype, layout: KeyLayout
) -> Tensor:
    """Today's saliency rule (docs/design.md, "The mix mask"): per pair, the second codec where
    its reconstruction error on the row's first quantized group (sum of squared errors over
    the group's tokens and both channels, float64) is strictly smaller than the first's; ties
    and pairs the second codec cannot store (a non-finite scalar) go to the first.

    Args:
        codec: the mix codec (its ``first`` and ``second`` pair codecs are compared).
        keys: storage-rounded keys ``[N, T, D]`` of each row's first quantized group.
        storage_dtype: the storage dtype.
        layout: the head's channel geometry.

    Returns:
        bool ``[N, P]``.
    """
    a, b = _cols(keys, layout.first), _cols(keys, layout.second)
    first = _pair_errors(codec.first, a, b, storage_dtype)
    second = _pair_errors(codec.second, a, b, storage_dtype)
    return second < first


def query_logit_saliency(codec: MixCodec, stats: TableStatistics) -> Tensor:
    """The query-aware mix rule (issue 8; docs/design.md, "Per-pair tables"): per (row, rotary
    pair), the second codec where its expected squared logit error, ``Σ_groups Σ_t E_q[(q_pair
    · (k_pair - k̂_pair))²]`` over the commit's queries and every group the row flushes in that
    commit (:meth:`TableStatistics.logit_error`), is strictly smaller than the first's; ties and
    pairs the second codec cannot store (a non-finite scalar in some group) go to the first.

    Returns:
        bool ``[N, P]``. Reads nothing back from the device.
    """
    lay, dt = stats.layout, stats.storage_dtype
    keys = stats.keys
    a, b = _cols(keys, lay.first), _cols(keys, lay.second)
    errors = []
    for part in (codec.first, codec.second):
        pc = part.encode_pairs(a, b, dt)
        a_hat, b_hat = part.decode_pairs(*pc)
        err = torch.zeros(keys.shape, dtype=torch.float64, device=keys.device)
        err.index_copy_(-1, lay.first, a_hat.double() - a.double())
        err.index_copy_(-1, lay.second, b_hat.double() - b.double())
        total = stats.logit_error(err)
        finite = torch.stack([torch.isfinite(t) for t in pc[2:]]).all(0)  # [G, P]
        bad = torch.zeros_like(total).index_add_(0, stats.owner, (~finite).double())
        errors.append(torch.where(bad > 0, torch.full_like(total, math.inf), total))
    return errors[1] < errors[0]


@dataclass(frozen=True)
class MixCodec(KeyCodec):
    """Per (sequence, kv head, rotary pair), the coding of ``first`` or ``second``.

    The choice is a bool mask ``[N, P]`` (True = ``second``) held by the cache, computed once
    per row and frozen (docs/design.md, "The mix mask"): by ``saliency`` from the row's first
    quantized group, or, with ``query_aware``, by :func:`query_logit_saliency` from the
    commit's queries and every group the row flushes in it. Non-rotary channels are Cartesian
    (both pair codecs code them so). The default is PN-Mix's: Cartesian or Phase–Norm by
    reconstruction error on the first group.

    Attributes:
        first, second: pair codecs of equal ``bits`` and frame (both pre-RoPE or neither).
        saliency: the first-group rule computing the mask (:data:`SaliencyRule`); unused with
            ``query_aware``.
        query_aware: choose by the expected squared logit error over the queries.
    """

    first: PairCodec = field(default_factory=CartesianCodec)
    second: PairCodec = field(default_factory=PhaseNormCodec)
    saliency: SaliencyRule = first_group_error_saliency
    query_aware: bool = False

    name = "mix"
    table_bits = 1
    table_dtype = torch.bool

    def __post_init__(self) -> None:
        for part in (self.first, self.second):
            if not isinstance(part, PairCodec):
                raise ValueError(f"MixCodec mixes pair codecs, got {type(part).__name__}")
        if self.first.bits != self.second.bits:
            raise ValueError(
                f"mixed codecs must share bits, got {self.first.bits} and {self.second.bits}"
            )
        if self.first.prerope != self.second.prerope:
            raise ValueError(
                "mixed codecs must code in the same frame (both prerope or neither), got "
                f"{self.first} and {self.second}"
            )
        if not isinstance(self.query_aware, bool):
            raise ValueError(f"query_aware must be a bool, got {self.query_aware!r}")

    @property
    def bits(self) -> int:  # type: ignore[override]
        return self.first.bits

    @property
    def position_aware(self) -> bool:  # type: ignore[override]
        return self.first.prerope

    def without_positions(self) -> MixCodec:
        return dataclasses.replace(
            self, first=self.first.without_positions(), second=self.second.without_positions()
        )

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * head_dim

    def compute_mask(self, keys: Tensor, storage_dtype: torch.dtype, layout: KeyLayout) -> Tensor:
        """The mask of ``N`` rows from their first groups' keys ``[N, T, D]`` by ``saliency``:
        bool ``[N, P]``."""
        return self.saliency(self, keys, storage_dtype, layout).to(torch.bool)

    def compute_table(self, stats: TableStatistics) -> Tensor:
        if self.query_aware:
            return query_logit_saliency(self, stats)
        return self.compute_mask(stats.first_group_keys(), stats.storage_dtype, stats.layout)

    def check_table(self, table: Tensor, layout: KeyLayout) -> None:
        super().check_table(table, layout)
        if table.dtype != torch.bool:
            raise ValueError(f"a mix mask is a bool tensor, got {table.dtype}")

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        mask = table
        if mask is None:
            raise ValueError("MixCodec.encode needs the per-pair mask [N, P]")
        codes, scalars = self.first.encode(keys, storage_dtype, layout)
        if layout.num_pairs == 0:
            return codes, scalars
        d = layout.head_dim
        f, s = layout.first, layout.second
        pc = self.second.encode_pairs(_cols(keys, f), _cols(keys, s), storage_dtype)
        scale, zero = scalars[..., :d], scalars[..., d:]
        tok = mask.unsqueeze(-2)
        codes.index_copy_(-1, f, torch.where(tok, pc.code_a, _cols(codes, f)))
        codes.index_copy_(-1, s, torch.where(tok, pc.code_b, _cols(codes, s)))
        scale.index_copy_(-1, f, torch.where(mask, pc.scale_a, _cols(scale, f)))
        zero.index_copy_(-1, f, torch.where(mask, pc.zero_a, _cols(zero, f)))
        scale.index_copy_(-1, s, torch.where(mask, pc.scale_b, _cols(scale, s)))
        zero.index_copy_(-1, s, torch.where(mask, pc.zero_b, _cols(zero, s)))
        return codes, scalars

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        mask = table
        if mask is None:
            raise ValueError("MixCodec.decode needs the per-pair mask [N, P]")
        out = self.first.decode(codes, scalars, layout)
        if layout.num_pairs == 0:
            return out
        d = layout.head_dim
        f, s = layout.first, layout.second
        if active_pairs is not None:
            if active_pairs.numel() == 0:
                return out
            f, s, mask = f[active_pairs], s[active_pairs], _cols(mask, active_pairs)
        scale, zero = scalars[..., :d], scalars[..., d:]
        a_hat, b_hat = self.second.decode_pairs(
            _cols(codes, f),
            _cols(codes, s),
            _cols(scale, f),
            _cols(zero, f),
            _cols(scale, s),
            _cols(zero, s),
        )
        tok = mask.unsqueeze(-2)
        out.index_copy_(-1, f, torch.where(tok, a_hat, _cols(out, f)))
        out.index_copy_(-1, s, torch.where(tok, b_hat, _cols(out, s)))
        return out

    def __str__(self) -> str:
        kind = "qmix" if self.query_aware else "mix"
        return f"{kind}({self.first}, {self.second})"


def _bit_alloc(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    from kvlab.pnmix.width_codec import BitAllocCodec

    return BitAllocCodec(bits, outlier_fraction=outlier_fraction)


def _prerope_cartesian(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    if outlier_fraction:
        from kvlab.pnmix.width_codec import BitAllocCodec

        return BitAllocCodec(bits, widths=(bits,), outlier_fraction=outlier_fraction)
    return CartesianCodec(bits, prerope=True)


def _cartesian(bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    if outlier_fraction:
        from kvlab.pnmix.width_codec import BitAllocCodec

        return BitAllocCodec(bits, widths=(bits,), outlier_fraction=outlier_fraction, prerope=False)
    return CartesianCodec(bits)


_NAMED: dict[str, Callable[[int], KeyCodec]] = {
    "mix": lambda bits: MixCodec(CartesianCodec(bits), PhaseNormCodec(bits)),
    "cartesian": CartesianCodec,
    "phase_norm": PhaseNormCodec,
    "per_token": PerTokenCodec,
    "prerope_cartesian": lambda bits: CartesianCodec(bits, prerope=True),
    "prerope_phase_norm": lambda bits: PhaseNormCodec(bits, prerope=True),
    "prerope_mix": lambda bits: MixCodec(
        CartesianCodec(bits, prerope=True), PhaseNormCodec(bits, prerope=True)
    ),
    "qmix": lambda bits: MixCodec(CartesianCodec(bits), PhaseNormCodec(bits), query_aware=True),
    "prerope_qmix": lambda bits: MixCodec(
        CartesianCodec(bits, prerope=True), PhaseNormCodec(bits, prerope=True), query_aware=True
    ),
    "bit_alloc": _bit_alloc,
}
# names whose codec keeps a fraction of exact sparse key outliers when asked
_WITH_OUTLIERS: dict[str, Callable[[int, float], KeyCodec]] = {
    "bit_alloc": _bit_alloc,
    "prerope_cartesian": _prerope_cartesian,
    "cartesian": _cartesian,
}

#: Every ``key_coding`` name (:func:`key_codec_from_name`).
KEY_CODING_NAMES: tuple[str, ...] = tuple(_NAMED)


def key_codec_from_name(name: str, bits: int, outlier_fraction: float = 0.0) -> KeyCodec:
    """The codec a ``key_coding`` name stands for (docs/design.md, "Key codecs").

    ``"mix"``: Cartesian/Phase–Norm mix with :func:`first_group_error_saliency`;
    ``"cartesian"``, ``"phase_norm"``, ``"per_token"``; ``"prerope_cartesian"``,
    ``"prerope_phase_norm"``, ``"prerope_mix"``: the same pair codings on pre-RoPE keys;
    ``"qmix"`` / ``"prerope_qmix"``: the Cartesian/Phase–Norm mix chosen by
    :func:`query_logit_saliency`; ``"bit_alloc"``: pre-RoPE keys with a width in {0, 2, 3, 4}
    bits per (kv head, rotary pair) (:class:`~kvlab.pnmix.width_codec.BitAllocCodec`).

    Args:
        name: one of :data:`KEY_CODING_NAMES`.
        bits: code width (average width for ``"bit_alloc"``).
        outlier_fraction: fraction of each group's key elements kept exact (``"bit_alloc"``,
            ``"cartesian"``, ``"prerope_cartesian"``; the latter two become a
            :class:`~kvlab.pnmix.width_codec.BitAllocCodec` with the single width ``bits``).

    Raises:
        ValueError: an unknown name, or outliers for a coding without them.
    """
    if name not in _NAMED:
        raise ValueError(f"key_coding must be one of {tuple(_NAMED)} or a KeyCodec, got {name!r}")
    if outlier_fraction:
        if name not in _WITH_OUTLIERS:
            raise ValueError(
                f"key_coding {name!r} keeps no sparse outliers; key_outlier_fraction needs one "
                f"of {tuple(_WITH_OUTLIERS)}"
            )
        return _WITH_OUTLIERS[name](bits, outlier_fraction)
    return _NAMED[name](bits)
