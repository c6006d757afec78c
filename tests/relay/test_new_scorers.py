"""ExpectedAttention, TOVA, SnapKV's pooling/group options and PyramidKV layer budgets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay import SCORERS, get_scorer
from kvlab.relay.expected_attention import ExpectedAttentionScorer, average_rotation
from kvlab.relay.layer_budgets import (
    allocate_layer_fractions,
    pyramid_layer_budgets,
    split_layer_budget,
)
from kvlab.relay.scorers import ScoreInputs, SnapKVScorer, pool_scores
from kvlab.relay.tova import TOVAScorer
from kvlab.rope import RotaryConfig, apply_rotary


def test_new_scorers_are_registered():
    assert {"expected-attention", "tova"} <= set(SCORERS)
    assert isinstance(get_scorer("expected-attention"), ExpectedAttentionScorer)
    assert isinstance(get_scorer("tova"), TOVAScorer)


@settings(max_examples=25, deadline=None)
@given(
    head_dim=st.sampled_from([4, 8, 16]),
    partial=st.booleans(),
    layout=st.sampled_from(["half", "interleaved"]),
    start=st.integers(0, 300),
    count=st.integers(1, 40),
    seed=st.integers(0, 100),
)
def test_average_rotation_is_the_mean_of_the_rotations(
    head_dim, partial, layout, start, count, seed
):
    rotary = RotaryConfig(
        head_dim=head_dim, rotary_dim=head_dim // 2 if partial else None, base=500.0, layout=layout
    )
    x = torch.randn(3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(start, start + count, dtype=torch.float64)
    mean = torch.stack([apply_rotary(x, p, rotary) for p in positions]).mean(0)
    torch.testing.assert_close(
        x @ average_rotation(rotary, start, count).T, mean, rtol=0, atol=1e-12
    )


def test_average_rotation_rejects_no_positions():
    with pytest.raises(ValueError, match="count"):
        average_rotation(RotaryConfig(head_dim=8), 0, 0)


def _ea_reference(keys, values, raw_queries, valid, orig, rotary, next_position, sinks, future):
    """Float64 loops over (b, h, g): kvpress's ExpectedAttention formula written out."""
    b_n, h_n, s_n, d = keys.shape
    g_n = raw_queries.shape[2]
    rot = torch.stack(
        [
            apply_rotary(torch.eye(d, dtype=torch.float64), float(p), rotary).T
            for p in range(next_position, next_position + future)
        ]
    ).mean(0)
    out = torch.zeros(b_n, h_n, s_n, dtype=torch.float64)
    for b in range(b_n):
        for h in range(h_n):
            scored = [s for s in range(s_n) if valid[b, h, s] and orig[b, h, s] >= sinks]
            acc = torch.zeros(len(scored), dtype=torch.float64)
            for g in range(g_n):
                q = raw_queries[b, h, g]  # [T, D]
                mu = q.mean(0)
                cov = sum(torch.outer(r - mu, r - mu) for r in q) / q.shape[0]
                mu_r, cov_r = rot @ mu, rot @ cov @ rot.T
                z = torch.tensor(
                    [
                        float(keys[b, h, s] @ mu_r) / math.sqrt(d)
                        + float(keys[b, h, s] @ cov_r @ keys[b, h, s]) / d / 2
                        for s in scored
                    ],
                    dtype=torch.float64,
                )
                acc += torch.softmax(z, 0) / g_n
            for i, s in enumerate(scored):
                out[b, h, s] = acc[i] * torch.linalg.vector_norm(values[b, h, s])
    return out


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    group=st.integers(1, 3),
    q_len=st.integers(6, 12),
    future=st.integers(1, 20),
    sinks=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_expected_attention_matches_a_float64_reference(
    batch, heads, group, q_len, future, sinks, seed
):
    gen = torch.Generator().manual_seed(seed)
    dim, slots = 8, q_len
    rotary = RotaryConfig(head_dim=dim, base=100.0)
    positions = torch.arange(q_len)
    raw_q = torch.randn(batch, heads * group, q_len, dim, generator=gen, dtype=torch.float64)
    raw_k = torch.randn(batch, heads, slots, dim, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, heads, slots, dim, generator=gen, dtype=torch.float64)
    counts = torch.randint(max(1, sinks + 1), slots + 1, (heads,), generator=gen)
    valid = (torch.arange(slots).view(1, -1) < counts.view(-1, 1)).expand(batch, -1, -1)
    orig = torch.where(valid, torch.arange(slots), -1)
    keys = apply_rotary(raw_k, orig.clamp_min(0).double(), rotary)
    inputs = ScoreInputs(
        keys=keys,
        values=values,
        valid=valid,
        original_positions=orig,
        queries=apply_rotary(raw_q, positions.double(), rotary),
        query_positions=positions,
        rotary=rotary,
        next_position=q_len,
    )
    scorer = ExpectedAttentionScorer(future_positions=future, sink_tokens=sinks)
    got = scorer.score(inputs)
    grouped = raw_q[:, :, sinks:].reshape(batch, heads, group, q_len - sinks, dim)
    expected = _ea_reference(keys, values, grouped, valid, orig, rotary, q_len, sinks, future)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, slots)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    assert bool((got[~valid] == 0).all()) and bool((got[orig < sinks] == 0).all())


