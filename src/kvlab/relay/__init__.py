"""RoPE-Relay: heterogeneous per-head eviction, then a relay of the kept keys (docs/design.md).

The package holds the mechanism's three parts, none of which imports ``transformers``:

* :mod:`~kvlab.relay.core` — the relay itself (:func:`relay`, :func:`relay_attention`): kept
  keys right-aligned at positions ending at one shared endpoint, by pure rotation.
* :mod:`~kvlab.relay.scorers` / :mod:`~kvlab.relay.budgets` — the eviction policy: which
  tokens each (layer, kv head) keeps, and how a layer's budget is split across heads.

The ``transformers`` cache that evicts inside a model's forward is
:class:`kvlab.integrations.RelayModelCache`.
"""

from __future__ import annotations

from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.core import EMPTY_POSITION, RelayedCache, relay, relay_attention, relay_logits
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, get_scorer

__all__ = [
    "EMPTY_POSITION",
    "SCORERS",
    "RelayedCache",
    "ScoreInputs",
    "Scorer",
    "allocate_counts",
    "get_scorer",
    "protected_mask",
    "relay",
    "relay_attention",
    "relay_logits",
    "select_keep",
]
