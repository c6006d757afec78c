"""Per-layer eviction budgets calibrated on the package's own text (like PN-Mix's group sizes).

:func:`layer_eviction_sensitivity` measures, for every decoder layer ``l`` and every kept
fraction ``f``, the mean ``KL(full || evicted)`` of the next-token distributions of ``score``
calibration tokens when **only** layer ``l`` evicts its ``prefill`` context down to
``f * prefill`` tokens per kv head with the given policy (all other layers exact). Only the
full-attention layers are measured (and get a fraction): sliding/chunked window layers keep
their window in every kvlab cache and take no share of the budget (Gemma 2/3, Mistral, ...).
:func:`kvlab.relay.layer_budgets.allocate_layer_fractions` then picks one fraction per layer
with the same total as a uniform budget, minimizing the summed KL; the fractions go into
``EvictionConfig.layer_budget`` as weights. The calibration text defaults to the package's
public-domain text (:func:`kvlab.data.default_text`), never the evaluation text.

Cost: two exact prefill forwards (kvlab attention recording the queries, SDPA recording the
keys and values), one exact forward of the ``score`` tokens recording the hidden states
entering every decoder layer, then per full-attention layer ``l`` and kept fraction a forward
of the ``score`` tokens through layers ``l .. L-1`` and the head only, from the recorded input
of layer ``l`` (:mod:`kvlab.integrations.calibration_capture`: the layers before ``l`` are
exact, so skipping them changes no bit of the result). Layer ``l``'s eviction is replayed on
the recorded prefill keys, values and queries, which also recomputes that layer's prefill
attention once and discards it. A layer's fractions share the rest: each fraction runs layer
``l`` alone, and layers ``l+1 .. L-1`` and the head run once for all of them, stacked along the
batch (``batch_candidates``; the same KL to the bit on one CPU thread). Several ratios measure
the union of their fractions once (:func:`calibrate_layer_budgets_for_ratios`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvlab.data import TextSource, default_text
from kvlab.integrations.attention import use_attention
from kvlab.integrations.calibration_capture import (
    MEASURES,
    ExactDistribution,
    capture_layer_inputs,
    later_layers,
    layer_sensitivities,
)
from kvlab.integrations.calibration_record import measurement_settings
from kvlab.integrations.model_support import plan_model
from kvlab.integrations.pnmix_calibration import CALIBRATION_START
from kvlab.integrations.relay_cache import EvictionConfig, RelayLayer, RelayModelCache
from kvlab.relay.layer_budgets import allocate_layer_fractions

__all__ = [
    "LayerBudgetCalibration",
    "calibrate_layer_budgets",
    "calibrate_layer_budgets_for_ratios",
    "fractions_around",
    "layer_eviction_sensitivity",
]

DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
#: The kept fractions :func:`calibrate_layer_budgets` measures, as multiples of the mean.
FRACTION_MULTIPLES = (0.5, 1.0, 1.5)


def fractions_around(mean_fraction: float) -> tuple[float, ...]:
    """The kept fractions measured per layer for a mean kept fraction: 0.5, 1 and 1.5 times
    ``mean_fraction``, capped at 1 (``(0.25, 0.5, 0.75)`` at 50 % eviction). Measuring around
    the mean keeps the allocation feasible at any ratio: a layer can always go below the mean
    (fixed fractions such as 0.25 leave no choice within the budget at 87.5 % eviction).

    Raises:
        ValueError: ``mean_fraction`` outside (0, 1].
    """
    if not 0.0 < mean_fraction <= 1.0:
        raise ValueError(f"mean_fraction must lie in (0, 1], got {mean_fraction}")
    return tuple(sorted({min(1.0, m * mean_fraction) for m in FRACTION_MULTIPLES}))


@torch.no_grad()
def layer_eviction_sensitivity(
    model: Any,
    input_ids: Tensor,
    config: EvictionConfig,
    *,
    prefill: int,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    progress: Callable[[int, int], None] | None = None,
    batch_candidates: bool = True,
    measure: str = "scaled",
) -> list[dict[float, float]]:
    """Per layer and kept fraction, the KL that evicting that one layer causes.

    Each evicted layer is a :class:`RelayLayer` replaying what the layer of a
    :class:`RelayModelCache` does in the prefill forward: ``update`` stashes the recorded
    prefill keys and values, ``attend`` with the recorded queries commits them, attends and
    evicts (the same code path, so the replay equals a direct run).

    Args:
        model: a ``transformers`` causal LM (its window layers are kept as they are: a
            ``DynamicSlidingWindowLayer`` holding their window, as ``DynamicCache`` does).
        input_ids: ``[1, prefill + score]`` int64 calibration ids, ``score >= 1``.
        config: the eviction policy (``ratio`` is replaced by ``1 - f``; ``layer_budget`` by
            ``"uniform"``).
        prefill: context tokens; the other ``score`` tokens are scored in one forward.
        fractions: kept fractions in (0, 1] to measure.
        progress: ``progress(done, total)`` in decoder layers, or ``None``.
        batch_candidates: run layers ``l+1 .. L-1`` and the head once for all fractions of
            layer ``l``, stacked along the batch (:func:`~kvlab.integrations.
            calibration_capture.layer_output`; the same KL to the bit on one CPU thread);
            ``False``: one forward per fraction from layer ``l``.
        measure: ``"scaled"`` (default: the later layers and the head run for one fraction
            per layer, the others scaled by their layer-output error) or ``"exact"`` (every
            fraction through them; :func:`~kvlab.integrations.calibration_capture.
            layer_sensitivities`).

    Returns:
        one ``{fraction: mean KL in nats}`` per full-attention layer, in decoder order
        (``RelayModelCache(...).plan.full_layers`` are their indices).

    Raises:
        ValueError: ``input_ids`` not ``[1, N]`` with ``0 < prefill < N``, a fraction
            outside (0, 1], or a model with no full-attention layer.
    """
    if measure not in MEASURES:  # before any forward
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 0 < prefill < n:
        raise ValueError(f"prefill must be an int in 1..{n - 1}, got {prefill!r}")
    if any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"fractions must lie in (0, 1], got {list(fractions)}")
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    head, tail = ids[:, :prefill], ids[:, prefill:]
    positions = torch.arange(prefill, n, device=device)[None]
    # the exact prefill through a keep-everything relay cache, recording each layer's queries
    keep_all = RelayModelCache(model.config, EvictionConfig(ratio=0.0, scorer="recency"))
    full_layers = keep_all.plan.full_layers  # the layers calibrated (window layers keep theirs)
    if not full_layers:
        raise ValueError("per-layer eviction budgets need a full-attention layer; there is none")
    queries: dict[int, tuple[Tensor, float]] = {}
    for layer in keep_all.relay_layers():

        def record(
            query: Tensor, scaling: float, row: int = 0, layer: RelayLayer = layer, **kwargs: Any
        ) -> Any:
            # the queries at cache positions, as the layer's attend passes them to evict
            queries[layer.layer_idx] = (query, scaling)
            return RelayLayer.evict(layer, query, scaling, row, **kwargs)

        layer.evict = record  # type: ignore[method-assign]
    # every layer's whole prefill keys and values (window layers take theirs from them below)
    reference = Cache(layers=[DynamicLayer() for _ in keep_all.layers])
    windows = {i: keep_all.plan.layers[i].window for i in keep_all.plan.window_layers}
    with use_attention(model, "kvlab"):
        model(head, cache=keep_all, use_cache=True, logits_to_keep=1)
    with use_attention(model, "sdpa"):
        model(head, cache=reference, use_cache=True, logits_to_keep=1)
        model_prefix = [(layer.keys, layer.values) for layer in reference.layers]

    def cache_with(evicted: int | None, kept: float, rows: int = 1) -> Cache:
        layers: list[Any] = []
        for i, (k, v) in enumerate(model_prefix):
            if rows != 1:  # exact layers only: ``rows`` copies along the batch
                k, v = k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)
            if i == evicted:
                cfg = dataclasses.replace(config, ratio=1.0 - kept, layer_budget="uniform")
                layer: Any = RelayLayer(cfg, keep_all.rotary, i)
                query, scaling = queries[i]
                layer.update(k, v)  # stashes; attend commits, attends and evicts
                layer.attend(query, scaling=scaling, attention_mask=None, kwargs={})
            else:
                window = windows.get(i)
                layer = DynamicLayer() if window is None else DynamicSlidingWindowLayer(window)
                layer.update(k, v)
            layers.append(layer)
        return Cache(layers=layers)

    def logits(cache: Cache) -> Tensor:
        with use_attention(model, "kvlab"):
            return model(tail, cache=cache, position_ids=positions, use_cache=True).logits[0]

    # the exact scoring forward, recording the hidden states entering every layer
    with capture_layer_inputs(model) as inputs:
        exact = ExactDistribution(logits(cache_with(None, 1.0)))
    result: list[dict[float, float]] = []
    if progress is not None:
        progress(0, len(full_layers))

    for done, layer_idx in enumerate(full_layers, start=1):
        kept = sorted(set(fractions))
        kls = layer_sensitivities(
            model,
            layer_idx,
            inputs[layer_idx],
            exact,
            [lambda f=f, i=layer_idx: logits(cache_with(i, f)) for f in kept],
            lambda: logits(cache_with(None, 1.0)),
            later_layers(
                model, layer_idx, tail, positions, lambda rows: cache_with(None, 1.0, rows)
            ),
            measure=measure,
            batch_candidates=batch_candidates,
            clamp=True,
        )
        row = dict(zip(kept, kls, strict=True))
        result.append(row)
        if progress is not None:
            progress(done, len(full_layers))
    return result


@dataclass(frozen=True)
class LayerBudgetCalibration:
    """Per-layer kept fractions chosen by :func:`calibrate_layer_budgets`, and how.

    Attributes:
        layer_fractions: one kept fraction per full-attention layer (mean = ``1 - ratio``);
            pass as ``EvictionConfig.layer_budget``.
        sensitivities: per full-attention layer, ``{kept fraction: mean KL in nats}``.
        layers: the decoder indices of those layers (empty: every decoder layer).
        text_id, text_sha256: the calibration text.
        start, prefill, score: the calibration window (tokens).
        seconds: wall time (s).
        measure: how the sensitivities were measured (``"scaled"`` or ``"exact"``,
            :func:`layer_eviction_sensitivity`).
    """

    layer_fractions: tuple[float, ...]
    sensitivities: tuple[dict[float, float], ...]
    text_id: str
    text_sha256: str
    start: int
    prefill: int
    score: int
    seconds: float
    layers: tuple[int, ...] = ()
    measure: str = "scaled"

    def settings(self) -> dict[str, Any]:
        """JSON-ready record for artifacts
        (:func:`~kvlab.integrations.calibration_record.measurement_settings`;
        ``calibrated_layers`` only when some decoder layers are window layers)."""
        record: dict[str, Any] = {"layer_fractions": list(self.layer_fractions)}
        if self.layers:
            record["calibrated_layers"] = list(self.layers)
        return {**record, **measurement_settings(self)}


def _calibration_window(
    tokenizer: Any, text: TextSource | None, start: int, prefill: int, score: int
) -> tuple[TextSource, int, Tensor]:
    """The calibration text, the window's first token and its ``[1, prefill + score]`` ids."""
    source = text if text is not None else default_text()
    need = start + prefill + score
    head = source.data[: max(8 * need, 4096)].decode("utf-8", errors="replace")
    ids = tokenizer(head, return_tensors="pt").input_ids
    if ids.shape[1] < prefill + score:
        raise ValueError(f"calibration text has {ids.shape[1]} tokens; {prefill + score} needed")
    first = max(0, min(start, ids.shape[1] - prefill - score))
    return source, first, ids[:, first : first + prefill + score]


