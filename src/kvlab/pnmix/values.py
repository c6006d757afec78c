"""Value codecs of the PN-Mix cache (docs/design.md, "Value codecs").

Values are coded per token over the head's channels (asymmetric min-max, KIVI: Liu et al.
2024): ``bits``-bit codes ``[T, Dv]`` and per-token scalars ``[scale(T) | zero(T)]`` per
group. With ``group_channels = c`` (a divisor of ``Dv``; ``c >= Dv`` is one group) each token
has one scale and zero per ``c`` consecutive channels of the coded frame instead (KIVI's value
group size):
``[scale(T, G) | zero(T, G)]``, ``G = Dv / c``, token-major — ``2 + 2·16/c`` bits per value
channel in float16 at any head_dim, where one pair per token costs ``2 + 32/Dv`` (2.125 bits at
Gemma 3's 256, 2.5 at 64: kvlab issue 40). The codecs share that storage layout and differ in
the frame they code:

* :class:`PerTokenValueCodec` — the values themselves (the seed's coding);
* :class:`HadamardValueCodec` — the values rotated by a fixed orthonormal Hadamard matrix
  ``H`` (incoherence processing: QuaRot, Ashkboos et al. 2024, arXiv:2404.00456), which
  spreads a token's outlier channels over all channels before the per-token range is taken;
  zero extra bytes;
* :class:`MSEHadamardValueCodec` (``"hadamard_mse"``) — the same frame and stored format, the
  per-token range chosen by squared error instead of by the extremes: rotated values are near
  Gaussian, and the extremes of ``Dv`` Gaussian samples grow with ``Dv`` (about ±2.4σ at 64
  channels, ±2.9σ at 256), so min-max spends the 2-bit levels on the tails (squared error
  about 0.31σ² per element at 256 channels against 0.12σ² for the best clipped uniform
  4-level quantizer of a Gaussian, Max 1960). A grid search over the range shrunk around its
  centre (the clipping search of AWQ, Lin et al. 2024, applied per token) picks it; the
  decoder, kernels' decode steps and bytes are unchanged (kvlab issue 19: Gemma 3's
  head_dim-256 values). Decoding gives ``(v H)^``; attention multiplies the attention-weighted sum
  of a query row's decoded values by ``H^T`` once (``Σ_t p_t (v_t H)^ H^T = (Σ_t p_t (v_t
  H)^) H^T``), :meth:`ValueCodec.output_transform`.
* :class:`AutoHadamardValueCodec` (``"hadamard_auto"``) — per kv head, min-max
  (``"hadamard"``) or squared-error ranges (``"hadamard_mse"``), chosen once, at the head's first
  flush, by the attention-weighted output error each gives on that append's last queries
  (:func:`attention_weighted_value_error`); both decode alike, so the stored format and every
  decode path are the Hadamard codec's (the choice is kept by the cache and counted as one byte
  per kv head: docs/design.md, "Value codecs").

A codec is device-free configuration; codes are chosen in float64 from storage-rounded inputs
against the stored scalars (:func:`kvlab.pnmix.quantizers.minmax_quantize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.pnmix.hadamard import hadamard_matrix, hadamard_signs
from kvlab.pnmix.quantizers import minmax_dequantize, minmax_quantize

__all__ = [
    "MSE_CLIP_RATIOS",
    "VALUE_CODING_NAMES",
    "AutoHadamardValueCodec",
    "HadamardValueCodec",
    "MSEHadamardValueCodec",
    "PerTokenValueCodec",
    "ValueCodec",
    "attention_weighted_value_error",
    "value_codec_from_name",
]


def _check_bits(bits: object) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def _check_group_channels(group_channels: object) -> None:
    if group_channels is None:
        return
    c = group_channels
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"group_channels must be a positive int or None, got {c!r}")


class ValueCodec:
    """A value coding (abstract): per-token min-max codes of the values in some fixed frame.

    Attributes:
        name: the coding's name (``PNMixConfig(value_coding=name)`` builds it).
        bits: code width.
        transforms_output: whether :meth:`output_transform` is not the identity.
    """

    name: str = "abstract"
    bits: int
    group_channels: int | None = None
    transforms_output: bool = False

    def channel_groups(self, value_head_dim: int) -> int:
        """``G``: scale/zero pairs per token (1 without ``group_channels`` or when it is at
        least ``Dv``)."""
        c = self.group_channels
        return 1 if c is None or c >= value_head_dim else value_head_dim // c

    def scalar_count(self, group_tokens: int, value_head_dim: int) -> int:
        """Storage-dtype scalars per (sequence, kv head, group): ``[scale(T, G) | zero(T, G)]``,
        ``2·T·G``."""
        return 2 * group_tokens * self.channel_groups(value_head_dim)

    def check_head_dim(self, value_head_dim: int) -> None:
        """Raise ``ValueError`` if the coding cannot code values of ``Dv`` channels (here:
        ``group_channels`` below ``Dv`` and not a divisor of it)."""
        c = self.group_channels
        if c is not None and c < value_head_dim and value_head_dim % c:
            raise ValueError(
                f"value group_channels {c} (PNMixConfig.value_group_channels) does not divide "
                f"the value head dim {value_head_dim}"
            )

    def frame(self, values: Tensor, storage_dtype: torch.dtype) -> Tensor:
        """The storage-rounded values ``[..., Dv]`` in the frame the codes hold, rounded to the
        storage dtype (the identity here)."""
        return values.to(storage_dtype)

    def encode(self, values: Tensor, storage_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Code ``N`` groups of storage-rounded values ``[N, T, Dv]``.

        Returns:
            ``(codes, scalars)``: uint8 ``[N, T, Dv]`` and ``[N, 2TG]`` (storage dtype,
            ``[scale(T, G) | zero(T, G)]``; possibly non-finite for values beyond the storage
            range: the caller checks). No device read.
        """
        x = self._blocks(self.frame(values, storage_dtype))
        q = minmax_quantize(x, self.bits, -1, storage_dtype)
        return q.codes.flatten(-2), torch.cat([q.scale.flatten(-2), q.zero.flatten(-2)], dim=-1)

    def decode(self, codes: Tensor, scalars: Tensor) -> Tensor:
        """Float32 ``[..., T, Dv]`` in the codes' frame from uint8 codes ``[..., T, Dv]`` and
        scalars ``[..., 2TG]``: ``zero_tg + code * scale_tg`` (``g``: the channel's group)."""
        t, dv = codes.shape[-2], codes.shape[-1]
        g = self.channel_groups(dv)
        scale = scalars[..., : t * g].unflatten(-1, (t, g))
        zero = scalars[..., t * g :].unflatten(-1, (t, g))
        return minmax_dequantize(self._blocks(codes), scale, zero, -1).flatten(-2)

    def _blocks(self, x: Tensor) -> Tensor:
        """``[..., Dv]`` viewed as ``[..., G, Dv / G]`` (the channels one scale/zero covers)."""
        return x.unflatten(-1, (self.channel_groups(x.shape[-1]), -1))

    def output_transform(self, x: Tensor) -> Tensor:
        """Map a float32 ``[..., Dv]`` combination of decoded values back to the values'
        frame (identity here)."""
        return x

    def __str__(self) -> str:
        c = self.group_channels
        return self.name if c is None else f"{self.name}(group_channels={c})"


