"""Rotation by RoPE angles: :func:`apply_rotary` (raw queries/keys to their positions),
:func:`rotate_by_delta` (relaying rotated keys) and :func:`rotation_tables` (the cos/sin that
compiled code reproduces); numerics and :data:`ROTATION_ERROR_BOUND` in :mod:`kvlab.rope`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.rope.config import RotaryConfig

__all__ = ["ROTATION_ERROR_BOUND", "apply_rotary", "rotate_by_delta", "rotation_tables"]

#: Per-component error bound of a float32 rotation, relative to the pair norm, for
#: ``|position| <= 2**24``; the derivation is in :mod:`kvlab.rope`'s docstring.
ROTATION_ERROR_BOUND: float = 4.0 * 2.0**-24


def _as_positions(positions: Tensor | int | float, x: Tensor, name: str) -> Tensor:
    """Validate ``positions`` against ``x [..., D]``; return it as float64 on x's device."""
    if isinstance(positions, (int, float)) and not isinstance(positions, bool):
        return torch.tensor(float(positions), dtype=torch.float64, device=x.device)
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a tensor or a number, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(
            f"{name} must be an integer or real floating tensor, got {positions.dtype}"
        )
    if positions.device != x.device:
        raise ValueError(f"{name} is on {positions.device} but x is on {x.device}")
    lead = tuple(x.shape[:-1])
    try:
        broadcast = tuple(torch.broadcast_shapes(tuple(positions.shape), lead))
    except RuntimeError:
        broadcast = None
    if broadcast != lead:
        raise ValueError(
            f"{name} of shape {tuple(positions.shape)} does not broadcast to x.shape[:-1]={lead}"
        )
    return positions.to(torch.float64)


def _cos_sin(
    positions64: Tensor, cfg: RotaryConfig, dtype: torch.dtype, factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos/sin of ``positions * inv_freq`` formed in float64, cast to ``dtype``: ``[..., P]``.

    ``factor`` multiplies both (HF's attention_scaling); 1.0 is a pure rotation.
    """
    angles = positions64.unsqueeze(-1) * cfg._inv_freq_on(positions64.device)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _check_x(x: Tensor, cfg: RotaryConfig) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"x must have last dimension head_dim={cfg.head_dim}, got shape {tuple(x.shape)}"
        )


def _rotate(
    x: Tensor,
    positions64: Tensor,
    cfg: RotaryConfig,
    *,
    factor: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Rotate the rotary channels of ``x [..., D]`` by ``positions64 * inv_freq``.

    Rotation runs in float32 (float64 for float64 ``x``); the result is ``out_dtype`` (default
    x's dtype), the non-rotary tail is x's own channels (cast only if ``out_dtype`` differs).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute = torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32
    r, p = cfg.rotary_dim, cfg.num_pairs
    cos, sin = _cos_sin(positions64, cfg, compute, factor)
    rot = x[..., :r].to(compute)
    if cfg.layout == "half":
        x1, x2 = rot[..., :p], rot[..., p:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    if cfg.layout == "half":
        out = torch.cat((y1, y2), dim=-1)
    else:
        out = torch.stack((y1, y2), dim=-1).flatten(-2)
    out = out.to(out_dtype)
    if r < cfg.head_dim:
        out = torch.cat((out, x[..., r:].to(out_dtype)), dim=-1)
    return out


def apply_rotary(
    x: Tensor,
    positions: Tensor | int | float,
    cfg: RotaryConfig,
    *,
    attention_scaling: bool = False,
) -> Tensor:
    """Rotate raw queries or keys to their positions (RoPE; Su et al. 2021, eq. 34).

    Args:
        x: ``[..., S, D]`` (any leading dims, ``D == cfg.head_dim``), any floating dtype.
        positions: token positions (integer or floating tensor, or a number), broadcastable to
            ``x.shape[:-1]`` (e.g. ``[S]``, ``[B, 1, S]``, ``[B, H, S]``), on x's device.
        cfg: the rotary configuration.
        attention_scaling: multiply cos and sin by ``cfg.attention_scaling`` as HF's rotary
            embedding does (only yarn differs from 1.0). Off by default: then a pure rotation.

    Returns:
        Tensor of x's shape and dtype: rotary channels rotated (angles in float64, rotation in
        float32, or float64 for float64 x), channels ``rotary_dim..`` bit-identical. The input
        is not modified; the op is differentiable. Error bound: see ``ROTATION_ERROR_BOUND``.

    Raises:
        ValueError: x not floating or wrong last dimension; positions not a real tensor, on
            another device, or not broadcastable to ``x.shape[:-1]``.
    """
    _check_x(x, cfg)
    pos = _as_positions(positions, x, "positions")
    factor = cfg.attention_scaling if attention_scaling else 1.0
    return _rotate(x, pos, cfg, factor=factor)


def rotate_by_delta(x: Tensor, delta: Tensor | int | float, cfg: RotaryConfig) -> Tensor:
    """Relay already-rotated keys by a position delta: a pure rotation by ``delta * inv_freq``.

    ``rotate_by_delta(apply_rotary(k, p, cfg), p2 - p, cfg) == apply_rotary(k, p2, cfg)`` up to
    rounding (rotations compose additively). Never multiplies by an attention factor, so every
    rotary pair keeps its norm (up to rounding).

    Args:
        x: rotated keys ``[..., S, D]``, any floating dtype.
        delta: position deltas (integer or floating tensor, or a number) broadcastable to
            ``x.shape[:-1]``, on x's device.
        cfg: the rotary configuration the keys were rotated with.

    Returns:
        Tensor of x's shape and dtype; non-rotary channels bit-identical; input not modified.

    Raises:
        ValueError: as :func:`apply_rotary`.
    """
    _check_x(x, cfg)
    return _rotate(x, _as_positions(delta, x, "delta"), cfg)


def rotation_tables(
    delta: Tensor, cfg: RotaryConfig, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The cos and sin by which :func:`rotate_by_delta` rotates: ``[..., P]`` of ``delta *
    inv_freq`` (angles in float64), cast to ``dtype`` — the rotation's precision, float32 unless
    the keys are float64. For compiled code that must reproduce :func:`rotate_by_delta` bit for
    bit (``y1 = x1 cos - x2 sin``, ``y2 = x1 sin + x2 cos``, each product and sum rounded to
    ``dtype``; pairs of :meth:`RotaryConfig.pair_indices`, entry ``p`` for pair ``p``).

    Args:
        delta: position deltas ``[...]`` (integer or floating tensor; tokens).
        cfg: the rotary configuration.
        dtype: floating dtype of the tables.

    Returns:
        ``(cos, sin)``, each ``[..., P]`` in ``dtype`` on ``delta``'s device.

    Raises:
        ValueError: ``delta`` not a real tensor.
    """
    if not isinstance(delta, Tensor) or delta.dtype == torch.bool or delta.is_complex():
        raise ValueError("delta must be an integer or real floating tensor")
    return _cos_sin(delta.to(torch.float64), cfg, dtype)
