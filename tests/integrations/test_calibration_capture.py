"""The calibrations' one-forward capture (kvlab.integrations.calibration_capture): replays that
start at a layer give the logits of a full forward bit for bit, so both per-layer calibrations
return exactly what their former per-layer full forwards returned; several ratios at once equal
one ratio at a time; progress is reported per layer."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from byte_text import ByteTokenizer, hamlet_text
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.integrations import calibration_capture, pnmix_calibration, relay_calibration
from kvlab.integrations.calibration_capture import (
    ExactDistribution,
    capture_layer_inputs,
    decoder_layers,
    layer_output,
    layer_sensitivities,
    start_at_layer,
)
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.pnmix import PNMixConfig

SMALL = PNMixConfig(sink_tokens=4, residual_tokens=4, group_tokens=8)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefix(model: Any, head: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = Cache(layers=[DynamicLayer() for _ in range(model.config.num_hidden_layers)])
    with torch.no_grad():
        model(head, cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache(prefix: list[tuple[torch.Tensor, torch.Tensor]], noisy: int | None) -> Cache:
    layers = []
    for i, (k, v) in enumerate(prefix):
        layer = DynamicLayer()
        if i == noisy:  # a perturbed prefix in this layer alone
            g = torch.Generator().manual_seed(i)
            k = k + 0.3 * torch.randn(k.shape, generator=g)
            v = v + 0.3 * torch.randn(v.shape, generator=g)
        layer.update(k, v)
        layers.append(layer)
    return Cache(layers=layers)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_replay_from_a_captured_layer_input_is_the_full_forward_bit_for_bit(make_llama, layers):
    model = make_llama(seed=3, num_hidden_layers=layers)
    ids = _ids(40, seed=4)
    head, tail = ids[:, :28], ids[:, 28:]
    positions = torch.arange(28, 40)[None]
    prefix = _prefix(model, head)
    with torch.no_grad():
        with capture_layer_inputs(model) as inputs:
            exact = model(tail, cache=_cache(prefix, None), position_ids=positions).logits
            model(tail, cache=_cache(prefix, None), position_ids=positions)  # not recorded
        assert len(inputs) == layers
        assert all(x.shape == (1, 12, model.config.hidden_size) for x in inputs)
        for layer in range(layers):
            full = model(tail, cache=_cache(prefix, layer), position_ids=positions).logits
            with start_at_layer(model, layer, inputs[layer]):
                replay = model(tail, cache=_cache(prefix, layer), position_ids=positions).logits
            assert torch.equal(replay, full)
            assert layer == 0 or not torch.equal(full, exact)  # the perturbation shows
    # the patched layers are restored
    assert all("forward" not in module.__dict__ for module in decoder_layers(model))
    with torch.no_grad():
        again = model(tail, cache=_cache(prefix, None), position_ids=positions).logits
    assert torch.equal(again, exact)


@pytest.mark.parametrize("layers", [1, 3])
def test_layer_outputs_stacked_then_replayed_from_the_next_layer_are_full_forwards(
    make_llama, layers
):
    """The batched path: each candidate's perturbed layer alone (layer_output), then the later
    layers and the head once over the stacked outputs and exact caches: each row is the full
    forward of its candidate, bit for bit (one CPU thread)."""
    model = make_llama(seed=3, num_hidden_layers=layers)
    ids = _ids(40, seed=4)
    head, tail = ids[:, :28], ids[:, 28:]
    positions = torch.arange(28, 40)[None]
    prefix = _prefix(model, head)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            with capture_layer_inputs(model) as inputs:
                model(tail, cache=_cache(prefix, None), position_ids=positions)
            for layer in range(layers):
                # three candidates: two perturbations of the layer and the exact layer
                def forward(noisy: int | None, scale: float) -> Any:
                    cache = _cache(prefix, noisy)
                    if noisy is not None and scale != 1.0:
                        k, v = cache.layers[noisy].keys, cache.layers[noisy].values
                        cache.layers[noisy].keys, cache.layers[noisy].values = scale * k, v
                    return model(tail, cache=cache, position_ids=positions)

                runs = [(layer, 1.0), (layer, 0.5), (None, 1.0)]
                full = [forward(*run).logits for run in runs]
                outs = [
                    layer_output(model, layer, inputs[layer], lambda run=run: forward(*run))
                    for run in runs
                ]
                stacked = torch.cat(outs)
                batch = len(runs)
                exact = Cache(layers=[DynamicLayer() for _ in prefix])
                for cache_layer, (k, v) in zip(exact.layers, prefix, strict=True):
                    cache_layer.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
                with start_at_layer(model, layer + 1, stacked):
                    batched = model(
                        tail.expand(batch, -1),
                        cache=exact,
                        position_ids=positions.expand(batch, -1),
                    ).logits
                for row, logits in zip(batched, full, strict=True):
                    assert torch.equal(row, logits[0])
                assert not torch.equal(batched[0], batched[2])  # the perturbation shows
    finally:
        torch.set_num_threads(threads)
    assert all("forward" not in module.__dict__ for module in decoder_layers(model))


def test_start_at_layer_refuses_bad_arguments(make_llama):
    model = make_llama(seed=5, num_hidden_layers=2)
    with (
        pytest.raises(ValueError, match=r"layer must lie in 0\.\.2"),
        start_at_layer(model, 3, None),
    ):
        pass
    with pytest.raises(ValueError, match=r"layer must lie in 0\.\.1"):
        layer_output(model, 2, None, lambda: None)
    with pytest.raises(RuntimeError, match="did not run decoder layer 1"):
        layer_output(model, 1, torch.zeros(1, 3, model.config.hidden_size), lambda: None)
    with pytest.raises(ValueError, match="needs the captured"), start_at_layer(model, 1, None):
        pass
    wrong = torch.zeros(1, 3, model.config.hidden_size)
    with (
        pytest.raises(ValueError, match="do not match"),
        torch.no_grad(),
        start_at_layer(model, 1, wrong),
    ):
        model(_ids(5))
    assert all("forward" not in module.__dict__ for module in decoder_layers(model))


def test_exact_distribution_kl_is_the_former_formula_to_float64_rounding():
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(16, 500, generator=g)
    q = z + 0.2 * torch.randn(16, 500, generator=g)
    exact = ExactDistribution(z)
    ref = torch.log_softmax(z.double(), -1)
    former = (ref.exp() * (ref - torch.log_softmax(q.double(), -1))).sum(-1)
    assert abs(exact.kl(q) - float(former.mean())) < 1e-12
    assert abs(exact.kl(z)) < 1e-12 and exact.kl(z, clamp=True) >= 0.0
    assert abs(exact.kl(q, clamp=True) - float(former.clamp_min(0).mean())) < 1e-12
    with pytest.raises(ValueError, match="must be shaped"):
        exact.kl(q[:3])


@contextlib.contextmanager
def _every_layer(module: Any) -> Iterator[None]:
    """The former path: every measurement is a full forward (no layer skipped)."""
    original = module.start_at_layer
    module.start_at_layer = lambda model, layer, hidden: contextlib.nullcontext()
    try:
        yield
    finally:
        module.start_at_layer = original


def test_group_sensitivity_equals_per_layer_full_forwards(make_llama):
    model = make_llama(seed=7, num_hidden_layers=3)
    ids = _ids(72, seed=8)
    calls: list[tuple[int, int]] = []
    exact = dict(prefill=56, candidates=(4, 8), measure="exact")
    fast = pnmix_calibration.layer_group_sensitivity(
        model, ids, SMALL, progress=lambda d, n: calls.append((d, n)), **exact
    )
    one_by_one = pnmix_calibration.layer_group_sensitivity(
        model, ids, SMALL, batch_candidates=False, **exact
    )
    with _every_layer(calibration_capture):
        slow = pnmix_calibration.layer_group_sensitivity(
            model, ids, SMALL, batch_candidates=False, **exact
        )
    assert fast == one_by_one == slow  # bit-identical floats
    assert all(v > 0 for row in fast for v in row.values())
    assert calls == [(i, 3) for i in range(4)]


def test_eviction_sensitivity_equals_per_layer_full_forwards(make_llama):
    model = make_llama(seed=9, num_hidden_layers=3)
    ids = _ids(64, seed=10)
    config = EvictionConfig(ratio=0.5, relay=False, sink_tokens=2, window_tokens=8)
    calls: list[tuple[int, int]] = []
    exact = dict(prefill=48, fractions=(0.25, 0.5), measure="exact")
    fast = relay_calibration.layer_eviction_sensitivity(
        model, ids, config, progress=lambda d, n: calls.append((d, n)), **exact
    )
    one_by_one = relay_calibration.layer_eviction_sensitivity(
        model, ids, config, batch_candidates=False, **exact
    )
    with _every_layer(calibration_capture):
        slow = relay_calibration.layer_eviction_sensitivity(
            model, ids, config, batch_candidates=False, **exact
        )
    assert fast == one_by_one == slow
    assert all(v > 0 for row in fast for v in row.values())
    assert calls == [(i, 3) for i in range(4)]


TEXT = hamlet_text(40)


@pytest.mark.parametrize("measure", ["exact", "scaled"])
def test_all_ratios_at_once_equal_one_ratio_at_a_time(make_llama, measure):
    model = make_llama(seed=11, num_hidden_layers=3)
    config = EvictionConfig(ratio=0.5, relay=False, sink_tokens=2, window_tokens=8)
    window = dict(text=TEXT, start=100, prefill=128, score=16, measure=measure)
    calls: list[tuple[int, int]] = []
    ratios = (0.5, 0.25, 0.5625, 0.5)
    joint = relay_calibration.calibrate_layer_budgets_for_ratios(
        model,
        ByteTokenizer(),
        config,
        ratios,
        progress=lambda d, n: calls.append((d, n)),
        **window,
    )
    assert list(joint) == [0.5, 0.25, 0.5625]
    # exact: one measurement of the union; scaled: one per distinct set of fractions
    total = 3 if measure == "exact" else 9
    assert calls == [(i, total) for i in range(total + 1)]
    for ratio, result in joint.items():
        alone = relay_calibration.calibrate_layer_budgets(
            model, ByteTokenizer(), dataclasses.replace(config, ratio=ratio), **window
        )
        assert result.layer_fractions == alone.layer_fractions
        assert result.sensitivities == alone.sensitivities
        assert set(result.sensitivities[0]) == set(relay_calibration.fractions_around(1 - ratio))
        assert (result.start, result.prefill, result.score) == (alone.start, 128, 16)
    with pytest.raises(ValueError, match="ratios must be"):
        relay_calibration.calibrate_layer_budgets_for_ratios(model, ByteTokenizer(), config, [])
    with pytest.raises(ValueError, match="ratios must be"):
        relay_calibration.calibrate_layer_budgets_for_ratios(model, ByteTokenizer(), config, [1.0])


def test_group_calibration_reports_progress_through_its_preparation(make_llama):
    from kvlab.evaluation.methods.preparations import accepts_progress

    assert accepts_progress(pnmix_calibration.calibrate_group_tokens)
    model = make_llama(seed=13, num_hidden_layers=2)
    calls: list[tuple[int, int]] = []
    pnmix_calibration.calibrate_group_tokens(
        model,
        ByteTokenizer(),
        SMALL,
        budget_group_tokens=8,
        text=TEXT,
        start=100,
        score=16,
        candidates=(4, 8, 16),
        progress=lambda d, n: calls.append((d, n)),
    )
    assert calls == [(0, 2), (1, 2), (2, 2)]


def _scaled_setup(model: Any, ids: torch.Tensor, prefill: int, layer: int, scales: list[float]):
    """Candidates that perturb layer ``layer``'s prefix by Gaussian noise of the given scales,
    with what :func:`layer_sensitivities` needs."""
    head, tail = ids[:, :prefill], ids[:, prefill:]
    positions = torch.arange(prefill, ids.shape[1])[None]
    prefix = _prefix(model, head)

    def cache(scale: float, rows: int = 1) -> Cache:
        layers = []
        for i, (k, v) in enumerate(prefix):
            if i == layer and scale:
                g = torch.Generator().manual_seed(5)
                k = k + scale * torch.randn(k.shape, generator=g)
                v = v + scale * torch.randn(v.shape, generator=g)
            cache_layer = DynamicLayer()
            cache_layer.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
            layers.append(cache_layer)
        return Cache(layers=layers)

    def logits(c: Cache) -> torch.Tensor:
        return model(tail, cache=c, position_ids=positions, use_cache=True).logits[0]

    def downstream(stacked: torch.Tensor) -> torch.Tensor:
        rows = stacked.shape[0]
        with start_at_layer(model, layer + 1, stacked):
            return model(
                tail.expand(rows, -1),
                cache=cache(0.0, rows),
                position_ids=positions.expand(rows, -1),
                use_cache=True,
            ).logits

    with torch.no_grad(), capture_layer_inputs(model) as inputs:
        exact = ExactDistribution(logits(cache(0.0)))
    forwards = [lambda s=s: logits(cache(s)) for s in scales]
    return inputs[layer], exact, forwards, (lambda: logits(cache(0.0))), downstream


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_scaled_measure_is_exact_at_its_reference_and_scales_the_rest_by_output_error(
    make_llama, layer
):
    model = make_llama(seed=15, num_hidden_layers=3)
    ids = _ids(60, seed=16)
    scales = [0.003, 0.01, 0.03, 0.0]
    hidden, exact, forwards, unperturbed, downstream = _scaled_setup(model, ids, 44, layer, scales)
    args = (model, layer, hidden, exact, forwards, unperturbed, downstream)
    with torch.no_grad():
        true = layer_sensitivities(*args, measure="exact")
        scaled = layer_sensitivities(*args, measure="scaled")
        base = layer_output(model, layer, hidden, unperturbed).double()
        errors = [
            float((layer_output(model, layer, hidden, f).double() - base).pow(2).sum())
            for f in forwards
        ]
    assert errors[3] == 0.0 and scaled[3] == 0.0  # an unperturbed candidate costs nothing
    # the geometric middle of the moved candidates is measured, bit for bit the exact value
    assert scaled[1] == true[1]
    for c in (0, 2):
        assert scaled[c] == pytest.approx(true[1] * errors[c] / errors[1], rel=1e-12)
        # small perturbations: the KL is quadratic in them, so the estimate is close
        assert scaled[c] == pytest.approx(true[c], rel=0.15)
    assert scaled[0] < scaled[1] < scaled[2]


def test_layer_sensitivities_refuses_bad_arguments(make_llama):
    model = make_llama(seed=17, num_hidden_layers=2)
    hidden, exact, forwards, unperturbed, downstream = _scaled_setup(
        model, _ids(40, seed=18), 30, 1, [0.01]
    )
    with pytest.raises(ValueError, match="measure must be one of"):
        layer_sensitivities(
            model, 1, hidden, exact, forwards, unperturbed, downstream, measure="fast"
        )
    with pytest.raises(ValueError, match="at least one candidate"):
        layer_sensitivities(model, 1, hidden, exact, [], unperturbed, downstream)


@pytest.mark.parametrize("measure", ["exact", "scaled"])
def test_calibrations_record_their_measure(make_llama, measure):
    model = make_llama(seed=19, num_hidden_layers=2)
    window = dict(text=TEXT, start=100, score=16, measure=measure)
    groups = pnmix_calibration.calibrate_group_tokens(
        model, ByteTokenizer(), SMALL, budget_group_tokens=8, candidates=(4, 8), **window
    )
    config = EvictionConfig(ratio=0.5, relay=False, sink_tokens=2, window_tokens=8)
    budgets = relay_calibration.calibrate_layer_budgets(
        model, ByteTokenizer(), config, prefill=64, **window
    )
    assert groups.measure == budgets.measure == measure
    assert groups.settings()["group_allocation"]["calibration_measure"] == measure
    assert budgets.settings()["calibration_measure"] == measure


def test_calibrations_refuse_an_unknown_measure_before_any_forward(make_llama):
    model = make_llama(seed=21, num_hidden_layers=2)
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    config = EvictionConfig(ratio=0.5, relay=False, sink_tokens=2, window_tokens=8)
    try:
        with pytest.raises(ValueError, match="measure must be one of"):
            pnmix_calibration.layer_group_sensitivity(
                model, _ids(40), SMALL, prefill=30, measure="Exact"
            )
        with pytest.raises(ValueError, match="measure must be one of"):
            relay_calibration.layer_eviction_sensitivity(
                model, _ids(40), config, prefill=30, measure="fast"
            )
    finally:
        handle.remove()
    assert forwards == []
