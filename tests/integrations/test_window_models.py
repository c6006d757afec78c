"""Every default method on a Gemma 3-like model (sliding-window layers interleaved with
full-attention layers, q/k norm, one kv head): it runs through prefill + decode compressing the
full-attention layers only, or is refused before the model loads, naming the method and an
alternative; window layers store what DynamicCache's sliding layers store; bytes per layer kind
add up (kvlab issue 19)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from byte_text import ByteTokenizer, hamlet_text
from transformers import DynamicCache

from kvlab.evaluation.methods import DEFAULT_METHODS, parse_method
from kvlab.evaluation.methods.caches import pnmix_config
from kvlab.evaluation.protocols import score_window
from kvlab.evaluation.support import check_methods, method_refusal
from kvlab.integrations.attention import use_attention
from kvlab.integrations.cache_protocol import FULL_ATTENTION_KIND, WINDOW_KIND
from kvlab.integrations.kvzip import compress
from kvlab.integrations.model_support import WindowLayer, plan_model
from kvlab.integrations.pnmix_calibration import calibrate_group_tokens
from kvlab.integrations.relay_cache import EvictionConfig, RelayModelCache
from kvlab.integrations.relay_calibration import layer_eviction_sensitivity
from kvlab.relay.layer_budgets import allocate_layer_fractions

S, F = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, F, S, S, F]
WINDOW = 8
PREFILL, DECODE = 160, 4
EXTRA_METHODS = (
    "relay:snapkv@0.5+pn-mix",  # composed
    "evict-no-relay:kvzip@0.5",
    "relay:kvzip@0.5",
    "relay:snapkv@0.5+pn-mix-lean",
    "evict-no-relay:kvzip@0.5+pn-mix-lean",
    "kivi-2bit-calibrated",  # per-layer PN-Mix group sizes calibrated on the full layers
)


def gemma_config(**overrides):
    settings = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Gemma3TextConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(gemma_config()).eval()


@pytest.fixture(scope="module")
def ids():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 96, (PREFILL + DECODE,), generator=gen)


@pytest.fixture(scope="module")
def fractions(model, ids):
    """Per-layer kept fractions as the relay-layer-budgets preparation calibrates them (on the
    full-attention layers only)."""
    config = EvictionConfig(ratio=0.5, scorer="snapkv", relay=False)
    sens = layer_eviction_sensitivity(
        model, ids[None], config, prefill=PREFILL, fractions=(0.25, 0.5, 0.75)
    )
    return allocate_layer_fractions(sens, 0.5, tokens=PREFILL)


TEXT = hamlet_text(20)


@pytest.fixture(scope="module")
def groups(model):
    """kivi-2bit-calibrated's group allocation, calibrated as its preparation does (group
    sizes 16 / 32 here, so its 160-token window fits the tiny model)."""
    config = pnmix_config(parse_method("kivi-2bit-calibrated").params)
    return calibrate_group_tokens(
        model,
        ByteTokenizer(),
        config,
        budget_group_tokens=config.group_tokens,
        text=TEXT,
        start=0,
        score=16,
        candidates=(16, 32),
    )


def test_group_calibration_measures_only_the_full_attention_layers(groups):
    assert groups.layers == (2, 5)
    assert len(groups.sensitivities) == 2
    assert all(set(row) == {16, 32} and min(row.values()) > 0 for row in groups.sensitivities)
    assert len(groups.layer_group_tokens) == len(LAYER_TYPES)
    # the window layers' entries are the budget's (unused: they keep their window)
    assert [groups.layer_group_tokens[i] for i in (0, 1, 3, 4)] == [32] * 4
    assert groups.settings()["group_allocation"]["calibrated_layers"] == [2, 5]


def prepared_for(method, fractions, groups=None):
    if method.preparation == "relay-layer-budgets":
        return {"layer_fractions": list(fractions)}
    if method.preparation == "pnmix-group-allocation":
        assert groups is not None
        return groups.settings()
    if method.preparation == "kvzip-prompt":
        return {"kvzip_prompt": {"first_ids": [5, 6, 7], "next_ids": [8, 9], "suffix_ids": [10]}}
    assert method.preparation is None, method.preparation
    return None


def test_plan_is_the_gemma3_interleave():
    plan = plan_model(gemma_config())
    assert plan.full_layers == (2, 5)
    assert plan.window_layers == (0, 1, 3, 4)
    assert {p.window for p in plan.layers if p.is_window} == {WINDOW}


def test_calibration_measures_only_the_full_attention_layers(model, ids, fractions):
    config = EvictionConfig(ratio=0.5, scorer="snapkv", relay=False)
    sens = layer_eviction_sensitivity(
        model, ids[None], config, prefill=PREFILL, fractions=(0.25, 0.5, 0.75)
    )
    assert len(sens) == 2 == len(fractions)
    assert all(set(row) == {0.25, 0.5, 0.75} for row in sens)
    assert all(v >= 0 for row in sens for v in row.values())
    assert sum(round(f * PREFILL) for f in fractions) <= 2 * round(0.5 * PREFILL)


def test_per_layer_budgets_split_over_full_attention_layers(model, ids):
    weights = (3.0, 1.0)
    cache = RelayModelCache(model.config, EvictionConfig(ratio=0.5, layer_budget=weights))
    with use_attention(model, "kvlab"):
        model(ids[None, :PREFILL], cache=cache, use_cache=True)
    counts = {e.layer_idx: e.tokens_after for e in cache.events()}
    assert set(counts) == {2, 5}
    per_head = {i: sum(c) / len(c) for i, c in counts.items()}  # one kv head
    assert per_head[2] + per_head[5] == 2 * round(0.5 * PREFILL)
    assert per_head[2] > per_head[5]
    with pytest.raises(ValueError, match="2 full-attention layers"):
        RelayModelCache(model.config, EvictionConfig(ratio=0.5, layer_budget=(1.0,) * 6))


def _check_storage(cache_storage, plan):
    kinds = cache_storage.layer_kinds
    assert kinds is not None
    assert sum(k["kv_bytes"] for k in kinds.values()) == cache_storage.kv_bytes
    assert sum(k["kv_bytes_16bit"] for k in kinds.values()) == cache_storage.kv_bytes_16bit
    assert kinds[FULL_ATTENTION_KIND]["layers"] == len(plan.full_layers)
    assert kinds[WINDOW_KIND]["layers"] == len(plan.window_layers)


def _window_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() * 2
        for layer in cache.layers
        if layer.is_sliding
    )


@pytest.mark.parametrize("name", [*DEFAULT_METHODS, *EXTRA_METHODS])
def test_every_method_runs_prefill_and_decode(model, ids, fractions, groups, name):
    method = parse_method(name)
    assert method_refusal(method, model.config) is None
    prepared = prepared_for(method, fractions, groups)
    plan = plan_model(model.config)
    if method.params.get("reconstruction"):
        cache = method.make_cache(model.config, prepared)
        with use_attention(model, method.attention):
            model(ids[None, :PREFILL], cache=cache, use_cache=True)
            before = [dict(vars(layer)) for layer in cache.layers if isinstance(layer, WindowLayer)]
            events = compress(model, cache, ids[None, :PREFILL])
            after = [dict(vars(layer)) for layer in cache.layers if isinstance(layer, WindowLayer)]
            # the reconstruction pass changes no window layer
            assert all(
                a.keys() == b.keys() and all(a[k] is b[k] for k in a)
                for a, b in zip(after, before, strict=True)
            )
            assert {e.layer_idx for e in events} == set(plan.full_layers)
            out = model(
                ids[None, PREFILL : PREFILL + 1],
                cache=cache,
                position_ids=cache.position_ids(1),
                use_cache=True,
            )
        assert torch.isfinite(out.logits).all()
        _check_storage(cache.storage(), plan)
        return
    result = score_window(model, ids, method, prefill=PREFILL, score=DECODE, prepared=prepared)
    assert torch.isfinite(result.nll).all()
    _check_storage(result.storage_final, plan)
    _check_storage(result.storage_prefill, plan)
    # window layers hold their window (window - 1 tokens) in every method, as DynamicCache's
    reference = DynamicCache(config=model.config)
    with use_attention(model, "sdpa"):
        model(ids[None, : PREFILL + DECODE - 1], cache=reference, use_cache=True)
    window = result.storage_final.layer_kinds[WINDOW_KIND]
    assert window["kv_bytes"] == _window_bytes(reference)
    if method.family != "full":
        full = result.storage_final.layer_kinds[FULL_ATTENTION_KIND]
        exact = sum(
            layer.keys.numel() * layer.keys.element_size() * 2
            for layer in reference.layers
            if not layer.is_sliding
        )
        assert full["kv_bytes"] < exact  # the full-attention layers are compressed


@pytest.mark.parametrize("name", ["pn-mix", "evict-no-relay:snapkv@0.5", "int4"])
def test_window_layers_equal_dynamic_cache_bit_for_bit(model, ids, fractions, name):
    """The layers in front of the first full-attention layer see the same inputs in both
    caches: their stored keys and values are DynamicCache's sliding layers', bit for bit; the
    later window layers keep exactly the states the model gave them (a shadow
    DynamicSlidingWindowLayer fed the same states)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    method = parse_method(name)
    cache = method.make_cache(model.config, prepared_for(method, fractions))
    shadows = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, WindowLayer):
            shadow = shadows[i] = DynamicSlidingWindowLayer(WINDOW)

            def tapped(k, v, *args, _layer=layer, _shadow=shadow, _update=layer.update, **kw):
                _shadow.update(k, v)
                return _update(k, v, *args, **kw)

            layer.update = tapped
    reference = DynamicCache(config=model.config)
    prompt = ids[None, :PREFILL]
    with use_attention(model, method.attention):
        model(prompt, cache=cache, use_cache=True)
        model(prompt, cache=reference, use_cache=True)
        for t in range(DECODE):
            token = ids[None, PREFILL + t : PREFILL + t + 1]
            model(token, cache=cache, use_cache=True)
            model(token, cache=reference, use_cache=True)
    for i in range(min(plan_model(model.config).full_layers)):
        assert torch.equal(cache.layers[i].keys, reference.layers[i].keys)
        assert torch.equal(cache.layers[i].values, reference.layers[i].values)
    for i, shadow in shadows.items():
        assert torch.equal(cache.layers[i].keys, shadow.keys)
        assert torch.equal(cache.layers[i].values, shadow.values)
        assert cache.layers[i].get_seq_length() == PREFILL + DECODE


