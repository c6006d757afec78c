"""The pre-RoPE frame of a key group (KVQuant, Hooper et al. 2024, arXiv:2401.18079, §3.2).

A PN-Mix cache receives keys already rotated by RoPE at their positions. Per-channel min-max
codes of rotated keys mix each pair's two channels at a position-dependent angle, which
spreads the channel ranges; rotated back to position 0 ("pre-RoPE"), each channel's values
over a group are those the key projection produced, whose ranges are narrower and
channel-aligned. A pre-RoPE codec therefore codes :func:`to_prerope` of the group and decodes
with :func:`from_prerope` (or, in packed attention, rotates each query by the key's position
instead — the same logits up to float32 rounding).

Conventions: the rotation is :func:`kvlab.rope.rotate_by_delta` (partial rotary, interleaved
layout and scaled frequencies follow the :class:`~kvlab.rope.RotaryConfig`); the pre-RoPE key
is rounded to the storage dtype once, after the rotation (it is what a codec stores or codes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.pnmix.quantizers import round_to_storage
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["from_prerope", "to_prerope"]


def _positions(positions: Tensor, keys: Tensor) -> Tensor:
    if not isinstance(positions, Tensor) or positions.dtype == torch.bool:
        raise ValueError("positions must be an integer or floating tensor")
    if positions.is_floating_point() and not torch.isfinite(positions).all():
        raise ValueError("positions must be finite")
    return positions.to(keys.device)


def to_prerope(
    keys: Tensor,
    positions: Tensor,
    rotary: RotaryConfig,
    storage_dtype: torch.dtype = torch.float16,
) -> Tensor:
    """Rotate keys back from their positions to position 0 and round to the storage dtype.

    Args:
        keys: RoPE-rotated keys ``[..., T, D]`` (``D == rotary.head_dim``), any floating dtype.
        positions: positions (tokens) broadcastable to ``keys.shape[:-1]``, e.g. ``[T]``.
        rotary: the model's RoPE.
        storage_dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        ``[..., T, D]`` in ``storage_dtype``: ``rotate_by_delta(keys, -positions)`` rounded;
        non-rotary channels are the keys' own (rounded).

    Raises:
        ValueError: bad shapes or dtypes (see :func:`kvlab.rope.rotate_by_delta`), non-finite
            results or values beyond the storage range
            (:func:`kvlab.pnmix.quantizers.round_to_storage`).
    """
    pos = _positions(positions, keys)
    return round_to_storage(rotate_by_delta(keys, -pos, rotary), storage_dtype, name="keys")


def from_prerope(keys: Tensor, positions: Tensor, rotary: RotaryConfig) -> Tensor:
    """Rotate pre-RoPE (decoded) keys ``[..., T, D]`` forward to their positions: float32
    ``rotate_by_delta(keys.float(), positions)``.

    Raises:
        ValueError: as :func:`kvlab.rope.rotate_by_delta`.
    """
    pos = _positions(positions, keys)
    return rotate_by_delta(keys.float(), pos, rotary)
