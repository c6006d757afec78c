"""RoPE-Relay: heterogeneous per-head eviction, then a relay of the kept keys
(docs/design.md, "RoPE-Relay").

The package holds the mechanism's parts, none of which imports ``transformers``:

* :mod:`~kvlab.relay.core` — the relay itself (:func:`relay`, :func:`relay_attention`): kept
  keys right-aligned at positions ending at one shared endpoint, by pure rotation.
* :mod:`~kvlab.relay.scorers` / :mod:`~kvlab.relay.budgets` — the eviction policy: which
  tokens each (layer, kv head) keeps, and how a layer's budget is split across heads.
* :mod:`~kvlab.relay.storage` / :mod:`~kvlab.relay.attention` — the ragged storage
  (:class:`RelayStore`: one flat buffer per layer, one segment per (sequence, kv head)) and
  the one-call attention over it (:func:`ragged_attention`).

The ``transformers`` cache that evicts inside a model's forward is
:class:`kvlab.integrations.RelayModelCache`.
"""

from __future__ import annotations

from kvlab.relay.attention import ragged_attention
from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.core import EMPTY_POSITION, RelayedCache, relay, relay_attention, relay_logits
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, get_scorer
from kvlab.relay.storage import PaddedSegments, RelayStore, Segment

__all__ = [
    "EMPTY_POSITION",
    "SCORERS",
    "PaddedSegments",
    "RelayStore",
    "RelayedCache",
    "ScoreInputs",
    "Scorer",
    "Segment",
    "allocate_counts",
    "get_scorer",
    "protected_mask",
    "ragged_attention",
    "relay",
    "relay_attention",
    "relay_logits",
    "select_keep",
]
