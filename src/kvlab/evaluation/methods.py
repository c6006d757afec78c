"""The KV-cache methods ``kvlab eval`` compares, by name.

Names (``--method``, repeatable):

* ``full`` — ``transformers.DynamicCache``, exact (the reference), SDPA attention.
* ``pn-mix`` — :class:`PNMixModelCache`, 2-bit, 32 sinks, 32 residual, float16 storage, with
  one group size per layer chosen by
  :func:`~kvlab.integrations.pnmix_calibration.calibrate_group_tokens` on the package's own
  text (not the evaluation text) under the scalar-byte budget of uniform groups of 32 tokens.
  ``pn-mix-uniform``: the same with every layer at 32 tokens.
* ``pn-mix-3bit`` / ``pn-mix-4bit`` — SPEC §3 defaults (groups of 128) at 3 or 4 bits.
* ``kivi-2bit`` / ``kivi-4bit`` — the same cache with every key channel Cartesian (per-channel
  min-max over a group of tokens: KIVI keys, Liu et al. 2024, arXiv:2402.02750), per-token
  values, same sinks and residual; ``kivi-2bit`` uses KIVI's groups of 32 tokens in every
  layer, ``kivi-2bit-calibrated`` the allocation procedure of ``pn-mix`` (ablation: the
  allocation without Phase–Norm).
* ``int4`` / ``int2`` — per-token min-max keys and values (groups of 128 tokens flushed as they
  fill, no sinks, no residual window beyond the filling group).
* ``hf-quanto-2bit`` / ``hf-quanto-4bit`` / ``hf-hqq-2bit`` / ``hf-hqq-4bit`` — ``transformers``'
  own ``QuantizedCache`` (peer rows; need ``optimum-quanto`` or ``hqq``): per-channel keys
  (quanto ``axis_key=-1``, hqq ``axis_key=0``), per-token values, groups of 64, residual 128.
* ``relay@R`` / ``relay:SCORER@R`` — :class:`RelayModelCache`, RoPE-Relay after eviction;
  ``SCORER`` is ``snapkv`` (default), ``keynorm``, ``recency``, ``expected-attention`` or
  ``tova``, with the default policy of :func:`kvlab.relay.policies.default_policy` (chosen by
  the search in docs/results.md). With SnapKV in the prefill-score protocol the budget is also
  split across layers by a calibration on the package's own text before the run
  (:func:`~kvlab.integrations.relay_calibration.calibrate_layer_budgets`, like ``pn-mix``).
* ``evict-no-relay@R`` / ``evict-no-relay:SCORER@R`` — the same selection, keys left at their
  original positions.
* ``relay-legacy:SCORER@R`` / ``evict-no-relay-legacy:SCORER@R`` — the policy before that
  search (:func:`kvlab.relay.policies.legacy_policy`); reproduces the earlier rows.
* ``streaming-llm@R`` — StreamingLLM (Xiao et al. 2023): 4 sinks + recent window, uniform per
  head, positions within the cache (i.e. relayed), as in the paper.

``R`` is the evicted fraction, in [0, 1). Protocol ``prefill-score``: the cache keeps
``(1 - R) * P`` tokens per kv head (layer average) after the prefill of ``P`` tokens.
Protocol ``stream``: the cache keeps at most ``(1 - R) * cache_slots`` tokens per kv head.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import DynamicCache

from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.integrations.pnmix_calibration import GroupAllocation, calibrate_group_tokens
from kvlab.integrations.relay_cache import EvictionConfig, RelayModelCache
from kvlab.integrations.relay_calibration import LayerBudgetCalibration, calibrate_layer_budgets
from kvlab.pnmix import PNMixConfig
from kvlab.relay import get_scorer
from kvlab.relay.policies import default_policy, legacy_policy

__all__ = [
    "DEFAULT_METHODS",
    "Method",
    "available_method_names",
    "hf_quantized_backend_available",
    "parse_method",
]

#: Methods run when ``--method`` is not given (prefill-score); HF peer rows are added when
#: their backend is installed.
DEFAULT_METHODS = (
    "full",
    "pn-mix",
    "pn-mix-4bit",
    "kivi-2bit",
    "int4",
    "int2",
    "relay:snapkv@0.5",
    "evict-no-relay:snapkv@0.5",
    "relay:keynorm@0.5",
    "evict-no-relay:keynorm@0.5",
    "streaming-llm@0.5",
    "evict-no-relay:recency@0.5",
)

_PNMIX: dict[str, dict[str, Any]] = {
    "pn-mix": dict(bits=2, key_coding="mix", group_tokens=32, calibrated=True),
    "pn-mix-uniform": dict(bits=2, key_coding="mix", group_tokens=32),
    "pn-mix-3bit": dict(bits=3, key_coding="mix"),
    "pn-mix-4bit": dict(bits=4, key_coding="mix"),
    "kivi-2bit": dict(bits=2, key_coding="cartesian", group_tokens=32),
    "kivi-2bit-calibrated": dict(bits=2, key_coding="cartesian", group_tokens=32, calibrated=True),
    "kivi-4bit": dict(bits=4, key_coding="cartesian"),
    "int4": dict(bits=4, key_coding="per_token", sink_tokens=0, residual_tokens=0),
    "int2": dict(bits=2, key_coding="per_token", sink_tokens=0, residual_tokens=0),
}
_HF_QUANTIZED = {
    "hf-quanto-2bit": ("quanto", 2, -1, 0),
    "hf-quanto-4bit": ("quanto", 4, -1, 0),
    "hf-hqq-2bit": ("hqq", 2, 0, 1),
    "hf-hqq-4bit": ("hqq", 4, 0, 1),
}
_HF_BACKEND_MODULE = {"quanto": "optimum.quanto", "hqq": "hqq"}
_SCORERS = ("snapkv", "keynorm", "recency", "expected-attention", "tova")
#: per-layer budget calibrations, per model object and policy (several methods share one)
_LAYER_CALIBRATIONS: dict[int, dict[tuple[float, str], LayerBudgetCalibration]] = {}
_EVICTION = re.compile(
    r"^(?P<kind>relay-legacy|evict-no-relay-legacy|relay|evict-no-relay|streaming-llm)"
    r"(?::(?P<scorer>[a-z-]+))?@(?P<ratio>[0-9.]+)$"
)


@dataclass(frozen=True)
class Method:
    """A named KV-cache method.

    Attributes:
        name: the name as given (table row label).
        family: ``"full"``, ``"quantized"`` (kvlab PN-Mix family), ``"hf-quantized"`` or
            ``"eviction"``.
        attention: the attention implementation it runs with (``"sdpa"`` or ``"kvlab"``).
        description: one line for tables and artifacts.
        settings: the method's configuration (JSON-ready).
        make_cache: ``make_cache(model_config)`` returns a fresh ``transformers`` cache.
        prepare: ``prepare(model, tokenizer)``, when set, must run once before
            ``make_cache`` (a calibration); it returns settings to add to ``settings``.
        prepare_note: what ``prepare`` does, in a few words (printed while it runs).
    """

    name: str
    family: str
    attention: str
    description: str
    settings: dict[str, Any]
    make_cache: Callable[[Any], Any]
    prepare: Callable[[Any, Any], dict[str, Any]] | None = None
    prepare_note: str | None = None


def hf_quantized_backend_available(backend: str) -> bool:
    """Whether ``transformers``' ``QuantizedCache`` backend ``"quanto"`` or ``"hqq"`` is
    installed (checked without importing it)."""
    module = _HF_BACKEND_MODULE[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def available_method_names() -> list[str]:
    """Method names (patterns for eviction methods) for help texts."""
    return [
        "full",
        *_PNMIX,
        *_HF_QUANTIZED,
        f"relay[:{'|'.join(_SCORERS)}]@R",
        f"evict-no-relay[:{'|'.join(_SCORERS)}]@R",
        "relay-legacy:SCORER@R",
        "evict-no-relay-legacy:SCORER@R",
        "streaming-llm@R",
    ]


def _pnmix_method(name: str) -> Method:
    kwargs = dict(_PNMIX[name])
    calibrated = bool(kwargs.pop("calibrated", False))
    config = PNMixConfig(**kwargs)
    settings: dict[str, Any] = {
        "bits": config.bits,
        "key_coding": config.key_coding,
        "sink_tokens": config.sink_tokens,
        "residual_tokens": config.residual_tokens,
        "group_tokens": "per layer (calibrated)" if calibrated else config.group_tokens,
        "storage_dtype": str(config.storage_dtype).removeprefix("torch."),
    }
    description = f"kvlab PN-Mix cache, {config.bits}-bit, key coding {config.key_coding}"
    if not calibrated:
        return Method(
            name=name,
            family="quantized",
            attention="kvlab",
            description=description,
            settings=settings,
            make_cache=lambda model_config: PNMixModelCache(model_config, config),
        )
    allocation: list[GroupAllocation] = []

    def prepare(model: Any, tokenizer: Any) -> dict[str, Any]:
        if not allocation:
            allocation.append(
                calibrate_group_tokens(
                    model, tokenizer, config, budget_group_tokens=config.group_tokens
                )
            )
        return allocation[0].settings()

    def make(model_config: Any) -> Any:
        if not allocation:
            raise RuntimeError(f"method {name!r} must be prepared (calibrated) before use")
        groups = allocation[0].layer_group_tokens
        return PNMixModelCache(model_config, config, layer_group_tokens=groups)

    return Method(
        name=name,
        family="quantized",
        attention="kvlab",
        description=f"{description}, per-layer groups calibrated within the bytes of "
        f"groups of {config.group_tokens}",
        settings=settings,
        make_cache=make,
        prepare=prepare,
        prepare_note="calibrating per-layer key groups on the package text: one forward per "
        "layer and group size",
    )


def _hf_quantized_method(name: str) -> Method:
    backend, bits, axis_key, axis_value = _HF_QUANTIZED[name]
    if not hf_quantized_backend_available(backend):
        package = "optimum-quanto" if backend == "quanto" else "hqq"
        raise ValueError(
            f"method {name!r} needs transformers' QuantizedCache backend {backend!r}: "
            f"pip install --no-deps {package}"
        )
    settings = {
        "backend": backend,
        "nbits": bits,
        "axis_key": axis_key,
        "axis_value": axis_value,
        "q_group_size": 64,
        "residual_length": 128,
    }

    def make(model_config: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(config=model_config, **settings)

    return Method(
        name=name,
        family="hf-quantized",
        attention="sdpa",
        description=f"transformers QuantizedCache ({backend}, {bits}-bit, per-channel keys)",
        settings=settings,
        make_cache=make,
    )


def _eviction_method(
    name: str, kind: str, scorer: str | None, ratio: float, *, protocol: str, cache_slots: int
) -> Method:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"method {name!r}: R must lie in [0, 1), got {ratio}")
    if kind == "streaming-llm":
        if scorer not in (None, "recency"):
            raise ValueError(f"method {name!r}: streaming-llm always scores by recency")
        scorer, relay, allocation = "recency", True, "uniform"
        policy: dict[str, Any] = {"scorer": scorer}
    else:
        scorer = scorer or "snapkv"
        relay, allocation = kind.startswith("relay"), None
        legacy = kind.endswith("-legacy")
        policy = legacy_policy(scorer) if legacy else default_policy(scorer)
    # the default SnapKV policy splits the budget across layers by a calibration on the
    # package's own text (docs/results.md, section 4); budgets per layer need a prefill ratio
    calibrated = kind in ("relay", "evict-no-relay") and scorer == "snapkv"
    calibrated = calibrated and protocol != "stream"
    if protocol == "stream":
        capacity = max(1, round((1.0 - ratio) * cache_slots))
        budget: dict[str, Any] = {"capacity": capacity}
    else:
        budget = {"ratio": ratio}
    config = EvictionConfig(**budget, relay=relay, allocation=allocation, **policy)
    settings = {
        "evicted_fraction": ratio,
        "scorer": scorer,
        "scorer_settings": repr(config.scorer),
        "relay": relay,
        "allocation": allocation or get_scorer(config.scorer).default_allocation,
        "sink_tokens": config.sink_tokens,
        "window_tokens": config.window_tokens,
        "window_fraction": config.window_fraction,
        "observation_tokens": config.observation_tokens,
    }
    if config.capacity is not None:
        settings["capacity_tokens_per_head"] = config.capacity
    what = "RoPE-Relay" if relay else "no relay (original positions)"
    description = f"evict {ratio:.0%} by {scorer}, {what}"
    if not calibrated:
        return Method(
            name=name,
            family="eviction",
            attention="kvlab",
            description=description,
            settings=settings,
            make_cache=lambda model_config: RelayModelCache(model_config, config),
        )
    settings["layer_budget"] = "per layer (calibrated)"
    # the calibration measures without relay; relay and no relay share it
    key = (ratio, repr(dataclasses.replace(config, relay=False)))

    def prepare(model: Any, tokenizer: Any) -> dict[str, Any]:
        memo = _LAYER_CALIBRATIONS.setdefault(id(model), {})
        if key not in memo:
            memo[key] = calibrate_layer_budgets(
                model, tokenizer, dataclasses.replace(config, relay=False)
            )
        chosen.append(memo[key])
        return memo[key].settings()

    chosen: list[LayerBudgetCalibration] = []

    def make(model_config: Any) -> Any:
        if not chosen:
            raise RuntimeError(f"method {name!r} must be prepared (calibrated) before use")
        fractions = chosen[-1].layer_fractions
        return RelayModelCache(model_config, dataclasses.replace(config, layer_budget=fractions))

    return Method(
        name=name,
        family="eviction",
        attention="kvlab",
        description=f"{description}, per-layer budgets calibrated on the package text",
        settings=settings,
        make_cache=make,
        prepare=prepare,
        prepare_note="calibrating per-layer eviction budgets on the package text: one forward "
        "of 128 tokens per layer and kept fraction",
    )


def parse_method(spec: str, *, protocol: str = "prefill-score", cache_slots: int = 2048) -> Method:
    """The :class:`Method` named ``spec`` (module docstring).

    Args:
        spec: a method name.
        protocol: ``"prefill-score"`` or ``"stream"`` (decides how eviction budgets apply).
        cache_slots: the stream protocol's cache window in tokens per head.

    Raises:
        ValueError: an unknown name, an R outside [0, 1), a scorer that does not exist, or an
            HF ``QuantizedCache`` backend that is not installed.
    """
    name = spec.strip()
    if name == "full":
        return Method(
            name="full",
            family="full",
            attention="sdpa",
            description="transformers DynamicCache, exact",
            settings={},
            make_cache=lambda model_config: DynamicCache(config=model_config),
        )
    if name in _PNMIX:
        return _pnmix_method(name)
    if name in _HF_QUANTIZED:
        return _hf_quantized_method(name)
    match = _EVICTION.match(name)
    if match:
        scorer = match.group("scorer")
        if scorer is not None and scorer not in _SCORERS:
            raise ValueError(f"method {name!r}: unknown scorer {scorer!r}")
        try:
            ratio = float(match.group("ratio"))
        except ValueError as exc:
            raise ValueError(f"method {name!r}: R is not a number") from exc
        return _eviction_method(
            name, match.group("kind"), scorer, ratio, protocol=protocol, cache_slots=cache_slots
        )
    raise ValueError(f"unknown method {spec!r}; known: {', '.join(available_method_names())}")
