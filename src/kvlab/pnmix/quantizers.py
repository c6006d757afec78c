"""Quantizers of the PN-Mix cache: asymmetric min-max codes and Phase–Norm (polar) pair codes.

Conventions shared by every function here:

* ``bits`` is the code width ``b``; codes are uint8 in ``0 .. L`` with ``L = 2 ** b - 1``.
* Scalars (scales, zero points, phase offsets and spans) are *stored* in a 2-byte storage
  dtype (``torch.float16`` or ``torch.bfloat16``). Codes are computed against the stored,
  rounded scalars, so dequantization reproduces exactly what the codes were chosen for.
* The arithmetic that chooses codes runs in float64 on the storage-dtype-rounded inputs:
  differences of float16 values are exact there, bfloat16 extremes cannot overflow, and every
  operation used (min/max, +, -, /, sqrt, round) is correctly rounded, so a code depends only
  on the values it encodes, never on tensor shapes or on how the tokens arrived.
* Dequantization returns float32 (``zero + code * scale``).

Asymmetric min-max (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache"): ``zero = min``, ``scale = (max - min) / L``,
``code = clamp(round((x - zero) / scale), 0, L)``, ``x_hat = zero + code * scale``. A range
of zero stores ``scale = 0`` and codes 0, so a constant reconstructs exactly (its zero point is
the storage-rounded value itself).

Phase–Norm coding of a rotary pair ``(a, b)`` (docs/design.md, "Key codecs"): the norm ``r =
sqrt(a² + b²)`` is min-max coded as above; the phase ``phi = atan2(b, a)`` is coded uniformly
over the *shortest arc* that covers the group's phases (so phases on both sides of ±π do not
inflate it), stored as ``offset`` (the arc's start, radians in (-π, π]) and ``span`` (its
length, radians in [0, 2π)). Level ``c`` is ``offset + c * (span / L)``: both arc endpoints are
levels, like the min-max scheme. The pair reconstructs as ``r_hat * (cos phi_hat, sin
phi_hat)``.

Key layout in channel space ("pair-slot convention"): a key group is ``codes [..., T, D]``
plus ``scale [..., D]`` and ``zero [..., D]``. For a Cartesian channel these are that
channel's code, scale and zero point. For a Phase–Norm pair ``(first[p], second[p])`` the
``first`` slot holds the norm code, norm scale and norm zero point and the ``second`` slot
holds the phase code, the phase span (in ``scale``) and the phase offset (in ``zero``). Both
codings therefore cost ``2 * b`` bits per pair per token and 4 stored scalars (8 bytes in a
2-byte dtype) per pair per group.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from kvlab.rope import RotaryConfig

__all__ = [
    "STORAGE_DTYPES",
    "ChannelwiseKeyCodes",
    "MinMaxCodes",
    "PhaseNormCodes",
    "check_storage_scalars",
    "dequantize_keys_channelwise",
    "key_pair_errors",
    "minmax_dequantize",
    "minmax_quantize",
    "phase_levels",
    "phase_norm_dequantize",
    "phase_norm_quantize",
    "quantize_keys_channelwise",
    "rotary_pair_indices",
    "round_to_storage",
    "shortest_arc",
    "storage_range_message",
]

STORAGE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
_TWO_PI = 2.0 * math.pi


def _levels(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    return (1 << bits) - 1


def _check_storage_dtype(storage_dtype: torch.dtype) -> None:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"storage dtype must be torch.float16 or torch.bfloat16, got {storage_dtype!r}"
        )


def storage_range_message(what: str, storage_dtype: torch.dtype) -> str:
    """The error text for a value beyond the storage dtype's finite range (for float16 it names
    bfloat16 storage as the way out)."""
    if storage_dtype == torch.float16:
        return (
            f"{what} exceeds the finite range of float16 storage (max 65504); use bfloat16 "
            "storage (PNMixConfig(storage_dtype=torch.bfloat16)) for models whose activations "
            "exceed float16's range"
        )
    return f"{what} exceeds the finite range of {storage_dtype} storage (max ~3.39e38)"


def rotary_pair_indices(rotary_dim: int, layout: str = "half") -> tuple[Tensor, Tensor]:
    """Channel indices of the rotary pairs (docs/design.md, "Rotary pairs").

    Args:
        rotary_dim: number of rotary channels, a positive even int.
        layout: ``"half"`` pairs ``(i, i + rotary_dim / 2)`` (GPT-NeoX / Llama);
            ``"interleaved"`` pairs ``(2i, 2i + 1)`` (GPT-J).

    Returns:
        ``(first, second)``: int64 tensors ``[rotary_dim // 2]`` on the CPU.

    Raises:
        ValueError: ``rotary_dim`` not a positive even int, or an unknown layout.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if layout not in ("half", "interleaved"):
        raise ValueError(f"rotary layout must be 'half' or 'interleaved', got {layout!r}")
    # One source of truth for the pairing convention: kvlab.rope.
    return RotaryConfig(head_dim=rotary_dim, layout=layout).pair_indices()  # type: ignore[arg-type]


def round_to_storage(x: Tensor, storage_dtype: torch.dtype, *, name: str = "input") -> Tensor:
    """Round a floating tensor to the storage dtype, refusing non-finite results.

    Args:
        x: any floating tensor.
        storage_dtype: ``torch.float16`` or ``torch.bfloat16``.
        name: what ``x`` is, for error messages.

    Returns:
        ``x`` rounded to nearest in ``storage_dtype`` (same shape and device).

    Raises:
        ValueError: ``x`` holds NaN or ±inf, or a value beyond the storage dtype's finite range
            (the float16 message names bfloat16 storage as the way out).
    """
    _check_storage_dtype(storage_dtype)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    rounded = x.to(storage_dtype)
    if not torch.isfinite(rounded).all():
        raise ValueError(storage_range_message(f"{name} has values whose magnitude", storage_dtype))
    return rounded


def check_storage_scalars(scalars: Tensor, storage_dtype: torch.dtype, *, what: str) -> None:
    """Raise ``ValueError`` if a stored scalar is not finite (for float16 storage the message
    names bfloat16 storage as the way out)."""
    if not torch.isfinite(scalars).all():
        raise ValueError(storage_range_message(what, storage_dtype))


class MinMaxCodes(NamedTuple):
    """Asymmetric min-max codes: ``codes`` uint8 (input shape), ``scale``/``zero`` (storage
    dtype, the input shape without the reduced dimension)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor


def minmax_quantize(
    x: Tensor, bits: int, dim: int, storage_dtype: torch.dtype = torch.float16
) -> MinMaxCodes:
    """Asymmetric min-max quantization along ``dim`` (KIVI, Liu et al. 2024).

    Args:
        x: floating tensor; for exact zero points it should already be storage-rounded.
        bits: code width (1..8).
        dim: the dimension reduced by min/max (the group's tokens for per-channel keys, the
            channels for per-token values).
        storage_dtype: dtype of the stored scale and zero point.

    Returns:
        :class:`MinMaxCodes`. ``zero`` is ``min`` rounded to the storage dtype, ``scale`` is
        ``(max - min) / (2**bits - 1)`` rounded to the storage dtype; codes are chosen against
        those stored values. A scale of 0 (constant input, or a range below the storage
        dtype's resolution) gives codes 0. A non-finite stored scalar (possible only for
        inputs that were not storage-rounded) yields codes 0 there; callers check it with
        :func:`check_storage_scalars`.
    """
    levels = _levels(bits)
    _check_storage_dtype(storage_dtype)
    x64 = x.to(torch.float64)
    lo = x64.amin(dim=dim, keepdim=True)
    hi = x64.amax(dim=dim, keepdim=True)
    zero = lo.to(storage_dtype)
    scale = ((hi - lo) / levels).to(storage_dtype)
    z64 = zero.to(torch.float64)
    s64 = scale.to(torch.float64)
    valid = (s64 > 0) & torch.isfinite(s64) & torch.isfinite(z64)
    ratio = (x64 - z64) / torch.where(valid, s64, torch.ones_like(s64))
    codes = torch.where(valid, torch.round(ratio).clamp(0, levels), torch.zeros_like(ratio))
    return MinMaxCodes(codes.to(torch.uint8), scale.squeeze(dim), zero.squeeze(dim))


def minmax_dequantize(codes: Tensor, scale: Tensor, zero: Tensor, dim: int) -> Tensor:
    """``zero + code * scale`` in float32, broadcasting ``scale``/``zero`` along ``dim`` of
    ``codes`` (the dimension :func:`minmax_quantize` reduced)."""
    return zero.float().unsqueeze(dim) + codes.float() * scale.float().unsqueeze(dim)


def shortest_arc(phases: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The shortest arc of the circle covering all phases along ``dim``.

    The complement of the largest gap between circularly consecutive phases: sort, take the
    gaps (including the wrap-around gap ``first + 2π - last``), and start the arc right after
    the largest one (ties: the first in sorted order).

    Args:
        phases: angles in radians, in (-π, π] (as returned by ``atan2``).
        dim: the dimension whose entries the arc must cover (must be non-empty).

    Returns:
        ``(start, span)`` in float64 radians, ``dim`` reduced: the arc is
        ``[start, start + span]`` counter-clockwise, ``start`` is one of the phases and
        ``0 <= span < 2π``.
    """
    p = phases.to(torch.float64)
    n = p.shape[dim]
    if n == 0:
        raise ValueError("shortest_arc needs at least one phase")
    s, _ = torch.sort(p, dim=dim)
    first = s.narrow(dim, 0, 1)
    last = s.narrow(dim, n - 1, 1)
    gaps = torch.cat([torch.diff(s, dim=dim), first + _TWO_PI - last], dim=dim)
    k = torch.argmax(gaps, dim=dim, keepdim=True)
    max_gap = torch.gather(gaps, dim, k)
    start = torch.gather(s, dim, (k + 1) % n)
    # largest gap = the wrap-around one: the arc is [first, last], span exactly last - first
    span = torch.where(k == n - 1, last - first, (_TWO_PI - max_gap).clamp_min(0.0))
    return start.squeeze(dim), span.squeeze(dim)


def phase_levels(offset: Tensor, span: Tensor, bits: int) -> Tensor:
    """Float32 phase levels ``offset + c * (span / L)`` for ``c = 0 .. L``: shape
    ``[*offset.shape, 2**bits]`` (radians). Dequantization and packed attention both read
    their cos/sin tables from here, so they agree bit for bit on the levels."""
    levels = _levels(bits)
    step = span.float() / levels
    c = torch.arange(levels + 1, device=offset.device, dtype=torch.float32)
    return offset.float().unsqueeze(-1) + c * step.unsqueeze(-1)


class PhaseNormCodes(NamedTuple):
    """Phase–Norm codes of rotary pairs: ``norm_codes``/``phase_codes`` uint8 (input shape);
    ``norm_scale``, ``norm_zero``, ``phase_span``, ``phase_offset`` in the storage dtype (input
    shape without the token dimension). ``norm_zero`` may be non-finite when the smallest norm
    exceeds the storage range: check it before storing."""

    norm_codes: Tensor
    phase_codes: Tensor
    norm_scale: Tensor
    norm_zero: Tensor
    phase_span: Tensor
    phase_offset: Tensor


def phase_norm_quantize(
    a: Tensor, b: Tensor, bits: int, dim: int, storage_dtype: torch.dtype = torch.float16
) -> PhaseNormCodes:
    """Phase–Norm coding of pairs ``(a, b)`` over the tokens along ``dim`` (docs/design.md,
    "Key codecs").

    Args:
        a, b: the pair's first and second channels, same shape (storage-rounded).
        bits: code width of the norm and of the phase (1..8).
        dim: the token dimension (the group the scalars are shared over).
        storage_dtype: dtype of the stored scalars.

    Returns:
        :class:`PhaseNormCodes`. The norm is min-max coded; the phase code is
        ``clamp(round(rel / span * L), 0, L)`` where ``rel`` is the phase's counter-clockwise
        distance from the stored offset, measured from the arc's midpoint so that rounding of
        the stored offset/span can never wrap a phase to the far end. ``span == 0`` gives
        phase codes 0 (the phase reconstructs as the stored offset).
    """
    levels = _levels(bits)
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    norm = torch.sqrt(a64 * a64 + b64 * b64)
    norm_q = minmax_quantize(norm, bits, dim, storage_dtype)
    phase = torch.atan2(b64, a64)
    start, span = shortest_arc(phase, dim)
    offset_s = start.to(storage_dtype)
    span_s = span.to(storage_dtype)
    off64 = offset_s.to(torch.float64).unsqueeze(dim)
    span64 = span_s.to(torch.float64).unsqueeze(dim)
    centred = torch.remainder(phase - (off64 + span64 / 2) + math.pi, _TWO_PI) - math.pi
    rel = centred + span64 / 2
    positive = span64 > 0
    ratio = rel / torch.where(positive, span64, torch.ones_like(span64))
    codes = torch.where(
        positive, torch.round(ratio * levels).clamp(0, levels), torch.zeros_like(rel)
    )
    return PhaseNormCodes(
        norm_codes=norm_q.codes,
        phase_codes=codes.to(torch.uint8),
        norm_scale=norm_q.scale,
        norm_zero=norm_q.zero,
        phase_span=span_s,
        phase_offset=offset_s,
    )


def _gather_levels(table: Tensor, codes: Tensor, dim: int) -> Tensor:
    """Per-pair level tables ``[..., P, 2**b]`` (token dim absent) read at ``codes``."""
    table = table.unsqueeze(dim - 1 if dim < 0 else dim)
    shape = [*codes.shape, table.shape[-1]]
    return torch.gather(table.expand(shape), -1, codes.long().unsqueeze(-1)).squeeze(-1)


def phase_norm_dequantize(
    norm_codes: Tensor,
    phase_codes: Tensor,
    norm_scale: Tensor,
    norm_zero: Tensor,
    phase_span: Tensor,
    phase_offset: Tensor,
    bits: int,
    dim: int,
) -> tuple[Tensor, Tensor]:
    """Float32 reconstruction ``r_hat * (cos phi_hat, sin phi_hat)`` of Phase–Norm codes.

    ``dim`` is the token dimension of the codes; the scalars lack it. ``cos``/``sin`` are
    taken of the :func:`phase_levels` table and then read at the codes (the same table packed
    attention uses). Returns ``(a_hat, b_hat)`` with the codes' shape.
    """
    r_hat = minmax_dequantize(norm_codes, norm_scale, norm_zero, dim)
    lv = phase_levels(phase_offset, phase_span, bits)
    cos_hat = _gather_levels(torch.cos(lv), phase_codes, dim)
    sin_hat = _gather_levels(torch.sin(lv), phase_codes, dim)
    return r_hat * cos_hat, r_hat * sin_hat


class ChannelwiseKeyCodes(NamedTuple):
    """One key group in the pair-slot convention (module docstring): ``codes`` uint8
    ``[..., T, D]``, ``scale``/``zero`` storage dtype ``[..., D]``."""

    codes: Tensor
    scale: Tensor
    zero: Tensor


def quantize_keys_channelwise(
    keys: Tensor,
    bits: int,
    first: Tensor,
    second: Tensor,
    phase_norm_pairs: Tensor,
    storage_dtype: torch.dtype = torch.float16,
) -> ChannelwiseKeyCodes:
    """Quantize one key group per channel, Phase–Norm on the selected rotary pairs.

    Args:
        keys: storage-rounded keys ``[..., T, D]`` (``T`` = the group's tokens).
        bits: code width (1..8).
        first, second: int64 ``[P]`` channel indices of the rotary pairs.
        phase_norm_pairs: bool ``[..., P]`` (broadcastable to ``keys.shape[:-2] + (P,)``);
            True = Phase–Norm, False = Cartesian. Channels outside the pairs are Cartesian.
        storage_dtype: dtype of the stored scalars.

    Returns:
        :class:`ChannelwiseKeyCodes` in the pair-slot convention.

    Raises:
        ValueError: a selected Phase–Norm pair's norm zero point exceeds the storage range
            (float16: the message names bfloat16 storage).
    """
    cart = minmax_quantize(keys, bits, -2, storage_dtype)
    if first.numel() == 0:
        return ChannelwiseKeyCodes(cart.codes, cart.scale, cart.zero)
    first = first.to(keys.device)
    second = second.to(keys.device)
    pn = phase_norm_quantize(keys[..., first], keys[..., second], bits, -2, storage_dtype)
    sel = torch.broadcast_to(phase_norm_pairs.to(keys.device), cart.scale[..., first].shape)
    check_storage_scalars(pn.norm_zero[sel], storage_dtype, what="a Phase–Norm key pair norm")
    codes = cart.codes.clone()
    scale = cart.scale.clone()
    zero = cart.zero.clone()
    tok_sel = sel.unsqueeze(-2)
    codes[..., first] = torch.where(tok_sel, pn.norm_codes, cart.codes[..., first])
    codes[..., second] = torch.where(tok_sel, pn.phase_codes, cart.codes[..., second])
    scale[..., first] = torch.where(sel, pn.norm_scale, cart.scale[..., first])
    zero[..., first] = torch.where(sel, pn.norm_zero, cart.zero[..., first])
    scale[..., second] = torch.where(sel, pn.phase_span, cart.scale[..., second])
    zero[..., second] = torch.where(sel, pn.phase_offset, cart.zero[..., second])
    return ChannelwiseKeyCodes(codes, scale, zero)


def dequantize_keys_channelwise(
    codes: Tensor,
    scale: Tensor,
    zero: Tensor,
    bits: int,
    first: Tensor,
    second: Tensor,
    phase_norm_pairs: Tensor,
) -> Tensor:
    """Float32 keys ``[..., T, D]`` from a group in the pair-slot convention (inverse of
    :func:`quantize_keys_channelwise` up to quantization error)."""
    out = minmax_dequantize(codes, scale, zero, -2)
    if first.numel() == 0:
        return out
    first = first.to(codes.device)
    second = second.to(codes.device)
    a_hat, b_hat = phase_norm_dequantize(
        codes[..., first],
        codes[..., second],
        scale[..., first],
        zero[..., first],
        scale[..., second],
        zero[..., second],
        bits,
        -2,
    )
    sel = torch.broadcast_to(phase_norm_pairs.to(codes.device), scale[..., first].shape)
    sel = sel.unsqueeze(-2)
    out[..., first] = torch.where(sel, a_hat, out[..., first])
    out[..., second] = torch.where(sel, b_hat, out[..., second])
    return out


def key_pair_errors(
    keys: Tensor,
    bits: int,
    first: Tensor,
    second: Tensor,
    storage_dtype: torch.dtype = torch.float16,
) -> tuple[Tensor, Tensor]:
    """Saliency: each rotary pair's reconstruction error under both codings.

    Args:
        keys: storage-rounded keys ``[..., T, D]`` of one group.
        bits, first, second, storage_dtype: as in :func:`quantize_keys_channelwise`.

    Returns:
        ``(cartesian, phase_norm)``: float64 ``[..., P]``, the sum over the group's tokens and
        the pair's two channels of the squared error between the float32 reconstruction (what
        :func:`dequantize_keys_channelwise` returns) and ``keys``. A pair whose Phase–Norm
        scalars would not be finite in the storage dtype gets ``+inf`` (it cannot be stored).
    """
    first = first.to(keys.device)
    second = second.to(keys.device)
    a = keys[..., first]
    b = keys[..., second]
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    cart_a = minmax_quantize(a, bits, -2, storage_dtype)
    cart_b = minmax_quantize(b, bits, -2, storage_dtype)
    ca = minmax_dequantize(*cart_a, dim=-2).double()
    cb = minmax_dequantize(*cart_b, dim=-2).double()
    cart_err = ((ca - a64) ** 2 + (cb - b64) ** 2).sum(dim=-2)
    pn = phase_norm_quantize(a, b, bits, -2, storage_dtype)
    pa, pb = phase_norm_dequantize(*pn, bits=bits, dim=-2)
    pn_err = ((pa.double() - a64) ** 2 + (pb.double() - b64) ** 2).sum(dim=-2)
    pn_err = torch.where(torch.isfinite(pn.norm_zero), pn_err, torch.full_like(pn_err, math.inf))
    return cart_err, pn_err
