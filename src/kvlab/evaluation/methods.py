"""The KV-cache methods ``kvlab eval`` compares: pure data, and a registry that builds them.

Names (``--method``, repeatable):

* ``full`` — ``transformers.DynamicCache``, exact (the reference), SDPA attention.
* ``pn-mix`` — :class:`~kvlab.integrations.PNMixModelCache`, 2-bit, 32 sinks, 32 residual,
  float16 storage, groups of 32 tokens in every layer (no calibration): the issue-8 coding
  (docs/pnmix-key-coding-research.md) — pre-RoPE keys with a code width in {0, 2, 3, 4} bits
  per (kv head, rotary pair) averaging 2, chosen once per row by the query-weighted logit error
  (key coding ``bit_alloc``), 1 % of each group's key elements kept exact (dense-and-sparse
  outliers), and per-token values of Hadamard-rotated channels.
* Its ablation ladder (each row adds one component, groups of 32): ``pn-mix-prerope``
  (pre-RoPE Cartesian keys), ``pn-mix-prerope-qmix`` (+ the query-aware 1-bit mix of
  pre-RoPE Cartesian / Phase–Norm), ``pn-mix-alloc`` (pre-RoPE keys with query-aware per-pair
  widths), ``pn-mix-alloc-outliers`` (+ 1 % exact key outliers); ``pn-mix`` adds Hadamard
  values. ``kivi-2bit-hadamard``: KIVI keys with Hadamard values (values alone).
* ``pn-mix-v1`` — the previous ``pn-mix``: Cartesian / Phase–Norm mix by first-group saliency,
  one group size per layer chosen by
  :func:`~kvlab.integrations.pnmix_calibration.calibrate_group_tokens` on the package's own
  text (not the evaluation text) under the scalar-byte budget of uniform groups of 32 tokens.
  ``pn-mix-uniform``: the same with every layer at 32 tokens.
* ``pn-mix-seed`` — the seed layout, :class:`~kvlab.pnmix.PNMixConfig` defaults (2-bit mix,
  groups of 128). ``pn-mix-3bit`` / ``pn-mix-4bit`` — the same layout at 3 or 4 bits.
* ``kivi-2bit`` / ``kivi-4bit`` — the same cache with every key channel Cartesian (per-channel
  min-max over a group of tokens: KIVI keys, Liu et al. 2024, arXiv:2402.02750), per-token
  values, same sinks and residual; ``kivi-2bit`` uses KIVI's groups of 32 tokens in every
  layer, ``kivi-2bit-calibrated`` the allocation procedure of ``pn-mix-v1`` (ablation: the
  allocation without Phase–Norm).
* ``int4`` / ``int2`` — per-token min-max keys and values (groups of 128 tokens flushed as they
  fill, no sinks, no residual window beyond the filling group).
* ``hf-quanto-2bit`` / ``hf-quanto-4bit`` / ``hf-hqq-2bit`` / ``hf-hqq-4bit`` — ``transformers``'
  own ``QuantizedCache`` (peer rows; need ``optimum-quanto`` or ``hqq``): per-channel keys
  (quanto ``axis_key=-1``, hqq ``axis_key=0``), per-token values, groups of 64, residual 128.
* ``relay@R`` / ``relay:SCORER@R`` — :class:`~kvlab.integrations.RelayModelCache`, RoPE-Relay
  after eviction; ``SCORER`` is any name in :data:`kvlab.relay.scorers.SCORERS` (``snapkv``,
  the default, ``keynorm``, ``recency``, ``expected-attention``, ``tova``, ``combined``,
  ``kvzip``), with
  the default policy of :func:`kvlab.relay.policies.default_policy` (chosen by the search in
  docs/results.md). With SnapKV in the prefill-score protocol the budget is also split across
  layers by a calibration on the package's own text before the run (the preparation
  ``"relay-layer-budgets"``,
  :func:`~kvlab.integrations.relay_calibration.calibrate_layer_budgets`, like ``pn-mix``; relay
  and no relay share it).
* ``evict-no-relay@R`` / ``evict-no-relay:SCORER@R`` — the same selection, keys left at their
  original positions.
* ``relay:kvzip@R`` / ``evict-no-relay:kvzip@R`` — KVzip (Kim et al. 2025, arXiv:2505.23416):
  the cache stores the prefill, a reconstruction pass (the model re-reading the context after
  "Repeat the previous context exactly.") scores every stored token, then it evicts
  (:func:`kvlab.integrations.kvzip.compress`, called by the prefill-score protocol right after
  the prefill forward). The repeat prompt is tokenized once (preparation ``"kvzip-prompt"``).
  Prefill-score protocol only (one eviction after the prefill).
* ``relay-legacy:SCORER@R`` / ``evict-no-relay-legacy:SCORER@R`` — the policy before that
  search (:func:`kvlab.relay.policies.legacy_policy`); reproduces the earlier rows.
* ``streaming-llm@R`` — StreamingLLM (Xiao et al. 2023): 4 sinks + recent window, uniform per
  head, positions within the cache (i.e. relayed), as in the paper.
* ``relay:SCORER@R+PNMIX`` / ``evict-no-relay:SCORER@R+PNMIX`` — eviction composed with PN-Mix
  (:class:`~kvlab.integrations.composed_cache.ComposedModelCache`): the eviction method
  ``relay:SCORER@R`` (or ``evict-no-relay:...``) with its full policy — its default policy
  and, for SnapKV, its calibrated per-layer budgets (the same preparation
  ``"relay-layer-budgets"``, shared) — then the kept tokens stored by the PN-Mix method
  ``PNMIX`` (any uncalibrated name of :data:`PNMIX_METHODS`: ``pn-mix``, ``pn-mix-lean``,
  ``kivi-2bit``, ...). Prefill-score protocol only (one eviction after the prefill), and not
  with ``kvzip`` (its eviction waits for a reconstruction pass after the prefill; the composed
  cache packs at the prefill).
* ``pn-mix-lean`` — ``pn-mix``'s coding with 4 sinks and an 8-token residual instead of 32 +
  32, meant for composition (``evict-no-relay:snapkv@0.5625+pn-mix-lean``): a kept stream of
  ``k`` tokens keeps ``4 + 8`` to ``4 + 39`` of them exact (docs/design.md, "Flush rule"), so
  at 56 % eviction the composed cache is about 1/8 of the full cache's bytes
  (docs/results.md, section 9). Usable alone too.

``R`` is the evicted fraction, in [0, 1). Protocol ``prefill-score``: the cache keeps
``(1 - R) * P`` tokens per kv head (layer average) after the prefill of ``P`` tokens.
Protocols ``stream`` and ``needle``: the cache keeps at most ``(1 - R) * cache_slots`` tokens
per kv head.

How a method is represented
---------------------------
A :class:`Method` is plain, picklable data: its name, family, attention implementation, the
settings recorded in artifacts, and ``factory`` + ``params`` — the key of a *cache factory*
in :data:`CACHE_FACTORIES` and the JSON-ready arguments it gets. A factory is a module-level
function ``factory(params, model_config, prepared) -> transformers cache``; ``prepared`` is the
JSON-ready state a *preparation* (:data:`PREPARATIONS`, e.g. a calibration) produced once per
model, or ``None``. No closures and no mutable state, so tasks ship to other processes (Ray
workers) and hash to the same content everywhere.

Adding a method
---------------
One registry entry, no other file:

* **A fixed name on an existing factory** (e.g. a new PN-Mix key codec or bit width): one line
  in :data:`PNMIX_METHODS`, the :class:`~kvlab.pnmix.PNMixConfig` keyword arguments
  (``"calibrated": True`` adds the per-layer group calibration), e.g.
  ``"pn-mix-lattice": dict(bits=2, key_coding="lattice", group_tokens=32)``.
* **A new eviction scorer**: add it to :data:`kvlab.relay.scorers.SCORERS`; ``relay:NAME@R``
  and ``evict-no-relay:NAME@R`` then work as they are, with the default policy's protected
  window (a scorer-specific default policy: one branch in
  :func:`kvlab.relay.policies.default_policy_settings`), and ``relay-legacy:NAME@R`` with
  ``EvictionConfig``'s plain settings.
* **A new kind of cache** (e.g. eviction composed with PN-Mix): write a module-level factory
  ``def _my_cache(params, model_config, prepared): ...`` (import heavy modules inside it),
  add it to :data:`CACHE_FACTORIES`, and register the name with :func:`register_method`
  (a fixed name) or :func:`register_pattern` (a parametric name such as
  ``relay:SCORER@R+PNMIX``, the composed methods), returning a :class:`Method`. If it
  needs a one-time preparation, add a :class:`Preparation` to :data:`PREPARATIONS` and set
  ``Method.preparation`` to its key; list in ``Preparation.modules`` the modules whose source
  decides its result (their code hash keys the on-disk cache,
  :mod:`kvlab.evaluation.calibration`).

Existing names and their numbers must stay unchanged: a method's name, ``params`` and
``settings`` are part of the task hash (:mod:`kvlab.evaluation.plan`). (Issue 9 changed the
eviction defaults once, with new settings recorded; the ``-legacy`` names keep the earlier
rows and settings.)
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CACHE_FACTORIES",
    "DEFAULT_METHODS",
    "PNMIX_METHODS",
    "PREPARATIONS",
    "Method",
    "MethodContext",
    "Preparation",
    "available_method_names",
    "hf_quantized_backend_available",
    "method_backends",
    "parse_method",
    "register_method",
    "register_pattern",
    "takes_ratio",
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

CacheFactory = Callable[[Mapping[str, Any], Any, Mapping[str, Any] | None], Any]


@dataclass(frozen=True)
class Method:
    """A named KV-cache method, as plain data (module docstring).

    Attributes:
        name: the name as given (table row label).
        family: ``"full"``, ``"quantized"`` (kvlab PN-Mix family), ``"hf-quantized"`` or
            ``"eviction"``.
        attention: the attention implementation it runs with (``"sdpa"`` or ``"kvlab"``).
        description: one line for tables and artifacts.
        settings: the method's configuration as recorded in artifacts (JSON-ready).
        factory: key of its cache factory in :data:`CACHE_FACTORIES`.
        params: the factory's arguments (JSON-ready).
        preparation: key of a one-time preparation in :data:`PREPARATIONS`, or ``None``.
    """

    name: str
    family: str
    attention: str
    description: str
    settings: Mapping[str, Any]
    factory: str
    params: Mapping[str, Any] = field(default_factory=dict)
    preparation: str | None = None

    def make_cache(self, model_config: Any, prepared: Mapping[str, Any] | None = None) -> Any:
        """A fresh ``transformers`` cache for ``model_config``.

        Args:
            prepared: the state :attr:`preparation` produced (required when it is set).

        Raises:
            RuntimeError: the method needs a preparation and ``prepared`` is ``None``.
        """
        if self.preparation is not None and prepared is None:
            raise RuntimeError(f"method {self.name!r} must be prepared (calibrated) before use")
        return CACHE_FACTORIES[self.factory](self.params, model_config, prepared)

    def record(self) -> dict[str, Any]:
        """JSON-ready description (hashed into tasks; see :mod:`kvlab.evaluation.plan`)."""
        return {
            "name": self.name,
            "family": self.family,
            "attention": self.attention,
            "description": self.description,
            "settings": dict(self.settings),
            "factory": self.factory,
            "params": dict(self.params),
            "preparation": self.preparation,
        }


@dataclass(frozen=True)
class MethodContext:
    """What a method's budget may depend on: the protocol and the stream cache window.

    Attributes:
        protocol: ``"prefill-score"``, ``"stream"`` or ``"needle"``.
        cache_slots: tokens per kv head of the stream/needle cache window.
    """

    protocol: str = "prefill-score"
    cache_slots: int = 2048


# --- cache factories (module-level functions: picklable by reference) ----------------------


def _dynamic_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model_config)


def _pnmix_config(params: Mapping[str, Any]) -> Any:
    import torch

    from kvlab.pnmix import PNMixConfig

    kwargs = {k: v for k, v in params.items() if k != "calibrated"}
    if "storage_dtype" in kwargs:
        kwargs["storage_dtype"] = getattr(torch, kwargs["storage_dtype"])
    return PNMixConfig(**kwargs)


def _pnmix_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from kvlab.integrations.pnmix_cache import PNMixModelCache

    groups = prepared.get("layer_group_tokens") if prepared else None
    return PNMixModelCache(model_config, _pnmix_config(params), layer_group_tokens=groups)


def _hf_quantized_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from transformers import QuantizedCache

    return QuantizedCache(config=model_config, **params)


#: Keys of a composed method's ``params`` that are not eviction settings (the PN-Mix part).
_COMPOSED_KEYS = ("pnmix", "pnmix_method")


def _eviction_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """An eviction (or composed) method's eviction settings: ``params`` without the PN-Mix
    part of a composed method."""
    return {k: v for k, v in params.items() if k not in _COMPOSED_KEYS}


def _eviction_kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments from an eviction method's ``params`` (the policy's
    JSON-ready settings, :func:`kvlab.relay.policies.policy_kwargs`; ``calibrated`` and a
    composed method's PN-Mix part dropped)."""
    from kvlab.relay.policies import policy_kwargs

    return policy_kwargs(
        {
            k: v
            for k, v in _eviction_params(params).items()
            if k not in ("calibrated", "reconstruction")
        }
    )