def calibrate_layer_budgets(
    model: Any,
    tokenizer: Any,
    config: EvictionConfig,
    *,
    text: TextSource | None = None,
    start: int = CALIBRATION_START,
    prefill: int = 512,
    score: int = 128,
    fractions: Sequence[float] | None = None,
    progress: Callable[[int, int], None] | None = None,
    measure: str = "scaled",
) -> LayerBudgetCalibration:
    """Measure :func:`layer_eviction_sensitivity` on the calibration text and choose per-layer
    kept fractions with mean ``1 - config.ratio``
    (:func:`kvlab.relay.layer_budgets.allocate_layer_fractions`); ``progress(done, total)``
    reports full-attention layers. ``fractions`` defaults to :func:`fractions_around` the
    mean; ``measure``: ``"scaled"`` or ``"exact"`` (:func:`layer_eviction_sensitivity`).

    Raises:
        ValueError: ``config.ratio`` unset, a text shorter than ``prefill + score`` tokens, or
            bad arguments (see the functions used).
    """
    if config.ratio is None:
        raise ValueError("calibrate_layer_budgets needs EvictionConfig.ratio")
    began = time.perf_counter()
    source, first, window = _calibration_window(tokenizer, text, start, prefill, score)
    if fractions is None:
        fractions = fractions_around(1.0 - config.ratio)
    sens = layer_eviction_sensitivity(
        model,
        window,
        config,
        prefill=prefill,
        fractions=fractions,
        progress=progress,
        measure=measure,
    )
    chosen = allocate_layer_fractions(sens, 1.0 - config.ratio, tokens=prefill)
    plan = plan_model(model.config.get_text_config(decoder=True))
    return LayerBudgetCalibration(
        layers=plan.full_layers if plan.window_layers else (),
        layer_fractions=tuple(chosen),
        sensitivities=tuple(sens),
        text_id=source.id,
        text_sha256=source.sha256,
        start=first,
        prefill=prefill,
        score=score,
        seconds=time.perf_counter() - began,
        measure=measure,
    )


