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
    assert method.preparation is None
    config = method.make_cache(CONFIG).eviction
    assert config.window_fraction == DEFAULT_WINDOW_FRACTION and config.relay is (kind == "relay")
    scorer = config.scorer
    assert isinstance(scorer, SnapKVScorer) and scorer.value_norm and scorer.kernel_size == 7
    # recency keeps sinks + the newest tokens whatever the window: plain settings
    assert parse_method(f"{kind}:recency@0.5").make_cache(CONFIG).eviction == EvictionConfig(
        ratio=0.5, scorer="recency", relay=kind == "relay"
    )


def test_prefill_score_snapkv_calibrates_layer_budgets_once(monkeypatch):
    from kvlab.evaluation.methods import PREPARATIONS
    from kvlab.evaluation.plan import EvalConfig, ModelRef, TextRef, plan_eval, select_methods
    from kvlab.integrations import relay_calibration
    from kvlab.integrations.relay_calibration import LayerBudgetCalibration

    calls = []

    def fake(model, tokenizer, config, **kwargs):
        calls.append(config)
        fractions = (0.75, 0.25) * (CONFIG.num_hidden_layers // 2)
        return LayerBudgetCalibration(fractions, (), "text", "sha", 0, 512, 128, 0.0)

    monkeypatch.setattr(relay_calibration, "calibrate_layer_budgets", fake)
    relay = parse_method("relay:snapkv@0.5")
    plain = parse_method("evict-no-relay:snapkv@0.5")
    with pytest.raises(RuntimeError, match="prepared"):
        relay.make_cache(CONFIG)
    # the plan holds one preparation for both (one calibration-cache key); run it
    config = EvalConfig(methods=[relay.name, plain.name], windows=1, prefill=64, score=16)
    model_ref = ModelRef("m", "local:m", "a" * 64, "float32", "cpu")
    plan = plan_eval(
        config, select_methods(config), model_ref, TextRef("file:t.txt", "b" * 64), range(100)
    )
    prepared = {}
    for prep in plan.preparations:
        run = PREPARATIONS[prep.method.preparation].run
        prepared[prep.key] = run(prep.method.params, object(), None, None, None)
    by_name = {t.method.name: t.preparation for t in plan.tasks}
    assert len(calls) == 1 and calls[0].relay is False  # shared by relay and no relay
    assert calls[0].window_fraction == DEFAULT_WINDOW_FRACTION and calls[0].ratio == 0.5
    for method, relayed in ((relay, True), (plain, False)):
        config = method.make_cache(CONFIG, prepared[by_name[method.name]]).eviction
        assert config.layer_budget == (0.75, 0.25) * (CONFIG.num_hidden_layers // 2)
        assert config.relay is relayed
    assert parse_method("relay:keynorm@0.5").preparation is None


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


def test_layer_budget_calibration_is_one_preparation_cached_on_disk(
    tiny_model_dir, tiny_text, tmp_path
):
    from eval_helpers import strip_timing

    from kvlab.evaluation import EvalConfig, run_eval

    names = ["relay:snapkv@0.5", "evict-no-relay:snapkv@0.5"]
    cache = tmp_path / "calibration"

    def run(out):
        config = EvalConfig(
            model=str(tiny_model_dir),
            text=tiny_text,
            methods=names,
            windows=1,
            prefill=192,
            score=4,
            device="cpu",
            output_dir=out,
            progress=False,
            calibration_cache=cache,
            argv=["kvlab", "eval"],
            cpu_threads=1,
        )
        return run_eval(config)

    first = run(tmp_path / "a")
    entries = list(cache.glob("*.json"))
    assert len(entries) == 1  # relay and no relay share one calibration
    records = [first.artifact["configuration"]["methods"][name] for name in names]
    for record in records:
        assert record["calibration_cache"] == {"status": "computed", "key": entries[0].stem}
        assert record["layer_budget"] == "per layer (calibrated)"
        assert len(record["layer_fractions"]) == 2 and sum(record["layer_fractions"]) == 1.0
        assert record["calibration_text"]["id"] != first.artifact["dataset"]["id"]
    second = run(tmp_path / "b")
    for name, record in zip(names, records, strict=True):
        again = second.artifact["configuration"]["methods"][name]
        assert again["calibration_cache"] == {"status": "reused", "key": entries[0].stem}
        assert again["layer_fractions"] == record["layer_fractions"]

    def numbers(summaries):
        return [{k: v for k, v in s.items() if k != "settings"} for s in strip_timing(summaries)]

    assert numbers(second.summaries) == numbers(first.summaries)


PROMPT = {"first_ids": [5, 6, 7], "next_ids": [8, 9], "suffix_ids": [10]}


@pytest.mark.parametrize("kind", ["relay", "evict-no-relay"])
def test_kvzip_names_need_the_prompt_preparation_and_the_prefill_score_protocol(kind):
    from kvlab.relay import KVzipScorer, ReconstructionPrompt

    method = parse_method(f"{kind}:kvzip@0.5")
    assert method.preparation == "kvzip-prompt"
    with pytest.raises(RuntimeError, match="prepared"):
        method.make_cache(CONFIG)
    config = method.make_cache(CONFIG, {"kvzip_prompt": PROMPT}).eviction
    assert isinstance(config.scorer, KVzipScorer)
    assert config.scorer.prompt == ReconstructionPrompt(**PROMPT)
    # kvpress's KVzipPress policy (issue 40): the whole budget to the top scores over every
    # layer and kv head, no protected window, the reconstruction queries only
    assert config.layer_budget == "scores" and config.scores_share == 1.0
    assert config.window_fraction is None and config.window_tokens == 0
    assert config.scorer.prefill_queries == 0
    assert config.relay is (kind == "relay")
    with pytest.raises(ValueError, match="prefill-score"):
        parse_method(f"{kind}:kvzip@0.5", protocol="stream", cache_slots=512)


def test_score_window_runs_the_kvzip_reconstruction_after_the_prefill():
    import torch
    from transformers import LlamaForCausalLM

    from kvlab.evaluation.metrics import cache_storage
    from kvlab.evaluation.protocols import score_window
    from kvlab.integrations import use_attention
    from kvlab.integrations.kvzip import compress

    torch.manual_seed(5)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    tokens = torch.randint(11, 96, (72,), generator=torch.Generator().manual_seed(6))
    method = parse_method("evict-no-relay:kvzip@0.5")
    prepared = {"kvzip_prompt": PROMPT}
    result = score_window(model, tokens, method, prefill=64, score=8, prepared=prepared)
    by_hand = method.make_cache(model.config, prepared)
    with torch.no_grad(), use_attention(model, "kvlab"):
        model(tokens[:64].view(1, -1), cache=by_hand)
    compress(model, by_hand, tokens[:64].view(1, -1))
    assert result.storage_prefill == cache_storage(by_hand)
    assert sum(sum(layer.tokens_per_head()) for layer in by_hand.layers) == 2 * 2 * 32
