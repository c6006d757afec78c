"""The built-in methods (:mod:`kvlab.evaluation.methods.grammar` lists their names): the
tables of fixed names (:data:`PNMIX_METHODS`, the HF ``QuantizedCache`` rows) and the builders
that turn a name into its :class:`~kvlab.evaluation.methods.method.Method`.

A builder of a fixed name is ``build(name, context)``; one of a parametric name is
``build(parsed, context)`` with the :class:`~kvlab.evaluation.methods.grammar.MethodName`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kvlab.evaluation.methods.caches import eviction_kwargs, pnmix_config
from kvlab.evaluation.methods.grammar import MethodName, parse_ratio
from kvlab.evaluation.methods.method import Method, MethodContext
from kvlab.userinput import quote

__all__ = [
    "DEFAULT_METHODS",
    "HF_QUANTIZED",
    "PNMIX_METHODS",
    "build_composed",
    "build_eviction",
    "build_full",
    "build_hf_quantized",
    "build_pnmix",
    "hf_quantized_backend_available",
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


_PN_MIX: dict[str, Any] = dict(
    bits=2,
    key_coding="bit_alloc",
    group_tokens=32,
    key_outlier_fraction=0.01,
    value_coding="hadamard",
)
#: PN-Mix family methods: ``PNMixConfig`` keyword arguments (``calibrated``: per-layer groups).
PNMIX_METHODS: dict[str, dict[str, Any]] = {
    "pn-mix": _PN_MIX,
    "pn-mix-prerope": dict(bits=2, key_coding="prerope_cartesian", group_tokens=32),
    "pn-mix-prerope-qmix": dict(bits=2, key_coding="prerope_qmix", group_tokens=32),
    "pn-mix-alloc": dict(bits=2, key_coding="bit_alloc", group_tokens=32),
    "pn-mix-alloc-outliers": dict(
        bits=2, key_coding="bit_alloc", group_tokens=32, key_outlier_fraction=0.01
    ),
    "kivi-2bit-hadamard": dict(
        bits=2, key_coding="cartesian", group_tokens=32, value_coding="hadamard"
    ),
    "pn-mix-seed": dict(),
    "pn-mix-v1": dict(bits=2, key_coding="mix", group_tokens=32, calibrated=True),
    "pn-mix-uniform": dict(bits=2, key_coding="mix", group_tokens=32),
    "pn-mix-3bit": dict(bits=3, key_coding="mix"),
    "pn-mix-4bit": dict(bits=4, key_coding="mix"),
    "kivi-2bit": dict(bits=2, key_coding="cartesian", group_tokens=32),
    "kivi-2bit-calibrated": dict(bits=2, key_coding="cartesian", group_tokens=32, calibrated=True),
    "kivi-4bit": dict(bits=4, key_coding="cartesian"),
    "int4": dict(bits=4, key_coding="per_token", sink_tokens=0, residual_tokens=0),
    "int2": dict(bits=2, key_coding="per_token", sink_tokens=0, residual_tokens=0),
    # pn-mix's coding with fewer exact tokens per stream, for composition with eviction: 4
    # sinks (the eviction policy's own) and an 8-token residual, so a stream keeps 4 + 8 to
    # 4 + 39 tokens exact (docs/design.md, "Flush rule"); chosen on a reduced protocol
    # (docs/archive/results-history.md, section 9, "At 1/8 of full bytes")
    "pn-mix-lean": {**_PN_MIX, "sink_tokens": 4, "residual_tokens": 8},
    # pn-mix with one value scale and zero per 64 channels of the Hadamard frame: 2.5 bits per
    # value channel at any head_dim (pn-mix: 2 + 32 / head_dim; kvlab issue 40, Gemma 3's 256);
    # no kernel reads that layout yet, so it attends through the torch reference
    "pn-mix-values64": {**_PN_MIX, "value_group_channels": 64},
}
#: ``transformers`` ``QuantizedCache`` rows: name -> (backend, bits, axis_key, axis_value).
HF_QUANTIZED = {
    "hf-quanto-2bit": ("quanto", 2, -1, 0),
    "hf-quanto-4bit": ("quanto", 4, -1, 0),
    # transformers' own QuantizedCache defaults for quanto (per-token keys and values): any
    # length; per-channel quanto keys need num_key_value_heads * tokens divisible by the group
    "hf-quanto-2bit-per-token": ("quanto", 2, 0, 0),
    "hf-quanto-4bit-per-token": ("quanto", 4, 0, 0),
    "hf-hqq-2bit": ("hqq", 2, 0, 1),
    "hf-hqq-4bit": ("hqq", 4, 0, 1),
}
_HF_BACKEND_MODULE = {"quanto": "optimum.quanto", "hqq": "hqq"}


def hf_quantized_backend_available(backend: str) -> bool:
    """Whether ``transformers``' ``QuantizedCache`` backend ``"quanto"`` or ``"hqq"`` is
    installed (checked without importing it)."""
    module = _HF_BACKEND_MODULE[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_full(name: str, context: MethodContext) -> Method:
    return Method(
        name="full",
        family="full",
        attention="sdpa",
        description="transformers DynamicCache, exact",
        settings={},
        factory="dynamic",
    )


def build_pnmix(name: str, context: MethodContext) -> Method:
    params = dict(PNMIX_METHODS[name])
    calibrated = bool(params.get("calibrated", False))
    config = pnmix_config(params)
    settings: dict[str, Any] = {
        "bits": config.bits,
        "key_coding": config.key_coding,
        "sink_tokens": config.sink_tokens,
        "residual_tokens": config.residual_tokens,
        "group_tokens": "per layer (calibrated)" if calibrated else config.group_tokens,
        "storage_dtype": str(config.storage_dtype).removeprefix("torch."),
    }
    # recorded only when not the default, so that the older rows keep their task hashes
    if config.key_outlier_fraction:
        settings["key_outlier_fraction"] = config.key_outlier_fraction
    if config.value_coding != "per_token":
        settings["value_coding"] = str(config.value_coding)
    if config.value_group_channels is not None:
        settings["value_group_channels"] = config.value_group_channels
    description = f"kvlab PN-Mix cache, {config.bits}-bit, key coding {config.key_coding}"
    if config.key_outlier_fraction:
        description += f" with {config.key_outlier_fraction:.0%} exact key outliers"
    if config.value_coding != "per_token":
        description += f", {config.value_coding} values"
    if config.value_group_channels is not None:
        description += f" (a scale and zero per {config.value_group_channels} channels)"
    if calibrated:
        description += (
            f", per-layer groups calibrated within the bytes of groups of {config.group_tokens}"
        )
    return Method(
        name=name,
        family="quantized",
        attention="kvlab",
        description=description,
        settings=settings,
        factory="pnmix",
        params=params,
        preparation="pnmix-group-allocation" if calibrated else None,
    )


def build_hf_quantized(name: str, context: MethodContext) -> Method:
    backend, bits, axis_key, axis_value = HF_QUANTIZED[name]
    if not hf_quantized_backend_available(backend):
        package = "optimum-quanto" if backend == "quanto" else "hqq"
        raise ValueError(
            f"method {quote(name)} needs transformers' QuantizedCache backend {backend!r}: "
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
    return Method(
        name=name,
        family="hf-quantized",
        attention="sdpa",
        description=(
            f"transformers QuantizedCache ({backend}, {bits}-bit, "
            f"{'per-token' if axis_key == 0 and backend == 'quanto' else 'per-channel'} keys)"
        ),
        settings=settings,
        factory="hf-quantized",
        params=settings,
    )


def build_eviction(parsed: MethodName, context: MethodContext) -> Method:
    from kvlab.integrations.relay_cache import EvictionConfig
    from kvlab.relay.policies import default_policy_settings, legacy_policy, policy_kwargs
    from kvlab.relay.scorers import SCORERS, get_scorer

    name, kind, scorer = parsed.text, parsed.kind, parsed.scorer
    if scorer is not None and scorer not in SCORERS:
        raise ValueError(f"method {quote(name)}: unknown scorer {quote(scorer)}")
    ratio = parse_ratio(name, parsed.ratio)
    legacy = kind.endswith("-legacy")
    if kind == "streaming-llm":
        if scorer not in (None, "recency"):
            raise ValueError(f"method {quote(name)}: streaming-llm always scores by recency")
        scorer, relay, allocation = "recency", True, "uniform"
        policy: dict[str, Any] = {"scorer": scorer}
    else:
        scorer = scorer or "snapkv"
        relay, allocation = kind.startswith("relay"), None
        policy = legacy_policy(scorer) if legacy else default_policy_settings(scorer)
    params: dict[str, Any] = {**policy, "relay": relay, "allocation": allocation}
    if context.protocol in ("stream", "needle"):
        params["capacity"] = max(1, round((1.0 - ratio) * context.cache_slots))
    else:
        params["ratio"] = ratio
    # the default SnapKV policy splits the budget across layers by a calibration on the
    # package's own text (docs/archive/results-history.md, section 6, "Policy search"); per-layer
    # budgets need a prefill ratio, so the stream and needle protocols keep uniform layers
    calibrated = not legacy and kind != "streaming-llm" and scorer == "snapkv"
    calibrated = calibrated and "ratio" in params
    if calibrated:
        params["calibrated"] = True
    reconstruction = get_scorer(scorer).needs_reconstruction
    if reconstruction:
        if "ratio" not in params:
            raise ValueError(
                f"method {quote(name)}: the {scorer} scorer evicts once after the prefill, by a "
                f"reconstruction pass (prefill-score protocol); the {context.protocol} protocol "
                "evicts while streaming"
            )
        params["reconstruction"] = True
    config = EvictionConfig(**eviction_kwargs(params))  # validates
    settings: dict[str, Any] = {
        "evicted_fraction": ratio,
        "scorer": scorer,
        "relay": relay,
        "allocation": allocation or get_scorer(config.scorer).default_allocation,
        "sink_tokens": config.sink_tokens,
        "window_tokens": config.window_tokens,
    }
    # what the default policy changed; absent at the pre-search values, so the recorded
    # settings (and task hashes) of names whose behaviour did not change stay the same
    if "scorer_options" in policy:
        settings["scorer_settings"] = repr(policy_kwargs(policy)["scorer"])
    for key in ("layer_budget", "scores_share"):
        if key in policy:
            settings[key] = policy[key]
    for key in ("window_fraction", "observation_tokens"):
        if getattr(config, key) is not None:
            settings[key] = getattr(config, key)
    if "capacity" in params:
        settings["capacity_tokens_per_head"] = params["capacity"]
    what = "RoPE-Relay" if relay else "no relay (original positions)"
    description = f"evict {ratio:.0%} by {scorer}, {what}"
    if legacy:
        description += ", pre-search policy"
    if calibrated:
        settings["layer_budget"] = "per layer (calibrated)"
        description += ", per-layer budgets calibrated on the package text"
    return Method(
        name=name,
        family="eviction",
        attention="kvlab",
        description=description,
        settings=settings,
        factory="eviction",
        params=params,
        preparation="relay-layer-budgets"
        if calibrated
        else ("kvzip-prompt" if reconstruction else None),
    )


def build_composed(parsed: MethodName, context: MethodContext) -> Method:
    name, quantizer = parsed.text, parsed.pnmix
    if quantizer is None:
        raise ValueError(f"method {quote(name)} is not composed (no '+PNMIX')")
    if context.protocol != "prefill-score":
        raise ValueError(
            f"method {quote(name)}: eviction composed with PN-Mix evicts once after the prefill "
            f"(prefill-score protocol); the {context.protocol} protocol's capacity mode would "
            "evict tokens already packed into groups"
        )
    if quantizer not in PNMIX_METHODS:
        raise ValueError(
            f"method {quote(name)}: unknown PN-Mix method {quote(quantizer)} after '+'; known: "
            + ", ".join(k for k, v in PNMIX_METHODS.items() if not v.get("calibrated"))
        )
    if PNMIX_METHODS[quantizer].get("calibrated"):
        raise ValueError(
            f"method {quote(name)}: {quote(quantizer)} needs its own calibration; compose an "
            "uncalibrated PN-Mix method (e.g. +pn-mix, +kivi-2bit)"
        )
    # a KVzip eviction: the composed cache packs after compress()'s reconstruction pass
    eviction = build_eviction(parsed.eviction(), context)
    pnmix = build_pnmix(quantizer, context)
    params = {**eviction.params, "pnmix": dict(pnmix.params), "pnmix_method": quantizer}
    settings = {
        **eviction.settings,
        "pnmix_method": quantizer,
        **{f"pnmix_{k}": v for k, v in pnmix.settings.items()},
    }
    return Method(
        name=name,
        family="composed",
        attention="kvlab",
        description=f"{eviction.description}; kept tokens stored as {quantizer} "
        f"({pnmix.description})",
        settings=settings,
        factory="composed",
        params=params,
        preparation=eviction.preparation,
    )
