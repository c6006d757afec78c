"""One-time, per-model preparations of methods (calibrations), keyed in
:data:`PREPARATIONS`: what each runs, on which text, and which modules decide its result
(their code hash keys the on-disk cache, :mod:`kvlab.evaluation.calibration`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvlab.evaluation.methods.caches import eviction_kwargs, eviction_params, pnmix_config

__all__ = ["PREPARATIONS", "Preparation", "Progress", "accepts_progress", "count_forwards"]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Preparation:
    """A one-time, per-model preparation of a method (a calibration), cached on disk.

    Attributes:
        run: ``run(params, model, tokenizer, text, progress) -> prepared`` (JSON-ready dict
            merged into the method's recorded settings); ``text`` is the calibration
            :class:`~kvlab.data.TextSource`; ``progress(done, total)`` reports steps.
        text: ``text()`` returns the calibration text (its sha256 keys the cache).
        modules: modules whose source decides the result (their code hash keys the cache).
        note: what it does, in a few words (shown while it runs).
        key_params: ``key_params(params)`` — the part of a method's ``params`` that decides the
            result (keys the cache; methods that agree on it share one preparation), or
            ``None`` for all of them.
        run_many: ``run_many(params_list, model, tokenizer, text, progress) -> [prepared]``,
            several methods' preparations from one measurement, each equal to ``run`` on its
            params; ``batch_params(params)`` says which methods may share it. ``None``: none.
        batch_params: ``batch_params(params)`` — what methods sharing one ``run_many`` must
            agree on (JSON-ready), or ``None``.
    """

    run: Callable[..., dict[str, Any]]
    text: Callable[[], Any]
    modules: tuple[str, ...]
    note: str
    key_params: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    run_many: Callable[..., list[dict[str, Any]]] | None = None
    batch_params: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


def _calibration_text() -> Any:
    from kvlab.data import default_text

    return default_text()


def _calibrate_groups(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Progress | None = None,
) -> dict[str, Any]:
    from kvlab.integrations.pnmix_calibration import calibrate_group_tokens

    config = pnmix_config(params)
    kwargs: dict[str, Any] = {"budget_group_tokens": config.group_tokens, "text": text}
    if accepts_progress(calibrate_group_tokens):
        allocation = calibrate_group_tokens(model, tokenizer, config, progress=progress, **kwargs)
    else:
        with count_forwards(model, config, progress):
            allocation = calibrate_group_tokens(model, tokenizer, config, **kwargs)
    return allocation.settings()


def _layer_budget_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The calibration measures the eviction alone, without relay: relay and no relay, with
    PN-Mix or not, share it."""
    return {**eviction_params(params), "relay": False}


def _calibrate_layer_budgets(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Progress | None = None,
) -> dict[str, Any]:
    from kvlab.integrations.relay_cache import EvictionConfig
    from kvlab.integrations.relay_calibration import calibrate_layer_budgets

    config = EvictionConfig(**eviction_kwargs(_layer_budget_params(params)))
    calibration = calibrate_layer_budgets(model, tokenizer, config, text=text, progress=progress)
    return calibration.settings()


def _layer_budget_batch(params: Mapping[str, Any]) -> dict[str, Any]:
    """Eviction settings but the ratio: one measurement serves every ratio."""
    return {k: v for k, v in _layer_budget_params(params).items() if k != "ratio"}


def _calibrate_layer_budgets_many(
    params_list: list[Mapping[str, Any]],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    from kvlab.integrations.relay_cache import EvictionConfig
    from kvlab.integrations.relay_calibration import calibrate_layer_budgets_for_ratios

    configs = [EvictionConfig(**eviction_kwargs(_layer_budget_params(p))) for p in params_list]
    ratios = [float(c.ratio) for c in configs if c.ratio is not None]
    if len(ratios) != len(configs):
        raise ValueError("calibrate_layer_budgets needs EvictionConfig.ratio")
    results = calibrate_layer_budgets_for_ratios(
        model, tokenizer, configs[0], ratios, text=text, progress=progress
    )
    return [results[r].settings() for r in ratios]


def _kvzip_prompt(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Progress | None = None,
) -> dict[str, Any]:
    from kvlab.relay.kvzip import ReconstructionPrompt

    return {"kvzip_prompt": ReconstructionPrompt.from_tokenizer(tokenizer).settings()}


@contextmanager
def count_forwards(model: Any, config: Any, progress: Progress | None) -> Iterator[None]:
    """Report :func:`~kvlab.integrations.pnmix_calibration.calibrate_group_tokens`'s progress
    in decoder layers, by counting the model's forwards: it runs one exact prefill, one exact
    scoring forward, then one forward per layer and candidate group size (its docstring).
    Does nothing when ``progress`` is ``None``."""
    if progress is None:
        yield
        return
    from kvlab.pnmix.allocation import DEFAULT_GROUP_CANDIDATES

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    per_layer = len(set(DEFAULT_GROUP_CANDIDATES))
    count = 0

    def hook(module: Any, args: Any) -> None:
        nonlocal count
        count += 1
        progress(min(layers, max(0, count - 2) // per_layer), layers)

    progress(0, layers)
    handle = model.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def accepts_progress(function: Callable[..., Any]) -> bool:
    """Whether ``function`` takes a ``progress`` keyword (a future calibration may)."""
    return "progress" in inspect.signature(function).parameters


#: One-time preparations by key.
PREPARATIONS: dict[str, Preparation] = {
    "pnmix-group-allocation": Preparation(
        run=_calibrate_groups,
        text=_calibration_text,
        modules=(
            "kvlab.integrations.pnmix_calibration",
            "kvlab.integrations.calibration_capture",
            "kvlab.integrations.calibration_record",
            "kvlab.integrations.pnmix_cache",
            "kvlab.integrations.pnmix_layer",
            "kvlab.integrations.decode_steps",
            "kvlab.integrations.layer",
            "kvlab.integrations.dense_attention",
            "kvlab.integrations.attention",
            "kvlab.pnmix.allocation",
            "kvlab.pnmix.attention",
            "kvlab.pnmix.reference",
            "kvlab.pnmix.cache",
            "kvlab.pnmix.cache_state",
            "kvlab.pnmix.cache_tables",
            "kvlab.pnmix.cache_flush",
            "kvlab.pnmix.cache_decode",
            "kvlab.pnmix.codecs",
            "kvlab.pnmix.key_codec",
            "kvlab.pnmix.pair_codecs",
            "kvlab.pnmix.mix_codec",
            "kvlab.pnmix.config",
            "kvlab.pnmix.packing",
            "kvlab.pnmix.quantizers",
            "kvlab.pnmix.store",
            "kvlab.pnmix.store_buffers",
            "kvlab.pnmix.bitalloc",
            "kvlab.pnmix.hadamard",
            "kvlab.pnmix.outliers",
            "kvlab.pnmix.values",
            "kvlab.pnmix.width_codec",
            "kvlab.integrations.model_support",
            "kvlab.rope",
            "kvlab.rope.config",
            "kvlab.rope.scaling",
            "kvlab.rope.rotation",
            "kvlab.data",
        ),
        note="calibrating per-layer key groups on the package text",
    ),
    "kvzip-prompt": Preparation(
        run=_kvzip_prompt,
        text=_calibration_text,
        modules=("kvlab.relay.kvzip",),
        note="tokenizing KVzip's repeat prompt",
        key_params=lambda params: {},
    ),
    "relay-layer-budgets": Preparation(
        run=_calibrate_layer_budgets,
        text=_calibration_text,
        modules=(
            "kvlab.integrations.relay_calibration",
            "kvlab.integrations.calibration_capture",
            "kvlab.integrations.calibration_record",
            "kvlab.integrations.relay_cache",
            "kvlab.integrations.relay_layer",
            "kvlab.integrations.relay_eviction",
            "kvlab.integrations.layer",
            "kvlab.integrations.model_cache",
            "kvlab.integrations.window_layer",
            "kvlab.integrations.forward",
            "kvlab.integrations.attention",
            "kvlab.integrations.model_support",
            "kvlab.integrations.pnmix_calibration",  # its calibration window (CALIBRATION_START)
            "kvlab.relay.attention",
            "kvlab.relay.kernels.cpu",
            "kvlab.kernels_common",  # kvlab_simd.h, included by the relay kernel
            "kvlab.backends",
            "kvlab.relay.budgets",
            "kvlab.relay.combined",
            "kvlab.relay.config",
            "kvlab.relay.core",
            "kvlab.relay.evictor",
            "kvlab.relay.reconstruction",
            "kvlab.relay.expected_attention",
            "kvlab.relay.layer_budgets",
            "kvlab.relay.policies",
            "kvlab.relay.scorers",
            "kvlab.relay.storage",
            "kvlab.relay.storage_views",
            "kvlab.relay.tova",
            "kvlab.rope",
            "kvlab.rope.config",
            "kvlab.rope.scaling",
            "kvlab.rope.rotation",
            "kvlab.data",
        ),
        note="calibrating per-layer eviction budgets on the package text: per layer and kept "
        "fraction, 128 tokens through that layer and the ones after it",
        key_params=_layer_budget_params,
        run_many=_calibrate_layer_budgets_many,
        batch_params=_layer_budget_batch,
    ),
}
