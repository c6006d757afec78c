"""allocate_group_tokens: an exact multiple-choice knapsack over per-layer group sizes."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import allocate_group_tokens

CANDIDATES = (4, 8, 16, 32, 64, 128)


def _cost(groups: list[int]) -> float:
    return sum(1.0 / g for g in groups)


def _brute_force(sens: list[dict[int, float]], budget: int) -> float:
    cands = sorted(sens[0])
    limit = len(sens) / budget + 1e-12
    best = math.inf
    for combo in itertools.product(cands, repeat=len(sens)):
        if _cost(list(combo)) <= limit:
            best = min(best, sum(s[g] for s, g in zip(sens, combo, strict=True)))
    return best


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    layers=st.integers(1, 4),
    cands=st.lists(st.sampled_from(CANDIDATES), min_size=1, max_size=4, unique=True),
)
def test_allocation_is_optimal_and_within_the_budget(data, layers, cands):
    cands = sorted(cands)
    budget = data.draw(st.sampled_from(cands))
    value = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)
    sens = [{g: data.draw(value) for g in cands} for _ in range(layers)]
    groups = allocate_group_tokens(sens, budget)
    assert len(groups) == layers and all(g in cands for g in groups)
    # never more scalar bytes than every layer at the budget group size
    assert _cost(groups) <= layers / budget + 1e-12
    total = sum(s[g] for s, g in zip(sens, groups, strict=True))
    assert total == pytest.approx(_brute_force(sens, budget), abs=1e-12)


def test_the_sensitive_layer_gets_the_small_groups():
    flat = {4: 0.010, 8: 0.010, 16: 0.010, 32: 0.010, 64: 0.010, 128: 0.010}
    steep = {4: 0.001, 8: 0.002, 16: 0.004, 32: 0.100, 64: 0.200, 128: 0.400}
    groups = allocate_group_tokens([flat, steep, flat, flat], 32)
    # budget 4 / 32 = 0.125 units: 1/16 + 3/128 fits, 1/8 + 3/128 does not
    assert groups[1] == 16  # the steep layer buys finer groups ...
    assert groups[0] == groups[2] == groups[3] == 128  # ... paid for by the flat ones
    assert allocate_group_tokens([flat, steep, flat, flat, flat, flat, flat, flat], 32)[1] == 8
    # a uniform profile keeps the cheapest choice everywhere (ties prefer fewer bytes)
    assert allocate_group_tokens([flat] * 3, 32) == [128, 128, 128]


def test_bad_input_is_a_clear_error():
    good = {16: 0.1, 32: 0.2}
    with pytest.raises(ValueError, match="at least one layer"):
        allocate_group_tokens([], 16)
    with pytest.raises(ValueError, match="same group candidates"):
        allocate_group_tokens([good, {16: 0.1, 64: 0.2}], 16)
    with pytest.raises(ValueError, match="not among"):
        allocate_group_tokens([good], 64)
    with pytest.raises(ValueError, match="finite"):
        allocate_group_tokens([{16: math.nan, 32: 0.2}], 16)
    with pytest.raises(ValueError, match="ints >= 2"):
        allocate_group_tokens([{1: 0.1, 16: 0.2}], 16)
