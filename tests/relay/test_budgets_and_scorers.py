"""Per-head budget allocation, keep masks and token scorers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.scorers import (
    KeyNormScorer,
    RecencyScorer,
    ScoreInputs,
    SnapKVScorer,
    get_scorer,
)


def _layout(batch: int, counts: list[int], seed: int):
    heads, slots = len(counts), max(counts)
    gen = torch.Generator().manual_seed(seed)
    valid = (torch.arange(slots).view(1, -1) < torch.tensor(counts).view(-1, 1)).expand(
        batch, heads, slots
    )
    scores = torch.randn(batch, heads, slots, generator=gen)
    positions = torch.where(valid, torch.arange(slots).expand(batch, heads, slots), -1)
    return scores, valid, positions


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    counts=st.lists(st.integers(12, 40), min_size=1, max_size=4),
    sinks=st.integers(0, 3),
    window=st.integers(0, 6),
    fraction=st.floats(0.0, 1.0),
    allocation=st.sampled_from(["uniform", "adaptive"]),
    comparable=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_allocation_and_selection_invariants(
    batch, counts, sinks, window, fraction, allocation, comparable, seed
):
    counts = [max(counts)] * len(counts) if batch > 1 else counts
    scores, valid, positions = _layout(batch, counts, seed)
    stream = max(counts)
    protected = protected_mask(
        positions, valid, stream_length=stream, sink_tokens=sinks, window_tokens=window
    )
    cap = max(counts)
    low = int(protected[0].sum())
    high = sum(min(c, cap) for c in counts)
    total = low + round(fraction * (high - low))
    k = allocate_counts(
        scores,
        valid,
        protected,
        total=total,
        allocation=allocation,
        cap=cap,
        comparable_across_heads=comparable,
    )
    assert k.dtype == torch.int64 and int(k.sum()) == total
    assert bool((k >= protected[0].sum(-1)).all())
    assert bool((k <= valid[0].sum(-1)).all())
    keep = select_keep(scores, valid, protected, k)
    assert torch.equal(keep.sum(-1), k.expand(batch, -1))
    assert bool((keep | ~protected).all())  # every protected slot kept
    assert not bool((keep & ~valid).any())
    # among unprotected valid slots, every kept one scores at least as high as every dropped one
    free = valid & ~protected
    for b in range(batch):
        for h in range(len(counts)):
            kept = scores[b, h][keep[b, h] & free[b, h]]
            dropped = scores[b, h][~keep[b, h] & free[b, h]]
            if kept.numel() and dropped.numel():
                assert float(kept.min()) >= float(dropped.max())


def test_adaptive_allocation_follows_concentration():
    # head 0 concentrates its mass on 2 tokens, head 1 spreads it: head 1 gets more budget
    scores = torch.zeros(1, 2, 20)
    scores[0, 0, :2] = 1.0
    scores[0, 1] = torch.linspace(0.2, 0.3, 20)
    valid = torch.ones(1, 2, 20, dtype=torch.bool)
    protected = torch.zeros_like(valid)
    k = allocate_counts(scores, valid, protected, total=20, allocation="adaptive", cap=20)
    assert k.tolist() == [2, 18]
    u = allocate_counts(scores, valid, protected, total=20, allocation="uniform", cap=20)
    assert u.tolist() == [10, 10]


def test_budget_below_protected_is_a_clear_error():
    scores, valid, positions = _layout(1, [10, 10], 0)
    protected = protected_mask(positions, valid, stream_length=10, sink_tokens=2, window_tokens=4)
    with pytest.raises(ValueError, match="protected"):
        allocate_counts(scores, valid, protected, total=5, allocation="uniform", cap=10)
    with pytest.raises(ValueError, match="allocation"):
        allocate_counts(scores, valid, protected, total=12, allocation="greedy", cap=10)


def test_scorers():
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]]]])
    valid = torch.tensor([[[True, True, False]]])
    positions = torch.tensor([[[5, 9, -1]]])
    window = torch.tensor([[[0.0, 1.0, 0.5]]])
    inputs = ScoreInputs(
        keys=keys, values=keys, valid=valid, original_positions=positions, window_attention=window
    )
    assert RecencyScorer().score(inputs)[0, 0, :2].tolist() == [5.0, 9.0]
    assert KeyNormScorer().score(inputs)[0, 0, :2].tolist() == [-5.0, -1.0]
    assert SnapKVScorer(kernel_size=1).score(inputs)[0, 0].tolist() == [0.0, 1.0, 0.0]
    pooled = SnapKVScorer(kernel_size=3).score(inputs)[0, 0].tolist()
    assert pooled == [1.0, 1.0, 1.0]  # max-pooled over neighbours (invalid slot zeroed first)
    with pytest.raises(ValueError, match="window_attention"):
        SnapKVScorer().score(ScoreInputs(keys, keys, valid, positions))
    with pytest.raises(ValueError, match="odd"):
        SnapKVScorer(kernel_size=4)
    with pytest.raises(ValueError, match="unknown scorer"):
        get_scorer("oracle")
