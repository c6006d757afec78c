"""Eviction method names: the searched default policy, the legacy policy, the new scorers."""

from __future__ import annotations

import pytest
from tiny_models import tiny_llama_config

from kvlab.evaluation.methods import parse_method
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.relay import ExpectedAttentionScorer, TOVAScorer
from kvlab.relay.policies import DEFAULT_WINDOW_FRACTION
from kvlab.relay.scorers import SnapKVScorer

CONFIG = tiny_llama_config()


@pytest.mark.parametrize("kind", ["relay", "evict-no-relay"])
def test_legacy_names_build_the_pre_search_config(kind):
    cache = parse_method(f"{kind}-legacy:snapkv@0.5").make_cache(CONFIG)
    old = EvictionConfig(ratio=0.5, scorer="snapkv", relay=kind == "relay")
    assert cache.eviction == old


@pytest.mark.parametrize("kind", ["relay", "evict-no-relay"])
def test_default_names_use_the_searched_policy(kind):
    # stream protocol: no per-layer calibration (layer budgets need a prefill ratio)
    method = parse_method(f"{kind}:snapkv@0.5", protocol="stream", cache_slots=512)
    assert method.prepare is None
    config = method.make_cache(CONFIG).eviction
    assert config.window_fraction == DEFAULT_WINDOW_FRACTION and config.relay is (kind == "relay")
    scorer = config.scorer
    assert isinstance(scorer, SnapKVScorer) and scorer.value_norm and scorer.kernel_size == 7
    # recency keeps sinks + the newest tokens whatever the window: plain settings
    assert parse_method(f"{kind}:recency@0.5").make_cache(CONFIG).eviction == EvictionConfig(
        ratio=0.5, scorer="recency", relay=kind == "relay"
    )


def test_prefill_score_snapkv_calibrates_layer_budgets_once(monkeypatch):
    from kvlab.evaluation import methods as methods_module
    from kvlab.integrations.relay_calibration import LayerBudgetCalibration

    calls = []

    def fake(model, tokenizer, config):
        calls.append(config)
        fractions = (0.75, 0.25) * (CONFIG.num_hidden_layers // 2)
        return LayerBudgetCalibration(fractions, (), "text", "sha", 0, 512, 128, 0.0)

    monkeypatch.setattr(methods_module, "calibrate_layer_budgets", fake)
    relay = parse_method("relay:snapkv@0.5")
    plain = parse_method("evict-no-relay:snapkv@0.5")
    with pytest.raises(RuntimeError, match="prepared"):
        relay.make_cache(CONFIG)
    model = object()
    relay.prepare(model, None)
    plain.prepare(model, None)
    assert len(calls) == 1 and calls[0].relay is False  # shared by relay and no relay
    assert calls[0].window_fraction == DEFAULT_WINDOW_FRACTION and calls[0].ratio == 0.5
    for method, relayed in ((relay, True), (plain, False)):
        config = method.make_cache(CONFIG).eviction
        assert config.layer_budget == (0.75, 0.25) * (CONFIG.num_hidden_layers // 2)
        assert config.relay is relayed
    assert parse_method("relay:keynorm@0.5").prepare is None


def test_new_scorers_have_method_names():
    cache = parse_method("relay:expected-attention@0.5").make_cache(CONFIG)
    assert isinstance(cache.layers[0].scorer, ExpectedAttentionScorer)
    cache = parse_method("evict-no-relay:tova@0.25").make_cache(CONFIG)
    assert isinstance(cache.layers[0].scorer, TOVAScorer) and cache.eviction.ratio == 0.25
    stream = parse_method("relay:tova@0.5", protocol="stream", cache_slots=512)
    assert stream.make_cache(CONFIG).eviction.capacity == 256
    with pytest.raises(ValueError, match="unknown scorer"):
        parse_method("relay:snap-kv@0.5")


def test_expected_attention_default_is_kvpress_policy():
    config = parse_method("evict-no-relay:expected-attention@0.5").make_cache(CONFIG).eviction
    assert (config.window_tokens, config.sink_tokens, config.window_fraction) == (0, 4, None)
    cache = parse_method("relay:expected-attention@0.5").make_cache(CONFIG)
    assert cache.layers[0].allocation == "uniform"
