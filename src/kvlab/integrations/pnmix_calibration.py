"""Per-layer sensitivity of a model to PN-Mix keys, measured once on a calibration text.

A 2-bit KV cache hurts some layers far more than others (on SmolLM2-135M three of 30 layers
carry most of the error; ``docs/archive/results-history.md``, section 3, "Why groups per
layer"). :func:`layer_group_sensitivity` measures, for every decoder layer ``l`` and every
candidate group size ``g``, the mean ``KL(full ‖ quantized)`` of the next-token distributions
of ``score`` calibration tokens when **only** layer ``l`` holds its ``prefill`` context as
PN-Mix codes with group size ``g`` (all other layers exact).
:func:`kvlab.pnmix.allocate_group_tokens` then picks one group size per layer under a
scalar-byte budget. Offline per-layer calibration of KV precision is common
practice (e.g. KVTuner, Li et al. 2025); kvlab's calibration text defaults to the package's
own public-domain text, so it never overlaps an evaluation text unless the user makes it.

Cost: one exact prefill forward, one exact forward of the ``score`` tokens that records the
hidden states entering every decoder layer, then per layer ``l`` and candidate a forward of the
``score`` tokens that runs only layers ``l .. L-1`` and the head from the recorded input of
layer ``l`` (:mod:`kvlab.integrations.calibration_capture`; the scored chunk attends to the
packed prefix through the ``"kvlab"`` attention). The layers before ``l`` are exact in every
such forward, so skipping them changes no bit of the result; it saves about half the decoder
layers' work (``L (L - 1) / 2`` of ``L^2`` layer passes per candidate). A layer's candidates
share the rest: each runs layer ``l`` alone, and layers ``l+1 .. L-1`` and the head run once for
all of them, stacked along the batch (``batch_candidates``; the same KL to the bit on one CPU
thread).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
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
from kvlab.integrations.model_support import layer_rotary, plan_model
from kvlab.integrations.pnmix_cache import PNMixLayer, pnmix_config_for_model
from kvlab.pnmix.allocation import DEFAULT_GROUP_CANDIDATES, allocate_group_tokens
from kvlab.pnmix.config import PNMixConfig
from kvlab.rope import RotaryConfig

__all__ = [
    "CALIBRATION_START",
    "GroupAllocation",
    "calibrate_group_tokens",
    "layer_group_sensitivity",
]


def _prefix_cache(
    prefix: list[tuple[Tensor, Tensor]],
    quantized: int | None,
    config: PNMixConfig | None,
    rotary: RotaryConfig | None = None,
    rows: int = 1,
    windows: Mapping[int, int] | None = None,
) -> Cache:
    """The exact prefix (``rows`` copies along the batch; layer ``quantized`` PN-Mix; the
    window layers ``windows`` (decoder index -> window tokens) hold their window, as
    ``DynamicCache`` does)."""
    layers: list[Any] = []
    for i, (k, v) in enumerate(prefix):
        window = (windows or {}).get(i)
        if i == quantized:
            assert config is not None
            layer: Any = PNMixLayer(config, exact_prefill=False, rotary=rotary)
        elif window is not None:
            layer = DynamicSlidingWindowLayer(window)
        else:
            layer = DynamicLayer()
        if rows != 1:
            k, v = k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)
        layer.update(k, v)
        layers.append(layer)
    return Cache(layers=layers)


@torch.no_grad()
def layer_group_sensitivity(
    model: Any,
    input_ids: Tensor,
    config: PNMixConfig,
    *,
    prefill: int,
    candidates: Sequence[int] = DEFAULT_GROUP_CANDIDATES,
    progress: Callable[[int, int], None] | None = None,
    batch_candidates: bool = True,
    measure: str = "scaled",
) -> list[dict[int, float]]:
    """Per layer and candidate group size, the KL one PN-Mix layer alone causes.

    Args:
        model: a ``transformers`` causal LM with RoPE decoder layers (full-attention layers
            are measured; window layers hold their window, as in ``DynamicCache``).
        input_ids: ``[1, prefill + score]`` calibration token ids (int64), ``score >= 1``.
        config: the PN-Mix configuration; only ``group_tokens`` is varied (rotary fields are
            set from the model).
        prefill: tokens of context held in the cache (tokens); the remaining ``score`` tokens
            are scored in one forward against that context.
        candidates: group sizes (tokens) to measure.
        progress: ``progress(done, total)`` in decoder layers, or ``None``.
        batch_candidates: run layers ``l+1 .. L-1`` and the head once for all candidates of
            layer ``l``, stacked along the batch (:func:`~kvlab.integrations.
            calibration_capture.layer_output`; the same KL to the bit on one CPU thread);
            ``False``: one forward per candidate from layer ``l``.
        measure: ``"scaled"`` (default: the later layers and the head run for one group size
            per layer, the others scaled by their layer-output error) or ``"exact"`` (every
            group size through them; :func:`~kvlab.integrations.calibration_capture.
            layer_sensitivities`).

    Returns:
        ``[{group_tokens: mean KL in nats}, ...]``, one dict per full-attention layer in
        decoder order (``plan_model(config).full_layers``; every decoder layer on a model
        without window layers), KL(full ‖ quantized) of the next-token distributions averaged
        over the ``score`` tokens. Sliding/chunked window layers keep their window exact in a
        PN-Mix cache and are not measured.

    Raises:
        ValueError: ``input_ids`` not ``[1, N]`` with ``0 < prefill < N``; a model with no
            full-attention layer.
    """
    if measure not in MEASURES:  # before any forward
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 0 < prefill < n:
        raise ValueError(f"prefill must be an int in 1..{n - 1}, got {prefill!r}")
    text_config = model.config.get_text_config(decoder=True)
    config = pnmix_config_for_model(text_config, config)
    rotary = layer_rotary(text_config) if config.key_codec.position_aware else None
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    head, tail = ids[:, :prefill], ids[:, prefill:]
    positions = torch.arange(prefill, n, device=device)[None]
    layers = text_config.num_hidden_layers
    plan = plan_model(text_config)
    measured = plan.full_layers  # window layers keep their window in every PN-Mix cache
    if not measured:
        raise ValueError("PN-Mix group calibration needs a full-attention layer; there is none")
    windows = {i: plan.layers[i].window for i in plan.window_layers}
    groups = sorted(set(candidates))
    with use_attention(model, "kvlab"):
        reference = Cache(layers=[DynamicLayer() for _ in range(layers)])
        model(head, cache=reference, use_cache=True, logits_to_keep=1)  # logits unused
        prefix = [(layer.keys, layer.values) for layer in reference.layers]

        def logits(cache: Cache) -> Tensor:
            return model(tail, cache=cache, position_ids=positions, use_cache=True).logits[0]

        # the exact scoring forward, recording the hidden states entering every layer
        with capture_layer_inputs(model) as inputs:
            exact = ExactDistribution(logits(_prefix_cache(prefix, None, None, windows=windows)))
        result: list[dict[int, float]] = []
        if progress is not None:
            progress(0, len(measured))

        def exact_rows(rows: int) -> Cache:
            return _prefix_cache(prefix, None, None, rows=rows, windows=windows)

        for done, layer in enumerate(measured, start=1):
            forwards = [
                lambda g=g, layer=layer: logits(
                    _prefix_cache(
                        prefix,
                        layer,
                        dataclasses.replace(config, group_tokens=g),
                        rotary,
                        windows=windows,
                    )
                )
                for g in groups
            ]
            kls = layer_sensitivities(
                model,
                layer,
                inputs[layer],
                exact,
                forwards,
                lambda: logits(_prefix_cache(prefix, None, None, windows=windows)),
                later_layers(model, layer, tail, positions, exact_rows),
                measure=measure,
                batch_candidates=batch_candidates,
            )
            row = dict(zip(groups, kls, strict=True))
            result.append(row)
            if progress is not None:
                progress(done, len(measured))
    return result


#: Where the calibration window starts in the calibration text (tokens).
CALIBRATION_START = 10_000


@dataclass(frozen=True)
class GroupAllocation:
    """Per-layer group sizes chosen by :func:`calibrate_group_tokens`, and how.

    Attributes:
        layer_group_tokens: one group size (tokens) per decoder layer.
        budget_group_tokens: the uniform group size whose scalar bytes bound the allocation.
        sensitivities: per layer, ``{group_tokens: mean KL in nats}`` as measured.
        text_id, text_sha256: the calibration text.
        start, prefill, score: the calibration window (tokens).
        seconds: wall time of the calibration (s).
        measure: how the sensitivities were measured (``"scaled"`` or ``"exact"``,
            :func:`layer_group_sensitivity`).
        layers: the decoder indices of the measured (full-attention) layers when the model has
            window layers (their ``layer_group_tokens`` entries are the budget's, unused);
            empty: every decoder layer.
    """

    layer_group_tokens: tuple[int, ...]
    budget_group_tokens: int
    sensitivities: tuple[dict[int, float], ...]
    text_id: str
    text_sha256: str
    start: int
    prefill: int
    score: int
    seconds: float
    measure: str = "scaled"
    layers: tuple[int, ...] = ()

    def settings(self) -> dict[str, Any]:
        """JSON-ready record for artifacts
        (:func:`~kvlab.integrations.calibration_record.measurement_settings`;
        ``calibrated_layers`` only when some decoder layers are window layers)."""
        allocation: dict[str, Any] = {"budget_group_tokens": self.budget_group_tokens}
        if self.layers:
            allocation["calibrated_layers"] = list(self.layers)
        return {
            "layer_group_tokens": list(self.layer_group_tokens),
            "group_allocation": {**allocation, **measurement_settings(self)},
        }


def calibrate_group_tokens(
    model: Any,
    tokenizer: Any,
    config: PNMixConfig,
    *,
    budget_group_tokens: int,
    text: TextSource | None = None,
    start: int = CALIBRATION_START,
    prefill: int | None = None,
    score: int = 128,
    candidates: Sequence[int] = DEFAULT_GROUP_CANDIDATES,
    progress: Callable[[int, int], None] | None = None,
    measure: str = "scaled",
) -> GroupAllocation:
    """Measure :func:`layer_group_sensitivity` on a calibration text and allocate group sizes
    with :func:`kvlab.pnmix.allocate_group_tokens` under ``budget_group_tokens``.

    Args:
        model, tokenizer: a ``transformers`` causal LM and its tokenizer.
        config: the PN-Mix configuration (its ``group_tokens`` is ignored).
        budget_group_tokens: the uniform group size whose scalar bytes bound the allocation
            (must be among ``candidates``).
        text: the calibration text (default: the package's public-domain text,
            :func:`kvlab.data.default_text`).
        start: first token of the calibration window (moved back if the text is short).
        prefill: context tokens (default ``sink_tokens + residual_tokens + 3 * max(candidates)``:
            every candidate group size then quantizes the same tokens and leaves the same exact
            residual, so the measured KL differences come from the group size alone).
        score: tokens scored against that context.
        candidates: group sizes (tokens) to choose from.
        progress: ``progress(done, total)`` in decoder layers, or ``None``.
        measure: ``"scaled"`` or ``"exact"`` (:func:`layer_group_sensitivity`).

    Raises:
        ValueError: a text shorter than ``prefill + score`` tokens, or bad arguments (see the
            functions used).
    """
    began = time.perf_counter()
    if prefill is None:
        prefill = config.sink_tokens + config.residual_tokens + 3 * max(candidates)
    source = text if text is not None else default_text()
    need = start + prefill + score
    # tokenize a prefix long enough for the window (about 4 bytes per token; doubled margin)
    head = source.data[: max(8 * need, 4096)].decode("utf-8", errors="replace")
    ids = tokenizer(head, return_tensors="pt").input_ids
    if ids.shape[1] < prefill + score:
        raise ValueError(
            f"calibration text has {ids.shape[1]} tokens; {prefill + score} are needed"
        )
    first = max(0, min(start, ids.shape[1] - prefill - score))
    window = ids[:, first : first + prefill + score]
    sens = layer_group_sensitivity(
        model,
        window,
        config,
        prefill=prefill,
        candidates=candidates,
        progress=progress,
        measure=measure,
    )
    plan = plan_model(model.config.get_text_config(decoder=True))
    chosen = iter(allocate_group_tokens(sens, budget_group_tokens))
    groups = [next(chosen) if layer.is_full else budget_group_tokens for layer in plan.layers]
    return GroupAllocation(
        layers=plan.full_layers if plan.window_layers else (),
        layer_group_tokens=tuple(groups),
        budget_group_tokens=budget_group_tokens,
        sensitivities=tuple(sens),
        text_id=source.id,
        text_sha256=source.sha256,
        start=first,
        prefill=prefill,
        score=score,
        seconds=time.perf_counter() - began,
        measure=measure,
    )
