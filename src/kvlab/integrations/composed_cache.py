"""Eviction composed with PN-Mix inside a ``transformers`` model: evict per (layer, sequence,
kv head), then store the kept tokens as PN-Mix codes, so the bytes multiply down.

``ComposedModelCache(model.config, EvictionConfig(ratio=...), PNMixConfig(...))`` is a
:class:`~kvlab.integrations.relay_cache.RelayModelCache` whose full-attention layers
(:class:`ComposedLayer`) compose an eviction stage — their own
:class:`~kvlab.integrations.relay_cache.RelayLayer`, whose eviction is
:class:`kvlab.relay.evictor.Evictor` — with a :class:`kvlab.pnmix.PNMixCache` that holds the
kept tokens once the prefill is evicted. Design: docs/design.md, "Eviction composed with
PN-Mix". Per layer:

1. **The prefill** (the cache's first forward) runs exactly as in ``RelayModelCache`` — the
   same :meth:`RelayLayer.attend <kvlab.integrations.relay_cache.RelayLayer.attend>`: input
   checks before any layer changes, the tokens committed to a ragged
   :class:`~kvlab.relay.storage.RelayStore`, exact attention over them, and the eviction
   (budget, scorer, per-head counts, selection, relay or not) of every row. Kept sets, relayed
   keys and the prefill's logits are therefore RelayModelCache's.
2. **Packing**: each (row, kv head)'s kept tokens, right-aligned, are appended to the layer's
   PN-Mix cache with per-(row, head) ``lengths`` — each stream its own sinks, groups and exact
   residual — and the RelayStore is dropped. The per-pair tables (bit widths, mix masks) are
   computed in this append from the KEPT keys and the prefill's queries
   (``PNMixCache.append(queries=..., query_lengths=...)``).
   Position-aware (pre-RoPE) codecs code each key rotated back from its position ``offset +
   stream index`` with a per-(row, head) offset ``next_position - kept``: with relay, exactly
   the relayed positions ``E - k + 1 .. E``; without relay, the true positions of the kept
   tail (the protected recent window) and of every later token, while earlier kept tokens are
   coded in a frame off by their gap — a pure rotation that decoding undoes exactly (keys still
   attend at their original positions), which only loosens how well the pre-RoPE frame aligns
   their channels.
3. **Later forwards** append to the PN-Mix cache and attend with
   :func:`kvlab.pnmix.pnmix_attention` over the packed codes; a single-token forward (decode:
   deferred value checks) does both with :func:`kvlab.pnmix.pnmix_decode_step`, one
   compiled call on the CPU backend, as :class:`kvlab.integrations.pnmix_cache.PNMixView`.
   With relay the new token of a sequence sits at the synchronized ``next_position`` in every
   head and layer (keys and queries re-rotated from the model's positions, as in
   ``RelayModelCache``).

**KVzip** (a scorer with ``needs_reconstruction``, :mod:`kvlab.integrations.kvzip`): the
prefill is stored, not evicted, and not packed; the layer keeps that forward's queries (at cache
positions, ``[B, H_q, T, D]``, counted in :meth:`ComposedLayer.held_bytes` until packed) for
the per-pair tables. :func:`kvlab.integrations.kvzip.compress` runs the reconstruction
pass(es) through the relay stages, :meth:`ComposedModelCache.evict_reconstructed` evicts with
their scores, and then packs every layer's kept tokens with those queries — the same
:meth:`ComposedLayer._pack` as step 2, so the codes are those a composed cache would store for
that kept set. Until then only reconstruction passes may follow the prefill.

Ratio mode only: ``EvictionConfig.capacity`` (stream mode, evicting again and again) would
evict tokens already packed into groups, which breaks groups; it is refused at construction.
Bytes (:meth:`ComposedModelCache.nbytes`): the PN-Mix stores' used bytes — codes, scalars,
payloads, tables and the exact sinks/residual of the kept streams; no per-token positions are
kept (positions are ``offset + stream index``, host ints), so :meth:`index_bytes` is 0.

A single-token forward with a mask reads the mask once (refusing a hole; docs/design.md,
"Cache life cycle"), without one nothing. The layer is
:class:`~kvlab.integrations.composed_layer.ComposedLayer`; this cache only chooses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvlab.integrations.composed_layer import ComposedLayer, ComposedView
from kvlab.integrations.forward import ForwardState
from kvlab.integrations.pnmix_cache import (
    check_pnmix_fits_model,
    pnmix_config_for_model,
    sum_backends,
)
from kvlab.integrations.relay_cache import RelayModelCache
from kvlab.integrations.relay_layer import RelayLayer
from kvlab.pnmix import PNMixConfig
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.rope import RotaryConfig

__all__ = ["ComposedLayer", "ComposedModelCache", "ComposedView"]


class ComposedModelCache(RelayModelCache):
    """A ``transformers`` cache that evicts per (layer, sequence, kv head) after the prefill —
    RoPE-Relay or not — and stores the kept tokens as PN-Mix codes (module docstring).

    Args:
        model_config: the model's ``PretrainedConfig``.
        eviction: the :class:`EvictionConfig`; ``ratio`` mode only.
        pnmix: the :class:`~kvlab.pnmix.PNMixConfig` (default ``PNMixConfig()``);
            ``rotary_dim`` / ``rotary_layout`` follow the model unless ``match_rotary=False``.
        rotary: the model's RoPE (default from the config).
        match_rotary: see ``pnmix``.
        record_kept: keep each layer's kept stream indices
            (:attr:`ComposedLayer.kept_positions`; diagnostics).

    Sliding-window layers keep their window exactly, as in ``RelayModelCache``.

    Raises:
        ValueError: ``eviction.capacity`` (stream mode: see the module docstring); everything
            ``RelayModelCache`` and ``PNMixCache`` refuse for this model (unsupported layers or
            RoPE, a value codec that cannot code the heads, ...).
    """

    kind: ClassVar[str] = "composed"

    def __init__(
        self,
        model_config: Any,
        eviction: EvictionConfig,
        pnmix: PNMixConfig | None = None,
        *,
        rotary: RotaryConfig | None = None,
        match_rotary: bool = True,
        record_kept: bool = False,
    ) -> None:
        if eviction.capacity is not None:
            raise ValueError(
                "ComposedModelCache evicts once, after the prefill (EvictionConfig.ratio); "
                "capacity (stream) mode would evict tokens already packed into PN-Mix groups, "
                "which breaks the groups (docs/design.md, 'Eviction composed with PN-Mix')"
            )
        text_config = model_config.get_text_config(decoder=True)
        config = pnmix or PNMixConfig()
        if not isinstance(config, PNMixConfig):
            raise ValueError(f"pnmix must be a PNMixConfig, got {type(config).__name__}")
        if match_rotary:
            config = pnmix_config_for_model(text_config, config)
        self.pnmix_config = config
        self.record_kept = record_kept
        check_pnmix_fits_model(text_config, config)
        super().__init__(model_config, eviction, rotary=rotary)

    def _full_layer(self, index: int, state: ForwardState) -> ComposedLayer:
        uses_rope = self.plan.layers[index].uses_rope
        config = self.pnmix_config
        codec = config.key_codec
        pnmix_rotary = self.rotary if codec.position_aware and uses_rope else None
        if codec.position_aware and not uses_rope:  # NoPE: its keys are position-0 keys
            config = dataclasses.replace(
                config, key_coding=codec.without_positions(), key_outlier_fraction=0.0
            )
        return ComposedLayer(
            self.eviction,
            self.rotary,
            index,
            state,
            uses_rope=uses_rope,
            pnmix_config=config,
            pnmix_rotary=pnmix_rotary,
            record_kept=self.record_kept,
        )

    def _composed_layers(self) -> list[ComposedLayer]:
        return [layer for layer in self.layers if isinstance(layer, ComposedLayer)]

    def _relay_layers(self) -> list[RelayLayer]:
        """The eviction stages of the full-attention layers (each composed layer's
        :attr:`~ComposedLayer.relay_layer`: its counters and events)."""
        return [layer.relay_layer for layer in self._composed_layers()]

    def evict_reconstructed(self) -> list[EvictionEvent]:
        """:meth:`RelayModelCache.evict_reconstructed` (KVzip's eviction with the
        reconstruction scores), then every composed layer packs its kept tokens
        (:meth:`ComposedLayer.pack_reconstructed`). Every row must be evicted by this call (a
        composed layer packs its rows together), which
        :func:`kvlab.integrations.kvzip.compress` guarantees.

        Raises:
            ValueError: as :meth:`RelayModelCache.evict_reconstructed`, or a row without
                complete scores (nothing changes).
        """
        layers = self._relay_layers()
        missing = [
            b
            for b in range(len(layers[0].stream_lengths))
            if any(layer.reconstruction_scores[b] is None for layer in layers)
        ]
        if missing:
            raise ValueError(
                f"rows {missing} have no reconstruction scores in every layer; a composed "
                "cache evicts and packs all rows at once"
            )
        events = super().evict_reconstructed()
        for layer in self._composed_layers():
            layer.pack_reconstructed()
        return events

    def storage_report(self) -> dict[str, int]:
        """PN-Mix bytes by component (``key_codes``, ``key_sink``, ...), summed over layers."""
        total: dict[str, int] = {}
        for layer in self._composed_layers():
            if layer.pnmix is not None:
                for name, value in layer.pnmix.nbytes().items():
                    total[name] = total.get(name, 0) + value
        return total

    def attention_calls(self) -> int:
        """Packed-attention calls over all layers."""
        return sum(
            0 if layer.pnmix is None else layer.pnmix.attention_calls
            for layer in self._composed_layers()
        )

    def attention_backends(self) -> dict[str, int]:
        """Packed-attention calls over all layers by the backend that ran them."""
        return sum_backends(
            layer.pnmix.attention_backends
            for layer in self._composed_layers()
            if layer.pnmix is not None
        )

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    def details(self) -> dict[str, Any]:
        """:meth:`RelayModelCache.details`, ``packed_attention_calls`` and
        ``packed_attention_backends`` (:meth:`attention_calls`, :meth:`attention_backends`)."""
        details = super().details()
        details["packed_attention_calls"] = self.attention_calls()
        details["packed_attention_backends"] = self.attention_backends()
        return details
