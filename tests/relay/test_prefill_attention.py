"""The prefill path of ``ragged_attention``: segments of equal length read as ``[B, H, S, D]``
views in one causal SDPA call, bit for bit the per-segment masked call it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.relay.attention import prefill_attention_with_lse, ragged_attention
from kvlab.relay.storage import RelayStore


def _store(batch, heads, d, dv, dtype, gen, *segments: int) -> tuple[RelayStore, torch.Tensor]:
    """A store of ``batch`` rows of ``heads`` kv heads holding random segments of the given
    token counts, appended one after the other from position 0; also the keys of the last
    non-empty segment ``[batch, heads, tokens, d]``."""
    store = RelayStore(batch, heads, d, dv, dtype=dtype, device="cpu")
    start, keys = 0, torch.empty(0)
    for tokens in segments:
        if tokens:
            keys = torch.randn(batch, heads, tokens, d, generator=gen).to(dtype)
            values = torch.randn(batch, heads, tokens, dv, generator=gen).to(dtype)
            store.append(
                keys,
                values,
                real=[tokens] * batch,
                original_start=[start] * batch,
                rotary_start=[start] * batch,
            )
        start += tokens
    return store, keys


def _masked_reference(query: torch.Tensor, store: RelayStore, scale: float) -> torch.Tensor:
    """The general path: ``[B*H, G, Q, D]`` queries over the stride-0 padded view with the
    per-segment bottom-right causal mask ``[B*H, 1, Q, S]``."""
    batch, q_heads, q_len, dim = query.shape
    heads = store.heads
    group, segments = q_heads // heads, batch * heads
    view = store.padded_view(group)
    keys, values = view.keys.to(query.dtype), view.values.to(query.dtype)
    slot = torch.arange(view.longest)
    lengths = torch.tensor(store.lengths)
    limit = lengths.view(-1, 1) + (torch.arange(q_len) - q_len).view(1, -1)
    mask = (slot.view(1, 1, -1) <= limit.unsqueeze(-1)).unsqueeze(1)
    q = query.reshape(segments, group, q_len, dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, q_heads, q_len, store.value_dim)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(2, 70),
    past=st.sampled_from([0, 0, 1, 5, 33]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_equal_segments_attention_is_the_masked_call(
    batch, heads, group, q_len, past, dtype, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    d, dv = 16, 8
    store, _ = _store(batch, heads, d, dv, dtype, gen, past, q_len)
    assert store.lengths == [past + q_len] * (batch * heads)
    query = torch.randn(batch, heads * group, q_len, d, generator=gen).to(dtype)
    got = ragged_attention(query, store, scale=0.3, backend="torch")
    want = _masked_reference(query, store, 0.3)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(2, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefill_attention_with_lse_is_the_prefill_call_and_its_logsumexp(
    batch, heads, group, q_len, dtype, seed
) -> None:
    """A whole prompt in one forward: the output is ragged_attention's, bit for bit, and the
    logsumexp that of the scaled causal logits (float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    d = dv = 16
    store, keys = _store(batch, heads, d, dv, dtype, gen, q_len)
    query = torch.randn(batch, heads * group, q_len, d, generator=gen).to(dtype)
    got = prefill_attention_with_lse(query, store, scale=0.3)
    assert got is not None
    out, lse = got
    assert torch.equal(out, ragged_attention(query, store, scale=0.3))
    logits = query.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2) * 0.3
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    expected = torch.logsumexp(logits.masked_fill(~causal, float("-inf")), dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads * group, q_len)
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bfloat16 inputs: the kernel's own rounding
    torch.testing.assert_close(lse.double(), expected, rtol=tol, atol=tol)


def test_prefill_attention_with_lse_only_for_a_whole_prompt_on_the_cpu() -> None:
    store = RelayStore(1, 2, 8, 8, dtype=torch.float32, device="cpu")
    kv = torch.randn(1, 2, 10, 8)
    store.append(kv, kv, real=[10], original_start=[0], rotary_start=[0])
    query = torch.randn(1, 4, 10, 8)
    assert prefill_attention_with_lse(query, store, scale=1.0) is not None
    assert prefill_attention_with_lse(query[:, :, 4:], store, scale=1.0) is None  # a chunk
    assert prefill_attention_with_lse(query[:, :, :1], store, scale=1.0) is None  # one token
    assert prefill_attention_with_lse(query.half(), store, scale=1.0) is None
    narrow = RelayStore(1, 2, 8, 4, dtype=torch.float32, device="cpu")  # Dv != D
    narrow.append(kv, kv[..., :4], real=[10], original_start=[0], rotary_start=[0])
    assert prefill_attention_with_lse(query, narrow, scale=1.0) is None
