"""Per-token quality metrics and KV-cache storage accounting for ``kvlab eval``.

* Negative log-likelihood (nats) of the observed next token, and perplexity
  ``exp(mean NLL)`` over the scored tokens.
* ``KL(P_full || P_method)`` in nats per scored token, between the next-token distributions of
  the full-cache reference and the method, computed in float64 from log-softmax outputs:
  ``sum_v p_full(v) (log p_full(v) - log p_method(v))``.
* The 95th percentile is :func:`torch.quantile`'s linear interpolation (NumPy's default).
* Storage: the bytes of every tensor a cache holds for keys and values (codes, scales, exact
  tensors), and the same count with every floating-point element at 2 bytes ("normalized to
  16-bit floats"), so float32 and float16 caches compare at equal precision of their exact
  parts. Bookkeeping indices are reported apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from kvlab.evaluation.foreign_cache import describe
from kvlab.integrations.cache_protocol import CacheStorage  # re-exported: its old home

__all__ = [
    "CacheStorage",
    "cache_storage",
    "kl_divergence",
    "percentile",
    "perplexity",
    "storage_record",
    "token_nll",
]


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """NLL in nats of ``targets`` ``[T]`` (int64) under ``logits`` ``[T, V]``; float64 ``[T]``."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.view(-1, 1)).squeeze(-1)


def kl_divergence(reference_logprobs: Tensor, logits: Tensor) -> Tensor:
    """``KL(P_ref || P)`` in nats per row: ``reference_logprobs`` ``[T, V]`` (log-softmax of the
    reference, any float dtype), ``logits`` ``[T, V]``; float64 ``[T]``, clamped at 0 (removes
    negative rounding residue)."""
    ref = reference_logprobs.double()
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0)


def perplexity(nll: Iterable[float] | Tensor) -> float:
    """``exp(mean NLL)``.

    Raises:
        ValueError: no tokens.
    """
    values = torch.as_tensor(list(nll) if not isinstance(nll, Tensor) else nll, dtype=torch.float64)
    if values.numel() == 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(float(values.mean()))


def percentile(values: Tensor, q: float) -> float:
    """The ``q``-quantile (``0 <= q <= 1``) with linear interpolation (NumPy's default)."""
    return float(torch.quantile(values.double().flatten(), q))


def cache_storage(cache: Any) -> CacheStorage:
    """Measure a cache (:meth:`kvlab.integrations.cache_protocol.KVLabCache.storage`): kvlab's
    :class:`~kvlab.integrations.PNMixModelCache`, :class:`~kvlab.integrations.RelayModelCache`
    and :class:`~kvlab.integrations.composed_cache.ComposedModelCache` measure themselves;
    ``transformers``' ``DynamicCache`` and ``QuantizedCache`` (quanto / hqq) through
    :func:`kvlab.evaluation.foreign_cache.describe`.

    Raises:
        TypeError: an unsupported cache type.
    """
    return describe(cache).storage()


def storage_record(storage: CacheStorage) -> dict[str, Any]:
    """JSON-ready fields of ``storage`` (task results): the byte counts, and per layer kind
    (full-attention and window layers) when the cache reports them."""
    record: dict[str, Any] = {
        "kv_bytes": storage.kv_bytes,
        "kv_bytes_16bit": storage.kv_bytes_16bit,
        "index_bytes": storage.index_bytes,
        "held_bytes": storage.held_bytes,
    }
    kinds = getattr(storage, "layer_kinds", None)
    if kinds is not None:
        record["layer_kinds"] = {kind: dict(counts) for kind, counts in kinds.items()}
    return record