def test_expected_attention_needs_queries():
    keys = torch.zeros(1, 1, 4, 8)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    inputs = ScoreInputs(keys, keys, valid, torch.arange(4).view(1, 1, 4))
    with pytest.raises(ValueError, match="queries"):
        ExpectedAttentionScorer().score(inputs)
    with pytest.raises(ValueError, match="future_positions"):
        ExpectedAttentionScorer(future_positions=0)


def _probs(batch, heads, group, w, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, heads, group, w, slots, generator=gen), -1)


def test_tova_averages_the_last_query_over_all_heads_by_token():
    # two kv heads holding different tokens (a heterogeneous eviction happened before)
    orig = torch.tensor([[[0, 2, 3, 5], [0, 1, 3, -1]]])
    valid = orig >= 0
    probs = _probs(1, 2, 3, 2, 4, seed=3).masked_fill(~valid.view(1, 2, 1, 1, 4), 0.0)
    inputs = ScoreInputs(
        keys=torch.zeros(1, 2, 4, 8),
        values=torch.zeros(1, 2, 4, 8),
        valid=valid,
        original_positions=orig,
        window_last=probs[:, :, :, -1],
    )
    got = TOVAScorer().score(inputs).double()
    last = probs[:, :, :, -1].double().mean(2)  # [1, 2, 4], per kv head
    by_token = {}
    for h in range(2):
        for s in range(4):
            if valid[0, h, s]:
                by_token[int(orig[0, h, s])] = by_token.get(int(orig[0, h, s]), 0.0) + float(
                    last[0, h, s]
                )
    for h in range(2):
        for s in range(4):
            want = by_token[int(orig[0, h, s])] / 2 if valid[0, h, s] else 0.0
            assert abs(float(got[0, h, s]) - want) < 1e-7
    per_group = TOVAScorer("group").score(inputs)
    torch.testing.assert_close(per_group.double(), last.masked_fill(~valid, 0.0))
    with pytest.raises(ValueError, match="head_reduction"):
        TOVAScorer("all")


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("group_reduction", ["sum", "mean"])
@pytest.mark.parametrize("value_norm", [False, True])
def test_snapkv_options_match_a_float64_reference(pooling, group_reduction, value_norm):
    batch, heads, group, w, slots, kernel = 2, 2, 3, 4, 11, 5
    probs = _probs(batch, heads, group, w, slots, seed=7)
    counts = torch.tensor([11, 8])
    valid = (torch.arange(slots).view(1, -1) < counts.view(-1, 1)).expand(batch, -1, -1)
    probs = probs.masked_fill(~valid.view(batch, heads, 1, 1, slots), 0.0)
    values = torch.randn(batch, heads, slots, 6, generator=torch.Generator().manual_seed(1))
    inputs = ScoreInputs(
        keys=torch.zeros(batch, heads, slots, 6),
        values=values,
        valid=valid,
        original_positions=torch.where(valid, torch.arange(slots), -1),
        window_attention=probs.sum((2, 3)),
        window_groups=probs.sum(3),
    )
    scorer = SnapKVScorer(
        kernel, pooling=pooling, group_reduction=group_reduction, value_norm=value_norm
    )
    got = scorer.score(inputs).double()
    mass = probs.double().sum(3)
    mass = mass.sum(2) if group_reduction == "sum" else mass.mean(2)
    mass = mass.masked_fill(~valid, 0.0)
    expected = torch.zeros_like(mass)
    for s in range(slots):
        lo, hi = max(0, s - kernel // 2), min(slots, s + kernel // 2 + 1)
        window = mass[..., lo:hi]
        expected[..., s] = window.amax(-1) if pooling == "max" else window.sum(-1) / kernel
    if value_norm:
        expected = expected * torch.linalg.vector_norm(values.double(), dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_snapkv_defaults_are_the_old_scorer():
    scorer = SnapKVScorer()
    assert (scorer.kernel_size, scorer.pooling, scorer.group_reduction, scorer.value_norm) == (
        7,
        "max",
        "sum",
        False,
    )
    attn = torch.rand(1, 2, 9)
    valid = torch.ones(1, 2, 9, dtype=torch.bool)
    expected = torch.nn.functional.max_pool1d(attn.view(2, 1, 9), 7, 1, 3).view(1, 2, 9)
    assert torch.equal(pool_scores(attn, valid, 7, "max"), expected)
    for bad in (dict(pooling="min"), dict(group_reduction="max"), dict(observation_tokens=0)):
        with pytest.raises(ValueError):
            SnapKVScorer(**bad)


@settings(max_examples=40, deadline=None)
@given(
    mean=st.integers(1, 400),
    layers=st.integers(1, 40),
    beta=st.floats(1.0, 40.0),
    extra=st.integers(0, 400),
)
def test_pyramid_budgets_are_linear_with_the_requested_mean(mean, layers, beta, extra):
    top = mean + extra
    budgets = pyramid_layer_budgets(mean, layers, beta=beta, max_tokens=top)
    assert len(budgets) == layers
    assert abs(sum(budgets) / layers - mean) < 1e-9 * max(1, mean)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(budgets))
    assert max(budgets) <= top + 1e-9
    if layers > 2:
        steps = [a - b for a, b in itertools.pairwise(budgets)]
        assert max(steps) - min(steps) < 1e-9 * max(1, mean)
    if layers > 1 and 2 * mean - mean / beta <= top:
        assert abs(budgets[-1] - mean / beta) < 1e-9 * max(1, mean)


def test_pyramid_matches_kvpress_at_512_tokens():
    # kvpress PyramidKVPress(compression_ratio=0.5, window_size=64, beta=20) on 512 tokens and
    # 30 layers: max_num capped at 512 - 64 = 448, min_num = 64, linear in between
    budgets = pyramid_layer_budgets(256, 30, beta=20, max_tokens=448)
    assert budgets[0] == 448 and abs(budgets[-1] - 64) < 1e-9


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=12),
    low=st.integers(0, 5),
    span=st.integers(0, 30),
    fraction=st.floats(0.0, 1.0),
)
def test_split_layer_budget_is_exact_and_bounded(weights, low, span, fraction):
    n = len(weights)
    lows, highs = [low] * n, [low + span] * n
    total = sum(lows) + round(fraction * (sum(highs) - sum(lows)))
    counts = split_layer_budget(total, weights, low=lows, high=highs)
    assert sum(counts) == total
    assert all(lo <= c <= hi for c, lo, hi in zip(counts, lows, highs, strict=True))


