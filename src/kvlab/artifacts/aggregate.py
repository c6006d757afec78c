"""Aggregation of per-seed results into the metric blocks of an artifact."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["aggregate_metrics", "numeric_per_seed"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate_metrics(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate per-seed metric dicts into an artifact ``metrics`` block.

    Args:
        per_seed: one mapping per seed, metric name to value (``int``, ``float`` or ``bool``),
            the same keys for every seed. A key named ``"seed"`` is ignored.

    Returns:
        Metrics in the key order of the first seed. A numeric metric becomes
        ``{"mean": statistics.mean(values), "std": statistics.stdev(values) (0.0 for one
        seed), "n": len(values)}``; the mean of integers that is integral stays an ``int``
        (``statistics.mean`` semantics). A boolean is ``True`` only if it is true for every seed.

    Raises:
        ValueError: no seeds, keys differing between seeds, a metric mixing booleans and
            numbers, a non-finite number, or a value that is neither number nor boolean.
    """
    if not per_seed:
        raise ValueError("aggregate_metrics needs at least one seed's results")
    keys = [k for k in per_seed[0] if k != "seed"]
    for index, row in enumerate(per_seed):
        row_keys = [k for k in row if k != "seed"]
        if sorted(row_keys) != sorted(keys):
            raise ValueError(
                f"seed result {index} has metrics {sorted(row_keys)}, expected {sorted(keys)}"
            )
    out: dict[str, Any] = {}
    for key in keys:
        values = [row[key] for row in per_seed]
        if all(isinstance(v, bool) for v in values):
            out[key] = all(values)
        elif all(_is_number(v) for v in values):
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"metric {key!r} has a non-finite value: {values}")
            std = float(statistics.stdev(values)) if len(values) > 1 else 0.0
            out[key] = {"mean": statistics.mean(values), "std": std, "n": len(values)}
        else:
            raise ValueError(f"metric {key!r} mixes types or is not numeric/boolean: {values}")
    return out


def numeric_per_seed(seeds: Sequence[int], per_seed: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The artifact's ``per_seed`` block: ``{"seed": s, <numeric metrics in order>}`` per seed
    (booleans are summarized in ``metrics`` only, as in the reference record).

    Raises:
        ValueError: ``seeds`` and ``per_seed`` differ in length.
    """
    if len(seeds) != len(per_seed):
        raise ValueError(f"{len(seeds)} seeds but {len(per_seed)} results")
    return [
        {"seed": int(seed), **{k: v for k, v in row.items() if k != "seed" and _is_number(v)}}
        for seed, row in zip(seeds, per_seed, strict=True)
    ]
