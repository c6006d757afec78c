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
* :mod:`~kvlab.relay.storage` (with :mod:`~kvlab.relay.storage_views`) /
  :mod:`~kvlab.relay.attention` — the ragged storage (:class:`RelayStore`: one flat buffer per
  layer, one segment per (sequence, kv head)), its padded read views, and the one-call
  attention over it (:func:`ragged_attention`).
* :mod:`~kvlab.relay.config` / :mod:`~kvlab.relay.evictor` /
  :mod:`~kvlab.relay.reconstruction` (with :mod:`~kvlab.relay.kvzip_attention`) — the
  eviction's settings (:class:`EvictionConfig`, :class:`EvictionEvent`), one layer's eviction
  on its RelayStore (:class:`Evictor`: budgets, protected window, observation window, scores,
  per-head counts, relay, compaction), and the per-sequence steps of a reconstruction pass
  (KVzip scoring; the pass's attention and scores).

The ``transformers`` cache that evicts inside a model's forward is
:class:`kvlab.integrations.RelayModelCache`.

The package exports what a user needs — the eviction's configuration and policy, the scorers
and their registry, the store and evictor a user builds, the relay and attention entry points;
internals (segments, budget steps, reconstruction steps) are imported from the module that
defines them.
"""

from __future__ import annotations

from kvlab.relay.attention import ragged_attention

# combined, expected_attention, kvzip and tova register their scorers in SCORERS on import; this
# package always runs first, so SCORERS is complete wherever kvlab.relay.* is imported
from kvlab.relay.combined import CombinedScorer
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.core import RelayedCache, relay, relay_attention, relay_logits
from kvlab.relay.evictor import Evictor
from kvlab.relay.expected_attention import ExpectedAttentionScorer
from kvlab.relay.kvzip import KVzipScorer, ReconstructionPrompt
from kvlab.relay.policies import EvictionPolicy, eviction_policy
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, get_scorer, scorer_from_settings
from kvlab.relay.storage import RelayStore
from kvlab.relay.tova import TOVAScorer

__all__ = [
    "SCORERS",
    "CombinedScorer",
    "EvictionConfig",
    "EvictionEvent",
    "EvictionPolicy",
    "Evictor",
    "ExpectedAttentionScorer",
    "KVzipScorer",
    "ReconstructionPrompt",
    "RelayStore",
    "RelayedCache",
    "ScoreInputs",
    "Scorer",
    "TOVAScorer",
    "eviction_policy",
    "get_scorer",
    "ragged_attention",
    "relay",
    "relay_attention",
    "relay_logits",
    "scorer_from_settings",
]
