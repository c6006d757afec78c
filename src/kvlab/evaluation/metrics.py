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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CacheStorage",
    "cache_storage",
    "kl_divergence",
    "percentile",
    "perplexity",
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


@dataclass(frozen=True)
class CacheStorage:
    """Storage of a KV cache.

    Attributes:
        kv_bytes: bytes of every stored key/value tensor as held (``numel * element_size``).
        kv_bytes_16bit: the same with each floating-point element counted at 2 bytes (integer
            codes counted as stored).
        index_bytes: bookkeeping (per-token positions of eviction caches).
    """

    kv_bytes: int
    kv_bytes_16bit: int
    index_bytes: int = 0


def _leaf_tensors(obj: Any) -> Iterator[Tensor]:
    """Plain tensors inside ``obj``: tensors (unwrapping tensor subclasses such as
    optimum-quanto's packed tensors via ``__tensor_flatten__``), lists, tuples, dict values."""
    if isinstance(obj, Tensor):
        if type(obj) is not Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            for name in names:
                yield from _leaf_tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _leaf_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _leaf_tensors(item)


def _storage_of(tensors: Iterable[Tensor]) -> tuple[int, int]:
    actual = normalized = 0
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        actual += size
        normalized += t.numel() * 2 if t.is_floating_point() else size
    return actual, normalized


def cache_storage(cache: Any) -> CacheStorage:
    """Measure a cache: kvlab's :class:`~kvlab.integrations.PNMixModelCache`,
    :class:`~kvlab.integrations.RelayModelCache` and
    :class:`~kvlab.integrations.composed_cache.ComposedModelCache`, ``transformers``'
    ``DynamicCache`` and ``QuantizedCache`` (quanto / hqq).

    Raises:
        TypeError: an unsupported cache type.
    """
    from transformers.cache_utils import DynamicLayer, QuantizedLayer

    from kvlab.integrations.composed_cache import ComposedLayer
    from kvlab.integrations.pnmix_cache import PNMixLayer
    from kvlab.integrations.relay_cache import RelayLayer

    actual = normalized = index = 0
    for layer in cache.layers:
        if isinstance(layer, (PNMixLayer, ComposedLayer)):
            size = layer.nbytes()  # a composed layer: its PN-Mix store (no per-token index)
            actual += size
            normalized += size  # exact parts and scales already stored in 2 bytes
        elif isinstance(layer, RelayLayer):
            actual += layer.nbytes()  # used elements only; headroom is not stored data
            normalized += layer.numel() * 2
            index += layer.index_bytes()
        elif isinstance(layer, QuantizedLayer):
            parts = [layer._quantized_keys, layer._quantized_values]
            if layer.keys is not None and layer.keys.dim() == 4:
                parts += [layer.keys, layer.values]
            a, n = _storage_of(_leaf_tensors(parts))
            actual += a
            normalized += n
        elif isinstance(layer, DynamicLayer):
            if layer.is_initialized and layer.keys is not None:
                a, n = _storage_of([layer.keys, layer.values])
                actual += a
                normalized += n
        else:
            raise TypeError(f"cannot measure cache layer {type(layer).__name__}")
    return CacheStorage(kv_bytes=actual, kv_bytes_16bit=normalized, index_bytes=index)
