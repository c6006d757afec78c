"""The registered "kvlab" attention: plain-tensor fallback, views, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache

from kvlab.integrations import (
    KVLAB_ATTENTION,
    PNMixModelCache,
    enable_kvlab_attention,
    use_attention,
)
from kvlab.integrations.attention import (
    CacheView,
    dense_causal_attention,
    kvlab_attention_forward,
    kvlab_mask,
)


def _reference_attention(q, k, v, scaling, offset):
    """float64 softmax attention, GQA by repetition, bottom-right causal."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    logits = q.double() @ k.transpose(-1, -2) * scaling
    qn, kn = q.shape[2], k.shape[2]
    allowed = torch.arange(kn).view(1, -1) <= torch.arange(qn).view(-1, 1) + offset
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v


@settings(max_examples=25, deadline=None)
@given(
    q_len=st.integers(1, 6),
    past=st.integers(0, 7),
    groups=st.sampled_from([1, 2, 3]),
    kv_heads=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_dense_causal_attention_matches_float64_reference(q_len, past, groups, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, kv_heads * groups, q_len, 8, generator=gen)
    k = torch.randn(2, kv_heads, past + q_len, 8, generator=gen)
    v = torch.randn(2, kv_heads, past + q_len, 5, generator=gen)
    out = dense_causal_attention(q, k, v, scaling=0.3)
    ref = _reference_attention(q, k, v, 0.3, past)
    assert out.shape == (2, kv_heads * groups, q_len, 5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_padding_mask_excludes_padded_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 8, generator=gen)
    k = torch.randn(1, 2, 5, 8, generator=gen)
    v = torch.randn(1, 2, 5, 4, generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out = dense_causal_attention(q, k, v, scaling=0.5, attention_mask=mask)
    ref = _reference_attention(q, k[:, :, 2:], v[:, :, 2:], 0.5, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)


def test_kvlab_attention_with_dynamic_cache_equals_sdpa(make_llama):
    model = make_llama()
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
        enable_kvlab_attention(model)
        assert model.config._attn_implementation == KVLAB_ATTENTION
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :25], cache=cache).logits
        second = model(ids[:, 25:], cache=cache).logits
    torch.testing.assert_close(torch.cat([first, second], 1), reference, atol=1e-5, rtol=1e-4)


def test_view_under_sdpa_raises_clear_error(make_llama):
    model = make_llama()
    cache = PNMixModelCache(model.config)
    with pytest.raises(TypeError, match="kvlab"), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=cache)


class _NoPaddingView(CacheView):
    """A view that leaves padding to the attention function (``supports_padding`` False)."""

    def attend(self, module, query, *, scaling, attention_mask, kwargs):
        return torch.zeros_like(query)


def test_padded_batch_is_rejected_for_views_without_padding_support():
    view = _NoPaddingView()
    module = torch.nn.Module()
    query = torch.randn(2, 4, 3, 8)
    padded = torch.tensor([[1, 1, 1], [0, 1, 1]]).bool()
    with pytest.raises(ValueError, match="padded"):
        kvlab_attention_forward(module, query, view, view, padded, scaling=1.0)
    with pytest.raises(ValueError, match="4-D"):
        kvlab_attention_forward(module, query, view, view, padded[:, None, None], scaling=1.0)
    out, _ = kvlab_attention_forward(
        module, query, view, view, torch.ones(2, 3).bool(), scaling=1.0
    )
    assert out.shape == (2, 3, 4, 8)


def test_mask_builder_never_reads_the_mask(monkeypatch):
    """kvlab_mask hands the 2-D mask on as given (a padding decision costs no host sync)."""
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])

    def forbidden(*args, **kwargs):
        raise AssertionError("kvlab_mask read the mask on the host")

    for name in ("item", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = kvlab_mask(2, 3, 3, attention_mask=mask)
    monkeypatch.undo()
    assert out.dtype == torch.bool and torch.equal(out, mask.bool())
    assert kvlab_mask(2, 3, 3, attention_mask=None) is None


def test_bad_padding_for_a_padding_view_is_refused_and_attention_restored(make_llama):
    model = make_llama()
    ids = torch.tensor([[5, 6, 7, 8], [6, 7, 8, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # right padding: PN-Mix refuses it
    with (
        use_attention(model, KVLAB_ATTENTION),
        torch.no_grad(),
        pytest.raises(ValueError, match="left padding"),
    ):
        model(ids, attention_mask=mask, cache=PNMixModelCache(model.config))
    assert model.config._attn_implementation == "sdpa"  # restored by use_attention


def test_fallback_respects_padding_like_sdpa(make_llama):
    model = make_llama()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        with use_attention(model, KVLAB_ATTENTION):
            out = model(ids, attention_mask=mask).logits
    # padded query rows are meaningless; compare the real tokens
    torch.testing.assert_close(out[0], reference[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1, 2:], reference[1, 2:], atol=1e-5, rtol=1e-4)


def test_importing_the_integration_registers_the_kvlab_attention(make_llama):
    """``set_attn_implementation("kvlab")`` works once ``kvlab.integrations`` is imported (no
    separate registration step)."""
    import kvlab.integrations  # noqa: F401

    model = make_llama(seed=3)
    model.set_attn_implementation(KVLAB_ATTENTION)
    assert model.config._attn_implementation == KVLAB_ATTENTION


def test_kvlab_attention_over_a_static_cache_attends_to_written_slots_only(make_llama):
    """A pre-allocated ``StaticCache`` hands the attention its whole capacity (64 slots): the
    unwritten slots past the last query must get no weight, as under ``sdpa`` (issue: the
    kvlab mask passed the plain causal pattern as ``None`` and the slots were attended)."""
    model = make_llama()
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
        enable_kvlab_attention(model)
        cache = StaticCache(config=model.config, max_cache_len=64)
        chunks = [model(ids[:, a:b], past_key_values=cache).logits
                  for a, b in ((0, 20), (20, 21), (21, 30))]  # fmt: skip
        torch.testing.assert_close(torch.cat(chunks, 1), reference, atol=1e-5, rtol=1e-4)
        tokens = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False,
                                cache_implementation="static")  # fmt: skip
        model.set_attn_implementation("sdpa")
        expected = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False,
                                  cache_implementation="static")  # fmt: skip
    assert torch.equal(tokens, expected)