def calibrate_layer_budgets_for_ratios(
    model: Any,
    tokenizer: Any,
    config: EvictionConfig,
    ratios: Sequence[float],
    *,
    text: TextSource | None = None,
    start: int = CALIBRATION_START,
    prefill: int = 512,
    score: int = 128,
    progress: Callable[[int, int], None] | None = None,
    measure: str = "scaled",
) -> dict[float, LayerBudgetCalibration]:
    """:func:`calibrate_layer_budgets` for several eviction ratios, sharing what they can.

    Exact measure: a layer's KL at a kept fraction does not depend on the ratio, so the union
    of every ratio's :func:`fractions_around` is measured once (one capture of the window;
    ``progress`` in decoder layers), and each ratio keeps its own fractions' sensitivities.
    Scaled measure: the candidate measured exactly is the middle of a ratio's own fractions,
    so each ratio is measured on its own (``progress`` counts decoder layers over all ratios;
    the expensive part, one exact measurement per layer, is per ratio either way). Each
    result equals ``calibrate_layer_budgets`` at that ratio (its ``seconds`` is the joint
    wall time). ``config.ratio`` is ignored.

    Returns:
        ``{ratio: LayerBudgetCalibration}`` in the order given (duplicates once).

    Raises:
        ValueError: no ratios, a ratio outside [0, 1), or what ``calibrate_layer_budgets``
            raises.
    """
    wanted = list(dict.fromkeys(float(r) for r in ratios))
    if not wanted or any(not 0.0 <= r < 1.0 for r in wanted):
        raise ValueError(f"ratios must be a non-empty list in [0, 1), got {list(ratios)}")
    began = time.perf_counter()
    source, first, window = _calibration_window(tokenizer, text, start, prefill, score)
    own = {r: fractions_around(1.0 - r) for r in wanted}
    measured = {tuple(sorted({f for fractions in own.values() for f in fractions})): wanted}
    if measure == "scaled":
        measured = {}
        for r in wanted:
            measured.setdefault(own[r], []).append(r)
    sens_of: dict[float, list[dict[float, float]]] = {}
    for index, (fractions, members) in enumerate(measured.items()):

        def report(done: int, total: int, index: int = index) -> None:
            if progress is not None and (done or not index):
                progress(index * total + done, total * len(measured))

        sens = layer_eviction_sensitivity(
            model,
            window,
            config,
            prefill=prefill,
            fractions=fractions,
            progress=report,
            measure=measure,
        )
        for r in members:
            sens_of[r] = sens
    seconds = time.perf_counter() - began
    results: dict[float, LayerBudgetCalibration] = {}
    for r in wanted:
        mine = tuple({f: row[f] for f in own[r]} for row in sens_of[r])
        results[r] = LayerBudgetCalibration(
            layer_fractions=tuple(allocate_layer_fractions(mine, 1.0 - r, tokens=prefill)),
            sensitivities=mine,
            text_id=source.id,
            text_sha256=source.sha256,
            start=first,
            prefill=prefill,
            score=score,
            seconds=seconds,
            measure=measure,
        )
    return results
