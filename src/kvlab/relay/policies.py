"""Named eviction policies: the defaults of ``kvlab eval``'s eviction methods, and the policy
they replaced (kept so that earlier rows stay reproducible).

A policy is a set of :class:`kvlab.integrations.EvictionConfig` keyword arguments besides the
budget (``ratio``/``capacity``), ``relay`` and ``allocation``. The default was chosen by the
search in docs/results.md ("Eviction policy search", issue 9) on SmolLM2-135M and *Hamlet*:

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
* SnapKV scores are multiplied by the value norm (``SnapKVScorer(value_norm=True)``, the
  value-norm rescaling of ExpectedAttention and CriticalKV), max-pooled over 7 tokens and
  compared across heads (adaptive per-head budgets, Ada-KV).
"""

from __future__ import annotations

from typing import Any

from kvlab.relay.scorers import SnapKVScorer

__all__ = ["DEFAULT_WINDOW_FRACTION", "default_policy", "legacy_policy"]

#: Protected recent window as a share of each layer's per-head budget (default policy).
DEFAULT_WINDOW_FRACTION = 0.75


def default_policy(scorer: str) -> dict[str, Any]:
    """``EvictionConfig`` keyword arguments of the default policy for the scorer ``scorer``
    (a name of :data:`kvlab.relay.SCORERS`). Recency keeps sinks + the newest tokens whatever
    the window, so it keeps the plain settings."""
    if scorer == "recency":
        return {"scorer": "recency"}
    if scorer == "expected-attention":
        # kvpress's ExpectedAttentionPress policy: 4 sinks, no protected window, uniform budgets
        # (the scorer's default allocation); a protected window measured worse
        return {"scorer": "expected-attention", "window_tokens": 0}
    if scorer == "snapkv":
        return {
            "scorer": SnapKVScorer(7, pooling="max", value_norm=True),
            "window_fraction": DEFAULT_WINDOW_FRACTION,
        }
    return {"scorer": scorer, "window_fraction": DEFAULT_WINDOW_FRACTION}


def legacy_policy(scorer: str) -> dict[str, Any]:
    """The policy before the issue-9 search (``EvictionConfig``'s own defaults): a 32-token
    protected recent window that is also SnapKV's observation window, SnapKV max-pooled over 7
    tokens and summed over the GQA group, no value norm. Reproduces the earlier rows of
    docs/results.md exactly."""
    return {"scorer": scorer}
