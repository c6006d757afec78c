"""Per-layer group sizes: calibration on a tiny model and PNMixModelCache(layer_group_tokens)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.data import TextSource
from kvlab.integrations import PNMixModelCache
from kvlab.integrations.pnmix_calibration import calibrate_group_tokens, layer_group_sensitivity
from kvlab.pnmix import PNMixCache, PNMixConfig

SMALL = PNMixConfig(sink_tokens=4, residual_tokens=4, group_tokens=8)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _kl(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - out)).sum(-1)


class _DequantizedLayer(DynamicLayer):
    """Reference layer: a PN-Mix store holds the prefix and every later token (as the
    calibration's PN-Mix layer does); attention gets ``store.dequantize()`` and runs SDPA."""

    def __init__(self, config: PNMixConfig, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.store = PNMixCache(
            config,
            batch_size=1,
            num_key_value_heads=keys.shape[1],
            head_dim=keys.shape[3],
            value_head_dim=values.shape[3],
        )
        self.store.append(keys, values)
        super().update(keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states)
        self.store.append(key_states, value_states)
        return self.store.dequantize()


def test_sensitivity_equals_a_dequantize_then_attend_reference(make_llama):
    """One layer's cache as a PN-Mix reconstruction (SDPA over ``dequantize()``), every other
    layer exact: the KL the calibration reports for that (layer, group)."""
    model = make_llama(seed=5)
    ids = _ids(56)
    prefill = 40
    sens = layer_group_sensitivity(model, ids, SMALL, prefill=prefill, candidates=(4, 8))
    assert len(sens) == 2 and all(sorted(s) == [4, 8] for s in sens)
    with torch.no_grad():
        exact = DynamicCache(config=model.config)
        model(ids[:, :prefill], cache=exact)
        prefix = [(layer.keys, layer.values) for layer in exact.layers]
        positions = torch.arange(prefill, 56)[None]

        def logprobs(replace: int | None, group: int) -> torch.Tensor:
            layers = []
            for i, (k, v) in enumerate(prefix):
                if i == replace:
                    cfg = PNMixConfig(sink_tokens=4, residual_tokens=4, group_tokens=group)
                    layers.append(_DequantizedLayer(cfg, k, v))
                else:
                    layer = DynamicLayer()
                    layer.update(k, v)
                    layers.append(layer)
            cache = Cache(layers=layers)
            logits = model(ids[:, prefill:], cache=cache, position_ids=positions).logits[0]
            return torch.log_softmax(logits.double(), -1)

        reference = logprobs(None, 8)
        for layer in range(2):
            for group in (4, 8):
                expected = float(_kl(reference, logprobs(layer, group)).mean())
                assert expected > 0.0
                assert sens[layer][group] == pytest.approx(expected, rel=1e-3, abs=1e-9)


def test_sensitivity_is_only_float16_rounding_when_nothing_is_quantized(make_llama):
    model = make_llama(seed=6)
    # sinks + residual + one group is 16 tokens: 12 + 3 tokens never flush a group, so the
    # PN-Mix layer differs from the exact one only by its float16 storage
    sens = layer_group_sensitivity(model, _ids(15), SMALL, prefill=12, candidates=(8,))
    assert all(0.0 <= s[8] < 1e-6 for s in sens)
    quantized = layer_group_sensitivity(model, _ids(60), SMALL, prefill=40, candidates=(8,))
    assert all(q[8] > 100 * s[8] for q, s in zip(quantized, sens, strict=True))


def test_sensitivity_rejects_bad_windows(make_llama):
    model = make_llama()
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        layer_group_sensitivity(model, _ids(20)[0], SMALL, prefill=10)
    with pytest.raises(ValueError, match="prefill must be"):
        layer_group_sensitivity(model, _ids(20), SMALL, prefill=20)


class _ByteTokenizer:
    """Token ids 3..98 from the bytes of the text (a stand-in tokenizer for a tiny model)."""

    def __call__(self, text: str, return_tensors: str = "pt"):
        data = text.encode("utf-8")
        ids = torch.tensor([[3 + b % 93 for b in data]])
        return type("Encoding", (), {"input_ids": ids})()


def test_calibrate_allocates_within_the_budget_and_records_how(make_llama):
    model = make_llama(seed=7)
    data = b"Who's there? Nay, answer me: stand, and unfold yourself. " * 20
    text = TextSource(data=data, id="test/text", sha256="0" * 64, source_url=None)
    allocation = calibrate_group_tokens(
        model,
        _ByteTokenizer(),
        SMALL,
        budget_group_tokens=8,
        text=text,
        start=100,
        score=16,
        candidates=(4, 8, 16),
    )
    # default context: sinks + residual + 3 x the largest candidate
    assert allocation.prefill == 4 + 4 + 3 * 16 and allocation.score == 16
    assert allocation.start == 100
    groups = allocation.layer_group_tokens
    assert len(groups) == 2 and sum(1 / g for g in groups) <= 2 / 8
    record = json.loads(json.dumps(allocation.settings()))
    assert record["layer_group_tokens"] == list(groups)
    assert record["group_allocation"]["calibration_text"]["id"] == "test/text"
    assert len(record["group_allocation"]["sensitivity_kl_nats"]) == 2
    short = TextSource(data=b"too short", id="t", sha256="0" * 64, source_url=None)
    with pytest.raises(ValueError, match="calibration text has"):
        calibrate_group_tokens(model, _ByteTokenizer(), SMALL, budget_group_tokens=8, text=short)


def test_layer_group_tokens_give_each_layer_its_groups(make_llama):
    model = make_llama(seed=8)
    cache = PNMixModelCache(model.config, SMALL, layer_group_tokens=[4, 16])
    k = torch.randn(1, 2, 60, 16)
    for layer in cache.layers:
        layer.update(k, k)
    stores = [layer.store for layer in cache.layers]
    assert [s.config.group_tokens for s in stores] == [4, 16]
    assert cache.layer_group_tokens == (4, 16)
    # 60 tokens: 4 sinks, then groups flush once residual + group is reached
    assert stores[0].quantized_tokens == 52 and stores[1].quantized_tokens == 48
    # scalars: 2 per channel per group in 2 bytes; codes 2 bits per element
    assert stores[0].nbytes()["key_scales"] == 13 * 2 * 2 * 16 * 2
    with pytest.raises(ValueError, match="layer_group_tokens has 3 entries"):
        PNMixModelCache(model.config, SMALL, layer_group_tokens=[4, 8, 16])
    with pytest.raises(ValueError, match="group_tokens"):
        PNMixModelCache(model.config, SMALL, layer_group_tokens=[1, 8])
