"""Query-aware bit allocation: float64 references, exact budgets, greedy optimality, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix.bitalloc import (
    DEFAULT_PAIR_WIDTHS,
    allocate_pair_bits,
    mixed_bits_code_bytes,
    mixed_bits_quantize,
    pair_logit_error,
    query_second_moment,
)
from kvlab.pnmix.quantizers import minmax_dequantize, minmax_quantize
from kvlab.rope import RotaryConfig

DTYPES = [torch.float16, torch.bfloat16]


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv=st.integers(1, 3),
    rep=st.integers(1, 3),
    t=st.integers(1, 7),
    d=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_query_second_moment_matches_explicit_sum(batch, kv, rep, t, d, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv * rep, t, d, generator=gen)
    m = query_second_moment(q, kv)
    assert m.dtype == torch.float64 and m.shape == (batch, kv, d, d)
    for b, h in itertools.product(range(batch), range(kv)):
        ref = torch.zeros(d, d, dtype=torch.float64)
        for r in range(rep):
            for i in range(t):
                v = q[b, h * rep + r, i].double()
                ref += torch.outer(v, v)
        torch.testing.assert_close(m[b, h], ref / (rep * t), rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from(["half", "interleaved"]),
    rotary=st.sampled_from([4, 8]),
    extra=st.sampled_from([0, 2]),
    t=st.integers(1, 6),
    n_q=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_pair_logit_error_is_the_expected_squared_logit_error(
    layout, rotary, extra, t, n_q, seed
) -> None:
    """Σ_t mean_q (q_pair · e_pair)^2, computed query by query in float64."""
    d = rotary + extra
    gen = torch.Generator().manual_seed(seed)
    first, second = RotaryConfig(head_dim=d, rotary_dim=rotary, layout=layout).pair_indices()
    q = torch.randn(1, 2, n_q, d, generator=gen, dtype=torch.float64)
    e = torch.randn(1, 2, t, d, generator=gen, dtype=torch.float64)
    got = pair_logit_error(e, query_second_moment(q, 2), first, second)
    assert got.shape == (1, 2, rotary // 2)
    for h, p in itertools.product(range(2), range(rotary // 2)):
        a, b = int(first[p]), int(second[p])
        ref = (
            sum(
                float((q[0, h, j, a] * e[0, h, i, a] + q[0, h, j, b] * e[0, h, i, b]) ** 2)
                for i in range(t)
                for j in range(n_q)
            )
            / n_q
        )
        assert math.isclose(float(got[0, h, p]), ref, rel_tol=1e-10, abs_tol=1e-12)


def test_pair_logit_error_rejects_mismatched_moment() -> None:
    first, second = RotaryConfig(head_dim=4).pair_indices()
    with pytest.raises(ValueError, match="moment must end in"):
        pair_logit_error(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 3), first, second)
    with pytest.raises(ValueError, match="errors must be"):
        pair_logit_error(torch.zeros(2, 4), torch.zeros(1, 1, 4, 4), first, second)


def _brute_force(dist: torch.Tensor, widths: list[int], avg: int) -> float:
    """Smallest total distortion over every assignment with Σ widths <= budget."""
    n_pairs = dist.shape[-1]
    budget = avg * n_pairs
    best = math.inf
    for choice in itertools.product(range(len(widths)), repeat=n_pairs):
        if sum(widths[c] for c in choice) <= budget:
            best = min(best, sum(float(dist[c, 0, 0, p]) for p, c in enumerate(choice)))
    return best


@settings(max_examples=40, deadline=None)
@given(pairs=st.integers(1, 5), avg=st.integers(0, 4), seed=st.integers(0, 2**31 - 1))
def test_greedy_is_optimal_for_convex_unit_steps(pairs, avg, seed) -> None:
    """With widths 0..4 (unit steps) and convex decreasing distortions the greedy allocation
    is optimal (marginal analysis) and spends the whole budget."""
    gen = torch.Generator().manual_seed(seed)
    widths = [0, 1, 2, 3, 4]
    # convex decreasing: cumulative sums of decreasing positive gains
    gains = torch.sort(
        torch.rand(4, pairs, generator=gen, dtype=torch.float64) + 0.01, dim=0, descending=True
    ).values
    base = gains.sum(0) + torch.rand(pairs, generator=gen, dtype=torch.float64)
    dist = torch.cat([base[None], base[None] - gains.cumsum(0)], 0).view(5, 1, 1, pairs)
    alloc = allocate_pair_bits(dist, widths, avg)
    assert int(alloc.sum()) == avg * pairs
    total = sum(float(dist[widths.index(int(w)), 0, 0, p]) for p, w in enumerate(alloc[0, 0]))
    assert math.isclose(total, _brute_force(dist, widths, avg), rel_tol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    pairs=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_default_widths_fill_the_budget_exactly(batch, heads, pairs, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    dist = torch.rand(4, batch, heads, pairs, generator=gen, dtype=torch.float64)
    dist = torch.sort(dist, dim=0, descending=True).values  # more bits, less error
    alloc = allocate_pair_bits(dist, DEFAULT_PAIR_WIDTHS, 2)
    assert alloc.dtype == torch.int64 and alloc.shape == (batch, heads, pairs)
    assert set(alloc.unique().tolist()) <= set(DEFAULT_PAIR_WIDTHS)
    # Σ = budget: with steps of 1 available (2->3, 3->4) the greedy can always finish
    assert alloc.sum(dim=(1, 2)).tolist() == [2 * heads * pairs] * batch


def test_allocation_follows_the_distortion() -> None:
    """Pair 0 loses far more per bit than pair 1: it gets the bits."""
    dist = torch.tensor([[100.0, 1.0], [10.0, 0.9], [1.0, 0.8], [0.1, 0.7]]).view(4, 1, 1, 2)
    alloc = allocate_pair_bits(dist, DEFAULT_PAIR_WIDTHS, 2)
    assert alloc.view(-1).tolist() == [4, 0]


@pytest.mark.parametrize(
    ("widths", "avg", "shape", "match"),
    [
        ((0, 2, 2, 4), 2, (4, 1, 1, 3), "strictly increasing"),
        ((0, 2, 3, 9), 2, (4, 1, 1, 3), "strictly increasing"),
        ((2, 3, 4), 1, (3, 1, 1, 3), "outside the widths"),
        ((0, 2, 3, 4), 2, (3, 1, 1, 3), "distortion must be"),
        ((0, 2, 3, 4), 2.0, (4, 1, 1, 3), "average_bits must be an int"),
    ],
)
def test_allocate_rejects_bad_input(widths, avg, shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        allocate_pair_bits(torch.zeros(shape), widths, avg)


def test_allocate_rejects_non_finite() -> None:
    dist = torch.zeros(4, 1, 1, 2)
    dist[1, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="finite"):
        allocate_pair_bits(dist, DEFAULT_PAIR_WIDTHS, 2)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 12),
    d=st.integers(1, 6),
    storage=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_mixed_bits_equals_minmax_per_width_and_mean_at_zero(t, d, storage, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, t, d, generator=gen) * 3).to(storage)
    bits = torch.randint(0, 5, (2, d), generator=gen)
    out = mixed_bits_quantize(x, bits, -2, storage)
    assert out.codes.dtype == torch.uint8 and out.codes.shape == x.shape
    assert out.scale.dtype == out.zero.dtype == storage and out.scale.shape == (2, d)
    for b in range(5):
        sel = bits == b
        if not sel.any():
            continue
        if b == 0:
            assert torch.equal(
                out.codes.permute(0, 2, 1)[sel], torch.zeros_like(out.codes.permute(0, 2, 1)[sel])
            )
            assert torch.equal(out.scale[sel], torch.zeros_like(out.scale[sel]))
            assert torch.equal(out.zero[sel], x.double().mean(-2).to(storage)[sel])
        else:
            ref = minmax_quantize(x, b, -2, storage)
            assert torch.equal(out.codes.permute(0, 2, 1)[sel], ref.codes.permute(0, 2, 1)[sel])
            assert torch.equal(out.scale[sel], ref.scale[sel])
            assert torch.equal(out.zero[sel], ref.zero[sel])
            assert int(out.codes.permute(0, 2, 1)[sel].max()) <= 2**b - 1
    dec = minmax_dequantize(out.codes, out.scale, out.zero, -2)
    zero_sel = (bits == 0).unsqueeze(-2).expand_as(x)
    torch.testing.assert_close(
        dec[zero_sel], x.double().mean(-2, keepdim=True).to(storage).float().expand_as(x)[zero_sel]
    )


def test_mixed_bits_rejects_bad_input_and_leaves_input_unchanged() -> None:
    x = torch.randn(3, 4).half()
    before = x.clone()
    with pytest.raises(ValueError, match=r"0\.\.8"):
        mixed_bits_quantize(x, torch.tensor([0, 2, 9, 1]))
    with pytest.raises(ValueError, match="integer"):
        mixed_bits_quantize(x, torch.tensor([0.0, 2.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="broadcast"):
        mixed_bits_quantize(x, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="dim=-2"):
        mixed_bits_quantize(x, torch.tensor([2, 2, 2]), dim=-1)
    assert torch.equal(x, before)


def test_mixed_bits_code_bytes_exact() -> None:
    bits = torch.tensor([[[0, 2, 3, 4], [2, 2, 2, 2]]])  # [B=1, H=2, D=4]
    # head 0: 9 bits/token * 5 tokens = 45 bits -> 6 bytes; head 1: 8 * 5 = 40 -> 5 bytes
    assert mixed_bits_code_bytes(bits, 5) == 11
    assert mixed_bits_code_bytes(torch.full((3, 64), 2), 32) == 3 * 32 * 64 * 2 // 8
