"""PNMixModelCache inside transformers models: exactness, closeness, beams, packed reads."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, PNMixModelCache, use_attention
from kvlab.pnmix import PNMixCache, PNMixConfig

SMALL = dict(sink_tokens=4, residual_tokens=8, group_tokens=16)


def _kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    ref = torch.log_softmax(reference_logits.double(), -1)
    out = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - out)).sum(-1)


def _score_one_at_a_time(model, ids, cache, prefill):
    """Prefill, then feed one token at a time; logits [B, T - prefill + 1, V] of the scored
    positions (prefill - 1 .. T - 1)."""
    out = [model(ids[:, :prefill], cache=cache).logits[:, -1:]]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache).logits)
    return torch.cat(out, 1)


def test_generate_matches_dynamic_cache_when_nothing_is_quantized(make_llama):
    model = make_llama(seed=3)
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    config = PNMixConfig(sink_tokens=32, residual_tokens=32, group_tokens=128)
    prompt = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.generate(
            prompt, max_new_tokens=24, do_sample=False, cache=DynamicCache(config=model.config)
        )
        cache = PNMixModelCache(model.config, config)
        with use_attention(model, KVLAB_ATTENTION):
            tokens = model.generate(prompt, max_new_tokens=24, do_sample=False, cache=cache)
    assert tokens.shape == (1, 48)
    assert torch.equal(tokens, reference)
    store = cache.layers[0].store
    assert store.quantized_tokens == 0  # sinks + residual cover all 47 cached tokens
    assert store.seq_length == 47


def test_logits_equal_to_float16_rounding_when_nothing_is_quantized(make_llama):
    model = make_llama(seed=4)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _score_one_at_a_time(model, ids, DynamicCache(config=model.config), 20)
        with use_attention(model, KVLAB_ATTENTION):
            out = _score_one_at_a_time(model, ids, PNMixModelCache(model.config), 20)
    # keys/values are stored in float16: the only difference is that rounding
    torch.testing.assert_close(out, reference, atol=2e-3, rtol=0)


@pytest.mark.parametrize("coding", ["mix", "cartesian", "per_token"])
def test_quantized_logits_are_close_and_more_bits_are_closer(make_llama, coding):
    model = make_llama(seed=5)
    ids = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(2))
    kls = {}
    with torch.no_grad():
        reference = _score_one_at_a_time(model, ids, DynamicCache(config=model.config), 96)
        with use_attention(model, KVLAB_ATTENTION):
            for bits in (2, 4):
                cache = PNMixModelCache(
                    model.config, PNMixConfig(bits=bits, key_coding=coding, **SMALL)
                )
                out = _score_one_at_a_time(model, ids, cache, 96)
                assert cache.layers[0].store.quantized_tokens >= 128  # really quantized
                kls[bits] = float(_kl(reference, out).mean())
    # this random model's attention is flat: 2-bit KL is ~6e-5 nats, 4-bit ~2e-6
    assert 0.0 < kls[4] < kls[2] < 1e-3, kls


def test_decode_reads_packed_codes_never_dequantizes(make_llama, monkeypatch):
    model = make_llama(seed=6)
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(3))

    def forbidden(self):
        raise AssertionError("the cache was dequantized as a whole")

    monkeypatch.setattr(PNMixCache, "dequantize", forbidden)
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids[:, :64], cache=cache)  # exact prefill: no packed call yet
        assert cache.attention_calls() == 0
        for t in range(64, 80):
            model(ids[:, t : t + 1], cache=cache)
    layers = model.config.num_hidden_layers
    assert cache.attention_calls() == 16 * layers
    assert cache.layers[0].store.quantized_tokens == 64


def test_exact_prefill_off_reads_codes_in_the_prefill(make_llama):
    model = make_llama(seed=6)
    ids = torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(3))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL), exact_prefill=False)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    assert cache.attention_calls() == model.config.num_hidden_layers


def _buffers(store: PNMixCache) -> list[torch.Tensor]:
    tensors = [store.sink_keys, store.sink_values, store.residual_keys, store.residual_values]
    for group in store.groups:
        tensors.extend(group.tensors().values())
    if store.mix_mask is not None:
        tensors.append(store.mix_mask)
    return tensors


def test_beam_reorder_of_a_quantized_cache_is_bit_exact(make_llama):
    model = make_llama(seed=7)
    ids = torch.randint(3, 96, (3, 70), generator=torch.Generator().manual_seed(4))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    assert cache.layers[0].store.quantized_tokens > 0
    before = [[t.clone() for t in _buffers(layer.store)] for layer in cache.layers]
    dequantized = [layer.store.dequantize() for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for layer, old, (old_k, old_v) in zip(cache.layers, before, dequantized, strict=True):
        new = _buffers(layer.store)
        assert len(new) == len(old)
        for a, b in zip(new, old, strict=True):
            assert torch.equal(a, b.index_select(0, beam_idx))  # bit-exact, codes permuted
        new_k, new_v = layer.store.dequantize()
        assert torch.equal(new_k, old_k[beam_idx]) and torch.equal(new_v, old_v[beam_idx])


def test_beam_search_generate_runs_on_a_quantized_cache(make_llama):
    model = make_llama(seed=8)
    prompt = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(5))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, num_beams=3, cache=cache)
    assert out.shape == (1, 68)
    assert cache.layers[0].store.batch_size == 3
    assert cache.layers[0].store.quantized_tokens > 0


def test_rotary_settings_follow_the_model(make_phi3_partial):
    model = make_phi3_partial()
    cache = PNMixModelCache(model.config)
    assert cache.pnmix_config.rotary_dim == 8
    assert cache.pnmix_config.rotary_layout == "half"


def test_crop_is_refused():
    from kvlab.integrations.pnmix_cache import PNMixLayer

    layer = PNMixLayer(PNMixConfig())
    layer.crop(0)
    with pytest.raises(NotImplementedError, match="cropped"):
        layer.crop(-1)
