"""RoPE-Relay: heterogeneous per-head eviction, then a relay of the kept keys (docs/design.md).

The package holds the mechanism's three parts, none of which imports ``transformers``:

* :mod:`~kvlab.relay.core` — the relay itself (:func:`relay`, :func:`relay_attention`): kept
  keys right-aligned at positions ending at one shared endpoint, by pure rotation.
* :mod:`~kvlab.relay.scorers` (with :mod:`~kvlab.relay.expected_attention` and
  :mod:`~kvlab.relay.tova`) / :mod:`~kvlab.relay.budgets` / :mod:`~kvlab.relay.layer_budgets`
  — the eviction policy: which tokens each (layer, kv head) keeps, how a layer's budget is
  split across heads, and how the model's budget is split across layers.

The ``transformers`` cache that evicts inside a model's forward is
:class:`kvlab.integrations.RelayModelCache`.
"""

from __future__ import annotations

from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep

# combined, expected_attention and tova register their scorers in SCORERS on import; this
# package always runs first, so SCORERS is complete wherever kvlab.relay.* is imported
from kvlab.relay.combined import CombinedScorer
from kvlab.relay.core import EMPTY_POSITION, RelayedCache, relay, relay_attention, relay_logits
from kvlab.relay.expected_attention import ExpectedAttentionScorer
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, get_scorer
from kvlab.relay.tova import TOVAScorer

__all__ = [
    "EMPTY_POSITION",
    "SCORERS",
    "CombinedScorer",
    "ExpectedAttentionScorer",
    "RelayedCache",
    "ScoreInputs",
    "Scorer",
    "TOVAScorer",
    "allocate_counts",
    "get_scorer",
    "protected_mask",
    "pyramid_layer_budgets",
    "relay",
    "relay_attention",
    "relay_logits",
    "select_keep",
    "split_layer_budget",
]
