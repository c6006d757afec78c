"""Named eviction policies: the defaults of ``kvlab eval``'s eviction methods, and the policy
they replaced (kept so that earlier rows stay reproducible).

A policy is a set of :class:`kvlab.integrations.EvictionConfig` keyword arguments besides the
budget (``ratio``/``capacity``), ``relay`` and ``allocation``. The default was chosen by the
search in docs/archive/results-history.md (section 6, "Policy search", issue 9) on SmolLM2-135M
and *Hamlet*:

* ``window_fraction`` 0.75 — three quarters of each layer's per-head budget is the protected
  recent window (with 4 sink tokens); the scorer fills the rest. It is also SnapKV's
  observation window. The pre-search policy protected 32 tokens.
* ExpectedAttention keeps kvpress's policy (4 sinks, no protected window, uniform per-head
  budgets): on the same windows it gives kvpress's KL to five digits, and neither a protected
  window nor adaptive budgets improved it.
* per-layer budgets for SnapKV: ``kvlab eval``'s ``relay:snapkv`` / ``evict-no-relay:snapkv``
  (prefill-score) calibrate them on the package's own text before the run
  (:func:`kvlab.integrations.relay_calibration.calibrate_layer_budgets`) and pass the kept
  fractions as ``EvictionConfig.layer_budget``; this module's dicts hold the rest.
* KVzip (:mod:`kvlab.relay.kvzip`): kvpress's ``KVzipPress`` policy, which keeps exactly
  ``KVzipPress``'s kept set (docs/archive/results-history.md 12.5.2): the model's whole budget
  to the top reconstruction scores over every layer and kv head (``layer_budget="scores"``,
  KVzip's cross-layer selection), no protected recent window (``window_tokens=0``; 4 sinks),
  the reconstruction queries only. Chosen for issue 40 by the rule of
  docs/results/runs/kvzip-policy-seed0/DECISION_RULE.md on RULER seed 0 (docs/results.md,
  section 1). The policy it replaced (section 7's search: a protected window of 3/8 of each
  head's budget, 3/4 of the budget split by the scores, the prefill's last 128 queries scored
  too) is :data:`PREVIOUS_POLICIES` ``["kvzip"]``.
* SnapKV scores are multiplied by the value norm (``SnapKVScorer(value_norm=True)``, the
  value-norm rescaling of ExpectedAttention and CriticalKV), max-pooled over 7 tokens and
  compared across heads (adaptive per-head budgets, Ada-KV).

A policy is one frozen :class:`EvictionPolicy` (:data:`DEFAULT_POLICIES`,
:func:`eviction_policy`). It has one settings shape, its JSON-ready form
(:meth:`EvictionPolicy.settings`, :func:`default_policy_settings`, :func:`legacy_policy`; a
scorer with options is ``"scorer"`` + ``"scorer_options"``, the keyword arguments of its class in
:data:`kvlab.relay.SCORERS`), which ``kvlab eval`` records and hashes; its ``EvictionConfig``
keyword arguments (:meth:`EvictionPolicy.kwargs`, :func:`default_policy`,
:func:`policy_kwargs`) hold the scorer object, built once
(:func:`kvlab.relay.scorers.scorer_from_settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvlab.relay.scorers import Scorer, scorer_from_settings

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_WINDOW_FRACTION",
    "PREVIOUS_POLICIES",
    "EvictionPolicy",
    "default_policy",
    "default_policy_settings",
    "eviction_policy",
    "legacy_policy",
    "policy_kwargs",
]

#: Protected recent window as a share of each layer's per-head budget (default policy).
DEFAULT_WINDOW_FRACTION = 0.75


@dataclass(frozen=True)
class EvictionPolicy:
    """An eviction policy: the scorer and its options, and the ``EvictionConfig`` settings the
    policy fixes besides the budget (``ratio`` / ``capacity``). ``None`` leaves a setting at
    ``EvictionConfig``'s default and out of :meth:`settings`.

    Attributes:
        scorer: a name of :data:`kvlab.relay.SCORERS`.
        scorer_options: the scorer class's keyword arguments, or ``None`` for its defaults.
        window_tokens, window_fraction, layer_budget, scores_share, relay, allocation: as in
            :class:`kvlab.relay.config.EvictionConfig`.

    Raises:
        ValueError: an unknown scorer or options it refuses (checked at construction).
    """

    scorer: str
    scorer_options: Mapping[str, Any] | None = None
    window_tokens: int | None = None
    window_fraction: float | None = None
    layer_budget: str | None = None
    scores_share: float | None = None
    relay: bool | None = None
    allocation: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_scorer", scorer_from_settings(self.scorer, self.scorer_options))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> EvictionPolicy:
        """The policy of JSON-ready ``settings`` (:meth:`settings`'s form).

        Raises:
            ValueError: a key that is not a policy setting, or see the class.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"not eviction policy settings: {unknown}")
        return cls(**settings)

    def settings(self) -> dict[str, Any]:
        """The JSON-ready form that ``kvlab eval`` records and hashes: ``"scorer"`` and every
        setting that is not ``None``, in field order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = dict(value) if f.name == "scorer_options" else value
        return out

    def scorer_object(self) -> Scorer:
        """The scorer (built once, at construction)."""
        return self._scorer  # type: ignore[attr-defined, no-any-return]

    def kwargs(self) -> dict[str, Any]:
        """``EvictionConfig`` keyword arguments: :meth:`settings` with the scorer object in
        place of ``"scorer"`` + ``"scorer_options"`` (the name stays when there are no
        options)."""
        kwargs = self.settings()
        if kwargs.pop("scorer_options", None) is not None:
            kwargs["scorer"] = self.scorer_object()
        return kwargs


#: The default policy of each scorer (module docstring). Recency keeps sinks + the newest
#: tokens whatever the window, so it keeps the plain settings.
DEFAULT_POLICIES: dict[str, EvictionPolicy] = {
    "recency": EvictionPolicy("recency"),
    # kvpress's ExpectedAttentionPress policy: 4 sinks, no protected window, uniform budgets
    # (the scorer's default allocation); a protected window measured worse
    "expected-attention": EvictionPolicy("expected-attention", window_tokens=0),
    # kvpress's KVzipPress policy: the whole budget to the top scores over every layer and kv
    # head, no protected window (module docstring; issue 40)
    "kvzip": EvictionPolicy("kvzip", window_tokens=0, layer_budget="scores"),
    "snapkv": EvictionPolicy(
        "snapkv",
        scorer_options={"kernel_size": 7, "pooling": "max", "value_norm": True},
        window_fraction=DEFAULT_WINDOW_FRACTION,
    ),
}


#: Defaults a later choice replaced, kept so that the rows they made can be rerun: KVzip's
#: policy of docs/archive/results-history.md section 7 (a protected window of 3/8 of each
#: head's budget, 3/4 of the budget split across layers by the scores, the prefill's last 128
#: queries scored too), the default until issue 40 (docs/results.md section 1's rows).
PREVIOUS_POLICIES: dict[str, EvictionPolicy] = {
    "kvzip": EvictionPolicy(
        "kvzip",
        scorer_options={"prefill_queries": 128},
        window_fraction=0.375,
        layer_budget="scores",
        scores_share=0.75,
    ),
}


def eviction_policy(scorer: str) -> EvictionPolicy:
    """The default :class:`EvictionPolicy` for the scorer ``scorer`` (a name of
    :data:`kvlab.relay.SCORERS`): :data:`DEFAULT_POLICIES`, else the scorer with the default
    protected window fraction.

    Raises:
        ValueError: an unknown scorer.
    """
    policy = DEFAULT_POLICIES.get(scorer)
    if policy is None:
        policy = EvictionPolicy(scorer, window_fraction=DEFAULT_WINDOW_FRACTION)
    return policy


def default_policy_settings(scorer: str) -> dict[str, Any]:
    """The default policy for the scorer ``scorer`` as JSON-ready settings
    (:meth:`EvictionPolicy.settings` of :func:`eviction_policy`)."""
    return eviction_policy(scorer).settings()


def policy_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments from JSON-ready policy settings: ``"scorer"`` +
    ``"scorer_options"`` become the scorer object ``SCORERS[scorer](**scorer_options)``
    (:func:`kvlab.relay.scorers.scorer_from_settings`); the other entries pass through (a
    method's budget and flags included).

    Raises:
        ValueError: ``scorer_options`` for a scorer name not in :data:`kvlab.relay.SCORERS`.
    """
    kwargs = dict(settings)
    options = kwargs.pop("scorer_options", None)
    if options is not None:
        kwargs["scorer"] = scorer_from_settings(kwargs.get("scorer"), options)  # type: ignore[arg-type]
    return kwargs


def default_policy(scorer: str) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments of the default policy for the scorer ``scorer``
    (:meth:`EvictionPolicy.kwargs` of :func:`eviction_policy`)."""
    return eviction_policy(scorer).kwargs()


def legacy_policy(scorer: str) -> dict[str, Any]:
    """The policy before the per-head policy search of issue 9 (``EvictionConfig``'s own
    defaults): a 32-token protected recent window that is also SnapKV's observation window,
    SnapKV max-pooled over 7 tokens and summed over the GQA group, no value norm. Reproduces
    the earlier rows of docs/archive/results-history.md exactly (section 1; checked in section
    6, "Output"). JSON-ready and ``EvictionConfig`` keyword arguments at once."""
    return {"scorer": scorer}
