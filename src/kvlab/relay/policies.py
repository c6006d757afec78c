"""Named eviction policies: the defaults of ``kvlab eval``'s eviction methods, and the policy
they replaced (kept so that earlier rows stay reproducible).

A policy is a set of :class:`kvlab.integrations.EvictionConfig` keyword arguments besides the
budget (``ratio``/``capacity``), ``relay`` and ``allocation``. The default was chosen by the
search in docs/results.md (section 6, "Policy search", issue 9) on SmolLM2-135M and *Hamlet*:

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
* KVzip (:mod:`kvlab.relay.kvzip`): three quarters of the model's budget split across layers
  by the scores (``layer_budget="scores"``, ``scores_share`` 0.75; KVzip's own cross-layer
  selection is share 1), the prefill's last 128 queries scored with the reconstruction pass's
  (``KVzipScorer(prefill_queries=128)``), a protected recent window of 3/8 of each layer's
  per-head budget (``window_fraction`` 0.375); docs/results.md section 7 has the search. With
  ``window_tokens=0`` and nothing else the policy reproduces kvpress's ``KVzipPress``.
* SnapKV scores are multiplied by the value norm (``SnapKVScorer(value_norm=True)``, the
  value-norm rescaling of ExpectedAttention and CriticalKV), max-pooled over 7 tokens and
  compared across heads (adaptive per-head budgets, Ada-KV).

Policies exist in two forms: JSON-ready settings (:func:`default_policy_settings`,
:func:`legacy_policy`; a scorer with options is ``"scorer"`` + ``"scorer_options"``, the
keyword arguments of its class in :data:`kvlab.relay.SCORERS`), which ``kvlab eval`` records
and hashes, and ``EvictionConfig`` keyword arguments (:func:`default_policy`,
:func:`policy_kwargs`), with the scorer object built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlab.relay.scorers import SCORERS

__all__ = [
    "DEFAULT_WINDOW_FRACTION",
    "default_policy",
    "default_policy_settings",
    "legacy_policy",
    "policy_kwargs",
]

#: Protected recent window as a share of each layer's per-head budget (default policy).
DEFAULT_WINDOW_FRACTION = 0.75


def default_policy_settings(scorer: str) -> dict[str, Any]:
    """The default policy for the scorer ``scorer`` (a name of :data:`kvlab.relay.SCORERS`) as
    JSON-ready settings (module docstring). Recency keeps sinks + the newest tokens whatever
    the window, so it keeps the plain settings."""
    if scorer == "recency":
        return {"scorer": "recency"}
    if scorer == "expected-attention":
        # kvpress's ExpectedAttentionPress policy: 4 sinks, no protected window, uniform budgets
        # (the scorer's default allocation); a protected window measured worse
        return {"scorer": "expected-attention", "window_tokens": 0}
    if scorer == "kvzip":
        # KVzip's cross-layer selection (three quarters of the model's budget to the top scores
        # over every layer and head, the rest uniform), the prefill's last 128 queries joined
        # to the reconstruction queries, a protected recent window of 3/8 of each layer's
        # per-head budget (docs/results.md, section 7)
        return {
            "scorer": "kvzip",
            "scorer_options": {"prefill_queries": 128},
            "window_fraction": 0.375,
            "layer_budget": "scores",
            "scores_share": 0.75,
        }
    if scorer == "snapkv":
        return {
            "scorer": "snapkv",
            "scorer_options": {"kernel_size": 7, "pooling": "max", "value_norm": True},
            "window_fraction": DEFAULT_WINDOW_FRACTION,
        }
    return {"scorer": scorer, "window_fraction": DEFAULT_WINDOW_FRACTION}


def policy_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments from JSON-ready policy settings: ``"scorer"`` +
    ``"scorer_options"`` become the scorer object ``SCORERS[scorer](**scorer_options)``; the
    other entries pass through.

    Raises:
        ValueError: ``scorer_options`` for a scorer name not in :data:`kvlab.relay.SCORERS`.
    """
    kwargs = dict(settings)
    options = kwargs.pop("scorer_options", None)
    if options is not None:
        name = kwargs.get("scorer")
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; choose one of {sorted(SCORERS)}")
        kwargs["scorer"] = SCORERS[name](**options)
    return kwargs


def default_policy(scorer: str) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments of the default policy for the scorer ``scorer``
    (:func:`default_policy_settings` with the scorer object built)."""
    return policy_kwargs(default_policy_settings(scorer))


def legacy_policy(scorer: str) -> dict[str, Any]:
    """The policy before the issue-9 search (``EvictionConfig``'s own defaults): a 32-token
    protected recent window that is also SnapKV's observation window, SnapKV max-pooled over 7
    tokens and summed over the GQA group, no value norm. Reproduces the earlier rows of
    docs/results.md exactly. JSON-ready and ``EvictionConfig`` keyword arguments at once."""
    return {"scorer": scorer}