def test_split_layer_budget_is_proportional_when_bounds_do_not_bind():
    counts = split_layer_budget(100, [1.0, 2.0, 3.0, 4.0], low=[0] * 4, high=[100] * 4)
    assert counts == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="between"):
        split_layer_budget(5, [1.0, 1.0], low=[3, 3], high=[9, 9])
    with pytest.raises(ValueError, match="weights"):
        split_layer_budget(5, [0.0, 0.0], low=[0, 0], high=[9, 9])
    with pytest.raises(ValueError, match="one entry"):
        split_layer_budget(5, [1.0], low=[0, 0], high=[9, 9])
    # a layer of weight 0 keeps its floor: 12 > 9 + 2 is out of reach (was a NaN error)
    with pytest.raises(ValueError, match="weight 0 keeps its floor"):
        split_layer_budget(12, [1.0, 0.0], low=[2, 2], high=[9, 9])
    assert split_layer_budget(11, [1.0, 0.0], low=[2, 2], high=[9, 9]) == [9, 2]


def test_split_layer_budget_returns_a_fresh_list_per_call():
    """The split is cached across layers; a caller changing its list changes no other's."""
    first = split_layer_budget(100, [1.0, 3.0], low=[0, 0], high=[100, 100])
    first[0] = -1
    assert split_layer_budget(100, [1.0, 3.0], low=[0, 0], high=[100, 100]) == [25, 75]


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 5),
    mean=st.sampled_from([0.25, 0.5, 0.75]),
    seed=st.integers(0, 10_000),
)
def test_allocate_layer_fractions_is_the_brute_force_optimum(layers, mean, seed):
    gen = torch.Generator().manual_seed(seed)
    fractions = (0.25, 0.5, 0.75)
    sens = []
    for _ in range(layers):
        kl = sorted(torch.rand(3, generator=gen).tolist(), reverse=True)  # less kept, more KL
        sens.append(dict(zip(fractions, kl, strict=True)))
    got = allocate_layer_fractions(sens, mean, tokens=64)
    assert sum(round(f * 64) for f in got) <= layers * round(mean * 64)
    options = [[*fractions, 1.0]] * layers
    best = min(
        sum(sens[i].get(f, 0.0) for i, f in enumerate(combo))
        for combo in itertools.product(*options)
        if sum(round(f * 64) for f in combo) <= layers * round(mean * 64)
    )
    assert abs(sum(sens[i].get(f, 0.0) for i, f in enumerate(got)) - best) < 1e-12


