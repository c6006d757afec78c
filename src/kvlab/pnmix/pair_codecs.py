"""The table-free key codecs: pair codecs (Cartesian, Phase–Norm) and per-token keys
(docs/design.md, "Key codecs").

* :class:`CartesianCodec` — per channel min-max over the group's tokens (KIVI keys, Liu et al.
  2024). Scalars ``[scale(D) | zero(D)]``.
* :class:`PhaseNormCodec` — every rotary pair in Phase–Norm (polar) coding, the remaining
  channels Cartesian; pair-slot convention of :mod:`kvlab.pnmix.quantizers`. Scalars
  ``[scale(D) | zero(D)]`` in that convention.
* :class:`PerTokenCodec` — per token over the head's channels (like values). Scalars
  ``[scale(T) | zero(T)]``.

Cartesian and per-token keys are the same asymmetric min-max coding along another axis
(:func:`kvlab.pnmix.key_codec.minmax_encode` / :func:`~kvlab.pnmix.key_codec.minmax_decode`).

A **pair codec** (:class:`PairCodec`) codes every rotary pair as two channel slots
(``first[p]``, ``second[p]``) with two codes per token and four scalars per group, and every
non-rotary channel Cartesian, so that any two pair codecs can be mixed slot by slot
(:class:`kvlab.pnmix.mix_codec.MixCodec`). A pair codec with ``prerope=True`` is
*position-aware*: the cache rotates each key back to position 0 before coding it (KVQuant,
Hooper et al. 2024, arXiv:2401.18079) and attention rotates the decoded key to its position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix.key_codec import (
    KeyCodec,
    KeyLayout,
    check_bits,
    columns,
    minmax_decode,
    minmax_encode,
)
from kvlab.pnmix.quantizers import (
    minmax_dequantize,
    minmax_quantize,
    phase_norm_dequantize,
    phase_norm_quantize,
)

__all__ = [
    "CartesianCodec",
    "PairCodec",
    "PairCodes",
    "PerTokenCodec",
    "PhaseNormCodec",
]


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
        check_bits(self.bits)
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

    def encode_slots(
        self, keys: Tensor, first: Tensor, second: Tensor, storage_dtype: torch.dtype
    ) -> PairCodes:
        """:meth:`encode_pairs` of the pairs ``(keys[..., first], keys[..., second])`` of keys
        ``[N, T, D]`` (int64 channel indices ``[U]`` each)."""
        return self.encode_pairs(columns(keys, first), columns(keys, second), storage_dtype)

    def decode_slots(
        self, codes: Tensor, scale: Tensor, zero: Tensor, first: Tensor, second: Tensor
    ) -> tuple[Tensor, Tensor]:
        """:meth:`decode_pairs` of the pair slots ``first``/``second`` (int64 ``[U]``) of codes
        ``[N, T, D]`` and per-channel ``scale``/``zero`` ``[N, D]`` (the pair-slot
        convention): float32 ``(a_hat, b_hat)`` ``[N, T, U]``."""
        return self.decode_pairs(
            columns(codes, first),
            columns(codes, second),
            columns(scale, first),
            columns(zero, first),
            columns(scale, second),
            columns(zero, second),
        )

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
            pc = self.encode_slots(keys, f, s, storage_dtype)
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
            a_hat, b_hat = self.decode_slots(codes, scale, zero, f, s)
            out.index_copy_(-1, f, a_hat).index_copy_(-1, s, b_hat)
        return out


class _MinMaxAlongAxis(KeyCodec):
    """Asymmetric min-max keys reduced over :attr:`axis` of ``[N, T, D]`` (``-2``: per channel
    over the group's tokens, Cartesian; ``-1``: per token over the head's channels), scalars
    ``[scale | zero]``: the one implementation of :class:`CartesianCodec` and
    :class:`PerTokenCodec` (docs/design.md, "Key codecs")."""

    axis: ClassVar[int]

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        table: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        return minmax_encode(keys, self.bits, self.axis, storage_dtype)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        table: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        count = layout.head_dim if self.axis == -2 else codes.shape[-2]
        return minmax_decode(codes, scalars, self.axis, count)


@dataclass(frozen=True)
class CartesianCodec(_MinMaxAlongAxis, PairCodec):
    """Per-channel asymmetric min-max over the group's tokens (KIVI keys, Liu et al. 2024)."""

    name = "cartesian"
    axis = -2

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
class PerTokenCodec(_MinMaxAlongAxis):
    """Keys per token over the head's channels (asymmetric min-max, like values)."""

    name = "per_token"
    min_group_tokens = 1
    axis = -1
    bits: int = 2

    def __post_init__(self) -> None:
        check_bits(self.bits)

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * group_tokens
