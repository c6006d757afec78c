"""The mix key codec: per (sequence, kv head, rotary pair) the coding of one of two pair codecs
(docs/design.md, "Key codecs" and "The mix mask").

:class:`MixCodec` holds, per row, a 1-bit mask chosen once by a pluggable saliency rule (default
:func:`first_group_error_saliency`, today's rule) or, with ``query_aware=True``, by the expected
squared logit error over the commit's queries (:func:`query_logit_saliency`). A mix of two
pre-RoPE pair codecs is position-aware (the frame is the cache's business: the codec codes
whatever frame it is handed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvlab.pnmix.key_codec import KeyCodec, KeyLayout, TableStatistics, columns
from kvlab.pnmix.pair_codecs import CartesianCodec, PairCodec, PhaseNormCodec

__all__ = [
    "MixCodec",
    "SaliencyRule",
    "first_group_error_saliency",
    "query_logit_saliency",
]


SaliencyRule = Callable[["MixCodec", Tensor, torch.dtype, KeyLayout], Tensor]
"""``rule(codec, keys [N, T, D], storage_dtype, layout) -> bool [N, P]`` (True = the mix's
second codec): the mix mask of ``N`` (sequence, kv head) rows from the storage-rounded keys of
each row's first quantized group."""


def _round_trip(
    codec: PairCodec, a: Tensor, b: Tensor, storage_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """``codec``'s float32 reconstruction ``(a_hat, b_hat)`` ``[N, T, U]`` of pairs ``(a, b)``
    and bool ``[N, U]``: whether every scalar of the pair is finite in storage."""
    pc = codec.encode_pairs(a, b, storage_dtype)
    a_hat, b_hat = codec.decode_pairs(*pc)
    finite = torch.stack([torch.isfinite(t) for t in pc[2:]]).all(0)
    return a_hat, b_hat, finite


def _pair_errors(codec: PairCodec, a: Tensor, b: Tensor, storage_dtype: torch.dtype) -> Tensor:
    """Float64 ``[N, U]`` sum over tokens and both slots of the squared reconstruction error of
    ``codec`` on pairs ``(a, b)``; ``+inf`` where a scalar would not be finite in storage."""
    a_hat, b_hat, finite = _round_trip(codec, a, b, storage_dtype)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    err = ((a_hat.double() - a64) ** 2 + (b_hat.double() - b64) ** 2).sum(dim=-2)
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
    a, b = columns(keys, layout.first), columns(keys, layout.second)
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
    a, b = columns(keys, lay.first), columns(keys, lay.second)
    errors = []
    for part in (codec.first, codec.second):
        a_hat, b_hat, finite = _round_trip(part, a, b, dt)  # finite: [G, P]
        err = torch.zeros(keys.shape, dtype=torch.float64, device=keys.device)
        err.index_copy_(-1, lay.first, a_hat.double() - a.double())
        err.index_copy_(-1, lay.second, b_hat.double() - b.double())
        total = stats.logit_error(err)
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
        pc = self.second.encode_slots(keys, f, s, storage_dtype)
        scale, zero = scalars[..., :d], scalars[..., d:]
        tok = mask.unsqueeze(-2)
        codes.index_copy_(-1, f, torch.where(tok, pc.code_a, columns(codes, f)))
        codes.index_copy_(-1, s, torch.where(tok, pc.code_b, columns(codes, s)))
        scale.index_copy_(-1, f, torch.where(mask, pc.scale_a, columns(scale, f)))
        zero.index_copy_(-1, f, torch.where(mask, pc.zero_a, columns(zero, f)))
        scale.index_copy_(-1, s, torch.where(mask, pc.scale_b, columns(scale, s)))
        zero.index_copy_(-1, s, torch.where(mask, pc.zero_b, columns(zero, s)))
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
            f, s, mask = f[active_pairs], s[active_pairs], columns(mask, active_pairs)
        scale, zero = scalars[..., :d], scalars[..., d:]
        a_hat, b_hat = self.second.decode_slots(codes, scale, zero, f, s)
        tok = mask.unsqueeze(-2)
        out.index_copy_(-1, f, torch.where(tok, a_hat, columns(out, f)))
        out.index_copy_(-1, s, torch.where(tok, b_hat, columns(out, s)))
        return out

    def __str__(self) -> str:
        kind = "qmix" if self.query_aware else "mix"
        return f"{kind}({self.first}, {self.second})"