@dataclass(frozen=True)
class PerTokenValueCodec(ValueCodec):
    """Per-token min-max of the values themselves (KIVI values; the seed's coding).

    Args:
        bits: code width, 1..8.
        group_channels: channels per scale and zero (``None``: all of a token's channels).

    Raises:
        ValueError: ``bits`` or ``group_channels`` out of domain.
    """

    bits: int = 2
    group_channels: int | None = None
    name = "per_token"

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_channels(self.group_channels)


@dataclass(frozen=True)
class HadamardValueCodec(ValueCodec):
    """Per-token min-max of the Hadamard-rotated values ``v H`` (module docstring).

    ``v H`` is computed as ``(v @ S) / sqrt(Dv)`` in float64 with ``S`` the exact ``±1``
    Sylvester matrix (:func:`kvlab.pnmix.hadamard.hadamard_signs`): for float16 values every
    partial sum is exact (multiples of ``2**-24`` below ``2**53``), so the rotated value
    depends on the token alone, not on the batch or how tokens arrived; then rounded to the
    storage dtype. ``Dv`` must be a power of two. The rotation spans all ``Dv`` channels;
    ``group_channels`` splits only the ranges.
    """

    bits: int = 2
    group_channels: int | None = None
    name = "hadamard"
    transforms_output = True

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_channels(self.group_channels)

    def check_head_dim(self, value_head_dim: int) -> None:
        if value_head_dim < 1 or value_head_dim & (value_head_dim - 1):
            raise ValueError(
                f"Hadamard value coding needs a power-of-two value head dim, got {value_head_dim}"
            )
        super().check_head_dim(value_head_dim)

    def frame(self, values: Tensor, storage_dtype: torch.dtype) -> Tensor:
        n = values.shape[-1]
        signs = hadamard_signs(n).to(values.device)
        rotated = (values.double() @ signs) * (1.0 / math.sqrt(n))
        return rotated.to(storage_dtype)

    def output_transform(self, x: Tensor) -> Tensor:
        """``x @ H^T`` in float32 (``H`` is symmetric)."""
        return x @ hadamard_matrix(x.shape[-1], torch.float32).to(x.device)