def test_allocate_layer_fractions_rejects_bad_input():
    with pytest.raises(ValueError, match="no layers"):
        allocate_layer_fractions([], 0.5, tokens=64)
    with pytest.raises(ValueError, match="fractions"):
        allocate_layer_fractions([{1.5: 0.1}], 0.5, tokens=64)
    with pytest.raises(ValueError, match="fits"):
        allocate_layer_fractions([{0.75: 0.1}], 0.25, tokens=64)


def test_combined_scorer_sums_normalized_parts():
    from kvlab.relay import CombinedScorer
    from kvlab.relay.scorers import KeyNormScorer, RecencyScorer

    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 10, 8, generator=gen, dtype=torch.float64)
    counts = torch.tensor([10, 7, 9])
    valid = (torch.arange(10).view(1, -1) < counts.view(-1, 1)).expand(2, -1, -1)
    orig = torch.where(valid, torch.arange(10), -1)
    inputs = ScoreInputs(keys=keys, values=keys, valid=valid, original_positions=orig)
    scorer = CombinedScorer([RecencyScorer(), ("keynorm", {})], weights=[2.0, 0.5])
    got = scorer.score(inputs).double()
    parts = [
        (2.0, orig.double().clamp_min(0)),
        (0.5, KeyNormScorer().score(inputs).double().clamp_min(0)),
    ]
    expected = torch.zeros_like(got)
    for w, s in parts:
        s = s.masked_fill(~valid, 0.0)
        expected += w * s / s.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not scorer.needs_window_attention and not scorer.comparable_across_heads
    default = CombinedScorer()
    assert default.needs_queries and default.needs_window_attention
    with pytest.raises(ValueError, match="weight"):
        CombinedScorer(["recency"], weights=[-1.0])
    with pytest.raises(ValueError, match="unknown scorer"):
        CombinedScorer([("oracle", {})])
