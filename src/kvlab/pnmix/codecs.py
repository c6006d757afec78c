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
  :func:`first_group_error_saliency`, today's rule) and held by the cache as a 1-bit mask.

A **pair codec** (:class:`PairCodec`) codes every rotary pair as two channel slots
(``first[p]``, ``second[p]``) with two codes per token and four scalars per group, and every
non-rotary channel Cartesian, so that any two pair codecs can be mixed slot by slot.

Rotary pairs are described by a :class:`KeyLayout` (head_dim and the pair channel indices of
:func:`kvlab.pnmix.quantizers.rotary_pair_indices`), passed to every call, so a codec object is
plain configuration (hashable, device-free) that any head geometry can use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix.quantizers import (
    minmax_dequantize,
    minmax_quantize,
    phase_norm_dequantize,
    phase_norm_quantize,
    rotary_pair_indices,
)

__all__ = [
    "CartesianCodec",
    "KeyCodec",
    "KeyLayout",
    "MixCodec",
    "PairCodec",
    "PairCodes",
    "PerTokenCodec",
    "PhaseNormCodec",
    "SaliencyRule",
    "first_group_error_saliency",
    "key_codec_from_name",
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


class KeyCodec:
    """A key coding (abstract). Subclasses are frozen dataclasses with at least ``bits``.

    Attributes:
        name: the coding's name (``PNMixConfig(key_coding=name)`` builds it).
        bits: code width of every coded key element.
        position_aware: True when codes hold keys rotated back to position 0 (pre-RoPE); no
            codec does so yet (docs/design.md, "Later").
        min_group_tokens: the smallest group a coding can use (2 for codings that take a
            per-channel min-max over a group's tokens).
    """

    name: str = "abstract"
    bits: int
    position_aware: bool = False
    min_group_tokens: int = 2

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        """Storage-dtype scalars per (sequence, kv head, group)."""
        raise NotImplementedError

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Code ``N`` groups.

        Args:
            keys: storage-rounded keys ``[N, T, D]`` (any floating dtype holding storage-dtype
                values).
            storage_dtype: dtype of the stored scalars.
            layout: the head's channel geometry.
            mask: bool ``[N, P]`` per-pair choice (mix codecs only; True = second codec).

        Returns:
            ``(codes, scalars)``: uint8 ``[N, T, D]`` codes in ``0 .. 2**bits - 1`` and
            ``[N, scalar_count(T, D)]`` scalars in ``storage_dtype``. A scalar may be
            non-finite when a value exceeds the storage range; the caller checks.
        """
        raise NotImplementedError

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        mask: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
        """Float32 keys ``[N, T, D]`` from ``codes`` (uint8 or float32 holding the integer
        codes, ``[N, T, D]``) and ``scalars`` ``[N, S]``. ``mask`` as in :meth:`encode`;
        ``active_pairs`` (mix codecs): int64 ``[U]`` pairs whose mask bit may be set in any of
        the ``N`` groups (a superset is fine; ``None`` = all), so that the second codec is
        decoded on those pairs only. Every element is computed by the same float32 operations
        whatever ``N``, block or ``active_pairs`` (docs/design.md, "Attention")."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PairCodec(KeyCodec):
    """A channel-wise key codec whose rotary pairs use two slots and four scalars each.

    Scalars are ``[scale(D) | zero(D)]`` in the pair-slot convention of
    :mod:`kvlab.pnmix.quantizers`; non-rotary channels are Cartesian (per-channel min-max).
    Subclasses define how a pair is coded: :meth:`encode_pairs` / :meth:`decode_pairs`.
    """

    bits: int = 2

    def __post_init__(self) -> None:
        _check_bits(self.bits)

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
        mask: Tensor | None = None,
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
        mask: Tensor | None = None,
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
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        q = minmax_quantize(keys, self.bits, -2, storage_dtype)
        return q.codes, torch.cat([q.scale, q.zero], dim=-1)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        mask: Tensor | None = None,
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
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        q = minmax_quantize(keys, self.bits, -1, storage_dtype)
        return q.codes, torch.cat([q.scale, q.zero], dim=-1)

    def decode(
        self,
        codes: Tensor,
        scalars: Tensor,
        layout: KeyLayout,
        mask: Tensor | None = None,
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


@dataclass(frozen=True)
class MixCodec(KeyCodec):
    """Per (sequence, kv head, rotary pair), the coding of ``first`` or ``second``.

    The choice is a bool mask ``[N, P]`` (True = ``second``) held by the cache, computed once
    per row by ``saliency`` from the row's first quantized group and frozen (docs/design.md,
    "The mix mask"). Non-rotary channels are Cartesian (both pair codecs code them so).
    The default is PN-Mix's: Cartesian or Phase–Norm by reconstruction error.

    Attributes:
        first, second: pair codecs of equal ``bits``.
        saliency: the rule computing the mask (:data:`SaliencyRule`).
    """

    first: PairCodec = field(default_factory=CartesianCodec)
    second: PairCodec = field(default_factory=PhaseNormCodec)
    saliency: SaliencyRule = first_group_error_saliency

    name = "mix"

    def __post_init__(self) -> None:
        for part in (self.first, self.second):
            if not isinstance(part, PairCodec):
                raise ValueError(f"MixCodec mixes pair codecs, got {type(part).__name__}")
        if self.first.bits != self.second.bits:
            raise ValueError(
                f"mixed codecs must share bits, got {self.first.bits} and {self.second.bits}"
            )

    @property
    def bits(self) -> int:  # type: ignore[override]
        return self.first.bits

    def scalar_count(self, group_tokens: int, head_dim: int) -> int:
        return 2 * head_dim

    def compute_mask(self, keys: Tensor, storage_dtype: torch.dtype, layout: KeyLayout) -> Tensor:
        """The mask of ``N`` rows from their first groups' keys ``[N, T, D]``: bool ``[N, P]``."""
        return self.saliency(self, keys, storage_dtype, layout).to(torch.bool)

    def encode(
        self,
        keys: Tensor,
        storage_dtype: torch.dtype,
        layout: KeyLayout,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
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
        mask: Tensor | None = None,
        active_pairs: Tensor | None = None,
    ) -> Tensor:
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
        return f"mix({self.first}, {self.second})"


_NAMED: dict[str, Callable[[int], KeyCodec]] = {
    "mix": lambda bits: MixCodec(CartesianCodec(bits), PhaseNormCodec(bits)),
    "cartesian": CartesianCodec,
    "phase_norm": PhaseNormCodec,
    "per_token": PerTokenCodec,
}


def key_codec_from_name(name: str, bits: int) -> KeyCodec:
    """The codec a ``key_coding`` name stands for (``"mix"``: Cartesian/Phase–Norm mix with
    :func:`first_group_error_saliency`).

    Raises:
        ValueError: an unknown name.
    """
    if name not in _NAMED:
        raise ValueError(f"key_coding must be one of {tuple(_NAMED)} or a KeyCodec, got {name!r}")
    return _NAMED[name](bits)