# ------------------------------------------------------------ refusals, from a config only


def test_gemma3_config_refuses_no_default_method():
    config = gemma_config()
    check_methods([parse_method(n) for n in (*DEFAULT_METHODS, *EXTRA_METHODS)], config)


def test_model_without_full_attention_layers_is_refused_naming_method_and_alternative():
    config = gemma_config(layer_types=[S] * 6)
    for name in ("pn-mix", "relay:snapkv@0.5", "relay:snapkv@0.5+pn-mix"):
        reason = method_refusal(parse_method(name), config)
        assert reason is not None
        assert repr(name) in reason and "no full-attention layer" in reason
        assert "'full'" in reason
    assert method_refusal(parse_method("full"), config) is None
    with pytest.raises(ValueError, match="2 method"):
        check_methods([parse_method("full"), parse_method("pn-mix"), parse_method("int4")], config)


def test_transformers_quantized_cache_on_window_layers_is_refused_before_loading():
    """transformers' QuantizedCache refuses sliding layers only once the model has loaded;
    kvlab refuses the row from the config, naming kvlab's 2-bit alternatives."""
    method = dataclasses.replace(
        parse_method("full"), name="hf-quanto-2bit-per-token", family="hf-quantized"
    )
    reason = method_refusal(method, gemma_config())
    assert reason is not None and "'hf-quanto-2bit-per-token'" in reason
    assert "QuantizedCache" in reason and "'kivi-2bit'" in reason and "[0, 1, 3, 4]" in reason
    assert method_refusal(method, gemma_config(layer_types=[F] * 6)) is None