def _eviction_config(params: Mapping[str, Any], prepared: Any) -> Any:
    """The ``EvictionConfig`` of an eviction (or composed) method, with the calibrated
    per-layer budgets of its preparation when it has one."""
    from kvlab.integrations.relay_cache import EvictionConfig

    kwargs = _eviction_kwargs(params)
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

    return RelayModelCache(model_config, _eviction_config(params, prepared))


def _composed_cache(params: Mapping[str, Any], model_config: Any, prepared: Any) -> Any:
    from kvlab.integrations.composed_cache import ComposedModelCache

    return ComposedModelCache(
        model_config, _eviction_config(params, prepared), _pnmix_config(params["pnmix"])
    )


#: Cache factories by key: ``factory(params, model_config, prepared) -> cache``.
CACHE_FACTORIES: dict[str, CacheFactory] = {
    "dynamic": _dynamic_cache,
    "pnmix": _pnmix_cache,
    "hf-quantized": _hf_quantized_cache,
    "eviction": _eviction_cache,
    "composed": _composed_cache,
}


# --- preparations --------------------------------------------------------------------------


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
    """

    run: Callable[..., dict[str, Any]]
    text: Callable[[], Any]
    modules: tuple[str, ...]
    note: str
    key_params: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


def _calibration_text() -> Any:
    from kvlab.data import default_text

    return default_text()


def _calibrate_groups(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from kvlab.evaluation.calibration import accepts_progress, count_forwards
    from kvlab.integrations.pnmix_calibration import calibrate_group_tokens

    config = _pnmix_config(params)
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
    return {**_eviction_params(params), "relay": False}


def _calibrate_layer_budgets(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from kvlab.integrations.relay_cache import EvictionConfig
    from kvlab.integrations.relay_calibration import calibrate_layer_budgets

    config = EvictionConfig(**_eviction_kwargs(_layer_budget_params(params)))
    calibration = calibrate_layer_budgets(model, tokenizer, config, text=text, progress=progress)
    return calibration.settings()


def _kvzip_prompt(
    params: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    text: Any,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from kvlab.relay.kvzip import ReconstructionPrompt

    return {"kvzip_prompt": ReconstructionPrompt.from_tokenizer(tokenizer).settings()}


#: One-time preparations by key.
PREPARATIONS: dict[str, Preparation] = {
    "pnmix-group-allocation": Preparation(
        run=_calibrate_groups,
        text=_calibration_text,
        modules=(
            "kvlab.integrations.pnmix_calibration",
            "kvlab.integrations.pnmix_cache",
            "kvlab.integrations.attention",
            "kvlab.pnmix.allocation",
            "kvlab.pnmix.attention",
            "kvlab.pnmix.cache",
            "kvlab.pnmix.cache_state",
            "kvlab.pnmix.cache_decode",
            "kvlab.pnmix.codecs",
            "kvlab.pnmix.key_codec",
            "kvlab.pnmix.pair_codecs",
            "kvlab.pnmix.mix_codec",
            "kvlab.pnmix.config",
            "kvlab.pnmix.packing",
            "kvlab.pnmix.quantizers",
            "kvlab.pnmix.store",
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
            "kvlab.integrations.relay_cache",
            "kvlab.integrations.attention",
            "kvlab.integrations.model_support",
            "kvlab.integrations.pnmix_calibration",  # its calibration window (CALIBRATION_START)
            "kvlab.relay.attention",
            "kvlab.relay.kernels.cpu",
            "kvlab.kernels_common",  # kvlab_simd.h, included by the relay kernel
            "kvlab.backends",
            "kvlab.relay.budgets",
            "kvlab.relay.combined",
            "kvlab.relay.core",
            "kvlab.relay.expected_attention",
            "kvlab.relay.layer_budgets",
            "kvlab.relay.policies",
            "kvlab.relay.scorers",
            "kvlab.relay.storage",
            "kvlab.relay.tova",
            "kvlab.rope",
            "kvlab.rope.config",
            "kvlab.rope.scaling",
            "kvlab.rope.rotation",
            "kvlab.data",
        ),
        note="calibrating per-layer eviction budgets on the package text: one forward of 128 "
        "tokens per layer and kept fraction",
        key_params=_layer_budget_params,
    ),
}


# --- names ---------------------------------------------------------------------------------

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
    # (docs/results.md, section 9)
    "pn-mix-lean": {**_PN_MIX, "sink_tokens": 4, "residual_tokens": 8},
}
_HF_QUANTIZED = {
    "hf-quanto-2bit": ("quanto", 2, -1, 0),
    "hf-quanto-4bit": ("quanto", 4, -1, 0),
    "hf-hqq-2bit": ("hqq", 2, 0, 1),
    "hf-hqq-4bit": ("hqq", 4, 0, 1),
}
_HF_BACKEND_MODULE = {"quanto": "optimum.quanto", "hqq": "hqq"}

_NAMED: dict[str, Callable[[str, MethodContext], Method]] = {}
_PATTERNS: list[tuple[re.Pattern[str], Callable[[re.Match[str], MethodContext], Method], str]] = []


def register_method(name: str, build: Callable[[str, MethodContext], Method]) -> None:
    """Register a fixed method name: ``build(name, context)`` returns its :class:`Method`.

    Raises:
        ValueError: the name is taken.
    """
    if name in _NAMED:
        raise ValueError(f"method {name!r} is already registered")
    _NAMED[name] = build


def register_pattern(
    pattern: str, build: Callable[[re.Match[str], MethodContext], Method], shown_as: str
) -> None:
    """Register a parametric method name: a full-match regular expression, a builder
    ``build(match, context)``, and how help texts show it (e.g. ``"streaming-llm@R"``)."""
    _PATTERNS.append((re.compile(pattern), build, shown_as))


def hf_quantized_backend_available(backend: str) -> bool:
    """Whether ``transformers``' ``QuantizedCache`` backend ``"quanto"`` or ``"hqq"`` is
    installed (checked without importing it)."""
    module = _HF_BACKEND_MODULE[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def available_method_names() -> list[str]:
    """Method names (patterns for parametric methods) for help texts."""
    return [*_NAMED, *(shown for _, _, shown in _PATTERNS)]


def _full(name: str, context: MethodContext) -> Method:
    return Method(
        name="full",
        family="full",
        attention="sdpa",
        description="transformers DynamicCache, exact",
        settings={},
        factory="dynamic",
    )


def _pnmix(name: str, context: MethodContext) -> Method:
    params = dict(PNMIX_METHODS[name])
    calibrated = bool(params.get("calibrated", False))
    config = _pnmix_config(params)
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
    description = f"kvlab PN-Mix cache, {config.bits}-bit, key coding {config.key_coding}"
    if config.key_outlier_fraction:
        description += f" with {config.key_outlier_fraction:.0%} exact key outliers"
    if config.value_coding != "per_token":
        description += f", {config.value_coding} values"
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


def _hf_quantized(name: str, context: MethodContext) -> Method:
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
    return Method(
        name=name,
        family="hf-quantized",
        attention="sdpa",
        description=f"transformers QuantizedCache ({backend}, {bits}-bit, per-channel keys)",
        settings=settings,
        factory="hf-quantized",
        params=settings,
    )


def _eviction(match: re.Match[str], context: MethodContext) -> Method:
    from kvlab.integrations.relay_cache import EvictionConfig
    from kvlab.relay.policies import default_policy_settings, legacy_policy, policy_kwargs
    from kvlab.relay.scorers import SCORERS, get_scorer

    name, kind, scorer = match.group(0), match.group("kind"), match.group("scorer")
    if scorer is not None and scorer not in SCORERS:
        raise ValueError(f"method {name!r}: unknown scorer {scorer!r}")
    try:
        ratio = float(match.group("ratio"))
    except ValueError as exc:
        raise ValueError(f"method {name!r}: R is not a number") from exc
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"method {name!r}: R must lie in [0, 1), got {ratio}")
    legacy = kind.endswith("-legacy")
    if kind == "streaming-llm":
        if scorer not in (None, "recency"):
            raise ValueError(f"method {name!r}: streaming-llm always scores by recency")
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
    # package's own text (docs/results.md, section 6, "Policy search"); per-layer budgets need a
    # prefill ratio, so the stream and needle protocols keep uniform layers
    calibrated = not legacy and kind != "streaming-llm" and scorer == "snapkv"
    calibrated = calibrated and "ratio" in params
    if calibrated:
        params["calibrated"] = True
    reconstruction = get_scorer(scorer).needs_reconstruction
    if reconstruction:
        if "ratio" not in params:
            raise ValueError(
                f"method {name!r}: the {scorer} scorer evicts once after the prefill, by a "
                f"reconstruction pass (prefill-score protocol); the {context.protocol} protocol "
                "evicts while streaming"
            )
        params["reconstruction"] = True
    config = EvictionConfig(**_eviction_kwargs(params))  # validates
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


def _composed(match: re.Match[str], context: MethodContext) -> Method:
    name, quantizer = match.group(0), match.group("pnmix")
    if context.protocol != "prefill-score":
        raise ValueError(
            f"method {name!r}: eviction composed with PN-Mix evicts once after the prefill "
            f"(prefill-score protocol); the {context.protocol} protocol's capacity mode would "
            "evict tokens already packed into groups"
        )
    if quantizer not in PNMIX_METHODS:
        raise ValueError(
            f"method {name!r}: unknown PN-Mix method {quantizer!r} after '+'; known: "
            + ", ".join(k for k, v in PNMIX_METHODS.items() if not v.get("calibrated"))
        )
    if PNMIX_METHODS[quantizer].get("calibrated"):
        raise ValueError(
            f"method {name!r}: {quantizer!r} needs its own calibration; compose an uncalibrated "
            "PN-Mix method (e.g. +pn-mix, +kivi-2bit)"
        )
    eviction = parse_method(name[: match.start("pnmix") - 1], protocol=context.protocol)
    if eviction.params.get("reconstruction"):
        raise ValueError(
            f"method {name!r}: the {eviction.settings['scorer']} scorer evicts after a "
            "reconstruction pass that follows the prefill; eviction composed with PN-Mix packs "
            "the kept tokens at the prefill itself (docs/design.md, 'Eviction composed with "
            "PN-Mix'), so it takes a scorer that scores the prefill forward"
        )
    pnmix = _pnmix(quantizer, context)
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


register_method("full", _full)
for _name in PNMIX_METHODS:
    register_method(_name, _pnmix)
for _name in _HF_QUANTIZED:
    register_method(_name, _hf_quantized)
register_pattern(
    r"(?P<kind>relay)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)",
    _eviction,
    "relay[:SCORER]@R",
)
register_pattern(
    r"(?P<kind>evict-no-relay)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)",
    _eviction,
    "evict-no-relay[:SCORER]@R",
)
register_pattern(
    r"(?P<kind>relay-legacy)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)",
    _eviction,
    "relay-legacy[:SCORER]@R",
)
register_pattern(
    r"(?P<kind>evict-no-relay-legacy)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)",
    _eviction,
    "evict-no-relay-legacy[:SCORER]@R",
)
register_pattern(
    r"(?P<kind>relay|evict-no-relay)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)"
    r"\+(?P<pnmix>[a-z0-9-]+)",
    _composed,
    "relay[:SCORER]@R+PNMIX / evict-no-relay[:SCORER]@R+PNMIX",
)
register_pattern(
    r"(?P<kind>streaming-llm)(?::(?P<scorer>[a-z0-9_-]+))?@(?P<ratio>[0-9.]+)",
    _eviction,
    "streaming-llm@R",
)


def takes_ratio(name: str) -> bool:
    """Whether ``name`` is a parametric method that needs ``@R`` appended (a sweep's
    ``ratios``): a registered pattern matches ``name@0.5``."""
    return "@" not in name and any(p.fullmatch(f"{name}@0.5") for p, _, _ in _PATTERNS)


def parse_method(spec: str, *, protocol: str = "prefill-score", cache_slots: int = 2048) -> Method:
    """The :class:`Method` named ``spec`` (module docstring).

    Args:
        spec: a method name.
        protocol: ``"prefill-score"``, ``"stream"`` or ``"needle"`` (decides how eviction
            budgets apply).
        cache_slots: the stream/needle protocol's cache window in tokens per head.

    Raises:
        ValueError: an unknown name, an R outside [0, 1), a scorer that does not exist, or an
            HF ``QuantizedCache`` backend that is not installed.
    """
    name = spec.strip()
    context = MethodContext(protocol=protocol, cache_slots=cache_slots)
    if name in _NAMED:
        return _NAMED[name](name, context)
    for pattern, build, _ in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return build(match, context)
    raise ValueError(f"unknown method {spec!r}; known: {', '.join(available_method_names())}")


def method_backends(method: Method) -> dict[str, str]:
    """The requested attention backend of each kvlab mechanism ``method`` runs: ``"pnmix"``
    (``KVLAB_PNMIX_BACKEND``) for the PN-Mix and composed families, ``"relay"``
    (``KVLAB_RELAY_BACKEND``) for the eviction and composed families; ``{}`` otherwise
    (:func:`kvlab.backends.family_backends`).

    Raises:
        ValueError: a variable that is not a backend name (see :mod:`kvlab.backends`).
    """
    from kvlab.backends import family_backends

    return family_backends(method.family)
