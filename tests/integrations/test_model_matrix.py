"""The model matrix: every supported transformers family, each kvlab cache, exact or refused.

For each family (a tiny random-initialized config, ``FAMILIES`` in tests/fixtures/tiny_models.py,
built in the test, no downloads):

* with a NON-compressing kvlab cache, the ``"kvlab"`` attention reproduces the model's own
  ``sdpa`` (or ``eager``, where the family has no SDPA path) logits in float32 to 1e-5, in a
  forward (prefill, then a multi-token chunk) and in ``generate`` (greedy tokens identical,
  per-step logits to 1e-5). PN-Mix stores its exact tokens in float16 (``storage_dtype``), so
  its reference after the prefill is the model's own attention over a cache that rounds
  stored keys/values the same way (the prefill itself is exact);
* with compression the cache runs (full-attention layers compressed, window layers holding
  exactly ``window - 1`` tokens), or refuses at construction, before any layer stores
  anything, with one line naming the unsupported feature;
* each family's special feature (window, soft-capping, sinks) changes the reference logits,
  so these tests fail if the feature is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from tiny_models import COMMON, FAMILIES, prompt
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention
from kvlab.integrations.model_support import WindowLayer, plan_model
from kvlab.integrations.pnmix_cache import PNMixLayer, PNMixModelCache
from kvlab.integrations.relay_cache import RelayLayer
from kvlab.pnmix import PNMixConfig

PROMPT = 20
CHUNK = 5
NEW_TOKENS = 6
# Families refused by every kvlab cache at construction (config only; no model is built).
REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "qwen3_next (linear attention)": (
        lambda: transformers.Qwen3NextConfig(**COMMON, num_hidden_layers=4, head_dim=16),
        "linear_attention",
    ),
    "deepseek_v3 (latent attention)": (
        lambda: transformers.DeepseekV3Config(**COMMON, num_hidden_layers=2),
        "latent attention",
    ),
    "gemma3n (KV sharing)": (
        lambda: transformers.Gemma3nTextConfig(**COMMON, num_hidden_layers=4, head_dim=16),
        "layer types",
    ),
}

# Non-compressing configurations: everything stays exact.
EXACT_PNMIX = PNMixConfig(sink_tokens=64, residual_tokens=8, group_tokens=8)
EXACT_RELAY = EvictionConfig(ratio=0.0, scorer="keynorm", sink_tokens=2, window_tokens=4)
# Compressing configurations.
SMALL_PNMIX = PNMixConfig(sink_tokens=2, residual_tokens=4, group_tokens=4)
SMALL_RELAY = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=4)


class StorageRoundedLayer(DynamicLayer):
    """A full-attention reference layer that stores keys/values rounded to float16, as PN-Mix
    stores its exact tokens: the first forward attends to its own unrounded keys (PN-Mix's
    exact prefill), every later one to the rounded storage."""

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized or self.keys.numel() == 0
        keys, values = super().update(
            key_states.half().to(key_states.dtype), value_states.half().to(value_states.dtype)
        )
        if first:
            return key_states, value_states
        return keys, values


def reference_cache(model: Any, cache_kind: str) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if cache_kind == "pnmix":
        cache.layers = [
            StorageRoundedLayer() if type(layer) is DynamicLayer else layer
            for layer in cache.layers
        ]
    return cache


def make_cache(model: Any, cache_kind: str, *, compress: bool) -> Any:
    if cache_kind == "pnmix":
        return PNMixModelCache(model.config, SMALL_PNMIX if compress else EXACT_PNMIX)
    return RelayModelCache(model.config, SMALL_RELAY if compress else EXACT_RELAY)


def two_forwards(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits of a prefill of all but the last CHUNK tokens, then of a CHUNK-token forward."""
    first = model(ids[:, :-CHUNK], cache=cache).logits
    second = model(ids[:, -CHUNK:], cache=cache).logits
    return torch.cat([first, second], 1)


def check_window_layers(model: Any, cache: Any, seen: int) -> None:
    """Every window layer holds exactly its last window - 1 tokens (real memory saved)."""
    plan = plan_model(model.config)
    for i in plan.window_layers:
        layer = cache.layers[i]
        window = plan.layers[i].window
        assert isinstance(layer, WindowLayer)
        kept = min(seen, window - 1)
        assert layer.keys.shape[-2] == kept
        assert layer.get_seq_length() == seen
        assert layer.nbytes() == layer.keys.numel() * 4 + layer.values.numel() * 4
    for i in plan.full_layers:
        assert isinstance(cache.layers[i], (PNMixLayer, RelayLayer))


def cases(kinds=("pnmix", "relay"), *, skip_refused: bool) -> list[Any]:
    out = []
    for name, family in FAMILIES.items():
        for kind in kinds:
            if skip_refused and kind in family.refused:
                continue
            out.append(pytest.param(name, kind, id=f"{name}-{kind}"))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_kvlab_attention_with_dynamic_cache_equals_own_attention(name):
    """Plain tensors (transformers' own DynamicCache, window layers included)."""
    model = FAMILIES[name].build(seed=9)
    ids = prompt(2, PROMPT, seed=10)
    with torch.no_grad():
        reference = two_forwards(model, ids, DynamicCache(config=model.config))
        with use_attention(model, KVLAB_ATTENTION):
            out = two_forwards(model, ids, DynamicCache(config=model.config))
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "cache_kind"), cases(skip_refused=False))
def test_forward_equals_own_attention_with_non_compressing_cache(name, cache_kind):
    family = FAMILIES[name]
    model = family.build(seed=1)
    ids = prompt(2, PROMPT, seed=2)
    relay_exact = EvictionConfig(
        ratio=0.0, scorer="keynorm", sink_tokens=2, window_tokens=4, relay=False
    )
    with torch.no_grad():
        reference = two_forwards(model, ids, reference_cache(model, cache_kind))
        with use_attention(model, KVLAB_ATTENTION):
            if cache_kind == "relay" and "relay" in family.refused:
                cache = RelayModelCache(model.config, relay_exact)  # relay=False is accepted
            else:
                cache = make_cache(model, cache_kind, compress=False)
            out = two_forwards(model, ids, cache)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    check_window_layers(model, cache, PROMPT)
    if cache_kind == "pnmix":
        for i in cache.plan.full_layers:
            assert cache.layers[i].store.quantized_tokens == 0
    else:
        for layer in cache._relay_layers():
            assert layer.tokens_per_head() == [PROMPT] * len(layer.tokens_per_head())


