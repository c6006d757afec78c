"""Eviction policies inside RelayModelCache: the new scorers, observation window, layer budgets."""

from __future__ import annotations

import pytest
import torch

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention
from kvlab.relay import ExpectedAttentionScorer, TOVAScorer
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.scorers import SnapKVScorer
from kvlab.rope import rotate_by_delta

POLICIES = {
    "expected-attention": lambda: "expected-attention",
    "tova": lambda: "tova",
    "tova-group": lambda: TOVAScorer("group"),
    "snapkv-avg-mean-vnorm": lambda: SnapKVScorer(
        5, pooling="avg", group_reduction="mean", value_norm=True
    ),
}


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _original_positions(layer) -> list[torch.Tensor]:
    """Per kv head, ``[1, n]`` stream indices of the tokens that row 0 keeps (stream order)."""
    return [layer.segment(0, h).original_positions.view(1, -1) for h in range(layer.store.heads)]


def _prefill(model, config: EvictionConfig, ids: torch.Tensor) -> RelayModelCache:
    cache = RelayModelCache(model.config, config)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("allocation", ["uniform", "adaptive"])
def test_new_scorers_keep_the_budget_sinks_and_window(make_llama, policy, relay, allocation):
    model = make_llama(seed=31)
    prefill = 64
    config = EvictionConfig(
        ratio=0.5,
        scorer=POLICIES[policy](),
        relay=relay,
        allocation=allocation,
        sink_tokens=2,
        window_tokens=8,
    )
    cache = _prefill(model, config, _ids(prefill, seed=32))
    heads = model.config.num_key_value_heads
    for layer in cache.layers:
        counts = layer.tokens_per_head()
        assert sum(counts) == 32 * heads
        if allocation == "uniform":
            assert counts == [32] * heads
        for orig in _original_positions(layer):
            kept = set(orig[0].tolist())
            assert {0, 1} | set(range(prefill - 8, prefill)) <= kept
        if relay:
            assert layer.next_positions[0] == prefill  # endpoint = slots - 1 = prefill - 1
        else:
            assert layer.next_positions[0] == prefill


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_keep_all_equals_the_full_cache(make_llama, policy):
    model = make_llama(seed=33)
    ids = _ids(40, seed=34)
    with torch.no_grad():
        reference = model(ids).logits
        cache = RelayModelCache(model.config, EvictionConfig(ratio=0.0, scorer=POLICIES[policy]()))
        with use_attention(model, KVLAB_ATTENTION):
            out = [model(ids[:, :30], cache=cache).logits]
            out += [model(ids[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(out, 1), reference, atol=1e-5, rtol=1e-4)


class _Recording(ExpectedAttentionScorer):
    def __init__(self) -> None:
        super().__init__(sink_tokens=0)
        self.inputs = []

    def score(self, inputs):
        self.inputs.append(inputs)
        return super().score(inputs)


def test_expected_attention_sees_the_pre_rope_queries_of_the_forward(make_llama):
    model = make_llama(seed=35)
    ids = _ids(48, seed=36)
    raw: dict[int, torch.Tensor] = {}
    heads_q = model.config.num_attention_heads
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(module, args, output, i=i, dim=attn.head_dim):
            b, s, _ = output.shape
            raw[i] = output.view(b, s, heads_q, dim).transpose(1, 2).detach().clone()

        handles.append(attn.q_proj.register_forward_hook(hook))
    scorer = _Recording()
    config = EvictionConfig(ratio=0.5, scorer=scorer, window_tokens=8)
    cache = _prefill(model, config, ids)
    for handle in handles:
        handle.remove()
    assert len(scorer.inputs) == len(cache.layers)
    for i, inputs in enumerate(scorer.inputs):
        assert inputs.next_position == 48 and torch.equal(inputs.query_positions, torch.arange(48))
        unrotated = rotate_by_delta(inputs.queries, -inputs.query_positions, inputs.rotary)
        torch.testing.assert_close(unrotated, raw[i], atol=2e-5, rtol=1e-5)


class _WindowProbe(SnapKVScorer):
    # reads the probabilities over every slot (their sums), not only before the protected window
    window_reach = None

    def __init__(self, observation_tokens=None) -> None:
        super().__init__(observation_tokens=observation_tokens)
        self.shapes = []

    def score(self, inputs):
        groups = inputs.window_groups
        # each query's probabilities sum to 1: the window's queries per query head
        window = round(float(groups.sum(-1).mean()))
        torch.testing.assert_close(groups.sum(-1), torch.full(groups.shape[:-1], float(window)))
        self.shapes.append((*groups.shape[:3], window, groups.shape[3]))
        torch.testing.assert_close(groups.sum(2), inputs.window_attention)
        assert inputs.window_last.shape == groups.shape
        return super().score(inputs)


@pytest.mark.parametrize(
    ("scorer_window", "config_window", "expected"), [(None, None, 8), (None, 5, 5), (3, 5, 3)]
)
def test_the_observation_window_is_configurable(make_llama, scorer_window, config_window, expected):
    model = make_llama(seed=37)
    probe = _WindowProbe(scorer_window)
    config = EvictionConfig(
        ratio=0.5, scorer=probe, window_tokens=8, observation_tokens=config_window
    )
    _prefill(model, config, _ids(40, seed=38))
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    heads = model.config.num_key_value_heads
    assert probe.shapes and all(s == (1, heads, group, expected, 40) for s in probe.shapes)


@pytest.mark.parametrize("scheme", ["pyramid", "weights"])
@pytest.mark.parametrize("relay", [True, False])
def test_layer_budgets_split_the_same_total(make_llama, scheme, relay):
    model = make_llama(seed=39, num_hidden_layers=4)
    layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    prefill, sinks, window = 80, 2, 4
    weights = (4.0, 1.0, 2.0, 1.0)
    layer_budget = "pyramid" if scheme == "pyramid" else weights
    config = EvictionConfig(
        ratio=0.5,
        layer_budget=layer_budget,
        relay=relay,
        sink_tokens=sinks,
        window_tokens=window,
        pyramid_beta=4.0,
    )
    cache = _prefill(model, config, _ids(prefill, seed=40))
    per_layer = [sum(layer.tokens_per_head()) // heads for layer in cache.layers]
    assert sum(per_layer) == 40 * layers
    if scheme == "pyramid":
        real = pyramid_layer_budgets(40, layers, beta=4.0, max_tokens=prefill)
    else:
        real = list(weights)
    expected = split_layer_budget(
        40 * layers, real, low=[sinks + window] * layers, high=[prefill] * layers
    )
    assert per_layer == expected
    assert len(set(per_layer)) > 1
    if scheme == "pyramid":
        assert per_layer == sorted(per_layer, reverse=True)


def test_layer_budget_settings_are_validated(make_llama):
    with pytest.raises(ValueError, match="layer_budget"):
        EvictionConfig(ratio=0.5, layer_budget="triangle")
    with pytest.raises(ValueError, match="> 0"):
        EvictionConfig(ratio=0.5, layer_budget=(1.0, 0.0))
    with pytest.raises(ValueError, match="needs ratio"):
        EvictionConfig(capacity=64, layer_budget="pyramid")
    with pytest.raises(ValueError, match="observation_tokens"):
        EvictionConfig(ratio=0.5, observation_tokens=0)
    with pytest.raises(ValueError, match="pyramid_beta"):
        EvictionConfig(ratio=0.5, pyramid_beta=0.5)
    model = make_llama(seed=41)
    config = EvictionConfig(ratio=0.5, layer_budget=(1.0,) * 7)
    with pytest.raises(ValueError, match="7 weights"):
        _prefill(model, config, _ids(40, seed=42))


def test_default_relay_selection_is_unchanged_by_the_new_fields(make_llama):
    """EvictionConfig's defaults reproduce the pre-issue-9 policy (SnapKV, max-pool 7, sum over
    the group, 32-token protected observation window, uniform layers): same kept tokens as an
    explicit old-style configuration."""
    model = make_llama(seed=43)
    ids = _ids(72, seed=44)
    a = _prefill(model, EvictionConfig(ratio=0.5), ids)
    old = SnapKVScorer(7, pooling="max", group_reduction="sum")
    b = _prefill(
        model,
        EvictionConfig(ratio=0.5, scorer=old, observation_tokens=32, layer_budget="uniform"),
        ids,
    )
    for la, lb in zip(a.layers, b.layers, strict=True):
        for pa, pb in zip(_original_positions(la), _original_positions(lb), strict=True):
            assert torch.equal(pa, pb)


def test_calibration_replays_one_layer_eviction_exactly(make_llama):
    from kvlab.integrations.relay_cache import RelayLayer
    from kvlab.integrations.relay_calibration import layer_eviction_sensitivity

    model = make_llama(seed=45)
    ids = _ids(56, seed=46)
    prefill = 40
    config = EvictionConfig(ratio=0.5, relay=False, sink_tokens=2, window_tokens=8)
    sens = layer_eviction_sensitivity(model, ids, config, prefill=prefill, fractions=(0.5, 1.0))
    assert len(sens) == model.config.num_hidden_layers
    with torch.no_grad():
        exact = torch.log_softmax(model(ids).logits[0, prefill:].double(), -1)
        for layer_idx, row in enumerate(sens):
            assert row[1.0] < 1e-9
            cache = RelayModelCache(model.config, config)
            for i in range(len(cache.layers)):
                if i != layer_idx:
                    cache.layers[i] = RelayLayer(
                        EvictionConfig(ratio=0.0, relay=False), cache.rotary, i
                    )
            with use_attention(model, KVLAB_ATTENTION):
                model(ids[:, :prefill], cache=cache)
                logits = model(ids[:, prefill:], cache=cache).logits[0]
            approx = torch.log_softmax(logits.double(), -1)
            direct = float((exact.exp() * (exact - approx)).sum(-1).clamp_min(0).mean())
            assert row[0.5] > 0
            assert abs(row[0.5] - direct) < 1e-5 * max(1.0, direct)


@pytest.mark.parametrize("allocation", ["uniform", "adaptive"])
def test_window_fraction_protects_that_share_of_each_layers_budget(make_llama, allocation):
    model = make_llama(seed=47, num_hidden_layers=3)
    prefill = 64
    probe = _WindowProbe()
    config = EvictionConfig(
        ratio=0.5,
        scorer=probe,
        allocation=allocation,
        window_fraction=0.5,
        layer_budget=(2.0, 1.0, 1.0),
        sink_tokens=2,
    )
    cache = _prefill(model, config, _ids(prefill, seed=48))
    budgets = split_layer_budget(96, [2.0, 1.0, 1.0], low=[3] * 3, high=[64] * 3)
    for layer, budget, shape in zip(cache.layers, budgets, probe.shapes, strict=True):
        recent = round(0.5 * budget)
        assert shape[3] == recent  # the observation window follows the protected window
        for orig in _original_positions(layer):
            assert set(range(prefill - recent, prefill)) | {0, 1} <= set(orig[0].tolist())
    with pytest.raises(ValueError, match="window_fraction"):
        EvictionConfig(ratio=0.5, window_fraction=1.0)


def test_nope_layers_give_the_scorer_their_queries_without_rotary():
    """A NoPE full-attention layer (SmolLM3's no_rope_layers; relay=False only) hands the
    scorer no rotary config: its queries are already pre-RoPE, and ExpectedAttention uses them
    as they are (R = I) instead of un-rotating them."""
    import transformers

    from kvlab.integrations.model_support import plan_model

    config = transformers.SmolLM3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        no_rope_layers=[1, 0],
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.SmolLM3ForCausalLM(config).eval()
    uses_rope = [layer.uses_rope for layer in plan_model(config).layers]
    assert uses_rope == [True, False]
    raw: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, output, i=i):
            b, s, _ = output.shape
            raw[i] = output.view(b, s, 4, 16).transpose(1, 2).detach().clone()

        handles.append(layer.self_attn.q_proj.register_forward_hook(hook))
    scorer = _Recording()
    eviction = EvictionConfig(ratio=0.5, scorer=scorer, relay=False, window_tokens=8)
    cache = _prefill(model, eviction, _ids(48, 50))
    for handle in handles:
        handle.remove()
    assert cache.events() and len(scorer.inputs) == 2
    for i, inputs in enumerate(scorer.inputs):
        if uses_rope[i]:
            assert inputs.rotary is not None
            queries = rotate_by_delta(inputs.queries, -inputs.query_positions, inputs.rotary)
        else:
            assert inputs.rotary is None
            queries = inputs.queries
        torch.testing.assert_close(queries, raw[i], atol=2e-5, rtol=1e-5)


def test_layer_budgets_split_over_the_full_attention_layers_of_window_models():
    """Qwen2 with layers 1-2 sliding: per-layer budgets take one weight per full-attention
    layer (here layer 0 alone), window layers take no share (issue 19)."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    for layer_budget in ("pyramid", (2.0,)):
        cache = RelayModelCache(config, EvictionConfig(ratio=0.5, layer_budget=layer_budget))
        assert [
            (ly.evictor.num_layers, ly.evictor.budget_index) for ly in cache._relay_layers()
        ] == [(1, 0)]
    with pytest.raises(ValueError, match="3 weights for 1 full-attention layers"):
        RelayModelCache(config, EvictionConfig(ratio=0.5, layer_budget=(1.0, 2.0, 1.0)))


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.875, 0.9375])
def test_calibrated_fractions_stay_feasible_at_any_ratio(ratio):
    from kvlab.integrations.relay_calibration import DEFAULT_FRACTIONS, fractions_around
    from kvlab.relay.layer_budgets import allocate_layer_fractions

    mean = 1.0 - ratio
    fractions = fractions_around(mean)
    assert min(fractions) < mean <= max(fractions) <= 1.0
    if ratio == 0.5:
        assert fractions == DEFAULT_FRACTIONS  # the recorded 50 % calibrations are unchanged
    prefill, layers = 512, 6
    # a made-up sensitivity: deeper layers lose more at the same kept fraction
    sens = [{f: (layer + 1) * (1.0 - f) for f in fractions} for layer in range(layers)]
    chosen = allocate_layer_fractions(sens, mean, tokens=prefill)
    assert sum(round(f * prefill) for f in chosen) <= layers * round(mean * prefill)
    if mean < min(DEFAULT_FRACTIONS):
        fixed = [{f: (layer + 1) * (1.0 - f) for f in DEFAULT_FRACTIONS} for layer in range(layers)]
        with pytest.raises(ValueError, match="no per-layer choice fits the budget"):
            allocate_layer_fractions(fixed, mean, tokens=prefill)


def test_fractions_around_refuses_a_mean_outside_the_unit_interval():
    from kvlab.integrations.relay_calibration import fractions_around

    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="mean_fraction"):
            fractions_around(bad)


class _ScoreRecorder(SnapKVScorer):
    """The default SnapKV options, recording each eviction's pooled scores."""

    def __init__(self) -> None:
        super().__init__(kernel_size=7, pooling="max", value_norm=True)
        self.scores: list[torch.Tensor] = []

    def score(self, inputs):
        out = super().score(inputs)
        self.scores.append(out.clone())
        return out


def test_a_one_forward_prefill_scores_from_the_attention_s_logsumexp(make_llama, monkeypatch):
    """A whole prompt in one forward, evicted by SnapKV: the observation window comes from the
    prefill attention's logsumexp (kvlab.relay.attention.prefill_attention_with_lse) and skips
    the protected window's logits; the scores of every slot it may evict equal the softmax
    path's to float32 rounding, and this prompt keeps the same tokens either way."""
    from kvlab.relay import attention as relay_attention
    from kvlab.relay import evictor as relay_evictor

    model = make_llama(seed=41)
    ids = _ids(96, seed=42)
    config_kwargs = {"ratio": 0.5, "window_fraction": 0.75, "relay": False}
    calls: list[int] = []
    real = relay_evictor.window_attention_from_lse

    def spy(*args, **kwargs):
        calls.append(args[5])  # the columns computed
        return real(*args, **kwargs)

    monkeypatch.setattr(relay_evictor, "window_attention_from_lse", spy)
    fast_scorer = _ScoreRecorder()
    fast = _prefill(model, EvictionConfig(scorer=fast_scorer, **config_kwargs), ids)
    assert len(calls) == len(fast.layers)
    per_head = 48  # (1 - 0.5) * 96
    recent = round(0.75 * per_head)
    assert calls == [96 - recent + 3] * len(fast.layers)  # before the window, + kernel // 2
    monkeypatch.setattr(relay_attention, "prefill_attention_with_lse", lambda *a, **k: None)
    monkeypatch.setattr(
        "kvlab.integrations.relay_eviction.prefill_attention_with_lse", lambda *a, **k: None
    )
    slow_scorer = _ScoreRecorder()
    slow = _prefill(model, EvictionConfig(scorer=slow_scorer, **config_kwargs), ids)
    assert len(calls) == len(fast.layers)  # the softmax path this time
    evictable = 96 - recent
    for ours, theirs in zip(fast_scorer.scores, slow_scorer.scores, strict=True):
        torch.testing.assert_close(
            ours[..., 4:evictable], theirs[..., 4:evictable], rtol=1e-5, atol=1e-9
        )
    for a, b in zip(fast.layers, slow.layers, strict=True):
        for x, y in zip(_original_positions(a), _original_positions(b), strict=True):
            assert torch.equal(x, y)
