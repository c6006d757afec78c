"""DenseModelCache: the exact cache written in place and attended by the compiled decode call
(kvlab.integrations.dense_cache; docs/benchmarks.md, "Decode on the CPU against the bytes
limit")."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.integrations import use_attention
from kvlab.integrations.dense_cache import DenseLayer, DenseModelCache, DenseView
from kvlab.relay.kernels import cpu as relay_cpu

pytestmark = pytest.mark.skipif(
    relay_cpu.load() is None, reason=f"kernel {relay_cpu.cpu_kernel_status()}"
)


def _decode(model, cache, tokens, attention):
    out = []
    with torch.no_grad(), use_attention(model, attention):
        for j in range(tokens.shape[1]):
            out.append(model(tokens[:, j : j + 1], cache=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def test_prefill_and_decode_agree_with_dynamic_cache_and_generate_the_same(make_llama):
    model = make_llama(seed=3)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 96, (2, 40), generator=gen)
    steps = torch.randint(3, 96, (2, 300), generator=gen)
    full, dense = DynamicCache(config=model.config), DenseModelCache(model.config)
    with torch.no_grad():
        a = model(prompt, cache=full, use_cache=True).logits
        with use_attention(model, "kvlab"):
            b = model(prompt, cache=dense, use_cache=True).logits
    assert torch.equal(a, b)  # the prefill is transformers' attention over the same tensors
    a, b = _decode(model, full, steps, "sdpa"), _decode(model, dense, steps, "kvlab")
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert dense.get_seq_length() == full.get_seq_length() == 340
    # layer 0 stores the same tensors; later layers' inputs carry the attention's rounding
    assert torch.equal(full.layers[0].keys, dense.layers[0].keys)
    assert torch.equal(full.layers[0].values, dense.layers[0].values)
    for x, y in zip(full.layers, dense.layers, strict=True):
        torch.testing.assert_close(y.keys, x.keys, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
        with use_attention(model, "kvlab"):
            mine = model.generate(
                prompt, max_new_tokens=12, do_sample=False, cache=DenseModelCache(model.config)
            )
    assert torch.equal(greedy, mine)


def test_decode_steps_write_in_place_and_take_the_compiled_call(make_llama, monkeypatch):
    model = make_llama(seed=4)
    calls = []
    kernel = relay_cpu.dense_decode_cpu

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(relay_cpu, "dense_decode_cpu", counting)
    cache = DenseModelCache(model.config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), use_attention(model, "kvlab"):
        model(torch.randint(3, 96, (1, 30), generator=gen), cache=cache, use_cache=True)
        assert calls == []  # a prefill is not a decode step
        layer = cache.layers[0]
        assert isinstance(layer, DenseLayer) and layer.capacity > 30
        buffer, capacity = layer.keys.data_ptr(), layer.capacity
        for _ in range(capacity - 30):  # every step fits: no copy
            model(torch.randint(3, 96, (1, 1), generator=gen), cache=cache, use_cache=True)
            assert layer.keys.data_ptr() == buffer
        assert len(calls) == 2 * (capacity - 30)  # one per layer and step
        model(torch.randint(3, 96, (1, 1), generator=gen), cache=cache, use_cache=True)
        assert layer.capacity > capacity and layer.get_seq_length() == capacity + 1


def test_row_selection_and_crop_keep_the_buffers(make_llama):
    model = make_llama(seed=5)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 96, (1, 20), generator=gen)
    steps = torch.randint(3, 96, (3, 4), generator=gen)
    full, dense = DynamicCache(config=model.config), DenseModelCache(model.config)
    with torch.no_grad():
        model(prompt, cache=full, use_cache=True)
        with use_attention(model, "kvlab"):
            model(prompt, cache=dense, use_cache=True)
    for cache in (full, dense):
        cache.batch_repeat_interleave(3)
        cache.crop(-2)
    assert dense.get_seq_length() == 18 and dense.layers[0].capacity > 18
    a, b = _decode(model, full, steps, "sdpa"), _decode(model, dense, steps, "kvlab")
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    dense.batch_select_indices(torch.tensor([2, 0]))
    full.batch_select_indices(torch.tensor([2, 0]))
    a, b = _decode(model, full, steps[:2], "sdpa"), _decode(model, dense, steps[:2], "kvlab")
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    dense.reset()
    assert dense.get_seq_length() == 0 and dense.layers[0].capacity == 0


def test_another_attention_implementation_refuses_the_view(make_llama):
    model = make_llama(seed=6)
    cache = DenseModelCache(model.config)
    with torch.no_grad(), pytest.raises(TypeError, match="enable_kvlab_attention"):
        model(torch.tensor([[3, 4, 5]]), cache=cache, use_cache=True)  # "sdpa"


def test_attention_features_and_other_dtypes_take_the_dense_path(make_llama, monkeypatch):
    """Soft-capping and sinks (and a float64 query) are not the compiled call's: the view
    attends with dense_causal_attention over the same tensors."""
    monkeypatch.setattr(relay_cpu, "dense_decode_cpu", None)  # would raise if called
    layer = DenseLayer()
    gen = torch.Generator().manual_seed(3)
    view, _ = layer.update(torch.randn(1, 2, 9, 16, generator=gen), torch.randn(1, 2, 9, 16))
    assert isinstance(view, DenseView)
    query = torch.randn(1, 4, 1, 16, generator=gen)
    from kvlab.integrations.dense_attention import dense_causal_attention

    module = torch.nn.Module()
    for kwargs in ({"softcap": 20.0}, {"s_aux": torch.zeros(4)}):
        out = view.attend(module, query, scaling=0.25, attention_mask=None, kwargs=kwargs)
        expected = dense_causal_attention(query, layer.keys, layer.values, scaling=0.25, **kwargs)
        assert torch.equal(out, expected)
