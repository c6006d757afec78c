"""RelayStore (ragged segments in one flat buffer) and ragged_attention (one call per layer)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay.attention import ragged_attention
from kvlab.relay.storage import RelayStore

HYPOTHESIS = settings(max_examples=30, deadline=None)


def _reference_segments(appends, batch, heads):
    """Per (b, h): the real tokens appended, concatenated (keys, values, orig, rot)."""
    out = {}
    for b in range(batch):
        for h in range(heads):
            ks, vs, os_, rs = [], [], [], []
            stream = rot = 0
            for keys, values, real in appends:
                t = keys.shape[2]
                r = real[b]
                ks.append(keys[b, h, t - r :])
                vs.append(values[b, h, t - r :])
                os_.append(torch.arange(stream, stream + r))
                rs.append(torch.arange(rot, rot + r) + 100)
                stream += r
                rot += r
            out[b, h] = (torch.cat(ks), torch.cat(vs), torch.cat(os_), torch.cat(rs))
    return out


@HYPOTHESIS
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_append_keeps_every_segment_exact_and_counts_used_bytes(batch, heads, steps, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    store = RelayStore(batch, heads, 6, 5, dtype=dtype, device="cpu", min_headroom=2)
    appends = []
    stream = [0] * batch
    for t in steps:
        keys = torch.randn(batch, heads, t, 6, generator=gen).to(dtype)
        values = torch.randn(batch, heads, t, 5, generator=gen).to(dtype)
        real = torch.randint(0, t + 1, (batch,), generator=gen).tolist()
        store.append(
            keys,
            values,
            real=real,
            original_start=stream,
            rotary_start=[s + 100 for s in stream],
        )
        stream = [s + r for s, r in zip(stream, real, strict=True)]
        appends.append((keys, values, real))
    expected = _reference_segments(appends, batch, heads)
    for (b, h), (k, v, o, r) in expected.items():
        seg = store.segment(b, h)
        assert torch.equal(seg.keys, k) and torch.equal(seg.values, v)
        assert torch.equal(seg.original_positions, o) and torch.equal(seg.rotary_positions, r)
        assert store.counts(b)[h] == stream[b]
    used = sum(stream) * heads
    size = torch.empty(0, dtype=dtype).element_size()
    assert store.nbytes() == used * (6 + 5) * size  # used elements exactly
    assert store.numel() == used * 11
    assert store.index_bytes() == used * (16 + size)  # two int64 positions, one key_bias
    assert store.reserved_bytes() >= store.nbytes()
    held = store.reserved_bytes() + store.rows_allocated * (16 + size)
    assert store.held_bytes() == held == store.reserved_bytes() + store.reserved_index_bytes()
    assert store.reserved_bytes() == store.rows_allocated * 11 * size
    # segments are contiguous, in order, and within the allocation
    for s in range(store.num_segments - 1):
        assert store.offsets[s + 1] == store.offsets[s] + store.capacities[s]
    assert store.offsets[-1] + store.capacities[-1] <= store.rows_allocated


def test_growth_is_amortized_constant_per_token():
    store = RelayStore(2, 3, 4, 4, dtype=torch.float32, device="cpu", min_headroom=4)
    tokens = 3000
    one = torch.ones(2, 3, 1, 4)
    for i in range(tokens):
        store.append(one * i, one, real=[1, 1], original_start=[i, i], rotary_start=[i, i])
    # headroom = max(4, ceil(mean / 2)): lengths grow by a factor >= 1.5 between re-layouts
    assert store.relayouts <= math.ceil(math.log(tokens / 4) / math.log(1.5)) + 1
    assert store.rows_allocated <= 1.5 * 6 * tokens + 6 * 4 + 6  # at most ~1.5x what is used
    assert torch.equal(store.segment(1, 2).keys[:, 0], torch.arange(tokens, dtype=torch.float32))


def test_write_front_compacts_in_place_and_shrink_frees_memory():
    gen = torch.Generator().manual_seed(0)
    store = RelayStore(2, 2, 4, 3, dtype=torch.float32, device="cpu")
    keys, values = torch.randn(2, 2, 40, 4, generator=gen), torch.randn(2, 2, 40, 3, generator=gen)
    store.append(keys, values, real=[40, 40], original_start=[0, 0], rotary_start=[0, 0])
    buffer = store.keys
    view = store.padded([1])
    # row 1 keeps slots 5..14 of head 0 and 32..39 of head 1, as given
    store.write_front(
        1,
        [10, 8],
        [5, 32],
        view.keys[0],
        view.values[0],
        view.original_positions[0],
        view.rotary_positions[0] + 7,
    )
    assert store.keys is buffer  # in place
    assert store.counts(1) == [10, 8] and store.counts(0) == [40, 40]
    assert torch.equal(store.segment(1, 0).keys, keys[1, 0, 5:15])
    assert torch.equal(store.segment(1, 1).values, values[1, 1, 32:40])
    assert torch.equal(store.segment(1, 1).rotary_positions, torch.arange(32, 40) + 7)
    assert torch.equal(store.segment(0, 1).keys, keys[0, 1])  # other rows untouched
    store.write_front(0, [4, 4], [0, 0], *_front(store.padded([0])))
    before = store.reserved_bytes()
    assert store.shrink()
    assert store.reserved_bytes() < before
    assert torch.equal(store.segment(1, 0).keys, keys[1, 0, 5:15])
    assert torch.equal(store.segment(0, 0).keys, keys[0, 0, :4])
    with pytest.raises(ValueError, match="exceed"):
        store.write_front(0, [4, 4], [38, 0], *_front(store.padded([0])))


def _front(view):
    return view.keys[0], view.values[0], view.original_positions[0], view.rotary_positions[0]


def test_select_rows_and_padded_view():
    gen = torch.Generator().manual_seed(1)
    store = RelayStore(3, 2, 4, 4, dtype=torch.float32, device="cpu")
    keys = torch.randn(3, 2, 6, 4, generator=gen)
    store.append(keys, keys + 1, real=[6, 2, 4], original_start=[0] * 3, rotary_start=[0] * 3)
    padded = store.padded()
    assert padded.keys.shape == (3, 2, 6, 4)
    assert torch.equal(padded.valid.sum(-1), torch.tensor([[6, 6], [2, 2], [4, 4]]))
    assert torch.equal(padded.keys[1, 0, :2], keys[1, 0, 4:])
    assert bool((padded.keys[1, :, 2:] == 0).all())
    assert bool((padded.original_positions[1, :, 2:] == -1).all())
    store.select_rows([2, 0, 0])
    assert store.batch == 3 and store.counts(0) == [4, 4] and store.counts(2) == [6, 6]
    assert torch.equal(store.segment(0, 1).keys, keys[2, 1, 2:])
    assert torch.equal(store.segment(2, 1).values, keys[0, 1] + 1)
    with pytest.raises(IndexError):
        store.select_rows([3])


def _reference_attention(query, store, scale, real, softcap=None, sinks=None):
    """float64, segment by segment (the definition): bottom-right causal, GQA, pads -> 0;
    optional Gemma 2 soft-capping and GPT-OSS sink logits (one per query head)."""
    batch, hq, q_len, _ = query.shape
    group = hq // store.heads
    out = torch.zeros(batch, hq, q_len, store.value_dim, dtype=torch.float64)
    for b in range(batch):
        for i in range(hq):
            seg = store.segment(b, i // group)
            n = seg.keys.shape[0]
            for j in range(q_len - real[b], q_len):
                visible = n - q_len + j + 1
                logits = seg.keys[:visible].double() @ query[b, i, j].double() * scale
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if sinks is not None:
                    logits = torch.cat([logits, sinks[i : i + 1].double()])
                probs = torch.softmax(logits, 0)[:visible]
                out[b, i, j] = probs @ seg.values[:visible].double()
    return out


@HYPOTHESIS
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    group=st.integers(1, 3),
    q_len=st.integers(1, 5),
    history=st.integers(0, 12),
    seed=st.integers(0, 2**16),
)
def test_ragged_attention_matches_the_float64_definition(batch, heads, group, q_len, history, seed):
    gen = torch.Generator().manual_seed(seed)
    store = RelayStore(batch, heads, 8, 5, dtype=torch.float32, device="cpu", min_headroom=1)
    if history:
        keys = torch.randn(batch, heads, history, 8, generator=gen)
        store.append(keys, keys[..., :5], real=[history] * batch, original_start=[0] * batch,
                     rotary_start=[0] * batch)  # fmt: skip
        # heterogeneous per-head counts, as after an adaptive eviction
        for b in range(batch):
            view = store.padded([b])
            counts = torch.randint(1, history + 1, (heads,), generator=gen).tolist()
            store.write_front(b, counts, [0] * heads, *_front(view))
    real = torch.randint(0, q_len + 1, (batch,), generator=gen).tolist()
    new = torch.randn(batch, heads, q_len, 8, generator=gen)
    store.append(new, new[..., 3:], real=real, original_start=[0] * batch, rotary_start=[0] * batch)
    query = torch.randn(batch, heads * group, q_len, 8, generator=gen)
    out = ragged_attention(query, store, scale=0.3, query_lengths=real)
    expected = _reference_attention(query, store, 0.3, real)
    assert out.shape == (batch, heads * group, q_len, 5) and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 2),
    q_len=st.integers(1, 4),
    softcap=st.sampled_from([None, 0.5, 3.0]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ragged_attention_softcap_and_sinks_match_the_float64_definition(
    batch, q_len, softcap, with_sinks, seed
):
    gen = torch.Generator().manual_seed(seed)
    heads, group = 2, 2
    store = RelayStore(batch, heads, 8, 4, dtype=torch.float32, device="cpu")
    keys = torch.randn(batch, heads, 9, 8, generator=gen)
    store.append(keys, keys[..., :4], real=[9] * batch, original_start=[0] * batch,
                 rotary_start=[0] * batch)  # fmt: skip
    for b in range(batch):
        counts = torch.randint(1, 10, (heads,), generator=gen).tolist()
        store.write_front(b, counts, [0] * heads, *_front(store.padded([b])))
    real = torch.randint(0, q_len + 1, (batch,), generator=gen).tolist()
    new = torch.randn(batch, heads, q_len, 8, generator=gen)
    store.append(new, new[..., :4], real=real, original_start=[0] * batch,
                 rotary_start=[0] * batch)  # fmt: skip
    query = torch.randn(batch, heads * group, q_len, 8, generator=gen) * 3
    sinks = torch.randn(heads * group, generator=gen) if with_sinks else None
    out = ragged_attention(
        query, store, scale=0.4, query_lengths=real, softcap=softcap, s_aux=sinks
    )
    expected = _reference_attention(query, store, 0.4, real, softcap=softcap, sinks=sinks)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_ragged_attention_is_one_sdpa_call_with_the_bits_of_one_call_per_head(monkeypatch):
    """On one intra-op thread (with more, SDPA's CPU kernel splits a head's keys across
    threads, and even two per-head calls on 1 and 2 threads differ in the last bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_one_call_bits(monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _check_one_call_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    store = RelayStore(2, 3, 16, 16, dtype=torch.float32, device="cpu")
    keys = torch.randn(2, 3, 40, 16, generator=gen)
    store.append(keys, keys.flip(-1), real=[40, 40], original_start=[0, 0], rotary_start=[0, 0])
    query = torch.randn(2, 6, 1, 16, generator=gen)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr("kvlab.relay.attention.F.scaled_dot_product_attention", counting)
    out = ragged_attention(query, store, scale=0.25, backend="torch")
    assert len(calls) == 1
    for b in range(2):
        for h in range(3):
            seg = store.segment(b, h)
            k = seg.keys.view(1, 1, 40, 16).expand(1, 2, 40, 16)
            v = seg.values.view(1, 1, 40, 16).expand(1, 2, 40, 16)
            per_head = real_sdpa(query[b : b + 1, 2 * h : 2 * h + 2], k, v, scale=0.25)
            assert torch.equal(out[b : b + 1, 2 * h : 2 * h + 2], per_head)


def test_bad_shapes_are_refused():
    store = RelayStore(1, 2, 4, 4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="store"):
        store.append(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), real=[2],
                     original_start=[0], rotary_start=[0])  # fmt: skip
    with pytest.raises(ValueError, match="real tokens"):
        store.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), real=[3],
                     original_start=[0], rotary_start=[0])  # fmt: skip
    with pytest.raises(ValueError, match="multiple"):
        ragged_attention(torch.zeros(1, 3, 1, 4), store, scale=1.0)
    with pytest.raises(ValueError):
        RelayStore(1, 2, 4, 4, dtype=torch.float32, device="cpu", growth=0.0)


