"""RoPE-Relay: heterogeneous per-head eviction, then a relay of the kept keys
(docs/design.md, "RoPE-Relay").

The package holds the mechanism's parts, none of which imports ``transformers``:

* :mod:`~kvlab.relay.core` — the relay itself (:func:`relay`, :func:`relay_attention`): kept
  keys right-aligned at positions ending at one shared endpoint, by pure rotation.
* :mod:`~kvlab.relay.scorers` (with :mod:`~kvlab.relay.expected_attention`,
  :mod:`~kvlab.relay.tova`, :mod:`~kvlab.relay.combined` and :mod:`~kvlab.relay.kvzip`) /
  :mod:`~kvlab.relay.budgets` /
  :mod:`~kvlab.relay.layer_budgets` / :mod:`~kvlab.relay.policies` — the eviction policy:
  which tokens each (layer, kv head) keeps, how a layer's budget is split across heads, how the
  model's budget is split across layers, and the named default policies.
* :mod:`~kvlab.relay.storage` / :mod:`~kvlab.relay.attention` — the ragged storage
  (:class:`RelayStore`: one flat buffer per layer, one segment per (sequence, kv head)) and
  the one-call attention over it (:func:`ragged_attention`).
* :mod:`~kvlab.relay.config` / :mod:`~kvlab.relay.evictor` /
  :mod:`~kvlab.relay.reconstruction` — the eviction's settings (:class:`EvictionConfig`,
  :class:`EvictionEvent`), one layer's eviction on its RelayStore (:class:`Evictor`: budgets,
  protected window, observation window, scores, per-head counts, relay, compaction), and the
  per-sequence steps of a reconstruction pass (KVzip scoring).

The ``transformers`` cache that evicts inside a model's forward is
:class:`kvlab.integrations.RelayModelCache`.
"""

from __future__ import annotations

from kvlab.relay.attention import ragged_attention
from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep

# combined, expected_attention, kvzip and tova register their scorers in SCORERS on import; this
# package always runs first, so SCORERS is complete wherever kvlab.relay.* is imported
from kvlab.relay.combined import CombinedScorer
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.core import EMPTY_POSITION, RelayedCache, relay, relay_attention, relay_logits
from kvlab.relay.evictor import Evictor, window_attention
from kvlab.relay.expected_attention import ExpectedAttentionScorer
from kvlab.relay.kvzip import KVzipScorer, ReconstructionPrompt, reconstruction_attention
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.policies import EvictionPolicy, eviction_policy
from kvlab.relay.reconstruction import ReconstructionSpan
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, get_scorer, scorer_from_settings
from kvlab.relay.storage import PaddedSegments, RelayStore, Segment
from kvlab.relay.tova import TOVAScorer

__all__ = [
    "EMPTY_POSITION",
    "SCORERS",
    "CombinedScorer",
    "EvictionConfig",
    "EvictionEvent",
    "EvictionPolicy",
    "Evictor",
    "ExpectedAttentionScorer",
    "KVzipScorer",
    "PaddedSegments",
    "ReconstructionPrompt",
    "ReconstructionSpan",
    "RelayStore",
    "RelayedCache",
    "ScoreInputs",
    "Scorer",
    "Segment",
    "TOVAScorer",
    "allocate_counts",
    "eviction_policy",
    "get_scorer",
    "protected_mask",
    "pyramid_layer_budgets",
    "ragged_attention",
    "reconstruction_attention",
    "relay",
    "relay_attention",
    "relay_logits",
    "scorer_from_settings",
    "select_keep",
    "split_layer_budget",
    "window_attention",
]