@pytest.mark.parametrize(("name", "cache_kind"), cases(skip_refused=True))
def test_generate_equals_own_attention_with_non_compressing_cache(name, cache_kind):
    model = FAMILIES[name].build(seed=3)
    ids = prompt(1, PROMPT, seed=4)
    settings = dict(
        max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    with torch.no_grad():
        reference = model.generate(ids, cache=reference_cache(model, cache_kind), **settings)
        plain = model.generate(ids, **settings)
        with use_attention(model, KVLAB_ATTENTION):
            cache = make_cache(model, cache_kind, compress=False)
            out = model.generate(ids, cache=cache, **settings)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.sequences, plain.sequences)  # float16 storage flips no greedy token
    torch.testing.assert_close(
        torch.stack(out.logits), torch.stack(reference.logits), atol=1e-5, rtol=0
    )
    check_window_layers(model, cache, PROMPT + NEW_TOKENS - 1)


@pytest.mark.parametrize(("name", "cache_kind"), cases(skip_refused=False))
def test_compressing_cache_runs_or_refuses_at_construction(name, cache_kind):
    family = FAMILIES[name]
    model = family.build(seed=5)
    if cache_kind in family.refused:
        with pytest.raises(ValueError, match=family.refused[cache_kind]) as err:
            make_cache(model, cache_kind, compress=True)
        assert "\n" not in str(err.value)
        return
    ids = prompt(1, PROMPT, seed=6)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = make_cache(model, cache_kind, compress=True)
        tokens = model.generate(ids, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert tokens.shape == (1, PROMPT + NEW_TOKENS)
    seen = PROMPT + NEW_TOKENS - 1
    check_window_layers(model, cache, seen)
    plan = cache.plan
    if cache_kind == "pnmix":
        for i in plan.full_layers:
            assert cache.layers[i].store.quantized_tokens > 0
    else:
        for layer in cache._relay_layers():
            assert max(layer.tokens_per_head()) < seen  # evicted
            assert len(layer.events) == 1


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.feature_off])
def test_family_feature_changes_the_reference(name):
    """The special feature matters at this size, so dropping it fails the exactness tests."""
    family = FAMILIES[name]
    ids = prompt(1, PROMPT, seed=7)
    with torch.no_grad():
        on = family.build(seed=8)(ids).logits
        off = family.build(seed=8, **family.feature_off)(ids).logits
    assert (on - off).abs().max() > 1e-3


def test_gpt_oss_sinks_change_the_reference():
    family = FAMILIES["gpt_oss"]
    ids = prompt(1, PROMPT, seed=7)
    model = family.build(seed=8)
    with torch.no_grad():
        on = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)  # sinks that take no mass
        off = model(ids).logits
    assert (on - off).abs().max() > 1e-3


# the issue-8 coding (``pn-mix``): pre-RoPE per-pair widths, exact outliers, Hadamard values
ISSUE8_PNMIX = PNMixConfig(
    sink_tokens=2,
    residual_tokens=4,
    group_tokens=4,
    key_coding="bit_alloc",
    key_outlier_fraction=0.05,
    value_coding="hadamard",
)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if "pnmix" not in f.refused])
def test_issue8_coding_runs_on_every_family(name):
    """Position-aware codes with each family's RoPE (partial, interleaved, scaled, per layer
    type; NoPE layers in their own frame): generate runs and every full layer quantizes."""
    family = FAMILIES[name]
    model = family.build(seed=5)
    ids = prompt(1, PROMPT, seed=6)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = PNMixModelCache(model.config, ISSUE8_PNMIX)
        tokens = model.generate(ids, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert tokens.shape == (1, PROMPT + NEW_TOKENS)
    for i in cache.plan.full_layers:
        store = cache.layers[i].store
        assert store.quantized_tokens > 0 and store.saliency_computations == 1
        assert store.codec.position_aware == cache.plan.layers[i].uses_rope


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("cache_kind", ["pnmix", "relay"])
def test_unsupported_families_are_refused_at_construction(name, cache_kind):
    config_factory, phrase = REFUSED[name]
    config = config_factory()
    with pytest.raises(ValueError, match=phrase) as err:
        if cache_kind == "pnmix":
            PNMixModelCache(config, SMALL_PNMIX)
        else:
            RelayModelCache(config, SMALL_RELAY)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(("PNMixModelCache", "RelayModelCache"))


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "mistral"])
def test_training_gradients_equal_own_attention(name):
    """Plain tensors in training mode (no cache): soft-capping, sinks and windows keep their
    gradients — the learned sinks included."""
    family = FAMILIES[name]
    ids = prompt(2, PROMPT, seed=11)
    grads = []
    for implementation in (None, KVLAB_ATTENTION):
        model = family.build(seed=12).train()
        if implementation is not None:
            model.set_attn_implementation(implementation)  # registered by conftest
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    if family.sinks:
        assert any("sinks" in n for n in grads[1])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)
