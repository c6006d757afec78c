"""Per-layer token budgets under a global budget: PyramidKV's pyramid, or calibrated weights.

A model-wide budget of ``L * k`` tokens per kv head (``k`` on average per layer) is split into
per-layer budgets ``k_l``; :mod:`kvlab.relay.budgets` then splits each ``k_l * H`` across the
layer's kv heads.

* :func:`pyramid_layer_budgets` — PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache
  Compression based on Pyramidal Information Funneling", arXiv:2406.02069, Sec. 3.2): budgets
  fall linearly from the first layer to the last, ``k_max`` to ``k_min = k / beta`` with
  ``k_max = 2 k - k_min`` (mean ``k``); when ``k_max`` exceeds what a layer holds it is
  capped and ``k_min = 2 k - k_max``. This is the formula of the authors' KVCache-Factory code
  as NVIDIA kvpress 0.5.5 ports it (``PyramidKVPress.get_layer_budget``, ``beta`` 20), in
  tokens per kv head.
* explicit per-layer weights, e.g. kept fractions chosen by :func:`allocate_layer_fractions`
  from per-layer sensitivities measured on a calibration text
  (:mod:`kvlab.integrations.relay_calibration`; the same recipe as PN-Mix's per-layer groups).

:func:`split_layer_budget` turns real-valued budgets or weights into integers that sum exactly
to the global budget and respect each layer's floor (its protected tokens) and ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache, reduce

__all__ = ["allocate_layer_fractions", "pyramid_layer_budgets", "split_layer_budget"]


def pyramid_layer_budgets(
    mean_tokens: float, num_layers: int, *, beta: float = 20.0, max_tokens: float
) -> list[float]:
    """PyramidKV's per-layer budgets (module docstring), real-valued, layer 0 first.

    Args:
        mean_tokens: the average budget ``k`` per layer (tokens per kv head), > 0.
        num_layers: ``L >= 1``.
        beta: steepness (``k_min = k / beta``), >= 1.
        max_tokens: most tokens a layer can keep (tokens per kv head), >= ``mean_tokens``.

    Returns:
        ``L`` floats, decreasing linearly, mean ``mean_tokens``.

    Raises:
        ValueError: ``num_layers < 1``, ``beta < 1``, ``mean_tokens <= 0`` or
            ``max_tokens < mean_tokens``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    if mean_tokens <= 0 or max_tokens < mean_tokens:
        raise ValueError(
            f"need 0 < mean_tokens <= max_tokens, got mean {mean_tokens}, max {max_tokens}"
        )
    if num_layers == 1:
        return [float(mean_tokens)]
    low = mean_tokens / beta
    high = 2.0 * mean_tokens - low
    if high > max_tokens:
        high = float(max_tokens)
        low = 2.0 * mean_tokens - high
    step = (high - low) / (num_layers - 1)
    return [high - layer * step for layer in range(num_layers)]


def split_layer_budget(
    total: int, weights: Sequence[float], *, low: Sequence[int], high: Sequence[int]
) -> list[int]:
    """Integers ``k_l`` with ``sum == total``, ``low[l] <= k_l <= high[l]``, as close to
    proportional to ``weights`` as the bounds allow.

    Water-filling: the scale ``c`` with ``sum_l clamp(c * w_l, low_l, high_l) == total`` is
    found by bisection, then each layer gets the floor of its share and the remaining tokens go
    one each to the layers with the largest fractional parts (ties: lower layer first).

    Args:
        total: tokens to hand out (per kv head, summed over layers).
        weights: ``L`` non-negative finite weights, not all zero.
        low, high: ``L`` integer floors and ceilings, ``low <= high``.

    Raises:
        ValueError: lengths differ; a negative, non-finite or all-zero weight; ``low > high``;
            ``total`` outside ``[sum(low), sum(high)]``, or above what the layers of positive
            weight can take (a layer of weight 0 keeps its floor).
    """
    n = len(weights)
    if len(low) != n or len(high) != n or n == 0:
        raise ValueError(f"weights, low and high must have one entry per layer (got {n})")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}")
    if any(lo > hi for lo, hi in zip(low, high, strict=True)):
        raise ValueError("every layer needs low <= high")
    if not sum(low) <= total <= sum(high):
        raise ValueError(
            f"total {total} must lie between the layers' floors ({sum(low)}) and ceilings "
            f"({sum(high)})"
        )

    reachable = sum(hi if w > 0 else lo for w, lo, hi in zip(weights, low, high, strict=True))
    if total > reachable:
        raise ValueError(
            f"total {total} exceeds what the layers can take ({reachable}): a layer of weight 0 "
            "keeps its floor"
        )
    return list(_water_fill(total, tuple(weights), tuple(low), tuple(high)))