# ------------------------------------------------------------------ padded view (no copies)


def _pre_change_attention(query, store, scale, query_lengths=None, softcap=None, s_aux=None):
    """``ragged_attention`` as it was before the padded view (kvlab f21680c): the segments
    gathered into a contiguous padded copy (short segments repeat their last row), then the same
    one SDPA call (or float32 logits with soft-capping / sinks). Kept here verbatim to pin the
    current implementation to its bits."""
    from kvlab.attention_logits import softcap_logits, softmax_with_sinks

    batch, q_heads, q_len, dim = query.shape
    heads = store.heads
    group = q_heads // heads
    index, lengths, longest = store.gather_index()
    flat = index.reshape(-1)
    keys = store.keys.index_select(0, flat).to(query.dtype)
    values = store.values.index_select(0, flat).to(query.dtype)
    keys = keys.view(batch * heads, 1, longest, dim).expand(-1, group, -1, -1)
    values = values.view(batch * heads, 1, longest, store.value_dim).expand(-1, group, -1, -1)
    q = query.reshape(batch * heads, group, q_len, dim)
    pad_queries = None
    if query_lengths is not None and any(r != q_len for r in query_lengths):
        real = torch.tensor(list(query_lengths), dtype=torch.int64)
        pad_queries = torch.arange(q_len).view(1, -1) < (q_len - real).view(-1, 1)
    mask = None
    if q_len > 1 or pad_queries is not None or min(store.lengths) != longest:
        slot = torch.arange(longest)
        if q_len > 1:
            row = torch.arange(q_len) - q_len
            limit = lengths.view(-1, 1) + row.view(1, -1)
            mask = slot.view(1, 1, -1) <= limit.unsqueeze(-1)
        else:
            mask = (slot.view(1, -1) < lengths.view(-1, 1)).unsqueeze(1)
        if pad_queries is not None:
            mask = mask | pad_queries.repeat_interleave(heads, 0).unsqueeze(-1)
        mask = mask.unsqueeze(1)
    if softcap is None and s_aux is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:
        logits = softcap_logits((q.float() @ keys.float().transpose(-1, -2)) * scale, softcap)
        if mask is not None:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        sinks = None if s_aux is None else s_aux.float().view(1, heads, group)
        if sinks is not None:
            sinks = sinks.expand(batch, heads, group).reshape(batch * heads, group, 1, 1)
        out = (softmax_with_sinks(logits, sinks) @ values.float()).to(query.dtype)
    out = out.reshape(batch, q_heads, q_len, store.value_dim)
    if pad_queries is not None:
        out = out.masked_fill(pad_queries.view(batch, 1, q_len, 1), 0)
    return out


