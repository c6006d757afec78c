"""The exact cache at its fastest on the CPU: :class:`DenseModelCache`, a ``DynamicCache`` whose
full-attention layers keep their keys and values in buffers with room to grow and attend decode
steps with one compiled call per layer (docs/benchmarks.md, "Decode on the CPU against the
bytes limit").

``transformers``' ``DynamicCache`` under the ``"sdpa"`` attention (the ``full`` method) pays
twice per decode step and layer for being general: ``update`` concatenates the new token to the
whole cache (every stored byte read and written again), and PyTorch's CPU SDPA with
``enable_gqa`` reads the keys and values once per query head. :class:`DenseLayer` writes the
new token in place (the buffers grow by about 1/16 when full, an amortized copy) and returns a
:class:`DenseView`, which the ``"kvlab"`` attention reads: a single-token forward on the CPU in
float32 (no soft-cap, sinks or window) runs :func:`kvlab.relay.kernels.cpu.dense_decode_cpu`,
which reads each kv head's keys and values once for all its query heads; everything else
(prefill, other devices and dtypes, padding, the other attention features) runs
:func:`kvlab.integrations.dense_attention.dense_causal_attention` over the same stored tensors.
The stored keys and values are the model's own (nothing is rounded or dropped): attention
agrees with ``full`` to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvlab.integrations.attention import CacheView, outputs_unused, unused_output
from kvlab.integrations.dense_attention import dense_causal_attention
from kvlab.relay.kernels import cpu as relay_cpu

__all__ = ["DenseLayer", "DenseModelCache", "DenseView"]

#: spare token slots allocated past the stored tokens: at least this many, and at least
#: 1/16 of them (a decode step copies the buffers about once in ``n / 16`` steps)
MIN_HEADROOM = 256


def _capacity(tokens: int) -> int:
    return tokens + max(MIN_HEADROOM, tokens // 16)


class DenseView(CacheView):
    """What :meth:`DenseLayer.update` returns for the key and the value slot: the layer's stored
    tokens, attended exactly (module docstring)."""

    supported_features: ClassVar[frozenset[str]] = frozenset({"softcap", "s_aux", "sliding_window"})
    supports_padding: ClassVar[bool] = True

    def __init__(self, layer: DenseLayer) -> None:
        self.layer = layer

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """Exact attention of ``query`` ``[B, H_q, Q, D]`` over the layer's tokens (the last
        ``Q`` its own), ``[B, H_q, Q, Dv]`` in the query dtype."""
        keys, values = self.layer.keys, self.layer.values
        assert keys is not None and values is not None
        softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
        window = kwargs.get("sliding_window")
        if query.shape[2] > 1 and outputs_unused():  # a replayed prefill: nothing reads it
            return unused_output(query, values.shape[-1])
        if (
            query.shape[2] == 1
            and softcap is None
            and s_aux is None
            and window is None
            and query.device.type == "cpu"
            and query.dtype == keys.dtype == torch.float32
            and (attention_mask is None or _all_kept(attention_mask))
        ):
            module_ = relay_cpu.load()
            if module_ is not None:
                return relay_cpu.dense_decode_cpu(
                    module_, query, keys, values, keys.shape[2], scaling
                )
        return dense_causal_attention(
            query,
            keys,
            values,
            scaling=scaling,
            attention_mask=attention_mask,
            sliding_window=window,
            softcap=softcap,
            s_aux=s_aux,
        )


def _all_kept(mask: Tensor) -> bool:
    """Whether a 2-D keep mask marks every column (one host read)."""
    return mask.dim() == 2 and bool(mask.bool().all())


class DenseLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores into buffers with spare room (``[B, H_kv, capacity, D]``)
    and returns :class:`DenseView` objects from :meth:`update`; :attr:`keys` and :attr:`values`
    are views of the stored tokens (``[B, H_kv, T, D]``), so ``transformers``' own crop and
    row selection read them as a ``DynamicLayer``'s."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key_buffer: Tensor | None = None
        self._value_buffer: Tensor | None = None

    @property
    def capacity(self) -> int:
        """Token slots of the buffers (stored tokens plus spare room; 0 before the first)."""
        return 0 if self._key_buffer is None else int(self._key_buffer.shape[2])

    def _store(self, keys: Tensor, values: Tensor, capacity: int) -> None:
        """New buffers of ``capacity`` token slots holding ``keys`` / ``values``."""
        b, h, n, d = keys.shape
        self._key_buffer = keys.new_empty((b, h, capacity, d))
        self._value_buffer = values.new_empty((b, h, capacity, values.shape[-1]))
        self._key_buffer[:, :, :n].copy_(keys)
        self._value_buffer[:, :, :n].copy_(values)
        self._view(n)

    def _view(self, n: int) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys = self._key_buffer[:, :, :n]
        self.values = self._value_buffer[:, :, :n]

    def update(  # type: ignore[override]
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[DenseView, DenseView]:
        """Append ``[B, H_kv, T, D]`` keys and ``[B, H_kv, T, Dv]`` values (in place while the
        buffers have room); return the layer's :class:`DenseView` for both slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        new = key_states.shape[2]
        buffer = self._key_buffer
        if (
            n == 0
            or buffer is None
            or n + new > buffer.shape[2]
            or buffer.shape[:2] != key_states.shape[:2]
        ):
            assert self.keys is not None and self.values is not None
            keys = torch.cat([self.keys, key_states], dim=-2) if n else key_states
            values = torch.cat([self.values, value_states], dim=-2) if n else value_states
            self._store(keys, values, _capacity(n + new))
        else:
            assert self._value_buffer is not None
            buffer[:, :, n : n + new].copy_(key_states)
            self._value_buffer[:, :, n : n + new].copy_(value_states)
            self._view(n + new)
        view = DenseView(self)
        return view, view

    def _rebuffer(self) -> None:
        """After ``transformers``' row selection or crop replaced :attr:`keys`: buffers again."""
        if self.keys is not None and self.keys.numel():
            assert self.values is not None
            self._store(self.keys, self.values, _capacity(self.keys.shape[2]))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self._key_buffer is not None and self.keys is not None:
            self._view(self.keys.shape[2])  # still views of the buffers

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rebuffer()

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._rebuffer()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rebuffer()

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


class DenseModelCache(DynamicCache):
    """``transformers``' ``DynamicCache`` for ``config`` with every ``DynamicLayer`` (its
    full-attention layers) a :class:`DenseLayer` (module docstring); sliding-window layers stay
    ``transformers``' own. Run the model with the ``"kvlab"`` attention
    (:func:`kvlab.integrations.use_attention`): a :class:`DenseView` is not a tensor, so another
    attention implementation refuses it with a ``TypeError``.

    Args:
        config: the model's config (its text config's ``layer_types``).
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.layers = [DenseLayer() if type(x) is DynamicLayer else x for x in self.layers]
