"""The tables both compiled packed-attention backends read besides the store's buffers
(docs/design.md, "Kernels"): RoPE cos/sin tables, the value-Hadamard matrix, and the
issue-8 arguments of the CPU and Triton kernels' entry points (:func:`extra_arguments`).

Shared by :mod:`kvlab.pnmix.kernels.cpu` and :mod:`kvlab.pnmix.kernels.triton_decode`; the
tables are cached per configuration and device (never rebuilt by a decode step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.hadamard import hadamard_matrix
from kvlab.pnmix.kernels.spec import KEYS_WIDTHS, KernelKeyDecode
from kvlab.rope import RotaryConfig

__all__ = ["extra_arguments", "hadamard_table", "rope_table"]

_EMPTY = torch.empty(0)
_ROPE_TABLES: dict[tuple[RotaryConfig, torch.device], tuple[int, Tensor, Tensor]] = {}
_HADAMARD: dict[tuple[int, torch.device], Tensor] = {}


def rope_table(
    rotary: RotaryConfig, lo: int, hi: int, device: torch.device | None = None
) -> tuple[int, Tensor, Tensor]:
    """cos and sin of ``position * inv_freq`` for every position in ``[lo, hi)`` (and more):
    ``(base, cos, sin)`` with float32 ``[rows, P]`` tables whose row ``i`` is position ``base
    + i``; formed in float64 and rounded to float32, exactly as
    :func:`kvlab.rope.rotate_by_delta` forms them (so that the kernel's rotated keys are the
    reference's). Cached per RoPE configuration and device (default: the CPU) and grown by
    doubling (amortized: a decode step almost never rebuilds or copies it)."""
    device = torch.device("cpu") if device is None else device
    cached = _ROPE_TABLES.get((rotary, device))
    if cached is not None:
        base, cos, _ = cached
        if base <= lo and hi <= base + cos.shape[0]:
            return cached
        lo = min(lo, base)
        hi = max(hi, base + 2 * cos.shape[0])
    lo = min(lo, 0)
    hi = max(hi, 4096)
    positions = torch.arange(lo, hi, dtype=torch.float64)
    angles = positions[:, None] * rotary.inv_freq()[None, :]
    cos = torch.cos(angles).float().contiguous().to(device)
    sin = torch.sin(angles).float().contiguous().to(device)
    table = (lo, cos, sin)
    _ROPE_TABLES[(rotary, device)] = table
    return table


def hadamard_table(dv: int, device: torch.device) -> Tensor:
    """The float32 Hadamard matrix ``[dv, dv]`` of the value transform on ``device`` (contiguous,
    cached per size and device; :func:`kvlab.pnmix.hadamard.hadamard_matrix`)."""
    h = _HADAMARD.get((dv, device))
    if h is None:
        h = _HADAMARD[(dv, device)] = hadamard_matrix(dv, torch.float32).contiguous().to(device)
    return h


def extra_arguments(
    decode: KernelKeyDecode,
    *,
    mask: Tensor | None,
    payload: Tensor | None,
    rotary: RotaryConfig | None,
    position_offsets: np.ndarray | None,
    group_counts: np.ndarray,
    sink_tokens: int,
    group_tokens: int,
    value_head_dim: int,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int, Tensor, int, Tensor]:
    """The issue-8 arguments of the kernels' entry points (empty tensors where unused):
    widths, payload, cos, sin, table base, position offsets, sink tokens, value transform.
    The cos/sin tables and the transform live on ``device`` (default: the CPU), cached; the
    position offsets are a host tensor."""
    device = torch.device("cpu") if device is None else device
    empty = _EMPTY
    widths = empty
    if decode.kind == KEYS_WIDTHS:  # the uint8 width table
        assert mask is not None
        widths = mask.contiguous()
    pay = payload if decode.payload_bytes and payload is not None else empty
    cos = sin = offsets = empty
    base = 0
    if decode.rotate_to_position:
        assert rotary is not None and position_offsets is not None
        first = position_offsets + sink_tokens
        last = first + group_counts * group_tokens
        used = group_counts > 0
        lo = int(first[used].min()) if used.any() else 0
        hi = int(last[used].max()) if used.any() else 1
        base, cos, sin = rope_table(rotary, lo, hi, device)
        offsets = torch.from_numpy(np.ascontiguousarray(position_offsets, dtype=np.int64))
    had = hadamard_table(value_head_dim, device) if decode.value_hadamard else empty
    return widths, pay, cos, sin, base, offsets, sink_tokens, had
