"""The compiled CPU statistics of PN-Mix per-pair width tables (docs/design.md, "Per-pair
tables", "Flush"): :func:`table_distortion_cpu` gives the bits of
:meth:`~kvlab.pnmix.width_codec.BitAllocCodec.table_distortion` (the torch reference).

The kernel (``table_terms`` in ``cpu_tables.cpp``, compiled into the module of
:mod:`kvlab.pnmix.kernels.cpu`) forms the reference's per-token terms — the coding error of
every candidate width, rotated to the keys' positions, weighted by the query moment — with the
same IEEE operations (:func:`table_terms_cpu`); the sums over tokens and over a row's groups
stay torch reductions of the shapes the reference reduces (:func:`distortion_from_terms`), so
their order is the reference's too. The kernel also returns each group's outliers, which the
compiled flush then takes instead of selecting them again
(:func:`~kvlab.pnmix.kernels.cpu.encode_groups_cpu`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.pnmix.kernels import cpu
from kvlab.pnmix.key_codec import KeyLayout, TableStatistics
from kvlab.pnmix.width_codec import BitAllocCodec
from kvlab.rope import rotation_tables

__all__ = ["distortion_from_terms", "table_distortion_cpu", "table_terms_cpu"]

_EMPTY = torch.empty(0)


def table_terms_cpu(
    keys: Tensor,
    *,
    layout: KeyLayout,
    widths: tuple[int, ...],
    outliers: int,
    frame_tables: tuple[Tensor, Tensor] | None = None,
    error_tables: tuple[Tensor, Tensor] | None = None,
    pair_moment: Tensor | None = None,
    owner: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """The per-token terms of the width-table statistics by the compiled kernel.

    Args:
        keys: float16 ``[G, T, D]`` on the CPU: storage-rounded keys in the codec's frame,
            or as gathered when ``frame_tables`` rotates them there.
        layout: the head's pairs.
        widths: the candidate widths ``W``.
        outliers: outliers per group ``K``.
        frame_tables: float32 ``(cos, sin)`` ``[G, T, P]`` of ``-positions``
            (:func:`kvlab.rope.rotation_tables`), or ``None``.
        error_tables: float64 ``(cos, sin)`` ``[G, T, P]`` of the positions (the coding
            error's rotation), or ``None``.
        pair_moment: float64 ``[N, 3, P]`` (:attr:`TableStatistics.pair_moment`) with
            ``owner`` int64 ``[G]`` (each group's row), or ``None`` (plain squared errors).

    Returns:
        ``(terms, outlier_index)``: float64 ``[W, G, T, P]`` and int32 ``[G, K]`` (ascending),
        or ``None`` where the reference must compute them (a frame key that is a negative
        zero or not finite).

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    module = cpu.loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    fcos, fsin = frame_tables if frame_tables is not None else (_EMPTY, _EMPTY)
    ecos, esin = error_tables if error_tables is not None else (_EMPTY, _EMPTY)
    moment = _EMPTY if pair_moment is None else pair_moment.to(torch.float64).contiguous()
    out = module.table_terms(
        keys.contiguous(),
        fcos.contiguous(),
        fsin.contiguous(),
        ecos.contiguous(),
        esin.contiguous(),
        layout.first,
        layout.second,
        torch.tensor(widths, dtype=torch.int64),
        outliers,
        moment,
        _EMPTY if owner is None else owner.to(torch.int64).contiguous(),
    )
    if not out:
        return None
    return out[0], out[1]


def distortion_from_terms(terms: Tensor, owner: Tensor, rows: int) -> Tensor:
    """float64 ``[W, N, P]`` from the terms ``[W, G, T, P]``: the reference's reductions, over
    tokens of ``[G, 1, T, P]``, then over each row's groups (``index_add_`` by ``owner``)."""
    owner = owner.to(torch.int64)
    dist = []
    for w in range(terms.shape[0]):
        per_group = terms[w].unsqueeze(1).sum(-2)[:, 0]
        dist.append(per_group.new_zeros((rows, terms.shape[-1])).index_add_(0, owner, per_group))
    return torch.stack(dist)


def table_distortion_cpu(codec: BitAllocCodec, stats: TableStatistics) -> Tensor | None:
    """:meth:`BitAllocCodec.table_distortion` of ``stats`` by the compiled kernel: float64
    ``[W, N, P]``, bit for bit the reference's; or ``None`` where the reference must compute
    it (a frame key that is a negative zero or not finite).

    Args:
        codec: the width codec (exactly :class:`BitAllocCodec`, with a table).
        stats: float16 frame keys on the CPU (storage-rounded, ``T <= 8192`` tokens, ``T * D
            <= 2**15`` when there are outliers), their rows, the moment and positions.

    Raises:
        RuntimeError: the kernel is not loaded.
        ValueError: a codec without a table, or keys that are not float16 on the CPU.
    """
    if codec.table_bits == 0:
        raise ValueError(f"{codec} keeps no per-pair table")
    keys = stats.keys
    if keys.dtype != torch.float16 or keys.device.type != "cpu":
        raise ValueError(f"the compiled statistics take float16 CPU keys, got {keys.dtype}")
    moment = stats.moment_entries() if codec.query_aware else None
    error_tables = None
    if moment is not None and stats.positions is not None and stats.rotary is not None:
        error_tables = rotation_tables(stats.positions, stats.rotary, torch.float64)
    t, d = keys.shape[1:]
    out = table_terms_cpu(
        keys,
        layout=stats.layout,
        widths=codec.widths,
        outliers=codec.outlier_count(t, d),
        error_tables=error_tables,
        pair_moment=moment,
        owner=stats.owner,
    )
    if out is None:
        return None
    return distortion_from_terms(out[0], stats.owner, stats.num_rows)
