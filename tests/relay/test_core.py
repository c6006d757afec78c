"""Tests for kvlab.relay: slot layout, exactness, attention, autograd and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay.core import EMPTY_POSITION, RelayedCache, relay, relay_attention, relay_logits
from kvlab.rope import ROTATION_ERROR_BOUND, RotaryConfig, apply_rotary

HYPOTHESIS = settings(max_examples=40, deadline=None)
UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 0.0,
    torch.float64: 0.0,
}


def make_case(
    batch=1,
    heads=2,
    slots=8,
    head_dim=12,
    rotary_dim=8,
    value_dim=5,
    counts=None,
    dtype=torch.float32,
    layout="half",
    shared_positions=True,
    seed=0,
    stream=4096,
):
    """Raw keys, their rotated form at sorted distinct positions, values and a keep mask."""
    gen = torch.Generator().manual_seed(seed)
    cfg = RotaryConfig(head_dim, rotary_dim, layout=layout)
    raw = torch.randn(batch, heads, slots, head_dim, generator=gen, dtype=torch.float64) * 1.3
    values = (torch.randn(batch, heads, slots, value_dim, generator=gen) * 1.3).to(dtype)
    if shared_positions:
        positions = torch.randperm(stream, generator=gen)[:slots].sort().values
    else:
        positions = torch.stack(
            [
                torch.randperm(stream, generator=gen)[:slots].sort().values
                for _ in range(batch * heads)
            ]
        ).view(batch, heads, slots)
    keys = apply_rotary(raw, positions, cfg).to(dtype)
    if counts is None:
        counts = torch.randint(1, slots + 1, (batch, heads), generator=gen)
    counts = torch.as_tensor(counts).view(batch, heads)
    keep = torch.zeros(batch, heads, slots, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            keep[b, h, torch.randperm(slots, generator=gen)[: int(counts[b, h])]] = True
    return cfg, raw, keys, values, positions, keep


def reference_layout(keep: torch.Tensor, endpoint: int):
    """Per head, by hand: (slot, source index, new position) of each kept token."""
    batch, heads, slots = keep.shape
    out = {}
    for b in range(batch):
        for h in range(heads):
            kept = keep[b, h].nonzero().flatten().tolist()
            r = len(kept)
            out[b, h] = [(slots - r + i, src, endpoint - r + 1 + i) for i, src in enumerate(kept)]
    return out


def reference_attention(raw, values, keep, query, cfg, endpoint, scale=None):
    """float64 attention over each head's kept raw keys rotated directly at new positions."""
    batch, q_heads, num_q, dim = query.shape
    kv_heads = raw.shape[1]
    group = q_heads // kv_heads
    scale = 1 / math.sqrt(dim) if scale is None else scale
    q_pos = torch.arange(endpoint + 1, endpoint + 1 + num_q)
    out = torch.empty(batch, q_heads, num_q, values.shape[-1], dtype=torch.float64)
    layout = reference_layout(keep, endpoint)
    for b in range(batch):
        for i in range(q_heads):
            h = i // group
            src = [s for _, s, _ in layout[b, h]]
            new_pos = torch.tensor([p for _, _, p in layout[b, h]])
            k = apply_rotary(raw[b, h, src].double(), new_pos, cfg)
            q = apply_rotary(query[b, i].double(), q_pos, cfg)
            weights = torch.softmax(q @ k.T * scale, dim=-1)
            out[b, i] = weights @ values[b, h, src].double()
    return out


# ------------------------------------------------------------------------------------------
# Layout and exactness
# ------------------------------------------------------------------------------------------


