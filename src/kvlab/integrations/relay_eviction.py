"""The eviction side of a :class:`~kvlab.integrations.relay_layer.RelayLayer`: which rows a
forward evicts, the eviction itself through the layer's :class:`kvlab.relay.evictor.Evictor`
(docs/design.md, "RoPE-Relay: Eviction policy"), and reconstruction scoring (KVzip,
:mod:`kvlab.relay.kvzip`; "RoPE-Relay: Reconstruction scoring"): what a layer observes of its
prefill, its part of a reconstruction pass (scores, nothing stored), and the scores its
deferred eviction reads. A mixin: the layer holds the state it reads and writes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvlab.integrations.forward import ForwardPlan, ForwardState
from kvlab.relay.attention import prefill_attention_with_lse
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.evictor import Evictor
from kvlab.relay.reconstruction import join_max, observe, reconstruct_row
from kvlab.relay.scorers import Scorer
from kvlab.relay.storage import RelayStore

__all__ = ["RelayEviction"]


class RelayEviction:
    """The eviction side of a relay layer (module docstring)."""

    # the layer's state (kvlab.integrations.relay_layer.RelayLayer)
    store: RelayStore | None
    shared: ForwardState
    scorer: Scorer
    evictor: Evictor
    evicted: list[bool]
    stream_lengths: list[int]
    next_positions: list[int]
    reconstruction_scores: list[Tensor | None]
    observation_scores: list[Tensor | None]
    eviction: EvictionConfig
    events: list[EvictionEvent]

    def observe_prefill(self, query: Tensor, scaling: float, plan: ForwardPlan) -> None:
        """Before the reconstruction pass: record, per sequence fed real tokens, the attention
        of this forward's last ``scorer.prefill_queries`` queries over its stored tokens (max
        over them and the GQA group, float32 ``[1, H, S]``), which the eviction joins to the
        reconstruction scores by a max (docs/design.md, "Reconstruction scoring"). A later
        storing forward replaces it: the newest context queries observe."""
        assert self.store is not None
        for b in range(plan.batch):
            real = plan.real[b]
            if real == 0 or self.evicted[b]:
                continue
            self.observation_scores[b] = observe(
                self.store,
                b,
                query[b : b + 1, :, plan.num_new - real :],
                scaling,
                self.scorer.prefill_queries,  # type: ignore[attr-defined]
            )

    def eviction_scores(self, row: int) -> Tensor | None:
        """The reconstruction scores of sequence ``row`` joined (max) with its observation
        scores, float32 ``[1, H, S]``, or ``None`` before a reconstruction pass."""
        scores, seen = self.reconstruction_scores[row], self.observation_scores[row]
        if scores is None or seen is None:
            return scores
        return torch.maximum(scores, seen)

    def attend_reconstruction(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        scaling: float,
        plan: ForwardPlan,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """A reconstruction pass through this layer (docs/design.md, "RoPE-Relay:
        Reconstruction scoring"): each fed sequence's real queries attend over its stored tokens
        and, causally, the pass's own tokens
        (:func:`kvlab.relay.kvzip_attention.reconstruction_attention`), the per-slot scores are
        max-accumulated into :attr:`reconstruction_scores`, and nothing is stored. Sequence by
        sequence, so a row's scores never depend on its neighbours.

        Raises:
            ValueError: a sequence that already evicted, or that receives tokens without a span.
        """
        assert self.store is not None and self.shared.reconstruction is not None
        spans = self.shared.reconstruction
        batch, q_heads, t, _ = query.shape
        out = query.new_zeros(batch, q_heads, t, values.shape[-1])
        for b in range(batch):
            real, span = plan.real[b], spans[b]
            if real == 0:
                continue
            if span is None or self.evicted[b]:
                raise ValueError(
                    f"row {b} of a reconstruction pass: "
                    + ("it has evicted already" if self.evicted[b] else "no span given")
                )
            o, scores = reconstruct_row(
                self.store,
                b,
                span,
                self.stream_lengths[b],
                query[b : b + 1, :, t - real :],
                keys[b : b + 1, :, t - real :],
                values[b : b + 1, :, t - real :],
                scale=scaling,
                softcap=kwargs.get("softcap"),
                s_aux=kwargs.get("s_aux"),
            )
            out[b, :, t - real :] = o[0]
            self.reconstruction_scores[b] = join_max(self.reconstruction_scores[b], scores)
        return out

    def split_keys(self, row: int, reconstruction: Tensor) -> Tensor:
        """The keys by which ``layer_budget="scores"`` ranks this layer's stored tokens of
        sequence ``row`` against every other layer's: float32 ``[H, S]``
        (:meth:`kvlab.relay.evictor.Evictor.split_keys`).

        Args:
            row: the sequence.
            reconstruction: ``[1, H, S]`` its reconstruction scores (:meth:`evict`).
        """
        assert self.store is not None
        return self.evictor.split_keys(
            self.store,
            row,
            reconstruction,
            stream_length=self.stream_lengths[row],
            next_position=self.next_positions[row],
        )

    def _rows_due(self, plan: ForwardPlan) -> list[int]:
        """Rows to evict after this forward (see :class:`EvictionConfig`)."""
        if self.eviction.ratio is not None:
            return plan.first_eviction
        assert self.store is not None
        return self.evictor.over_capacity(self.store)

    def _prefill_with_lse(
        self,
        query: Tensor,
        scaling: float,
        plan: ForwardPlan,
        due: list[int],
        kwargs: dict[str, Any],
    ) -> tuple[Tensor, Tensor] | None:
        """This forward's attention and its logsumexp in one call
        (:func:`kvlab.relay.attention.prefill_attention_with_lse`) when the eviction right after
        it can use them: one sequence whose whole prompt is this forward, evicted by a scorer
        with a ``window_reach``, no soft-cap or learned sinks; else ``None``."""
        if (
            self.store is None
            or due != [0]
            or plan.batch != 1
            or plan.padded
            or getattr(self.scorer, "window_reach", None) is None
            or not self.scorer.needs_window_attention
            or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None
        ):
            return None
        return prefill_attention_with_lse(query, self.store, scale=scaling)

    # ---------------------------------------------------------------- eviction
    def evict(
        self,
        query: Tensor | None,
        scaling: float | None,
        row: int = 0,
        *,
        reconstruction: Tensor | None = None,
        layer_total: int | None = None,
        window_lse: Tensor | None = None,
    ) -> EvictionEvent:
        """Evict in sequence ``row``: budget and protected window, score, allocate, select,
        relay (or not), compact (:meth:`kvlab.relay.evictor.Evictor.evict`; docs/design.md,
        "RoPE-Relay: Eviction policy"), then record the event.

        Args:
            query: that row's real queries of the current forward ``[1, H_q, Q, D]`` at cache
                positions (the scorers' observation window and ExpectedAttention's queries), or
                ``None`` for a scorer that reads neither (a reconstruction scorer).
            scaling: the model's softmax scale (``None`` with ``query``).
            row: the sequence.
            reconstruction: ``[1, H, S]`` float32 reconstruction scores of the row's padded
                view (KVzip), for a scorer with ``needs_reconstruction``.
            layer_total: tokens this layer keeps summed over its kv heads, replacing the
                configured layer budget (``layer_budget="scores"``, decided over every layer by
                :meth:`kvlab.integrations.RelayModelCache.evict_reconstructed`), or ``None``.
            window_lse: the logsumexp of ``query``'s logits when the forward's attention gave
                it (:meth:`kvlab.relay.evictor.Evictor.evict`), or ``None``.

        Raises:
            ValueError: ``query`` missing for a scorer that needs it.
        """
        assert self.store is not None
        event, next_position = self.evictor.evict(
            self.store,
            row,
            query,
            scaling,
            stream_length=self.stream_lengths[row],
            next_position=self.next_positions[row],
            reconstruction=reconstruction,
            layer_total=layer_total,
            window_lse=window_lse,
        )
        if next_position is not None:
            self.next_positions[row] = next_position
        self.evicted[row] = True
        self.events.append(event)
        return event