def _assert_valid_mask_matches_lengths(store):
    grid = store.valid.view(store.num_segments, store.stride)
    expected = torch.arange(store.stride).view(1, -1) < torch.tensor(store.lengths).view(-1, 1)
    assert torch.equal(grid, expected)
    bias = torch.zeros(expected.shape).masked_fill(~expected, float("-inf")).to(store.dtype)
    assert torch.equal(store.key_bias.view(store.num_segments, store.stride), bias)
    assert store.offsets == [s * store.stride for s in range(store.num_segments)]
    assert store.capacities == [store.stride] * store.num_segments
    assert store.rows_allocated == store.stride * store.num_segments


@HYPOTHESIS
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    group=st.integers(1, 3),
    history=st.integers(1, 40),
    decode_steps=st.integers(1, 6),
    q_len=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    features=st.sampled_from([(None, False), (2.0, False), (None, True)]),
    seed=st.integers(0, 2**16),
)
def test_ragged_attention_has_the_bits_of_the_pre_change_gather(
    batch, heads, group, history, decode_steps, q_len, dtype, features, seed
):
    """Prefill, heterogeneous compaction (as after an adaptive eviction), a shrink, then decode
    steps and one multi-token forward with left-padded rows: after every write the padded view
    attends with exactly the bits of the former gathered copy, and ``valid`` marks exactly the
    used rows."""
    softcap, with_sinks = features
    gen = torch.Generator().manual_seed(seed)
    store = RelayStore(batch, heads, 8, 6, dtype=dtype, device="cpu", min_headroom=2)
    sinks = torch.randn(heads * group, generator=gen) if with_sinks else None

    def check(q_len, real=None):
        query = torch.randn(batch, heads * group, q_len, 8, generator=gen).to(dtype)
        out = ragged_attention(
            query,
            store,
            scale=0.3,
            query_lengths=real,
            softcap=softcap,
            s_aux=sinks,
            backend="torch",
        )
        expected = _pre_change_attention(
            query, store, 0.3, query_lengths=real, softcap=softcap, s_aux=sinks
        )
        assert torch.equal(out, expected)
        _assert_valid_mask_matches_lengths(store)

    def append(t, real):
        keys = torch.randn(batch, heads, t, 8, generator=gen).to(dtype)
        values = torch.randn(batch, heads, t, 6, generator=gen).to(dtype)
        store.append(keys, values, real=real, original_start=[0] * batch,
                     rotary_start=[0] * batch)  # fmt: skip

    append(history, [history] * batch)
    check(history)
    for b in range(batch):
        counts = torch.randint(1, history + 1, (heads,), generator=gen).tolist()
        store.write_front(b, counts, [0] * heads, *_front(store.padded([b])))
    store.shrink()
    _assert_valid_mask_matches_lengths(store)
    for _ in range(decode_steps):
        append(1, [1] * batch)
        check(1)
    real = torch.randint(0, q_len + 1, (batch,), generator=gen).tolist()
    append(q_len, real)
    check(q_len, real)
    store.select_rows(list(range(batch))[::-1])
    check(1)


