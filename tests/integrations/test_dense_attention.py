"""The dense path of the "kvlab" attention: SDPA's own causal call where nothing is masked,
bit-identical to the masked call it replaces, and to transformers' "sdpa" on a whole model."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvlab.integrations import enable_kvlab_attention
from kvlab.integrations.dense_attention import dense_causal_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _causal_4d(q_len: int, k_len: int) -> torch.Tensor:
    """The bottom-right causal keep mask ``[1, 1, Q, K]``: the masked path of the attention."""
    rows = torch.arange(q_len).view(-1, 1) + (k_len - q_len)
    return (torch.arange(k_len).view(1, -1) <= rows).view(1, 1, q_len, k_len)


@settings(max_examples=30, deadline=None)
@given(
    q_len=st.integers(1, 40),
    past=st.integers(0, 9),
    groups=st.sampled_from([1, 2, 3]),
    kv_heads=st.integers(1, 2),
    dtype=st.sampled_from(DTYPES),
    two_d=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_unmasked_causal_equals_masked_bit_for_bit(
    q_len, past, groups, kv_heads, dtype, two_d, seed
):
    gen = torch.Generator().manual_seed(seed)
    k_len = past + q_len
    q = torch.randn(2, kv_heads * groups, q_len, 16, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, k_len, 16, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, k_len, 8, generator=gen).to(dtype)
    ones = torch.ones(2, k_len, dtype=torch.int64) if two_d else None
    fast = dense_causal_attention(q, k, v, scaling=0.25, attention_mask=ones)
    masked = dense_causal_attention(q, k, v, scaling=0.25, attention_mask=_causal_4d(q_len, k_len))
    assert fast.dtype == dtype and fast.shape == (2, kv_heads * groups, q_len, 8)
    assert torch.equal(fast, masked)


def test_padding_zeros_still_mask():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    k = torch.randn(1, 2, 4, 8, generator=gen)
    v = torch.randn(1, 2, 4, 8, generator=gen)
    padded = torch.tensor([[0, 1, 1, 1]])
    out = dense_causal_attention(q, k, v, scaling=0.5, attention_mask=padded)
    ref = dense_causal_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], scaling=0.5)
    torch.testing.assert_close(out[:, :, 1:], ref, atol=1e-6, rtol=1e-5)


def test_kvlab_attention_on_dynamic_cache_is_sdpa_bit_for_bit(make_llama):
    model = make_llama(num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(3, 96, (2, 50), generator=torch.Generator().manual_seed(1))
    outs = {}
    with torch.no_grad():
        for name in ("sdpa", "kvlab"):
            if name == "kvlab":
                enable_kvlab_attention(model)
            cache = DynamicCache(config=model.config)
            logits = [model(ids[:, :30], cache=cache).logits]  # one prefill forward
            logits.append(model(ids[:, 30:45], cache=cache).logits)  # a chunk after it
            for t in range(45, 50):  # decode steps
                logits.append(model(ids[:, t : t + 1], cache=cache).logits)
            outs[name] = torch.cat(logits, 1)
    assert torch.equal(outs["kvlab"], outs["sdpa"])
