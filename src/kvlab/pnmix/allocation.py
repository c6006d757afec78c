"""Per-layer group sizes for a PN-Mix model cache under a byte budget.

Quantization error of 2-bit keys is far from uniform across a model's layers: on
SmolLM2-135M a few layers carry most of the attention error (see
``docs/archive/results-history.md``, section 3, "Why groups per layer"). The key codes cost
``2 * D / 8`` bytes per token whatever the group, while the per-channel scalars (a 2-byte
scale and zero per channel per group) cost ``4 * D / group_tokens`` bytes per token — so
smaller groups buy accuracy with scalar bytes. :func:`allocate_group_tokens` spends a
fixed scalar budget where it matters: given a per-layer sensitivity for each candidate group
size (e.g. measured by :func:`kvlab.integrations.pnmix_calibration.layer_group_sensitivity`),
it solves the
multiple-choice knapsack exactly — one group size per layer minimizing the summed sensitivity
subject to ``Σ_l 1 / g_l <= L / budget_group_tokens``, i.e. never more scalar bytes per
quantized token than every layer at ``budget_group_tokens`` (codes and values cost the same
either way; a larger group also keeps up to ``group_tokens - 1`` more tokens exact in the
residual, a bounded cost the knapsack does not count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["DEFAULT_GROUP_CANDIDATES", "allocate_group_tokens"]

DEFAULT_GROUP_CANDIDATES: tuple[int, ...] = (4, 8, 16, 32, 64, 128)


def _check_candidates(candidates: Sequence[int]) -> tuple[int, ...]:
    cands = tuple(sorted(set(candidates)))
    if not cands or any(isinstance(g, bool) or not isinstance(g, int) or g < 2 for g in cands):
        raise ValueError(f"group candidates must be ints >= 2, got {tuple(candidates)!r}")
    return cands


def allocate_group_tokens(
    sensitivities: Sequence[dict[int, float]], budget_group_tokens: int
) -> list[int]:
    """One group size per layer, minimizing total sensitivity under a scalar-byte budget.

    Exact multiple-choice knapsack (dynamic programming over integer cost units): the cost of
    group size ``g`` is ``lcm(candidates) / g`` units (scalar bytes per quantized token are
    proportional to ``1 / g``); the budget is ``L * lcm / budget_group_tokens`` units. Ties
    prefer larger groups (fewer bytes), then lower layer indices' choices as found first.

    Args:
        sensitivities: per layer, ``{group_tokens: cost}`` (e.g. from
            :func:`prefill_sensitivity`); every layer must offer the same candidates, and
            ``budget_group_tokens`` must be one of them.
        budget_group_tokens: the uniform group size whose scalar bytes bound the allocation.

    Returns:
        ``[g_0, ..., g_{L-1}]``. Every layer at ``budget_group_tokens`` is always feasible, so
        the result never costs more scalar bytes than that uniform allocation.

    Raises:
        ValueError: no layers, mismatched candidates, a budget not among them, or a
            non-finite sensitivity.
    """
    if not sensitivities:
        raise ValueError("at least one layer is needed")
    cands = _check_candidates(list(sensitivities[0]))
    for s in sensitivities:
        if tuple(sorted(s)) != cands:
            raise ValueError("every layer must offer the same group candidates")
        if not all(math.isfinite(v) for v in s.values()):
            raise ValueError("sensitivities must be finite")
    if budget_group_tokens not in cands:
        raise ValueError(f"budget_group_tokens {budget_group_tokens} is not among {cands}")
    unit = math.lcm(*cands)
    cost = {g: unit // g for g in cands}
    budget = len(sensitivities) * cost[budget_group_tokens]
    # best[c] = (total sensitivity, choices) using exactly cost c so far
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for s in sensitivities:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for used, (total, choice) in best.items():
            for g in sorted(cands, reverse=True):
                c = used + cost[g]
                if c > budget:
                    continue
                cand = (total + s[g], [*choice, g])
                if c not in nxt or cand[0] < nxt[c][0]:
                    nxt[c] = cand
        best = nxt
    return min(best.items(), key=lambda item: (item[1][0], item[0]))[1][1]
