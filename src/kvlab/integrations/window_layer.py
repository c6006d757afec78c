"""The window layers of kvlab's model caches: :class:`WindowLayer`, an exact sliding-window
(or chunked) layer that keeps only its window (``transformers``' ``DynamicSlidingWindowLayer``),
and :class:`ForwardGuard`, which puts back the window layers a refused forward changed.

Atomic failure (docs/design.md, "Model integration"): a forward's inputs are checked by its
first full-attention layer, which needs the 2-D attention mask that only the attention call
receives. The window layers in front of it (``layer_types`` starting with
``"sliding_attention"``: Gemma 2/3, GPT-OSS, Cohere 2) store their tokens before that, so the
caches give them a :class:`ForwardGuard`: each keeps a reference to what its last ``update``
replaced (no copy: ``update`` never writes a tensor in place), and a refusal by the first
full-attention layer puts them back. A window layer checks its own batch, heads, head_dim and
device before it stores anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from kvlab.integrations.attention import check_attention_kwargs
from kvlab.integrations.cache_protocol import CacheStorage, dense_layer_storage
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["ForwardGuard", "WindowLayer"]


def _frame_offsets(kwargs: Mapping[str, Any], seen: int, new: int) -> Tensor | None:
    """``position_ids[:, -1] - (seen + new - 1)`` per row (``[B]`` int64): how far the model's
    positions for the new tokens are from the layer's own count; ``None`` without usable
    ``position_ids`` (the model did not pass them to ``Cache.update``)."""
    inner = kwargs.get("kwargs")
    ids = inner.get("position_ids") if isinstance(inner, Mapping) else None
    if not isinstance(ids, Tensor) or ids.dim() not in (1, 2) or ids.shape[-1] != new:
        return None
    return ids.reshape(-1, new)[:, -1].to(torch.int64) - (seen + new - 1)


class WindowLayer(DynamicSlidingWindowLayer):
    """Exact sliding-window cache layer of the kvlab model caches.

    ``transformers``' ``DynamicSlidingWindowLayer``: ``update`` returns the last
    ``sliding_window - 1`` cached tokens plus the new ones (plain tensors, read by the dense
    path of the ``"kvlab"`` attention under the layer's window mask) and keeps only the last
    ``sliding_window - 1``; ``get_seq_length`` is the tokens seen.

    Positions (only with ``rotary``, which :class:`~kvlab.integrations.relay_cache.
    RelayModelCache` passes): the model rotates new keys at its ``position_ids``
    (``Cache.get_seq_length`` of layer 0 unless the caller passes them), and a relay cache may
    move the positions of later tokens (RoPE-Relay's synchronized endpoint). If the per-row
    offset between the model's positions and this layer's own token count changes after the
    first forward, the layer stores new keys rotated back into its first frame and returns
    every key rotated into the current one (pure rotations, :func:`kvlab.rope.rotate_by_delta`),
    so distances inside the window stay the tokens' true distances, as in the relay layers. With
    a constant offset (left padding included) nothing is rotated. Without ``rotary`` the layer
    is exactly ``transformers``' (keys stay at the positions the model gave them).

    Refusals (module docstring): ``update`` refuses states that do not fit what the layer
    stores before it changes anything; a layer in front of the model's first full-attention
    layer (``keeps_undo``, set by :class:`ForwardGuard`) keeps what its last ``update``
    replaced until :meth:`keep_update` or :meth:`undo_update`. In a model with no
    full-attention layer, layer 0 (``undo_by_attention``, also set by :class:`ForwardGuard`)
    keeps it too and tags the keys it returns (``_kvlab_window_layer``, a weak reference to
    the layer), so that the ``"kvlab"`` attention, the forward's only check, puts it back when
    it refuses the call and forgets it when it accepts it.

    Args:
        sliding_window: tokens a query sees, itself included (>= 1).
        rotary: the layer's RoPE, or ``None`` (positions are the model's own).
        layer_idx: the decoder layer, for messages.

    Raises:
        ValueError: ``sliding_window < 1``.
    """

    def __init__(
        self,
        sliding_window: int,
        rotary: RotaryConfig | None = None,
        layer_idx: int | None = None,
    ) -> None:
        if isinstance(sliding_window, bool) or int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 token, got {sliding_window!r}")
        super().__init__(sliding_window=int(sliding_window))
        self.rotary = rotary
        self.layer_idx = layer_idx
        self._frame: Tensor | None = None  # per-row offset of the first forward, [B] int64
        self.keeps_undo = False
        self.undo_by_attention = False
        self._undo: dict[str, Any] | None = None

    def _check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor [B, H_kv, T, D]")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                f"key_states {tuple(key_states.shape)} and value_states "
                f"{tuple(value_states.shape)} disagree on batch, heads or tokens"
            )
        if not self.is_initialized or self.keys is None or self.keys.dim() != 4:
            return
        want = (*self.keys.shape[:2], self.keys.shape[3], self.values.shape[3])
        got = (*key_states.shape[:2], key_states.shape[3], value_states.shape[3])
        if got != want or key_states.device != self.keys.device:
            raise ValueError(
                f"sliding-window layer {self.layer_idx} stores [B, H_kv, D, Dv] = {want} on "
                f"{self.keys.device}, got {got} on {key_states.device} (a new batch needs a new "
                "cache or reset())"
            )

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Append ``[B, H_kv, T, D]`` keys and ``[B, H_kv, T, Dv]`` values; return the last
        ``min(seen, sliding_window - 1) + T`` keys and values (see the class docstring).

        Raises:
            ValueError: states of another rank, batch, kv heads, head_dim or device than the
                stored ones; with ``keeps_undo``, attention keywords the ``"kvlab"``
                attention refuses (:func:`kvlab.integrations.attention.check_attention_kwargs`:
                the first full-attention layer would refuse them after this layer stored).
                Nothing changes.
        """
        self._check_states(key_states, value_states)
        if self.keeps_undo:
            inner = kwargs.get("kwargs")
            check_attention_kwargs(inner if isinstance(inner, Mapping) else {})
        if self.keeps_undo or self.undo_by_attention:
            # references only: update replaces the tensors, it never writes into them
            self._undo = {k: v for k, v in vars(self).items() if k != "_undo"}
        shift: Tensor | None = None
        if self.rotary is not None:
            offsets = _frame_offsets(kwargs, self.cumulative_length, key_states.shape[-2])
            if offsets is not None and self._frame is None:
                self._frame = offsets
            elif offsets is not None and self._frame is not None:
                moved = offsets - self._frame
                if bool((moved != 0).any()):
                    shift = moved.to(key_states.device).view(-1, 1, 1)
        if shift is not None:
            assert self.rotary is not None
            key_states = rotate_by_delta(key_states, -shift, self.rotary)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if shift is not None:
            assert self.rotary is not None
            keys = rotate_by_delta(keys, shift, self.rotary)
        if self.undo_by_attention:
            keys._kvlab_window_layer = weakref.ref(self)  # type: ignore[attr-defined]
        return keys, values

    def undo_update(self) -> None:
        """Put back the state before the last ``update`` (nothing if it was kept or undone)."""
        state, self._undo = self._undo, None
        if state is not None:
            vars(self).clear()
            vars(self).update(state, _undo=None)

    def keep_update(self) -> None:
        """Forget what the last ``update`` replaced (its forward was accepted)."""
        self._undo = None

    def reset(self) -> None:
        super().reset()
        self._frame = None
        self._undo = None

    def _select_frame(self, index: Tensor) -> None:
        if self._frame is not None and self._frame.numel() > 1:
            self._frame = self._frame.index_select(0, index.to(self._frame.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_frame(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_frame(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._frame is not None and self._frame.numel() > 1:
            self._frame = self._frame.repeat_interleave(repeats)

    def numel(self) -> int:
        """Stored key and value elements (at most ``sliding_window - 1`` tokens)."""
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.numel() + self.values.numel()

    def nbytes(self) -> int:
        """Bytes of the stored keys and values (``numel * element_size``)."""
        if not self.is_initialized or self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + (
            self.values.numel() * self.values.element_size()
        )

    def storage(self) -> CacheStorage:
        """The window as held (:func:`~kvlab.integrations.cache_protocol.dense_layer_storage`)."""
        return dense_layer_storage(self)


class ForwardGuard:
    """Makes a refused forward change no window layer of a kvlab model cache (module docstring).

    The cache's full-attention layers share one guard. Their ``update`` checks and their
    whole attention call (the forward's input checks, then the first change: a store whose
    eager checks store nothing on failure) run inside :meth:`checking`: a ``ValueError`` puts
    back the last update of every window layer in front of the first full-attention layer (the
    only layers that store before the forward's checks); the first full-attention layer's
    success forgets it, so nothing is held after the forward.

    Args:
        layers: the cache's layers, in decoder order (none: a guard with nothing to undo; no
            full-attention layer: layer 0 is put back by the attention itself, see
            :class:`WindowLayer`).
    """

    def __init__(self, layers: Iterable[CacheLayerMixin] = ()) -> None:
        windows: list[WindowLayer] = []
        for layer in layers:
            if not isinstance(layer, WindowLayer):
                break
            windows.append(layer)
        else:  # no full-attention layer: the kvlab attention of layer 0 is the only check
            if windows:
                windows[0].undo_by_attention = True
            windows = []
        for layer in windows:
            layer.keeps_undo = True
        self.windows = windows

    def checking(
        self, on_refusal: Callable[[], None] | None = None, *, accept: bool = True
    ) -> _Checking:
        """Run a full-attention layer's checks, or its attention call (class docstring).

        Args:
            on_refusal: called first on a refusal (e.g. to drop the layer's stash).
            accept: on success, forget the window layers' undo state (``False`` for checks
                that run before the forward's last check, e.g. in ``update``).

        Returns:
            A context manager; a ``ValueError`` raised inside is re-raised after the window
            layers are put back. (A class, not a generator: it runs twice per layer and
            decode step.)
        """
        return _Checking(self.windows, on_refusal, accept)


class _Checking:
    """The context manager of :meth:`ForwardGuard.checking`."""

    __slots__ = ("accept", "on_refusal", "windows")

    def __init__(
        self, windows: list[WindowLayer], on_refusal: Callable[[], None] | None, accept: bool
    ) -> None:
        self.windows = windows
        self.on_refusal = on_refusal
        self.accept = accept

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        if kind is None:
            if self.accept:
                for layer in self.windows:
                    layer.keep_update()
        elif issubclass(kind, ValueError):
            if self.on_refusal is not None:
                self.on_refusal()
            for layer in self.windows:
                layer.undo_update()
        return False  # never swallow the exception
