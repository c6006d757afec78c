"""Dense-and-sparse min-max coding of a key group (KVQuant, Hooper et al. 2024,
arXiv:2401.18079, §3.3).

Per group and per sequence/kv head, a fixed number ``count`` of elements of the ``[T, D]``
group — those farthest from their channel's median over the group's tokens — are kept exact
in a sparse side table (the storage-dtype value and an int16 index ``t * D + d`` into the
group), excluded from their channel's min and max, and written back exactly on decode. The
rest is coded per channel by min-max as :func:`kvlab.pnmix.quantizers.minmax_quantize` does
(codes chosen against the storage-rounded scalars; an outlier's own code is 0 and unused).

Bytes per group and (sequence, kv head): the dense codes plus the scalars as without outliers,
plus ``count * (element_size(storage dtype) + 2)`` — see :func:`sparse_outlier_bytes`.
A fixed count per group keeps the storage size a function of the length alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvlab.pnmix.quantizers import STORAGE_DTYPES, MinMaxCodes

__all__ = [
    "SparseMinMaxCodes",
    "minmax_excluding",
    "outlier_count",
    "select_outliers",
    "sparse_minmax_dequantize",
    "sparse_minmax_quantize",
    "sparse_outlier_bytes",
]

_INDEX_DTYPE = torch.int16
_MAX_GROUP_ELEMENTS = 1 << 15  # int16 indices


class SparseMinMaxCodes(NamedTuple):
    """Dense-and-sparse codes of groups ``[..., T, D]``: ``codes`` uint8 ``[..., T, D]``;
    ``scale``/``zero`` storage dtype ``[..., D]``; ``outlier_values`` storage dtype
    ``[..., K]``; ``outlier_index`` int16 ``[..., K]`` (flat ``t * D + d``, ascending)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor
    outlier_values: Tensor
    outlier_index: Tensor


def outlier_count(fraction: float, tokens: int, head_dim: int) -> int:
    """Outliers per group and (sequence, kv head): ``round(fraction * tokens * head_dim)``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"outlier fraction must lie in [0, 1), got {fraction!r}")
    return round(fraction * tokens * head_dim)


def sparse_outlier_bytes(count: int, storage_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of ``count`` sparse outliers: value (storage dtype) + int16 index each."""
    return count * (torch.empty(0, dtype=storage_dtype).element_size() + 2)


def _check(x: Tensor, count: int) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError("x must be a floating tensor [..., T, D]")
    t, d = x.shape[-2:]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < t * d:
        raise ValueError(f"count must be an int in 0..{t * d - 1} (T * D - 1), got {count!r}")
    if t * d > _MAX_GROUP_ELEMENTS:
        raise ValueError(
            f"a group of {t * d} elements exceeds int16 indices ({_MAX_GROUP_ELEMENTS})"
        )


def select_outliers(x: Tensor, count: int) -> Tensor:
    """Flat indices ``t * D + d`` of the ``count`` elements of each ``[T, D]`` group farthest
    from their channel's median over the tokens (float64 distances; ties: the lower index).

    Args:
        x: ``[..., T, D]`` floating.
        count: outliers per group, ``0 <= count < T * D``.

    Returns:
        int64 ``[..., count]``, ascending.

    Raises:
        ValueError: bad ``x`` or ``count``.
    """
    _check(x, count)
    x64 = x.double()
    # lower median (torch.median), the same for every caller
    med = x64.median(dim=-2, keepdim=True).values
    dist = (x64 - med).abs().flatten(-2)
    # stable order: distance descending, then index ascending
    order = torch.sort(dist, dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.sort(order, dim=-1).values


def sparse_minmax_quantize(
    x: Tensor, bits: int, count: int, storage_dtype: torch.dtype = torch.float16
) -> SparseMinMaxCodes:
    """Dense-and-sparse per-channel min-max coding of groups ``x [..., T, D]`` (module
    docstring).

    Args:
        x: storage-rounded keys ``[..., T, D]`` (codes run along ``T`` per channel).
        bits: dense code width, 1..8.
        count: outliers per group (see :func:`outlier_count`).
        storage_dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        :class:`SparseMinMaxCodes`. A channel whose every element is an outlier stores scale 0
        and zero 0.

    Raises:
        ValueError: bad ``x``, ``bits``, ``count`` or storage dtype; a value that is not finite
            in the storage dtype.
    """
    _check(x, count)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be float16 or bfloat16, got {storage_dtype!r}")
    stored = x.to(storage_dtype)
    if not torch.isfinite(stored).all():
        raise ValueError("x has values that are not finite in the storage dtype")
    index = select_outliers(stored, count)
    mask = torch.zeros_like(stored, dtype=torch.bool).flatten(-2)
    mask = mask.scatter_(-1, index, True).view_as(stored)
    dense = minmax_excluding(stored, mask, bits, storage_dtype)
    values = torch.gather(stored.flatten(-2), -1, index)
    return SparseMinMaxCodes(
        codes=dense.codes,
        scale=dense.scale,
        zero=dense.zero,
        outlier_values=values,
        outlier_index=index.to(_INDEX_DTYPE),
    )


def minmax_excluding(
    x: Tensor, exclude: Tensor, bits: int, storage_dtype: torch.dtype = torch.float16
) -> MinMaxCodes:
    """Per-channel min-max codes of ``x [..., T, D]`` along the tokens with the ``exclude``d
    elements left out of each channel's min and max (their codes are 0): the dense part of
    :func:`sparse_minmax_quantize`, without input checks and without any device-to-host read
    (the cache's decode path, docs/design.md "Host syncs").

    Args:
        x: storage-rounded ``[..., T, D]``.
        exclude: bool, ``x``'s shape.
        bits: code width, 1..8.
        storage_dtype: dtype of the stored scale and zero point.

    Returns:
        :class:`~kvlab.pnmix.quantizers.MinMaxCodes` (scale/zero ``[..., D]``). A channel
        whose every element is excluded stores scale 0 and zero 0; a channel with nothing
        excluded gets exactly :func:`~kvlab.pnmix.quantizers.minmax_quantize`'s codes and
        scalars (when those are finite).
    """
    levels = (1 << bits) - 1
    x64 = x.double()
    inf = torch.full_like(x64, torch.inf)
    lo = torch.where(exclude, inf, x64).amin(-2, keepdim=True)
    hi = torch.where(exclude, -inf, x64).amax(-2, keepdim=True)
    empty = lo > hi  # every element of the channel is excluded
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    zero = lo.to(storage_dtype)
    scale = ((hi - lo) / levels).to(storage_dtype)
    z64, s64 = zero.double(), scale.double()
    valid = (s64 > 0) & torch.isfinite(s64) & torch.isfinite(z64)
    ratio = (x64 - z64) / torch.where(valid, s64, torch.ones_like(s64))
    codes = torch.where(valid, torch.round(ratio).clamp(0, levels), torch.zeros_like(ratio))
    codes = torch.where(exclude, torch.zeros_like(codes), codes)
    return MinMaxCodes(codes.to(torch.uint8), scale.squeeze(-2), zero.squeeze(-2))


def sparse_minmax_dequantize(codes: SparseMinMaxCodes) -> Tensor:
    """Float32 ``[..., T, D]``: ``zero + code * scale`` per channel, with every outlier
    written back exactly (its storage-dtype value)."""
    dense = codes.zero.float().unsqueeze(-2) + codes.codes.float() * codes.scale.float().unsqueeze(
        -2
    )
    flat = dense.flatten(-2).clone()
    flat.scatter_(-1, codes.outlier_index.long(), codes.outlier_values.float())
    return flat.view_as(dense)
