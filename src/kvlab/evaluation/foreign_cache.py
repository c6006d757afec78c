"""Caches kvlab does not own, read through kvlab's cache protocol: :func:`describe`.

kvlab's model caches implement :class:`~kvlab.integrations.cache_protocol.KVLabCache`
themselves; ``transformers``' caches (``DynamicCache``, ``QuantizedCache`` with the quanto or
hqq backend) get :class:`ForeignCache`. This module is the one place where evaluation knows
about caches that are not kvlab's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvlab.integrations.cache_protocol import (
    CacheStorage,
    KVLabCache,
    dense_layer_storage,
    layers_storage,
    tensor_storage,
)

__all__ = ["ForeignCache", "describe"]


#: Per cache class, whether its instances implement :class:`KVLabCache` (a runtime protocol
#: check costs tens of microseconds; :func:`describe` runs inside timed model calls).
_IMPLEMENTS: dict[type, bool] = {}


def describe(cache: Any) -> KVLabCache:
    """``cache`` itself when it implements :class:`KVLabCache` (kvlab's caches), else a
    :class:`ForeignCache` around it. The check is made once per cache class (the protocol's
    members are class attributes and methods)."""
    kind = type(cache)
    implements = _IMPLEMENTS.get(kind)
    if implements is None:
        implements = _IMPLEMENTS[kind] = isinstance(cache, KVLabCache)
    return cache if implements else ForeignCache(cache)


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


def _quantized_layer_storage(layer: Any) -> CacheStorage:
    """A ``transformers`` ``QuantizedLayer``: its quantized keys and values (every plain tensor
    inside them) and its exact residual keys and values once it holds some."""
    parts = [layer._quantized_keys, layer._quantized_values]
    if layer.keys is not None and layer.keys.dim() == 4:
        parts += [layer.keys, layer.values]
    return tensor_storage(_leaf_tensors(parts))


@dataclass(frozen=True)
class ForeignCache:
    """A ``transformers`` cache (``DynamicCache``, ``QuantizedCache``) as a
    :class:`KVLabCache`: positions are the model's own (the tokens seen), no details.

    Attributes:
        cache: the wrapped cache (``layers``, ``get_seq_length``).
    """

    cache: Any
    explicit_positions: ClassVar[bool] = False

    def position_ids(self, num_new: int, device: torch.device | str | None = None) -> Tensor:
        """The tokens seen onward, int64 ``[1, num_new]`` (the model's default)."""
        start = int(self.cache.get_seq_length())
        return torch.arange(start, start + num_new, dtype=torch.int64, device=device).view(1, -1)

    def rope_position(self) -> int:
        """The tokens seen (``get_seq_length``)."""
        return int(self.cache.get_seq_length())

    def details(self) -> dict[str, Any]:
        """``{}``: a foreign cache reports no method-specific facts."""
        return {}

    def end_prompt(self) -> None:
        """A no-op: a foreign cache has no prompt rule."""

    def expect_prompt(self, tokens: int) -> None:
        """A no-op: a foreign cache's multi-token forward is taken as it comes (exact for
        ``DynamicCache``; ``QuantizedCache`` stores and attends it as one forward)."""

    def storage(self) -> CacheStorage:
        """Every layer's key/value tensors as held (``QuantizedLayer``: quantized and residual
        parts; ``DynamicLayer`` and subclasses: keys and values); no index bytes.

        Raises:
            TypeError: a layer of another kind.
        """
        from transformers.cache_utils import DynamicLayer, QuantizedLayer

        def measure(layer: Any) -> CacheStorage:
            if isinstance(layer, QuantizedLayer):  # a DynamicLayer subclass: checked first
                return _quantized_layer_storage(layer)
            if isinstance(layer, DynamicLayer):
                return dense_layer_storage(layer)
            raise TypeError(f"cannot measure cache layer {type(layer).__name__}")

        return layers_storage((layer, measure(layer)) for layer in self.cache.layers)
