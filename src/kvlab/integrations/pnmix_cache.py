"""PN-Mix as a ``transformers`` cache: one :class:`kvlab.pnmix.PNMixCache` per decoder layer.

``PNMixModelCache(model.config, PNMixConfig(...))`` is a ``transformers.Cache`` usable as
``model(..., cache=cache)`` and in ``model.generate(..., cache=cache)``. Each layer's
``update`` appends the new (already rotated) keys and values to the layer's PN-Mix storage
(exact sinks, exact residual, packed codes for the rest) and returns a :class:`PNMixView`;
the ``"kvlab"`` attention function (:mod:`kvlab.integrations.attention`) then calls
:func:`kvlab.pnmix.pnmix_attention`, which reads the packed codes directly — the cache is never
dequantized as a whole. The one exception is the prefill (the first forward into an empty
cache, more than one token): by default it attends to its freshly computed keys and values
exactly and stores them packed, as ``transformers``' ``QuantizedCache`` and KIVI do
(``exact_prefill=False`` makes the prefill read its own codes too). Switch the model to that
attention first: :func:`kvlab.integrations.enable_kvlab_attention`.

Beam search: ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
row-select every buffer (exact tensors, packed codes, scales, packed mix mask) with
:meth:`PNMixCache.select_batch`; nothing is re-quantized, so a reorder is bit-exact.
``crop`` (assisted decoding) is not supported: codes already written are never rewritten.

Per-layer group sizes: ``layer_group_tokens`` gives each decoder layer its own
``group_tokens`` (everything else as ``config``), e.g. an allocation from
:func:`kvlab.integrations.pnmix_calibration.calibrate_group_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.attention import CacheView, dense_causal_attention
from kvlab.integrations.model_support import layer_rotary, plan_model
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

__all__ = ["PNMixLayer", "PNMixModelCache", "PNMixView", "pnmix_config_for_model"]


def pnmix_config_for_model(model_config: Any, base: PNMixConfig | None = None) -> PNMixConfig:
    """``base`` (default ``PNMixConfig()``) with ``rotary_dim`` and ``rotary_layout`` taken from
    the RoPE of the model's full-attention layers
    (:func:`kvlab.integrations.model_support.layer_rotary`), so that Phase–Norm pairs are the
    model's true rotary pairs (partial rotary and interleaved layouts included).

    Raises:
        ValueError: the config has no supported RoPE (see ``RotaryConfig.from_hf_config``).
    """
    base = base or PNMixConfig()
    rotary = layer_rotary(model_config)  # model-matrix: per-layer-type RoPE (Gemma 3)
    return dataclasses.replace(base, rotary_dim=rotary.rotary_dim, rotary_layout=rotary.layout)


class PNMixView(CacheView):
    """Returned by :meth:`PNMixLayer.update`; attends over the layer's packed storage.

    ``exact`` holds the forward's own keys and values when they were the layer's first tokens
    and the layer's ``exact_prefill`` is on: the prefill then attends to them exactly (they are
    stored packed for every later token), as ``transformers``' ``QuantizedCache`` and KIVI do.
    """

    # model-matrix: Gemma 2 logit soft-capping and GPT-OSS learned sinks (kvlab.attention_logits)
    supported_features = frozenset({"softcap", "s_aux"})

    def __init__(self, layer: PNMixLayer, exact: tuple[Tensor, Tensor] | None = None) -> None:
        self.layer = layer
        self.exact = exact

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """:func:`kvlab.pnmix.pnmix_attention` (causal, bottom-right aligned) of ``query``
        ``[B, H_q, Q, D]`` — or exact attention over the prefill's own keys (see the class
        docstring); returns ``[B, H_q, Q, Dv]`` in the query dtype."""
        softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")  # model-matrix
        if self.exact is not None:
            keys, values = self.exact
            return dense_causal_attention(
                query, keys, values, scaling=scaling, softcap=softcap, s_aux=s_aux
            )
        store = self.layer.store
        if store is None:
            raise RuntimeError("PNMixView used before its layer received any token")
        return pnmix_attention(
            query, store, scale=scaling, causal=True, logit_softcap=softcap, sink_logits=s_aux
        ).to(query.dtype)


class PNMixLayer(CacheLayerMixin):
    """One decoder layer's PN-Mix cache (a ``transformers`` cache layer).

    The :class:`kvlab.pnmix.PNMixCache` (``store``) is created lazily from the first keys:
    batch size, ``num_key_value_heads``, ``head_dim`` and value head dim are read from them.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, config: PNMixConfig, exact_prefill: bool = True) -> None:
        super().__init__()
        self.config = config
        self.exact_prefill = exact_prefill
        self.store: PNMixCache | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.store = PNMixCache(
            self.config,
            batch_size=batch,
            num_key_value_heads=heads,
            head_dim=head_dim,
            value_head_dim=value_states.shape[-1],
            device=key_states.device,
        )
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[PNMixView, PNMixView]:
        """Append ``[B, H_kv, T, D]`` keys (rotated) and ``[B, H_kv, T, Dv]`` values; return
        the view (twice: the key and the value slot)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        first = self.store.seq_length == 0 and key_states.shape[2] > 1
        self.store.append(key_states, value_states)
        exact = (key_states, value_states) if first and self.exact_prefill else None
        view = PNMixView(self, exact)
        return view, view

    def get_seq_length(self) -> int:
        return 0 if self.store is None else self.store.seq_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the packed storage stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.store = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select every buffer (codes included) by ``beam_idx``; never re-quantizes."""
        if self.store is not None:
            self.store.select_batch(beam_idx.to(self.store.device))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.store is not None:
            self.store.select_batch(torch.as_tensor(indices).to(self.store.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            index = torch.arange(self.store.batch_size, device=self.store.device)
            self.store.select_batch(index.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` is supported (packed codes are never rewritten).

        Raises:
            NotImplementedError: ``tokens_to_remove != 0``.
        """
        if tokens_to_remove != 0:
            raise NotImplementedError(
                "PN-Mix caches cannot be cropped (quantized groups are never rewritten); "
                "assisted decoding is not supported"
            )

    def nbytes(self) -> int:
        """Persistent bytes of this layer's storage (0 before the first token)."""
        return 0 if self.store is None else self.store.persistent_bytes


class PNMixModelCache(Cache):
    """A ``transformers`` cache holding every decoder layer in PN-Mix form.

    Args:
        model_config: the model's ``PretrainedConfig`` (number of layers, RoPE).
        config: the PN-Mix configuration; ``rotary_dim``/``rotary_layout`` are overridden from
            the model's RoPE unless ``match_rotary=False``.
        match_rotary: see ``config``.
        exact_prefill: the first forward (the prefill) attends to its own keys and values
            exactly; every later forward reads the packed storage (see :class:`PNMixView`).
        layer_group_tokens: one ``group_tokens`` per decoder layer (tokens); ``None`` = every
            layer uses ``config.group_tokens``.

    Sliding-window and chunked layers (Mistral, Gemma 2/3, GPT-OSS, ...) are not compressed:
    each keeps exactly its last ``window - 1`` tokens
    (:class:`kvlab.integrations.model_support.WindowLayer`); the full-attention layers hold
    PN-Mix. ``plan`` is the :class:`~kvlab.integrations.model_support.ModelPlan` used.

    Raises:
        ValueError: a model :func:`kvlab.integrations.model_support.plan_model` marks
            unsupported (linear-attention or KV-sharing layers, latent attention), a RoPE that
            :class:`kvlab.rope.RotaryConfig` does not support, or ``layer_group_tokens`` of the
            wrong length or with a value PNMixConfig rejects.
    """

    def __init__(
        self,
        model_config: Any,
        config: PNMixConfig | None = None,
        *,
        match_rotary: bool = True,
        exact_prefill: bool = True,
        layer_group_tokens: Sequence[int] | None = None,
    ) -> None:
        text_config = model_config.get_text_config(decoder=True)
        # model-matrix: refuse unsupported models before any layer exists (one line, every
        # reason); full-attention layers hold PN-Mix, sliding/chunked layers only their window.
        plan = plan_model(text_config)
        plan.check(type(self).__name__)
        config = config or PNMixConfig()
        if match_rotary:
            config = pnmix_config_for_model(text_config, config)
        self.pnmix_config = config
        n_layers = text_config.num_hidden_layers
        groups = [config.group_tokens] * n_layers
        if layer_group_tokens is not None:
            groups = list(layer_group_tokens)
            if len(groups) != n_layers:
                raise ValueError(
                    f"layer_group_tokens has {len(groups)} entries; the model has {n_layers} layers"
                )
        self.layer_group_tokens = tuple(groups)
        # model-matrix: window layers (WindowLayer) keep their window exactly, as transformers
        # does; their layer_group_tokens entries are unused.
        self.plan = plan
        super().__init__(
            layers=plan.build_layers(
                lambda i: PNMixLayer(
                    dataclasses.replace(config, group_tokens=groups[i]), exact_prefill
                )
            )
        )

    def nbytes(self) -> int:
        """Persistent bytes of every layer (sinks, residual, codes, scales, masks; window
        layers: their exact keys and values)."""
        return sum(layer.nbytes() for layer in self.layers)

    def storage_report(self) -> dict[str, int]:
        """Bytes by component, summed over layers (see :meth:`PNMixCache.nbytes`)."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if getattr(layer, "store", None) is not None:  # model-matrix: skip window layers
                for name, value in layer.store.nbytes().items():
                    total[name] = total.get(name, 0) + value
        return total

    def attention_calls(self) -> int:
        """Packed-attention calls over all layers (each reads codes, never a dequantized copy)."""
        stores = [getattr(layer, "store", None) for layer in self.layers]  # model-matrix
        return sum(0 if store is None else store.attention_calls for store in stores)