def test_a_decode_step_reads_the_store_without_copying_it():
    """One single-token step over heterogeneous segments: no gather, no copy of keys or values,
    no host tensor built; the key-padding mask is a view of the store's ``valid``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(5)
    store = RelayStore(1, 3, 16, 16, dtype=torch.float32, device="cpu")
    keys = torch.randn(1, 3, 50, 16, generator=gen)
    store.append(keys, keys, real=[50], original_start=[0], rotary_start=[0])
    store.write_front(0, [20, 35, 50], [0, 0, 0], *_front(store.padded([0])))
    query = torch.randn(1, 6, 1, 16, generator=gen)
    with Ops() as ops:
        out = ragged_attention(query, store, scale=0.25, backend="torch")
    copies = {"index_select", "gather", "index", "clone", "copy_", "cat", "lift_fresh", "_to_copy"}
    assert not copies & set(ops.names), ops.names
    assert sum(name.startswith("_scaled_dot_product") for name in ops.names) == 1  # one call
    assert torch.equal(out, _pre_change_attention(query, store, 0.25))


@HYPOTHESIS
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    events=st.lists(
        st.sampled_from(["step", "step", "step", "jump", "evict", "peek", "grow"]), max_size=30
    ),
    seed=st.integers(0, 2**16),
    min_headroom=st.sampled_from([1, 12]),
)
def test_decode_steps_write_each_token_at_its_row_stream_index_and_position(
    batch, heads, events, seed, min_headroom
):
    """Single-token appends reuse and advance the device tensor of the next rows and defer their
    positions; a position jump (a relay moves ``next_positions``), a compaction, a re-layout or
    a read of the positions ends the run. Every segment stays exactly the tokens appended, at
    their stream indices and positions."""
    gen = torch.Generator().manual_seed(seed)
    store = RelayStore(
        batch, heads, 4, 3, dtype=torch.float32, device="cpu", min_headroom=min_headroom
    )
    segments = {(b, h): ([], [], []) for b in range(batch) for h in range(heads)}
    stream, rot = [0] * batch, [50] * batch
    for event in ["step", *events, "step"]:
        if event == "jump":
            rot = [r + int(torch.randint(-20, 20, (1,), generator=gen)) for r in rot]
            continue
        if event == "peek":  # reading the positions mid-run writes the deferred ones
            for (b, h), (_, o, r) in segments.items():
                seg = store.segment(b, h)
                assert seg.original_positions.tolist() == o
                assert seg.rotary_positions.tolist() == r
            continue
        if event == "grow":  # a re-layout in the middle of a run
            store.relayout([2] * store.num_segments)
            continue
        if event == "evict":
            for b in range(batch):
                keep = [max(1, len(segments[b, h][0]) // 2) for h in range(heads)]
                view = store.padded([b])
                store.write_front(b, keep, [0] * heads, *_front(view))
                for h in range(heads):
                    for column in segments[b, h]:
                        del column[keep[h] :]
            continue
        keys = torch.randn(batch, heads, 1, 4, generator=gen)
        store.append(keys, keys[..., :3], real=[1] * batch, original_start=stream,
                     rotary_start=rot)  # fmt: skip
        for b in range(batch):
            for h in range(heads):
                segments[b, h][0].append(keys[b, h, 0])
                segments[b, h][1].append(stream[b])
                segments[b, h][2].append(rot[b])
        stream, rot = [s + 1 for s in stream], [r + 1 for r in rot]
    for (b, h), (k, o, r) in segments.items():
        seg = store.segment(b, h)
        assert torch.equal(seg.keys, torch.stack(k))
        assert seg.original_positions.tolist() == o and seg.rotary_positions.tolist() == r
    _assert_valid_mask_matches_lengths(store)
