"""The compiled CPU statistics of PN-Mix per-pair width tables (docs/design.md, "Per-pair
tables", "Flush"): :func:`table_distortion_cpu` gives the bits of
:meth:`~kvlab.pnmix.width_codec.BitAllocCodec.table_distortion` (the torch reference).

The kernel (``table_terms`` in ``cpu_tables.cpp``, compiled into the module of
:mod:`kvlab.pnmix.kernels.cpu`) forms the reference's per-token terms — the coding error of
every candidate width, rotated to the keys' positions, weighted by the query moment — with the
same IEEE operations; the sums over tokens and over a row's groups stay torch reductions of
the shapes the reference reduces, so their order is the reference's too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.pnmix.kernels import cpu
from kvlab.pnmix.key_codec import TableStatistics
from kvlab.pnmix.width_codec import BitAllocCodec
from kvlab.rope import rotation_tables

__all__ = ["table_distortion_cpu"]

_EMPTY = torch.empty(0)


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
    module = cpu.loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    if codec.table_bits == 0:
        raise ValueError(f"{codec} keeps no per-pair table")
    keys, lay = stats.keys, stats.layout
    if keys.dtype != torch.float16 or keys.device.type != "cpu":
        raise ValueError(f"the compiled statistics take float16 CPU keys, got {keys.dtype}")
    moment = stats.moment_entries() if codec.query_aware else None
    cos = sin = _EMPTY
    if moment is not None and stats.positions is not None and stats.rotary is not None:
        cos, sin = rotation_tables(stats.positions, stats.rotary, torch.float64)
    owner = stats.owner.to(torch.int64).contiguous()
    t, d = keys.shape[1:]
    out = module.table_terms(
        keys.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        lay.first,
        lay.second,
        torch.tensor(codec.widths, dtype=torch.int64),
        codec.outlier_count(t, d),
        _EMPTY if moment is None else moment.to(torch.float64).contiguous(),
        owner,
    )
    if not out:
        return None
    terms = out[0]  # [W, G, T, P]
    rows, pairs = stats.num_rows, lay.num_pairs
    dist = []
    for w in range(terms.shape[0]):
        # the reference's reductions: over tokens of [G, 1, T, P], then over each row's groups
        per_group = terms[w].unsqueeze(1).sum(-2)[:, 0]
        dist.append(per_group.new_zeros((rows, pairs)).index_add_(0, owner, per_group))
    return torch.stack(dist)
