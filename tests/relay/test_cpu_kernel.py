"""The compiled RoPE-Relay CPU decode kernel against the float64 definition and the SDPA
reference, and the backend rule (docs/design.md, "RoPE-Relay: Attention")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay.attention import ragged_attention
from kvlab.relay.kernels import cpu as relay_cpu
from kvlab.relay.storage import RelayStore

pytestmark = pytest.mark.skipif(
    relay_cpu.load() is None, reason=f"kernel {relay_cpu.cpu_kernel_status()}"
)


def _store(batch, heads, dim, value_dim, counts, seed, min_headroom=4):
    """A float32 store whose segments hold ``counts[b][h]`` tokens (compacted, ragged)."""
    gen = torch.Generator().manual_seed(seed)
    longest = max(max(row) for row in counts)
    store = RelayStore(
        batch, heads, dim, value_dim, dtype=torch.float32, device="cpu", min_headroom=min_headroom
    )
    keys = torch.randn(batch, heads, longest, dim, generator=gen) * 2
    values = torch.randn(batch, heads, longest, value_dim, generator=gen)
    store.append(keys, values, real=[longest] * batch, original_start=[0] * batch,
                 rotary_start=[0] * batch)  # fmt: skip
    for b in range(batch):
        view = store.padded([b])
        store.write_front(
            b,
            counts[b],
            [0] * heads,
            view.keys[0],
            view.values[0],
            view.original_positions[0],
            view.rotary_positions[0],
        )
    return store, gen


def _definition(query, store, scale):
    """float64 softmax attention of each query head over its kv head's segment."""
    batch, q_heads, _, _ = query.shape
    group = q_heads // store.heads
    out = torch.zeros(batch, q_heads, 1, store.value_dim, dtype=torch.float64)
    for b in range(batch):
        for i in range(q_heads):
            seg = store.segment(b, i // group)
            probs = torch.softmax(seg.keys.double() @ query[b, i, 0].double() * scale, 0)
            out[b, i, 0] = probs @ seg.values.double()
    return out


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    group=st.integers(1, 5),
    dim=st.sampled_from([1, 7, 8, 12, 64, 80]),
    value_dim=st.sampled_from([3, 8, 64, 72, 130]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_computes_the_definition(batch, heads, group, dim, value_dim, data, seed):
    counts = data.draw(
        st.lists(
            st.lists(st.integers(1, 40), min_size=heads, max_size=heads),
            min_size=batch,
            max_size=batch,
        )
    )
    store, gen = _store(batch, heads, dim, value_dim, counts, seed)
    query = torch.randn(batch, heads * group, 1, dim, generator=gen) * 2
    scale = dim**-0.5
    out = ragged_attention(query, store, scale=scale, backend="cpu")
    reference = ragged_attention(query, store, scale=scale, backend="torch")
    expected = _definition(query, store, scale)
    assert out.dtype == torch.float32 and out.shape == (batch, heads * group, 1, value_dim)
    # Each float32 implementation is held to the float64 definition; the two differ from each
    # other by at most both their roundings (triangle inequality), never by one alone.
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(reference.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, reference, atol=4e-6, rtol=2e-5)


def test_auto_runs_the_kernel_for_decode_steps_only(monkeypatch):
    """A float32 CPU decode step takes the kernel; prefill, padding queries, soft-capping and
    other dtypes take SDPA; KVLAB_RELAY_BACKEND=torch always takes SDPA."""
    store, gen = _store(2, 2, 16, 16, [[5, 9], [12, 3]], seed=1)
    calls = []
    kernel = relay_cpu.ragged_decode_cpu

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(relay_cpu, "ragged_decode_cpu", counting)
    monkeypatch.delenv(relay_cpu.ENV_VAR, raising=False)
    query = torch.randn(2, 4, 1, 16, generator=gen)
    ragged_attention(query, store, scale=0.25)
    assert calls == [1]
    ragged_attention(query, store, scale=0.25, query_lengths=[1, 0])  # a padding query
    ragged_attention(query, store, scale=0.25, softcap=30.0)
    ragged_attention(torch.randn(2, 4, 3, 16, generator=gen), store, scale=0.25)  # 3 queries
    assert calls == [1]
    monkeypatch.setenv(relay_cpu.ENV_VAR, "torch")
    ragged_attention(query, store, scale=0.25)
    assert calls == [1]
    monkeypatch.setenv(relay_cpu.ENV_VAR, "cpu")
    ragged_attention(query, store, scale=0.25)
    assert calls == [1, 1]


def test_bfloat16_stores_and_empty_segments_use_the_reference():
    store, gen = _store(1, 2, 8, 8, [[4, 6]], seed=2)
    empty = RelayStore(1, 2, 8, 8, dtype=torch.float32, device="cpu")
    query = torch.randn(1, 2, 1, 8, generator=gen)
    assert not relay_cpu_covers(query, empty)
    half = RelayStore(1, 2, 8, 8, dtype=torch.bfloat16, device="cpu")
    half.append(torch.randn(1, 2, 3, 8).bfloat16(), torch.randn(1, 2, 3, 8).bfloat16(),
                real=[1 * 3], original_start=[0], rotary_start=[0])  # fmt: skip
    assert not relay_cpu_covers(query.bfloat16(), half)
    assert relay_cpu_covers(query, store)


def relay_cpu_covers(query, store):
    from kvlab.relay.attention import _kernel_covers

    return _kernel_covers(query, store, None, None, None)


def test_a_bad_backend_is_refused_before_anything_runs(monkeypatch):
    store, gen = _store(1, 1, 8, 8, [[3]], seed=3)
    query = torch.randn(1, 1, 1, 8, generator=gen)
    with pytest.raises(ValueError, match="backend must be"):
        ragged_attention(query, store, scale=0.3, backend="cuda")
    monkeypatch.setenv(relay_cpu.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="KVLAB_RELAY_BACKEND='fast'"):
        ragged_attention(query, store, scale=0.3)


def test_the_kernel_refuses_inputs_that_do_not_fit_the_buffers():
    module = relay_cpu.load()
    store, gen = _store(1, 2, 8, 8, [[3, 4]], seed=4)
    query = torch.randn(2, 1, 8, generator=gen)
    with pytest.raises(RuntimeError, match="length"):
        module.ragged_decode(query, store.keys, store.values, store.stride, [3, 0], 0.3)
    with pytest.raises(RuntimeError, match="do not fit"):
        module.ragged_decode(query, store.keys, store.values, store.stride * 2, [3, 4], 0.3)
    with pytest.raises(RuntimeError, match="float32"):
        module.ragged_decode(query.double(), store.keys, store.values, store.stride, [3, 4], 0.3)


def test_a_kernel_that_cannot_compile_is_reported_once_and_sdpa_is_used(monkeypatch, caplog):
    import logging

    def broken():
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(relay_cpu._KERNEL, "state", {})
    monkeypatch.setattr(relay_cpu, "_compile", broken)
    monkeypatch.delenv(relay_cpu.ENV_VAR, raising=False)
    store, gen = _store(1, 2, 8, 8, [[3, 5]], seed=5)
    query = torch.randn(1, 4, 1, 8, generator=gen)
    with caplog.at_level(logging.WARNING, logger="kvlab"):
        first = ragged_attention(query, store, scale=0.3)
        second = ragged_attention(query, store, scale=0.3)
    messages = [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(messages) == 1 and "no C++ compiler here" in messages[0]
    reference = ragged_attention(query, store, scale=0.3, backend="torch")
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert relay_cpu.cpu_kernel_status() == "unavailable: no C++ compiler here"
    with pytest.raises(RuntimeError, match="unavailable: no C\\+\\+ compiler here"):
        ragged_attention(query, store, scale=0.3, backend="cpu")


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    group=st.integers(1, 8),
    dim=st.sampled_from([8, 12, 16, 64, 80]),
    value_dim=st.sampled_from([3, 16, 64, 72]),
    length=st.integers(1, 300),
    room=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_dense_decode_computes_the_definition(
    batch, heads, group, dim, value_dim, length, room, seed
):
    """The dense cache's decode step (relay_cpu.dense_decode_cpu) over a view of buffers with
    spare room against the float64 softmax attention of each query head over its kv head."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length + room, dim, generator=gen) * 2
    values = torch.randn(batch, heads, length + room, value_dim, generator=gen)
    query = torch.randn(batch, heads * group, 1, dim, generator=gen) * 2
    scale = dim**-0.5
    out = relay_cpu.dense_decode_cpu(
        relay_cpu.load(), query, keys[:, :, :length], values[:, :, :length], length, scale
    )
    k = keys[:, :, :length].double().repeat_interleave(group, 1)
    v = values[:, :, :length].double().repeat_interleave(group, 1)
    probs = torch.softmax(query.double() @ k.transpose(-1, -2) * scale, -1)
    assert out.dtype == torch.float32 and out.shape == (batch, heads * group, 1, value_dim)
    torch.testing.assert_close(out.double(), probs @ v, atol=2e-6, rtol=1e-5)


def test_dense_decode_refuses_what_it_cannot_read_in_place():
    module = relay_cpu.load()
    query = torch.randn(2, 3, 8)
    keys, values = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    with pytest.raises(RuntimeError, match="length"):
        module.dense_decode(query, keys, values, 11, 0.3)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.dense_decode(query, keys.transpose(1, 2).contiguous().transpose(1, 2), values, 5,
                            0.3)  # fmt: skip
    with pytest.raises(RuntimeError, match="float32"):
        module.dense_decode(query.double(), keys, values, 5, 0.3)
