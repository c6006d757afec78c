"""What evaluation asks of a KV cache: :class:`KVLabCache` and its storage result,
:class:`CacheStorage`.

kvlab's model caches (:class:`~kvlab.integrations.PNMixModelCache`,
:class:`~kvlab.integrations.RelayModelCache`,
:class:`~kvlab.integrations.composed_cache.ComposedModelCache`) implement the protocol as
methods; ``kvlab eval`` reads every cache through it (a ``transformers`` cache through the one
adapter :func:`kvlab.evaluation.foreign_cache.describe`), so evaluation never branches on cache
classes. This module imports no cache class (the caches import it).

Storage (docs/design.md, "Byte accounting" of PN-Mix and of RoPE-Relay): the bytes of every
tensor a cache holds for keys and values, the same count with each floating-point element at 2
bytes ("normalized to 16-bit floats"), and bookkeeping indices apart. Each cache's
:meth:`KVLabCache.storage` is the one place its byte model lives (bytes a later accounting
adds, e.g. reserved headroom, go there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "FULL_ATTENTION_KIND",
    "LAYER_KINDS",
    "WINDOW_KIND",
    "CacheStorage",
    "KVLabCache",
    "crop_count",
    "dense_layer_storage",
    "layer_kind",
    "layers_storage",
    "sum_storage",
    "tensor_storage",
]

#: Layer kinds of :attr:`CacheStorage.layer_kinds`: full-attention layers (the ones kvlab
#: compresses) and bounded window layers (sliding/chunked, ``is_sliding``: kept exact, their
#: window only, by every cache).
FULL_ATTENTION_KIND = "full_attention"
WINDOW_KIND = "sliding_window"
LAYER_KINDS = (FULL_ATTENTION_KIND, WINDOW_KIND)


@dataclass(frozen=True)
class CacheStorage:
    """Storage of a KV cache.

    Attributes:
        kv_bytes: bytes of every stored key/value tensor as held (``numel * element_size``).
        kv_bytes_16bit: the same with each floating-point element counted at 2 bytes (integer
            codes counted as stored).
        index_bytes: bookkeeping of the stored tokens (per-token positions and key-padding
            bias of eviction caches).
        held_bytes: bytes the process holds for the cache: every allocated buffer (keys,
            values, their headroom, position and bias buffers, PN-Mix's spare group and
            residual slots), ``>= kv_bytes + index_bytes``; ``None`` where a cache cannot say
            (then taken as ``kv_bytes + index_bytes`` when summed).
        layer_kinds: per layer kind (:data:`LAYER_KINDS`) present, ``{"layers": count,
            "kv_bytes": ..., "kv_bytes_16bit": ...}`` — the same counts over those layers only
            (they add up to ``kv_bytes`` and ``kv_bytes_16bit``); ``None`` where not measured
            per layer.
    """

    kv_bytes: int
    kv_bytes_16bit: int
    index_bytes: int = 0
    held_bytes: int | None = None
    layer_kinds: Mapping[str, Mapping[str, int]] | None = None


@runtime_checkable
class KVLabCache(Protocol):
    """A KV cache as ``kvlab eval`` reads it (``isinstance`` works: runtime-checkable; it checks
    that the members exist, not their signatures).

    Attributes:
        explicit_positions: ``True`` when the cache's RoPE positions are its own (RoPE-Relay's
            synchronized positions, an eviction cache's stream positions): every forward must
            pass ``position_ids=cache.position_ids(num_new)`` so that the model rotates new
            tokens there. ``False`` when they are the model's default (the tokens seen,
            ``get_seq_length``): callers pass nothing.
    """

    explicit_positions: bool

    def position_ids(self, num_new: int, device: torch.device | str | None = None) -> Tensor:
        """The RoPE positions of the next ``num_new`` tokens, int64 ``[B, num_new]`` (a
        cache may answer ``[1, num_new]`` for every sequence at once)."""
        ...

    def rope_position(self) -> int:
        """The RoPE position the next token would get (one sequence).

        Raises:
            ValueError: the sequences of a batch differ (where the cache tracks them apart).
        """
        ...

    def details(self) -> dict[str, Any]:
        """Method-specific facts after a run (JSON-ready: eviction counts, packed-attention
        calls, positions); ``{}`` when the cache has none."""
        ...

    def end_prompt(self) -> None:
        """Close every sequence's prompt: later multi-token forwards (a question after a
        compressed context) are continuations, never part of the prompt an eviction cache
        evicts to its budget (docs/design.md, "Cache life cycle"). A no-op for caches without
        a prompt rule."""
        ...

    def expect_prompt(self, tokens: int) -> None:
        """Mark where the prompt ends: token columns ``tokens`` (the conversation so far
        included). A later forward's tokens after it are decode-phase tokens: the cache
        stores and attends them as the one-token forwards of a plain run would (a
        teacher-forced answer as ``answer``'s decode steps; docs/design.md, "Cache life
        cycle"). A no-op for caches whose multi-token forwards already do (``DynamicCache``).

        Raises:
            ValueError: ``tokens`` not an int >= 1, or fewer than the tokens already seen.
        """
        ...

    def storage(self) -> CacheStorage:
        """What the cache holds now, in bytes (module docstring)."""
        ...


def crop_count(tokens_to_remove: Any) -> int:
    """``Cache.crop``'s argument as the number of tokens to remove: ``transformers``' generate
    passes minus it (``crop(-r)``; ``crop(0)`` removes nothing).

    Raises:
        ValueError: not an int, or positive (the legacy "crop to this length" form).
    """
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
        raise ValueError(f"crop takes an int, got {tokens_to_remove!r}")
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): pass minus the number of tokens to remove, as "
            "transformers' generate does"
        )
    return -int(tokens_to_remove)


def tensor_storage(tensors: Iterable[Tensor]) -> CacheStorage:
    """Bytes of ``tensors`` (each distinct tensor object once): ``numel * element_size``, and
    the same with floating-point elements at 2 bytes; ``index_bytes`` 0."""
    actual = normalized = 0
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        actual += size
        normalized += t.numel() * 2 if t.is_floating_point() else size
    return CacheStorage(kv_bytes=actual, kv_bytes_16bit=normalized, held_bytes=actual)


def dense_layer_storage(layer: Any) -> CacheStorage:
    """Storage of a layer holding plain ``keys`` and ``values`` tensors (``transformers``'
    ``DynamicLayer`` and its subclasses, kvlab's window layers): :func:`tensor_storage` of
    both, zero before the layer is initialized."""
    if layer.is_initialized and layer.keys is not None:
        return tensor_storage([layer.keys, layer.values])
    return CacheStorage(0, 0, held_bytes=0)


def sum_storage(parts: Iterable[CacheStorage]) -> CacheStorage:
    """The field-wise sum of ``parts`` (``CacheStorage(0, 0, 0, 0)`` for none; a part's
    ``held_bytes`` of ``None`` counts as its ``kv_bytes + index_bytes``; ``layer_kinds``
    summed per kind, ``None`` when no part has them)."""
    actual = normalized = index = held = 0
    kinds: dict[str, dict[str, int]] | None = None
    for part in parts:
        actual += part.kv_bytes
        normalized += part.kv_bytes_16bit
        index += part.index_bytes
        held += part.kv_bytes + part.index_bytes if part.held_bytes is None else part.held_bytes
        if part.layer_kinds is not None:
            kinds = {} if kinds is None else kinds
            for kind, counts in part.layer_kinds.items():
                into = kinds.setdefault(kind, {"layers": 0, "kv_bytes": 0, "kv_bytes_16bit": 0})
                for key in into:
                    into[key] += int(counts[key])
    return CacheStorage(
        kv_bytes=actual,
        kv_bytes_16bit=normalized,
        index_bytes=index,
        held_bytes=held,
        layer_kinds=kinds,
    )


def layer_kind(layer: Any) -> str:
    """:data:`WINDOW_KIND` for a bounded window layer (``transformers``' ``is_sliding``:
    ``DynamicSlidingWindowLayer`` and kvlab's ``WindowLayer``), else
    :data:`FULL_ATTENTION_KIND`."""
    return WINDOW_KIND if bool(getattr(layer, "is_sliding", False)) else FULL_ATTENTION_KIND


def layers_storage(pairs: Iterable[tuple[Any, CacheStorage]]) -> CacheStorage:
    """:func:`sum_storage` of per-layer storages ``(layer, storage)``, with
    :attr:`CacheStorage.layer_kinds` filled by :func:`layer_kind` (every layer counted, an
    empty one with 0 bytes)."""

    def tagged(layer: Any, part: CacheStorage) -> CacheStorage:
        counts = {"layers": 1, "kv_bytes": part.kv_bytes, "kv_bytes_16bit": part.kv_bytes_16bit}
        return CacheStorage(
            part.kv_bytes,
            part.kv_bytes_16bit,
            part.index_bytes,
            part.held_bytes,
            layer_kinds={layer_kind(layer): counts},
        )

    return sum_storage(tagged(layer, part) for layer, part in pairs)