def test_heterogeneous_counts_right_aligned():
    # Seed-like configuration: 2 layers x 2 kv heads, retained counts [8, 6, 4, 2].
    cfg, _, keys, values, positions, keep = make_case(batch=2, counts=[[8, 6], [4, 2]])
    out = relay(keys, values, positions, keep, cfg)
    assert isinstance(out, RelayedCache)
    assert out.next_position == 8 and out.endpoint == 7
    assert out.kept_counts.tolist() == [[8, 6], [4, 2]]
    assert out.kept_counts.dtype == out.positions.dtype == out.source_index.dtype == torch.int64
    expected_valid = torch.tensor(
        [
            [[True] * 8, [False] * 2 + [True] * 6],
            [[False] * 4 + [True] * 4, [False] * 6 + [True] * 2],
        ]
    )
    assert torch.equal(out.valid, expected_valid)
    for (b, h), entries in reference_layout(keep, 7).items():
        assert [out.source_index[b, h, slot].item() for slot, _, _ in entries] == [
            src for _, src, _ in entries
        ]
        assert [out.positions[b, h, slot].item() for slot, _, _ in entries] == [
            pos for _, _, pos in entries
        ]
        # Every head ends at the same endpoint.
        assert out.positions[b, h, -1].item() == 7
    assert (out.positions[~out.valid] == EMPTY_POSITION).all()
    assert (out.source_index[~out.valid] == EMPTY_POSITION).all()
    assert (out.keys[~out.valid] == 0).all() and (out.values[~out.valid] == 0).all()
    assert out.query_positions(3).tolist() == [8, 9, 10]


def test_streaming_endpoint_and_per_head_positions():
    cfg, raw, keys, values, positions, keep = make_case(
        batch=2, heads=3, counts=[[1, 5, 8], [3, 3, 2]], shared_positions=False
    )
    endpoint = int(positions.max())
    out = relay(keys, values, positions, keep, cfg, endpoint=endpoint)
    assert out.next_position == endpoint + 1
    for (b, h), entries in reference_layout(keep, endpoint).items():
        for slot, src, pos in entries:
            assert out.positions[b, h, slot].item() == pos
            expect = apply_rotary(raw[b, h, src], torch.tensor(pos), cfg)
            torch.testing.assert_close(out.keys[b, h, slot].double(), expect, rtol=0, atol=2e-6)
    # A tensor endpoint is accepted too.
    again = relay(keys, values, positions, keep, cfg, endpoint=torch.tensor(endpoint))
    assert torch.equal(again.keys, out.keys)