def test_relay_on_nope_layers_is_refused_with_the_no_relay_alternative():
    config = transformers.Cohere2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        sliding_window=WINDOW,
        layer_types=[S, F],
    )
    reason = method_refusal(parse_method("relay:snapkv@0.5"), config)
    assert reason is not None and "'evict-no-relay:snapkv@0.5'" in reason
    assert method_refusal(parse_method("evict-no-relay:snapkv@0.5"), config) is None
    assert "'evict-no-relay:recency@0.5'" in method_refusal(
        parse_method("streaming-llm@0.5"), config
    )


def test_eval_refuses_before_the_model_loads(tmp_path, monkeypatch):
    """kvlab eval's input checks read the config only: the model never loads."""
    from kvlab.evaluation.harness import prepare_inputs
    from kvlab.evaluation.plan import EvalConfig

    folder = tmp_path / "model"
    gemma_config(layer_types=[S] * 6).save_pretrained(folder)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvlab.models.load_model", no_load)
    monkeypatch.setattr("kvlab.models.load_tokenizer", no_load)
    config = EvalConfig(model=str(folder), methods=["full", "pn-mix"], output_dir=tmp_path / "o")
    with pytest.raises(ValueError, match="'pn-mix' cannot run"):
        prepare_inputs(config, tmp_path / "o")


def test_table_says_which_layers_were_compressed():
    from kvlab.evaluation.table import prefill_score_table

    def summary(name, family, full16, window16):
        kinds = {
            FULL_ATTENTION_KIND: {
                "layers": 3,
                "kv_bytes": full16,
                "kv_bytes_16bit": full16,
                "fraction_of_full": full16 / 300.0,
            },
            WINDOW_KIND: {
                "layers": 15,
                "kv_bytes": window16,
                "kv_bytes_16bit": window16,
                "fraction_of_full": 1.0,
            },
        }
        return dict(
            method=name,
            family=family,
            kv_bytes=full16 + window16,
            held_bytes=full16 + window16,
            kv_bytes_16bit=full16 + window16,
            kv_fraction_of_full=(full16 + window16) / 1500.0,
            prefill_kv_bytes_16bit=1.0,
            ppl=1.0,
            delta_ppl_pct=0.0,
            kl_mean=0.0,
            kl_p95=0.0,
            model_seconds=1.0,
            tokens_per_second=1.0,
            kv_bytes_by_layer_kind=kinds,
        )

    table = prefill_score_table(
        [summary("full", "full", 300, 1200), summary("pn-mix", "quantized", 45, 1200)]
    )
    assert "full-attn vs full" in table and "| 0.150 |" in table
    assert "Only the 3 full-attention layers of 18 are compressed" in table
    assert "80%" in table
    plain = {k: v for k, v in summary("full", "full", 1, 1).items() if "layer_kind" not in k}
    assert "full-attn" not in prefill_score_table([plain])


def test_eviction_config_weights_still_one_per_layer_on_all_full_models():
    from tiny_models import tiny_llama_config

    config = tiny_llama_config()
    cache = RelayModelCache(config, EvictionConfig(ratio=0.5, layer_budget=(1.0, 2.0)))
    assert [layer.evictor.budget_index for layer in cache._relay_layers()] == [0, 1]