#: Range ratios :class:`MSEHadamardValueCodec` tries (1 = min-max), largest first.
MSE_CLIP_RATIOS: tuple[float, ...] = tuple(1.0 - 0.025 * i for i in range(29))  # 1.0 .. 0.3


@dataclass(frozen=True)
class MSEHadamardValueCodec(HadamardValueCodec):
    """:class:`HadamardValueCodec` whose per-token range minimizes the token's squared error
    (module docstring): for each ratio ``r`` of :data:`MSE_CLIP_RATIOS` the range ``[c - r·h,
    c + r·h]`` (``c``, ``h``: the min-max range's centre and half-width) is rounded to the
    storage dtype as ``zero`` and ``scale``, codes are chosen against those stored values
    (clamped to the levels), and the ratio with the least squared error in the coded frame
    wins (ties: the larger ratio). Decoding, bytes and the output transform are the Hadamard
    codec's."""

    name = "hadamard_mse"

    def encode(self, values: Tensor, storage_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        x = self._blocks(self.frame(values, storage_dtype).to(torch.float64))
        levels = float(2**self.bits - 1)
        lo = x.amin(-1, keepdim=True)
        hi = x.amax(-1, keepdim=True)
        centre, half = (lo + hi) / 2, (hi - lo) / 2
        best_codes = torch.zeros_like(x)
        best_scale = torch.zeros_like(lo)
        best_zero = lo.to(storage_dtype).to(torch.float64)
        best_error = torch.full_like(lo, float("inf"))
        for r in MSE_CLIP_RATIOS:
            zero = (centre - r * half).to(storage_dtype).to(torch.float64)
            scale = (2 * r * half / levels).to(storage_dtype).to(torch.float64)
            valid = (scale > 0) & torch.isfinite(scale) & torch.isfinite(zero)
            ratio = (x - zero) / torch.where(valid, scale, torch.ones_like(scale))
            codes = torch.where(valid, ratio.round().clamp(0, levels), torch.zeros_like(ratio))
            error = ((zero + codes * scale - x) ** 2).sum(-1, keepdim=True)
            error = torch.where(valid, error, (x - zero).pow(2).sum(-1, keepdim=True))
            better = error < best_error
            best_codes = torch.where(better, codes, best_codes)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
            best_error = torch.where(better, error, best_error)
        scale, zero = best_scale.squeeze(-1).flatten(-2), best_zero.squeeze(-1).flatten(-2)
        scalars = torch.cat([scale, zero], dim=-1)
        return best_codes.flatten(-2).to(torch.uint8), scalars.to(storage_dtype)


@dataclass(frozen=True)
class AutoHadamardValueCodec(HadamardValueCodec):
    """Per kv head, :class:`HadamardValueCodec` (min-max ranges) or
    :class:`MSEHadamardValueCodec` (squared-error ranges), whichever gives the smaller
    attention-weighted output error on the append that flushes the head's first group
    (:func:`attention_weighted_value_error`; kvlab issue 19). Why not squared error alone: a
    token's clipping error is biased toward the range's centre, and when the values of many
    attended tokens share their extreme channels (a common offset), those biases add up in the
    attention-weighted sum where min-max's rounding errors average out; the per-token squared
    error cannot see that, the output error can.

    Decoding, bytes per group and the output transform are the Hadamard codec's;
    :meth:`encode` (no choice known) is min-max. :class:`~kvlab.pnmix.cache.PNMixCache` keeps
    the per-row choice (:attr:`~kvlab.pnmix.cache.PNMixCache.value_mse_rows`)."""

    name = "hadamard_auto"

    @property
    def minmax(self) -> HadamardValueCodec:
        """The min-max candidate."""
        return HadamardValueCodec(self.bits, self.group_channels)

    @property
    def mse(self) -> MSEHadamardValueCodec:
        """The squared-error candidate."""
        return MSEHadamardValueCodec(self.bits, self.group_channels)

    def encode(self, values: Tensor, storage_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Min-max codes (:meth:`HadamardValueCodec.encode`): the choice of a row with none."""
        return self.minmax.encode(values, storage_dtype)


def attention_weighted_value_error(
    probs: Tensor, values: Tensor, decoded: Tensor, storage_dtype: torch.dtype
) -> Tensor:
    """Attention-weighted output error of decoded values: ``Σ_q ||Σ_t p_qt (v_t - v̂_t)||²``.

    Args:
        probs: float ``[n, Q, T]``: per row, each query's attention probability on each coded
            token (under the full softmax, so a row sums to at most 1).
        values: ``[n, T, Dv]`` the values (any float dtype; taken to the codec's frame by the
            caller, or not: the Hadamard rotation is orthonormal, so the error's norm is the
            same in either frame).
        decoded: float ``[n, T, Dv]``, the decoded values in the same frame.
        storage_dtype: the values are rounded to it before the difference.

    Returns:
        float64 ``[n]``, in squared value units.
    """
    error = decoded.double() - values.to(storage_dtype).double()
    return torch.einsum("nqt,ntd->nqd", probs.double(), error).pow(2).sum((-1, -2))


_NAMED = {
    "per_token": PerTokenValueCodec,
    "hadamard": HadamardValueCodec,
    "hadamard_mse": MSEHadamardValueCodec,
    "hadamard_auto": AutoHadamardValueCodec,
}

#: Every ``value_coding`` name.
VALUE_CODING_NAMES: tuple[str, ...] = tuple(_NAMED)


def value_codec_from_name(name: str, bits: int, group_channels: int | None = None) -> ValueCodec:
    """The value codec ``name`` (``"per_token"``, ``"hadamard"``, ``"hadamard_mse"`` or
    ``"hadamard_auto"``) at ``bits`` bits, one scale and zero per ``group_channels`` channels
    (``None``: per token).

    Raises:
        ValueError: an unknown name, or ``bits``/``group_channels`` out of domain.
    """
    if name not in _NAMED:
        raise ValueError(
            f"value_coding must be one of {VALUE_CODING_NAMES} or a ValueCodec, got {name!r}"
        )
    return _NAMED[name](bits, group_channels)