@lru_cache(maxsize=64)
def _water_fill(
    total: int, weights: tuple[float, ...], low: tuple[int, ...], high: tuple[int, ...]
) -> tuple[int, ...]:
    """:func:`split_layer_budget` on checked arguments; cached, since every layer of a model
    asks for the same split at a prompt's eviction."""
    n = len(weights)

    def filled(scale: float) -> list[float]:
        return [min(max(scale * w, lo), hi) for w, lo, hi in zip(weights, low, high, strict=True)]

    lo_s, hi_s = 0.0, 1.0
    while sum(filled(hi_s)) < total:
        hi_s *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo_s + hi_s)
        if mid in (lo_s, hi_s):  # adjacent floats: further steps change nothing
            break
        if sum(filled(mid)) < total:
            lo_s = mid
        else:
            hi_s = mid
    shares = filled(hi_s)
    counts = [max(lo, min(hi, math.floor(x))) for x, lo, hi in zip(shares, low, high, strict=True)]
    order = sorted(range(n), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    while sum(counts) < total:
        for i in order:
            if sum(counts) == total:
                break
            if counts[i] < high[i]:
                counts[i] += 1
    while sum(counts) > total:
        for i in reversed(order):
            if sum(counts) == total:
                break
            if counts[i] > low[i]:
                counts[i] -= 1
    return tuple(counts)


def allocate_layer_fractions(
    sensitivities: Sequence[Mapping[float, float]], mean_fraction: float, *, tokens: int
) -> list[float]:
    """One kept fraction per layer minimizing the summed KL under the uniform budget.

    Each layer ``l`` may keep any fraction it was measured at (``sensitivities[l]``:
    ``{fraction: KL}``) or everything (fraction 1.0, KL 0); the choice minimizes
    ``sum_l KL_l(f_l)`` subject to ``sum_l round(f_l * tokens) <= L * round(mean_fraction *
    tokens)`` (an exact knapsack by dynamic programming over token counts in units of their
    greatest common divisor; ties go to the lower total, then to the lower layer's larger
    fraction). The summed KL is an additive model of the layers' joint effect.

    Args:
        sensitivities: per layer, kept fraction in (0, 1] -> KL in nats (>= 0).
        mean_fraction: the uniform kept fraction, in (0, 1].
        tokens: the context the fractions apply to (tokens per kv head).

    Returns:
        ``L`` fractions (floats).

    Raises:
        ValueError: no layers, a fraction outside (0, 1], ``mean_fraction`` outside (0, 1], or
            no choice within the budget (every layer's smallest fraction is too large).
    """
    if not sensitivities:
        raise ValueError("no layers to allocate")
    if not 0.0 < mean_fraction <= 1.0:
        raise ValueError(f"mean_fraction must lie in (0, 1], got {mean_fraction}")
    options: list[list[tuple[int, float, float]]] = []  # (tokens, kl, fraction)
    for row in sensitivities:
        if any(not 0.0 < f <= 1.0 for f in row):
            raise ValueError(f"fractions must lie in (0, 1], got {sorted(row)}")
        choice = {round(f * tokens): (float(kl), float(f)) for f, kl in row.items()}
        choice.setdefault(tokens, (0.0, 1.0))
        options.append(sorted((t, kl, f) for t, (kl, f) in choice.items()))
    unit = reduce(math.gcd, [t for row in options for t, _, _ in row if t > 0], 0) or 1
    budget = len(options) * round(mean_fraction * tokens) // unit
    # best[u] = (cost, picks) using exactly u units so far
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for row in options:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for used, (cost, picks) in best.items():
            for index, (t, kl, _) in enumerate(row):
                total = used + t // unit
                if total > budget:
                    continue
                candidate = (cost + kl, [*picks, index])
                if total not in nxt or candidate[0] < nxt[total][0]:
                    nxt[total] = candidate
        best = nxt
        if not best:
            raise ValueError("no per-layer choice fits the budget")
    _, (_, picks) = min(best.items(), key=lambda item: (item[1][0], item[0]))
    return [options[layer][pick][2] for layer, pick in enumerate(picks)]
