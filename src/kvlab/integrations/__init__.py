"""Hugging Face ``transformers`` integration: kvlab caches inside real pretrained models.

Shaped like ``transformers``' ``cache_utils``: layer classes implement one small contract, and
the model caches only choose their layers.

* :mod:`~kvlab.integrations.attention` — the ``"kvlab"`` attention implementation registered in
  ``transformers.AttentionInterface`` (no model code is patched); exact attention over plain
  tensors in :mod:`~kvlab.integrations.dense_attention`.
* :mod:`~kvlab.integrations.layer` — the layer contract (:class:`~kvlab.integrations.layer.
  KVLabLayer`) with the forward, ``update``, ``crop`` and row selection written once; the layer
  classes :mod:`~kvlab.integrations.pnmix_layer`, :mod:`~kvlab.integrations.relay_layer` (its
  eviction side: :mod:`~kvlab.integrations.relay_eviction`),
  :mod:`~kvlab.integrations.composed_layer` and :mod:`~kvlab.integrations.window_layer`.
* :mod:`~kvlab.integrations.model_cache` — what every model cache does whatever its layers;
  the caches :class:`PNMixModelCache` (PN-Mix for every full-attention layer),
  :class:`RelayModelCache` (per-head eviction with RoPE-Relay, or without as a baseline) and
  :class:`ComposedModelCache` (that eviction followed by PN-Mix codes for the kept tokens).
* :mod:`~kvlab.integrations.dense_cache` — :class:`DenseModelCache`: the exact cache at its
  fastest on the CPU (keys and values written in place, one compiled GQA decode call per layer),
  the honest plain baseline of the decode benchmarks.
* :mod:`~kvlab.integrations.model_support` — :func:`plan_model`: which layers a cache compresses
  (full attention), which it keeps as an exact window (:class:`WindowLayer`), what it refuses.
* :mod:`~kvlab.integrations.forward` — one forward through the evicting layers: the stash, the
  input checks and the shared plan.

The eviction policy these caches run (:class:`EvictionConfig`, :class:`kvlab.relay.Evictor`,
scorers, per-head budgets) lives in :mod:`kvlab.relay`.
"""

from __future__ import annotations

from kvlab.integrations.attention import (
    KVLAB_ATTENTION,
    CacheView,
    enable_kvlab_attention,
    kvlab_attention_forward,
    register_kvlab_attention,
    use_attention,
)
from kvlab.integrations.composed_cache import ComposedModelCache
from kvlab.integrations.dense_cache import DenseModelCache
from kvlab.integrations.model_support import ModelPlan, WindowLayer, plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache, pnmix_config_for_model
from kvlab.integrations.relay_cache import RelayModelCache
from kvlab.relay.config import EvictionConfig, EvictionEvent

# "kvlab" is a name transformers knows once this package is imported: from_pretrained(...,
# attn_implementation="kvlab") and model.set_attn_implementation("kvlab") work
register_kvlab_attention()

__all__ = [
    "KVLAB_ATTENTION",
    "CacheView",
    "ComposedModelCache",
    "DenseModelCache",
    "EvictionConfig",
    "EvictionEvent",
    "ModelPlan",
    "PNMixModelCache",
    "RelayModelCache",
    "WindowLayer",
    "enable_kvlab_attention",
    "kvlab_attention_forward",
    "plan_model",
    "pnmix_config_for_model",
    "register_kvlab_attention",
    "use_attention",
]