@st.composite
def relay_cases(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    slots = draw(st.integers(1, 12))
    pairs = draw(st.integers(1, 6))
    head_dim = 2 * pairs + draw(st.integers(0, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    counts = torch.tensor(
        draw(st.lists(st.integers(1, slots), min_size=batch * heads, max_size=batch * heads))
    )
    case = make_case(
        batch=batch,
        heads=heads,
        slots=slots,
        head_dim=head_dim,
        rotary_dim=2 * pairs,
        value_dim=draw(st.integers(1, 6)),
        counts=counts,
        dtype=dtype,
        layout=draw(st.sampled_from(["half", "interleaved"])),
        shared_positions=draw(st.booleans()),
        seed=seed,
        stream=draw(st.sampled_from([64, 4096, 10**6])),
    )
    extra = draw(st.sampled_from([None, 0, 5, 10**6]))
    endpoint = None if extra is None else int(counts.max()) - 1 + extra
    return case, endpoint


@HYPOTHESIS
@given(case_endpoint=relay_cases())
def test_relay_invariants(case_endpoint):
    (cfg, raw, keys, values, positions, keep), endpoint = case_endpoint
    batch, heads, slots, _ = keys.shape
    clones = [t.clone() for t in (keys, values, positions, keep)]
    out = relay(keys, values, positions, keep, cfg, endpoint=endpoint)
    for before, after in zip(clones, (keys, values, positions, keep), strict=True):
        assert torch.equal(before, after)
    end = slots - 1 if endpoint is None else endpoint
    counts = keep.sum(-1)
    assert out.next_position == end + 1
    assert torch.equal(out.kept_counts, counts)
    assert out.keys.dtype == keys.dtype and out.values.dtype == values.dtype
    slot = torch.arange(slots)
    assert torch.equal(out.valid, slot >= slots - counts[..., None])
    assert torch.equal(
        out.positions[out.valid], (slot + end + 1 - slots).expand_as(out.valid)[out.valid]
    )
    # Sources: each head's kept slots, in original order.
    for b in range(batch):
        for h in range(heads):
            kept = keep[b, h].nonzero().flatten()
            assert torch.equal(out.source_index[b, h, out.valid[b, h]], kept)
    src = out.source_index.clamp(min=0)
    gathered_values = values.gather(2, src[..., None].expand_as(values))
    gathered_keys = keys.gather(2, src[..., None].expand_as(keys))
    valid = out.valid
    assert torch.equal(out.values[valid], gathered_values[valid])  # bit-identical
    r = cfg.rotary_dim
    assert torch.equal(out.keys[valid][:, r:], gathered_keys[valid][:, r:])
    assert (out.keys[~valid] == 0).all() and (out.values[~valid] == 0).all()
    # Relayed keys equal raw keys rotated directly at the new positions.
    gathered_raw = raw.gather(2, src[..., None].expand_as(raw))
    reference = apply_rotary(gathered_raw, out.positions.clamp(min=0), cfg)
    old_positions = positions.expand(batch, heads, slots).gather(-1, src)
    stored = apply_rotary(gathered_raw, old_positions, cfg)  # float64 keys before the relay
    first, second = cfg.pair_indices()
    norm = torch.empty_like(stored[..., :r])  # each rotary channel's pair norm
    norm[..., first] = norm[..., second] = torch.hypot(stored[..., first], stored[..., second])
    u = UNIT_ROUNDOFF[keys.dtype]
    bound = 1e-9 if keys.dtype == torch.float64 else 3 * (ROTATION_ERROR_BOUND + u)
    err = (out.keys[..., :r].double() - reference[..., :r]).abs()
    assert (err[valid] <= bound * norm[valid] + 1e-300).all()


def test_no_move_is_bit_identical():
    cfg, _, keys, values, _, _ = make_case(heads=3)
    keep = torch.ones(1, 3, 8, dtype=torch.bool)
    out = relay(keys, values, torch.arange(8), keep, cfg)
    assert torch.equal(out.keys, keys) and torch.equal(out.values, values)


def test_relay_twice_equals_direct():
    """A second eviction of an already relayed cache composes exactly like a single relay."""
    cfg, raw, keys, values, positions, keep = make_case(
        batch=2, heads=2, counts=[[7, 5], [6, 8]], dtype=torch.float64, layout="interleaved"
    )
    first = relay(keys, values, positions, keep, cfg, endpoint=int(positions.max()))
    second_keep = first.valid & (
        torch.rand(first.valid.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    )
    second_keep[..., -1] = True
    second = relay(first.keys, first.values, first.positions, second_keep, cfg, endpoint=100)
    src = first.source_index.gather(-1, second.source_index.clamp(min=0))
    reference = apply_rotary(
        raw.gather(2, src[..., None].clamp(min=0).expand_as(raw)),
        second.positions.clamp(min=0),
        cfg,
    )
    torch.testing.assert_close(
        second.keys[second.valid], reference[second.valid], rtol=0, atol=1e-12
    )
    assert second.next_position == 101


# ------------------------------------------------------------------------------------------
# relay_attention
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (4, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_relay_attention_matches_direct_rotation(q_heads, kv_heads, layout):
    gen = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    cfg, raw, keys, values, positions, keep = make_case(
        batch=2, heads=kv_heads, dtype=torch.float64, layout=layout, seed=q_heads
    )
    query = torch.randn(2, q_heads, 3, 12, generator=gen, dtype=torch.float64)
    out = relay(keys, values, positions, keep, cfg)
    got = relay_attention(query, out, cfg)
    expected = reference_attention(raw, values, keep, query, cfg, endpoint=7)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    got_scaled = relay_attention(query, out, cfg, scale=0.5)
    expected_scaled = reference_attention(raw, values, keep, query, cfg, endpoint=7, scale=0.5)
    torch.testing.assert_close(got_scaled, expected_scaled, rtol=0, atol=1e-12)
    # float32 agrees with the float64 reference to float32 rounding.
    out32 = relay(keys.float(), values.float(), positions, keep, cfg)
    got32 = relay_attention(query.float(), out32, cfg)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), expected, rtol=0, atol=1e-5)


def test_gqa_mapping():
    """Query head i reads kv head i // (H_q / H_kv): perturbing kv head 1 moves heads 2, 3."""
    cfg, _, keys, values, positions, keep = make_case(heads=2, dtype=torch.float64)
    query = torch.randn(1, 4, 2, 12, dtype=torch.float64)
    base = relay_attention(query, relay(keys, values, positions, keep, cfg), cfg)
    bumped_values = values.clone()
    bumped_values[:, 1] += 10.0
    bumped = relay_attention(query, relay(keys, bumped_values, positions, keep, cfg), cfg)
    assert torch.equal(bumped[:, :2], base[:, :2])
    torch.testing.assert_close(bumped[:, 2:], base[:, 2:] + 10.0, rtol=0, atol=1e-12)


def test_masked_slots_get_zero_weight():
    cfg, _, keys, values, positions, keep = make_case(counts=[[3, 1]])
    out = relay(keys, values, positions, keep, cfg)
    query = torch.randn(1, 2, 4, 12)
    reference = relay_attention(query, out, cfg)
    poisoned = RelayedCache(
        keys=out.keys.masked_fill(~out.valid[..., None], 1e4),
        values=out.values.masked_fill(~out.valid[..., None], -3e4),
        valid=out.valid,
        positions=out.positions,
        next_position=out.next_position,
        kept_counts=out.kept_counts,
        source_index=out.source_index,
    )
    assert torch.equal(relay_attention(query, poisoned, cfg), reference)
    # A single kept token takes all the weight: the output is its value exactly.
    kept_value = values[0, 1, keep[0, 1]].squeeze(0)
    torch.testing.assert_close(reference[0, 1], kept_value.expand(4, -1), rtol=0, atol=0)


def test_logits_and_query_positions():
    cfg, _, keys, values, positions, keep = make_case(dtype=torch.float64)
    out = relay(keys, values, positions, keep, cfg)
    query = torch.randn(1, 2, 3, 12, dtype=torch.float64)
    logits = relay_logits(query, out, cfg)
    assert logits.shape == (1, 2, 3, 8) and logits.dtype == torch.float64
    assert (logits[..., ~out.valid[0, 0]][0, 0] == 0).all()
    sync = relay_logits(query, out, cfg, query_positions=torch.arange(8, 11))
    assert torch.equal(sync, logits)
    # Unsynchronized: queries keep original-stream positions after the last original one.
    stream_pos = int(positions.max()) + 1 + torch.arange(3)
    unsync = relay_logits(query, out, cfg, query_positions=stream_pos)
    q_rot = apply_rotary(query, stream_pos, cfg)
    torch.testing.assert_close(unsync, q_rot @ out.keys.transpose(-1, -2), rtol=0, atol=1e-12)
    assert (unsync - logits)[out.valid[:, :, None, :].expand_as(logits)].abs().mean() > 0.1
    # Default scale is 1/sqrt(D) over these raw logits.
    manual = (
        torch.softmax(
            (logits / math.sqrt(12)).masked_fill(~out.valid[:, :, None, :], -math.inf), -1
        )
        @ out.values
    )
    torch.testing.assert_close(relay_attention(query, out, cfg), manual, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dtypes(dtype):
    cfg, raw, keys, values, positions, keep = make_case(dtype=dtype)
    out = relay(keys, values, positions, keep, cfg)
    assert out.keys.dtype == out.values.dtype == dtype
    query = torch.randn(1, 4, 3, 12).to(dtype)
    got = relay_attention(query, out, cfg)
    assert got.dtype == dtype
    expected = reference_attention(raw, values, keep, query, cfg, endpoint=7)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=0.05)


def test_gradcheck_relay_and_attention():
    cfg, _, keys, values, positions, keep = make_case(
        batch=1,
        heads=2,
        slots=5,
        head_dim=6,
        rotary_dim=4,
        value_dim=3,
        counts=[[3, 5]],
        dtype=torch.float64,
        layout="interleaved",
    )
    query = torch.randn(1, 4, 2, 6, dtype=torch.float64)
    inputs = tuple(t.clone().requires_grad_(True) for t in (keys, values, query))

    def fn(k, v, q):
        return relay_attention(q, relay(k, v, positions, keep, cfg, endpoint=40), cfg)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    k, v, q = inputs
    fn(k, v, q).square().sum().backward()
    # Evicted tokens receive exactly zero gradient; kept ones do not.
    assert (k.grad[~keep] == 0).all() and (v.grad[~keep] == 0).all()
    assert (k.grad[keep].abs().sum(-1) > 0).all() and (v.grad[keep].abs().sum(-1) > 0).all()


def test_relay_attention_inputs_not_modified():
    cfg, _, keys, values, positions, keep = make_case(dtype=torch.float32)
    out = relay(keys, values, positions, keep, cfg)
    query = torch.randn(1, 2, 3, 12)
    snapshot = [t.clone() for t in (query, out.keys, out.values, out.valid)]
    relay_attention(query, out, cfg)
    relay_logits(query, out, cfg)
    for before, after in zip(snapshot, (query, out.keys, out.values, out.valid), strict=True):
        assert torch.equal(before, after)


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def _bad_relay_inputs():
    cfg, _, keys, values, positions, keep = make_case(batch=2, heads=2, counts=[[2, 3], [1, 4]])
    no_keep = keep.clone()
    no_keep[1, 0] = False
    inf_keys = keys.clone()
    inf_keys[0, 0, 0, 0] = math.inf
    nan_values = values.clone()
    nan_values[1, 1, 2, 0] = math.nan
    too_many = torch.ones(2, 2, 9, dtype=torch.bool)
    base = {"keys": keys, "values": values, "positions": positions, "keep": keep, "cfg": cfg}
    return base, [
        ({"keep": no_keep}, r"zero kept tokens at \(b=1, h=0\)"),
        ({"keep": too_many}, "cannot keep more tokens than there are slots"),
        ({"keep": keep[:, :1]}, r"keep shape \(2, 1, 8\) does not match"),
        ({"keep": keep.int()}, "keep must be a bool tensor"),
        ({"values": values[:, :, :7]}, "values shape .* does not match"),
        ({"values": values[0]}, r"values must be a \[B, H_kv, S, Dv\] tensor"),
        ({"keys": keys[0]}, r"keys must be a \[B, H_kv, S, D\] tensor"),
        ({"keys": keys[..., :10]}, "keys have head_dim 10 but cfg.head_dim=12"),
        ({"keys": keys.int()}, "keys must be floating point"),
        ({"values": values.double()}, "values dtype torch.float64 differs from keys dtype"),
        ({"positions": positions.float()}, "positions must be an integer tensor"),
        ({"positions": positions[:7]}, r"positions must have shape \[S\]"),
        ({"positions": positions.expand(2, 1, 8)}, r"positions must have shape \[S\]"),
        ({"positions": positions.to("meta")}, "positions is on meta"),
        ({"keys": inf_keys}, "keys contain non-finite"),
        ({"values": nan_values}, "values contain non-finite"),
        ({"endpoint": 2}, "endpoint=2 is smaller than max kept count - 1 = 3"),
        ({"endpoint": 7.0}, "endpoint must be an int"),
        ({"endpoint": True}, "endpoint must be an int"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_relay_inputs()[1])))
def test_relay_errors(index):
    base, cases = _bad_relay_inputs()
    override, match = cases[index]
    with pytest.raises(ValueError, match=match):
        relay(**{**base, **override})


def test_relay_empty_cache_error():
    cfg = RotaryConfig(4)
    keys = torch.zeros(1, 1, 0, 4)
    with pytest.raises(ValueError, match="non-empty"):
        relay(
            keys,
            keys,
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(1, 1, 0, dtype=torch.bool),
            cfg,
        )


def test_relay_attention_errors():
    cfg, _, keys, values, positions, keep = make_case(heads=2)
    out = relay(keys, values, positions, keep, cfg)
    query = torch.randn(1, 4, 3, 12)
    cases = [
        (query[:, :3], {}, r"H_q=3 must be a multiple of kv heads H_kv=2"),
        (query.double(), {}, "query dtype torch.float64 differs"),
        (torch.randn(2, 4, 3, 12), {}, "query batch 2 differs"),
        (query[..., :10], {}, "query has head_dim 10"),
        (query[0], {}, r"query must be a \[B, H_q, Q, D\] tensor"),
        (query.int(), {}, "query must be floating point"),
        (query.to("meta"), {}, "query is on meta"),
        (query, {"scale": 0.0}, "scale must be finite and > 0"),
        (query, {"scale": math.nan}, "scale must be finite and > 0"),
        (query, {"scale": "1"}, "scale must be a number"),
        (query, {"query_positions": torch.arange(4)}, "query_positions.*does not broadcast"),
    ]
    for q, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            relay_attention(q, out, cfg, **kwargs)
    broken = RelayedCache(
        out.keys,
        out.values,
        torch.zeros_like(out.valid),
        out.positions,
        out.next_position,
        out.kept_counts,
        out.source_index,
    )
    with pytest.raises(ValueError, match="at least one valid slot"):
        relay_attention(query, broken, cfg)


def test_float16_overflow_after_rotation_is_a_clear_error() -> None:
    cfg = RotaryConfig(head_dim=2)
    keys = torch.tensor([60000.0, 60000.0], dtype=torch.float16).view(1, 1, 1, 2)
    keys = torch.cat([keys, keys], dim=2)  # two slots at positions 0 and 1
    keep = torch.tensor([[[True, False]]])
    with pytest.raises(ValueError, match=r"overflow torch\.float16"):
        relay(keys, keys.clone(), torch.tensor([0, 1]), keep, cfg, endpoint=5)


def test_check_finite_false_relays_non_finite_tokens_as_they_are():
    """``check_finite=False`` (a cache relaying the model's own NaN states): the token with a
    NaN channel stays non-finite, every other head and token equals the relay of the same
    cache with that token finite, bit for bit; a finite key that overflows is still refused."""
    cfg = RotaryConfig(head_dim=8, base=10000.0)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 2, 6, 8, generator=gen)
    values = torch.randn(2, 2, 6, 8, generator=gen)
    keep = torch.ones(2, 2, 6, dtype=torch.bool)
    keep[:, :, 1] = False
    positions = torch.arange(6)
    clean = relay(keys, values, positions, keep, cfg, endpoint=9)
    poisoned = keys.clone()
    poisoned[1, 0, 3, 2] = math.nan
    out = relay(poisoned, values, positions, keep, cfg, endpoint=9, check_finite=False)
    bad = ~torch.isfinite(out.keys)
    assert bad.any() and bad[1, 0].any() and not bad[0].any() and not bad[1, 1].any()
    same = ~bad.any(-1, keepdim=True).expand_as(bad)
    assert torch.equal(out.keys[same], clean.keys[same])
    assert torch.equal(out.values, clean.values) and torch.equal(out.positions, clean.positions)
    with pytest.raises(ValueError, match="keys contain non-finite"):
        relay(poisoned, values, positions, keep, cfg, endpoint=9)
    big = torch.full((1, 1, 2, 8), torch.finfo(torch.float16).max, dtype=torch.float16)
    with pytest.raises(ValueError, match="overflow"):
        relay(big, big, torch.arange(2), torch.ones(1, 1, 2, dtype=torch.bool),
              RotaryConfig(head_dim=8, base=10000.0), endpoint=40, check_finite=False)  # fmt: skip
