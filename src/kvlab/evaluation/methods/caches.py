"""Cache factories: module-level functions ``factory(params, model_config, prepared) ->
transformers cache`` (picklable by reference), keyed in :data:`CACHE_FACTORIES`, and the
configurations they build from a method's JSON-ready ``params``
(:mod:`kvlab.evaluation.methods`, "How a method is represented").

Heavy modules (``torch``, ``transformers``, the caches) are imported inside the functions, so
that importing the registry stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "CACHE_FACTORIES",
    "COMPOSED_KEYS",
    "CacheFactory",
    "eviction_config",
    "eviction_kwargs",
    "eviction_params",
    "pnmix_config",
]

CacheFactory = Callable[[Mapping[str, Any], Any, Mapping[str, Any] | None], Any]


def _dynamic_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model_config)


def pnmix_config(params: Mapping[str, Any]) -> Any:
    """The :class:`~kvlab.pnmix.PNMixConfig` of a PN-Mix method's ``params`` (its keyword
    arguments; ``calibrated`` dropped, ``storage_dtype`` named as a ``torch`` dtype)."""
    import torch

    from kvlab.pnmix import PNMixConfig

    kwargs = {k: v for k, v in params.items() if k != "calibrated"}
    if "storage_dtype" in kwargs:
        kwargs["storage_dtype"] = getattr(torch, kwargs["storage_dtype"])
    return PNMixConfig(**kwargs)


def _pnmix_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from kvlab.integrations.pnmix_cache import PNMixModelCache

    groups = prepared.get("layer_group_tokens") if prepared else None
    return PNMixModelCache(model_config, pnmix_config(params), layer_group_tokens=groups)


def _hf_quantized_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from transformers import QuantizedCache

    return QuantizedCache(config=model_config, **params)


#: Keys of a composed method's ``params`` that are not eviction settings (the PN-Mix part).
COMPOSED_KEYS = ("pnmix", "pnmix_method")


def eviction_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """An eviction (or composed) method's eviction settings: ``params`` without the PN-Mix
    part of a composed method."""
    return {k: v for k, v in params.items() if k not in COMPOSED_KEYS}


def eviction_kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments from an eviction method's ``params`` (the policy's
    JSON-ready settings, :func:`kvlab.relay.policies.policy_kwargs`; ``calibrated`` and a
    composed method's PN-Mix part dropped)."""
    from kvlab.relay.policies import policy_kwargs

    return policy_kwargs(
        {
            k: v
            for k, v in eviction_params(params).items()
            if k not in ("calibrated", "reconstruction")
        }
    )


def eviction_config(params: Mapping[str, Any], prepared: Any) -> Any:
    """The ``EvictionConfig`` of an eviction (or composed) method, with the calibrated
    per-layer budgets of its preparation when it has one.

    Raises:
        RuntimeError: a KVzip or calibrated method whose ``prepared`` lacks its state.
    """
    from kvlab.integrations.relay_cache import EvictionConfig

    kwargs = eviction_kwargs(params)
    if params.get("reconstruction"):
        from kvlab.relay.kvzip import ReconstructionPrompt
        from kvlab.relay.scorers import get_scorer

        prompt = prepared.get("kvzip_prompt") if prepared else None
        if not prompt:
            raise RuntimeError(
                "a KVzip eviction method needs the repeat prompt of its preparation 'kvzip-prompt'"
            )
        kwargs["scorer"] = get_scorer(kwargs["scorer"]).with_prompt(ReconstructionPrompt(**prompt))
    if params.get("calibrated"):
        fractions = prepared.get("layer_fractions") if prepared else None
        if not fractions:
            raise RuntimeError(
                "a calibrated eviction method needs the layer_fractions of its preparation "
                "'relay-layer-budgets'"
            )
        kwargs["layer_budget"] = tuple(fractions)
    return EvictionConfig(**kwargs)


def _eviction_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from kvlab.integrations.relay_cache import RelayModelCache

    return RelayModelCache(model_config, eviction_config(params, prepared))


def _composed_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from kvlab.integrations.composed_cache import ComposedModelCache

    return ComposedModelCache(
        model_config, eviction_config(params, prepared), pnmix_config(params["pnmix"])
    )


#: Cache factories by key: ``factory(params, model_config, prepared) -> cache``.
CACHE_FACTORIES: dict[str, CacheFactory] = {
    "dynamic": _dynamic_cache,
    "pnmix": _pnmix_cache,
    "hf-quantized": _hf_quantized_cache,
    "eviction": _eviction_cache,
    "composed": _composed_cache,
}
