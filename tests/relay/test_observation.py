"""The observation window's attention (kvlab.relay.observation): in one piece, the reductions of
one softmax tensor, bit for bit; in chunks of queries (bounded memory), the same values up to
float32 rounding of the sums."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay import observation
from kvlab.relay.observation import window_attention, window_attention_from_lse


def _reference(query, scaling, keys, valid, window):
    """The full ``[B, H, G, w, S]`` probabilities, causal per head (the definition)."""
    batch, hq, q_len, dim = query.shape
    heads, s = keys.shape[1], keys.shape[2]
    group = hq // heads
    w = max(1, min(window, q_len))
    q = query[:, :, q_len - w :].float().reshape(batch, heads, group * w, dim)
    logits = q @ keys.float().transpose(-1, -2) * scaling
    counts = valid[0].sum(-1)
    j = torch.arange(w).repeat(group)
    limit = counts.view(heads, 1) - w + j.view(1, -1)
    allowed = torch.arange(s).view(1, 1, -1) <= limit.unsqueeze(-1)
    allowed = allowed.unsqueeze(0) & valid.unsqueeze(2)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs.reshape(batch, heads, group, w, s)


def _case(heads, group, q_len, slots, missing, seed):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads * group, q_len, 8, generator=gen)
    keys = torch.randn(1, heads, slots, 8, generator=gen)
    counts = torch.tensor([slots - missing * (h % 2) for h in range(heads)])
    valid = (torch.arange(slots).view(1, -1) < counts.view(-1, 1)).unsqueeze(0)
    return query, keys, valid


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(1, 30),
    extra=st.integers(0, 20),
    missing=st.integers(0, 3),
    window=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_window_attention_reduces_the_probabilities(
    heads, group, q_len, extra, missing, window, seed
) -> None:
    slots = q_len + extra + missing
    query, keys, valid = _case(heads, group, q_len, slots, missing, seed)
    probs = _reference(query, 0.4, keys, valid, window)
    got = window_attention(query, 0.4, keys, valid, window, peak=True)
    assert torch.equal(got.total, probs.sum((2, 3)))
    assert torch.equal(got.groups, probs.sum(3))
    assert torch.equal(got.last, probs[:, :, :, -1])
    assert got.peak is not None and torch.equal(got.peak, probs.amax(dim=(2, 3)))
    with pytest.MonkeyPatch.context() as mp:  # the same window in chunks of a few queries
        mp.setattr(observation, "ONE_PIECE_LOGITS", 0)
        mp.setattr(observation, "CHUNK_LOGITS", heads * group * slots * 3)
        chunked = window_attention(query, 0.4, keys, valid, window, peak=True)
    torch.testing.assert_close(chunked.total, got.total, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked.groups, got.groups, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked.last, got.last, rtol=1e-6, atol=1e-7)
    assert chunked.peak is not None
    torch.testing.assert_close(chunked.peak, got.peak, rtol=1e-6, atol=1e-7)
    assert chunked.total.dtype == chunked.groups.dtype == torch.float32


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(2, 40),
    extra=st.integers(0, 20),
    window=st.integers(1, 50),
    chunk_queries=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_fill_is_the_mask_bit_for_bit(
    heads, group, q_len, extra, window, chunk_queries, seed
) -> None:
    """Heads of one count (a prefill): the late slots filled row by row give the bits of the
    boolean mask, in one piece and in chunks that start anywhere in the window."""
    slots = q_len + extra
    query, keys, valid = _case(heads, group, q_len, slots, 0, seed)

    def run(by_rows: bool, chunked: bool):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(observation, "FILL_BY_ROWS", by_rows)
            if chunked:
                mp.setattr(observation, "ONE_PIECE_LOGITS", 0)
                mp.setattr(observation, "CHUNK_LOGITS", heads * group * slots * chunk_queries)
            return window_attention(query, 0.4, keys, valid, window, peak=True)

    for chunked in (False, True):
        rows, mask = run(True, chunked), run(False, chunked)
        for name in ("total", "groups", "last", "peak"):
            assert torch.equal(getattr(rows, name), getattr(mask, name)), (chunked, name)
    probs = _reference(query, 0.4, keys, valid, window)
    assert torch.equal(run(True, False).total, probs.sum((2, 3)))


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(2, 40),
    window=st.integers(1, 50),
    cut=st.integers(0, 45),
    chunk_queries=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_window_attention_from_lse_is_the_softmax_before_the_cut(
    heads, group, q_len, window, cut, chunk_queries, seed
) -> None:
    """A prefill (every head holds the forward's Q tokens): exp(logit - lse) over the first
    ``columns`` slots is the softmax's probabilities there to float32 rounding, zero after."""
    query, keys, valid = _case(heads, group, q_len, q_len, 0, seed)
    scaling = 0.4
    logits = query.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2)
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    lse = torch.logsumexp((logits * scaling).masked_fill(~causal, float("-inf")), dim=-1).float()
    columns = max(1, q_len - cut)
    reference = window_attention(query, scaling, keys, valid, window, peak=True)
    with pytest.MonkeyPatch.context() as mp:
        if chunk_queries is not None:
            mp.setattr(observation, "ONE_PIECE_LOGITS", 0)
            mp.setattr(observation, "CHUNK_LOGITS", heads * group * columns * chunk_queries)
        got = window_attention_from_lse(query, scaling, keys, window, lse, columns, peak=True)
    for name in ("total", "groups", "last", "peak"):
        ours, theirs = getattr(got, name), getattr(reference, name)
        assert ours.shape == theirs.shape and ours.dtype == torch.float32
        torch.testing.assert_close(ours[..., :columns], theirs[..., :columns], rtol=2e-5, atol=2e-7)
        assert not ours[..., columns:].any()
