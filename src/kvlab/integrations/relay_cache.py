"""RoPE-Relay eviction inside a ``transformers`` model: a cache with ragged per-head storage.

``RelayModelCache(model.config, EvictionConfig(...))`` is a ``transformers.Cache``. Each layer
keeps its tokens in a :class:`kvlab.relay.storage.RelayStore`: one flat key buffer and one flat
value buffer with one segment per (sequence, kv head), so every head of every sequence keeps its
own number of tokens and evicted tokens are physically gone (:meth:`RelayModelCache.nbytes`
shrinks by the evicted fraction). Layout, growth and byte accounting: docs/design.md,
"RoPE-Relay".

A forward through a layer (docs/design.md, "RoPE-Relay: A forward"):

1. ``update`` only stashes the new keys and values and returns a :class:`RelayView`;
2. the ``"kvlab"`` attention function calls :meth:`RelayView.attend` with the queries and the
   2-D attention mask. The first layer of the forward checks every input (mask, position ids,
   prompt length, ...) before any layer changes; then the layer commits the new tokens (left
   padding dropped), attends with ONE call over all heads and sequences
   (:func:`kvlab.relay.attention.ragged_attention`), and evicts when due: once after a
   sequence's prefill (``EvictionConfig.ratio``) or whenever a sequence holds more than
   ``capacity`` tokens per kv head on average (``EvictionConfig.capacity``).

The eviction itself — budgets, protected window, scores, per-head counts, relay, compaction —
is :class:`kvlab.relay.evictor.Evictor` (torch only); this module and
:mod:`kvlab.integrations.relay_layer` (the cache layer, :class:`RelayLayer`, re-exported here)
are the ``transformers`` glue. The forward's checks and plan are
:mod:`kvlab.integrations.forward`.

Positions (docs/design.md, "RoPE-Relay: Positions"): :meth:`RelayModelCache.get_seq_length` is
what ``transformers`` means by it — the tokens (columns, left padding included) the cache has
seen — so multi-turn ``generate``, continuing a cached prefix and ``copy.deepcopy`` reuse work.
The RoPE position of a sequence's next token is a separate quantity,
:attr:`RelayModelCache.next_positions` (after a relay ``E + 1`` plus tokens appended since; the
sequence's own token count without relay). New tokens arrive rotated at the model's
``position_ids``; the cache re-rotates keys and queries by the difference — a pure rotation,
exact up to float rounding. Pass :meth:`RelayModelCache.position_ids` to skip that rotation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvlab.integrations.forward import ForwardState
from kvlab.integrations.model_cache import KVLabModelCache
from kvlab.integrations.model_support import WindowLayer, layer_rotary, plan_model
from kvlab.integrations.relay_layer import RelayLayer, RelayView
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.reconstruction import ReconstructionSpan, split_by_scores
from kvlab.rope import RotaryConfig

__all__ = [
    "EvictionConfig",
    "EvictionEvent",
    "ReconstructionSpan",
    "RelayLayer",
    "RelayModelCache",
    "RelayView",
]


class RelayModelCache(KVLabModelCache):
    """A ``transformers`` cache that evicts per (layer, sequence, kv head) and relays kept keys.

    Args:
        model_config: the model's ``PretrainedConfig`` (layers, RoPE).
        config: the :class:`EvictionConfig`.
        rotary: the model's RoPE; default :meth:`RotaryConfig.from_hf_config` of the config.

    Sliding-window and chunked layers (Mistral, Gemma 2/3, GPT-OSS, ...) are not evicted from:
    each keeps exactly its last ``window - 1`` tokens
    (:class:`kvlab.integrations.model_support.WindowLayer`, which follows the relay's position
    moves by rotation); the full-attention layers evict and relay. ``plan`` is the
    :class:`~kvlab.integrations.model_support.ModelPlan` used.

    Raises:
        ValueError: a model :func:`kvlab.integrations.model_support.plan_model` marks
            unsupported (linear-attention or KV-sharing layers, latent attention), full-attention
            layers without RoPE when ``config.relay``, an unsupported RoPE (dynamic,
            longrope, ...), or per-layer weights (``config.layer_budget``) whose count is not
            the number of full-attention layers (window layers take no share of the budget).
    """

    def __init__(
        self,
        model_config: Any,
        config: EvictionConfig,
        *,
        rotary: RotaryConfig | None = None,
    ) -> None:
        text_config = model_config.get_text_config(decoder=True)
        # model-matrix: refuse unsupported models before any layer exists (one line, every
        # reason); full-attention layers evict, sliding/chunked layers keep only their window.
        plan = plan_model(text_config)
        plan.check(type(self).__name__, rotates_keys=config.relay)
        # per-layer budgets split the model's budget over the evicting layers: the
        # full-attention ones (window layers keep their window and take no share)
        evicting = len(plan.full_layers)
        if not isinstance(config.layer_budget, str) and len(config.layer_budget) != evicting:
            raise ValueError(
                f"layer_budget has {len(config.layer_budget)} weights for {evicting} "
                f"full-attention layers (one weight per full-attention layer: "
                f"{list(plan.full_layers)})"
            )
        self.plan = plan
        self.eviction = config
        self.rotary = rotary or layer_rotary(text_config)
        state = self._forward_state()  # shared by the relay layers: one input check per forward
        super().__init__(
            plan.build_layers(
                lambda i: self._full_layer(i, state),
                rotary=lambda layer_type: layer_rotary(text_config, layer_type),
            ),
            state,
        )
        for position, layer in enumerate(self._relay_layers()):
            layer.evictor.num_layers, layer.evictor.budget_index = evicting, position

    kind: ClassVar[str] = "relay"

    def speculative_refusal(self) -> str | None:
        """A scorer fed by a reconstruction pass (its deferred eviction cannot be cropped)."""
        if self.eviction.resolved_scorer.needs_reconstruction:
            return f"scorer {self.eviction.resolved_scorer.name!r} needs a reconstruction pass"
        if any(layer.deferred for layer in self._relay_layers()):
            return "a deferred eviction waits for a reconstruction pass"
        return None

    def _forward_state(self) -> ForwardState:
        """The forward state the full-attention layers share (a subclass may extend it)."""
        return ForwardState()

    def _full_layer(self, index: int, state: ForwardState) -> CacheLayerMixin:
        """The cache layer of full-attention decoder layer ``index`` (a subclass's layer kind,
        e.g. :class:`kvlab.integrations.composed_cache.ComposedLayer`)."""
        return RelayLayer(
            self.eviction, self.rotary, index, state, uses_rope=self.plan.layers[index].uses_rope
        )

    def relay_layers(self) -> list[RelayLayer]:
        """The eviction stage of every layer this cache evicts in, in decoder order: the
        full-attention layers (a model's sliding-window layers are ``WindowLayer`` s, kept as
        they are; a composed cache's are its layers' eviction stages)."""
        return self._relay_layers()

    def _relay_layers(self) -> list[RelayLayer]:
        """:meth:`relay_layers` (a subclass with other layer classes overrides this)."""
        return [layer for layer in self.layers if isinstance(layer, RelayLayer)]

    def numel(self) -> int:
        """Stored key and value elements over all layers."""
        return sum(layer.numel() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes allocated for keys and values over all layers (used + headroom; a window
        layer's tensors as held)."""
        full = set(self.plan.full_layers)
        return sum(
            layer.reserved_bytes() if i in full else layer.nbytes()
            for i, layer in enumerate(self.layers)
        )

    def index_bytes(self) -> int:
        """Bytes of the per-token position bookkeeping over all layers."""
        return sum(layer.index_bytes() for layer in self._relay_layers())

    @property
    def stream_lengths(self) -> list[int]:
        """Per sequence, real tokens received (left padding excluded)."""
        relay_layers = self._relay_layers()
        return list(relay_layers[0].stream_lengths) if relay_layers else []

    @property
    def next_positions(self) -> list[int]:
        """Per sequence, the RoPE position of its next token (the same in every
        full-attention layer)."""
        relay_layers = self._relay_layers()
        return list(relay_layers[0].next_positions) if relay_layers else []

    @staticmethod
    def _single(values: list[int], name: str) -> int:
        if len(set(values)) > 1:
            raise ValueError(f"the sequences of the batch differ in {name} {values}")
        return values[0] if values else 0

    @property
    def stream_length(self) -> int:
        """Real tokens received, when every sequence has the same number (else ValueError)."""
        return self._single(self.stream_lengths, "stream_lengths")

    @property
    def next_position(self) -> int:
        """RoPE position of the next token, when equal for every sequence (else ValueError)."""
        return self._single(self.next_positions, "next_positions")

    def position_ids(self, num_new: int, device: torch.device | str | None = None) -> Tensor:
        """The cache's own RoPE positions for ``num_new`` new tokens of every sequence,
        int64 ``[B, num_new]`` (``[1, num_new]`` before the first forward): passing them as
        ``position_ids`` makes the model rotate at the cache's positions, so no re-rotation is
        needed (a forward that adds no padding)."""
        starts = self.next_positions or [0]
        ramp = torch.arange(num_new, dtype=torch.int64, device=device)
        return torch.tensor(starts, dtype=torch.int64, device=device).view(-1, 1) + ramp

    def events(self) -> list[EvictionEvent]:
        """Every eviction of every layer, in layer order."""
        return [event for layer in self._relay_layers() for event in layer.events]

    # ------------------------------------------------------------ reconstruction scoring
    @property
    def needs_reconstruction(self) -> bool:
        """Whether the eviction waits for a reconstruction pass (a KVzip scorer,
        :mod:`kvlab.relay.kvzip`): forwards then only store, until
        :func:`kvlab.integrations.kvzip.compress` scores the stored tokens and evicts."""
        return self.eviction.resolved_scorer.needs_reconstruction

    def awaiting_reconstruction(self) -> list[bool]:
        """Per sequence, whether it holds tokens that wait for a reconstruction pass (stored,
        never evicted)."""
        layer = self._relay_layers()[0]
        if not layer.deferred:
            return [False] * len(layer.stream_lengths)
        return [n > 0 and not e for n, e in zip(layer.stream_lengths, layer.evicted, strict=True)]

    def check_reconstruction_eviction(self, rows: Sequence[int]) -> None:
        """Run the budget checks of the deferred eviction of ``rows`` (each holding its stream
        length per kv head) without changing anything.

        Raises:
            ValueError: a budget the eviction could not meet
                (:meth:`kvlab.relay.evictor.Evictor.check_first_eviction`).
        """
        layer = self._relay_layers()[0]
        assert layer.store is not None
        for b in rows:
            layer.evictor.check_first_eviction(layer.stream_lengths[b], layer.store.heads, b)

    @contextmanager
    def reconstruction_pass(self, spans: Sequence[ReconstructionSpan | None]) -> Iterator[None]:
        """Inside this context a forward of the model through the cache is a *reconstruction
        pass* (docs/design.md, "RoPE-Relay: Reconstruction scoring"): sequence ``b``'s real
        tokens (``spans[b]`` says which stored tokens they rebuild; ``None`` for a row fed only
        padding) attend over its stored tokens and their own, every full-attention layer
        max-accumulates its reconstruction scores, and nothing is stored (tokens seen,
        positions and storage unchanged). Window layers (sliding/chunked) serve the pass
        their window as in any forward and are put back after it (their ``update`` never
        writes a tensor in place, so the state they held is restored as it was): the pass
        changes no layer. Used by :func:`kvlab.integrations.kvzip.compress`.

        Raises:
            ValueError: a cache whose scorer needs no reconstruction, ``spans`` not one per
                sequence, or a span for a sequence that is not awaiting one.
        """
        if not self.needs_reconstruction:
            raise ValueError("this cache's scorer needs no reconstruction pass")
        awaiting = self.awaiting_reconstruction()
        if len(spans) != len(awaiting):
            raise ValueError(f"{len(spans)} spans for {len(awaiting)} sequences")
        for b, span in enumerate(spans):
            if span is not None and not awaiting[b]:
                raise ValueError(f"row {b} is not awaiting a reconstruction pass")
        state = self._relay_layers()[0].shared
        state.plan, state.reconstruction = None, list(spans)
        windows = [layer for layer in self.layers if isinstance(layer, WindowLayer)]
        kept = [dict(vars(layer)) for layer in windows]  # references: update replaces tensors
        try:
            yield
        finally:
            state.plan, state.reconstruction = None, None
            for layer, held in zip(windows, kept, strict=True):
                vars(layer).clear()
                vars(layer).update(held)

    def discard_reconstruction(self) -> None:
        """Forget every accumulated reconstruction score (e.g. after a failed pass)."""
        for layer in self._relay_layers():
            layer.reconstruction_scores = [None] * len(layer.reconstruction_scores)

    def evict_reconstructed(self) -> list[EvictionEvent]:
        """Evict every sequence whose tokens every layer has reconstruction scores for, with
        those scores, through the layer's policy (budget and protected window, the scorer,
        per-head allocation, selection, relay or not, compaction), then forget the scores.
        Budgets are checked for every sequence before any layer changes.

        Returns:
            the new :class:`EvictionEvent` s, layer by layer.

        Raises:
            ValueError: no sequence has complete scores, or a budget the eviction cannot meet.
        """
        layers = self._relay_layers()
        awaiting = self.awaiting_reconstruction()
        rows = [
            b
            for b, wait in enumerate(awaiting)
            if wait and all(layer.reconstruction_scores[b] is not None for layer in layers)
        ]
        if not rows:
            raise ValueError("no sequence has reconstruction scores in every layer")
        self.check_reconstruction_eviction(rows)
        totals = {b: self._split_by_scores(b) for b in rows}
        events = []
        for i, layer in enumerate(layers):
            assert layer.store is not None
            for b in rows:
                scores = layer.eviction_scores(b)
                layer.reconstruction_scores[b] = layer.observation_scores[b] = None
                total = None if totals[b] is None else totals[b][i]
                events.append(layer.evict(None, None, b, reconstruction=scores, layer_total=total))
            layer.store.shrink()
        return events

    def _split_by_scores(self, row: int) -> list[int] | None:
        """Per layer, the tokens (summed over kv heads) sequence ``row`` keeps under
        ``layer_budget="scores"``: the model's budget (the uniform split's total) goes to the
        top :meth:`RelayLayer.split_keys` over every layer and kv head (KVzip's cross-layer
        selection; protected tokens always win). ``None`` for any other ``layer_budget``."""
        if self.eviction.layer_budget != "scores":
            return None
        layers = self._relay_layers()
        keys = []
        budget = 0
        for layer in layers:
            assert layer.store is not None
            scores = layer.eviction_scores(row)
            assert scores is not None
            keys.append(layer.split_keys(row, scores).flatten())
            per_head, _ = layer.evictor.layer_budget(layer.store.counts(row))
            budget += per_head * layer.store.heads
        return split_by_scores(keys, budget, self.eviction.scores_share)

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    #: the RoPE positions are the cache's own (:meth:`position_ids`; with RoPE-Relay they
    #: differ from the tokens seen): every forward passes them
    explicit_positions = True

    def rope_position(self) -> int:
        """:attr:`next_position` (ValueError when the sequences of the batch differ)."""
        return self.next_position

    def details(self) -> dict[str, Any]:
        """``evictions`` (events over all layers), ``next_position``, ``stream_length``,
        ``first_eviction_tokens_per_head`` (the ``tokens_after`` of the first ``len(layers)``
        events) and ``prompt_forwards`` (per sequence, the forwards its prompt arrived in:
        docs/design.md, "Cache life cycle")."""
        events = self.events()
        layers = self._relay_layers()
        per_head = [e.tokens_after for e in events[: len(layers)]]
        return {
            "evictions": len(events),
            "next_position": self.next_position,
            "stream_length": self.stream_length,
            "first_eviction_tokens_per_head": per_head,
            "prompt_forwards": list(layers[0].prompt_forwards) if layers else [],
        }

    def end_prompt(self) -> None:
        """Close every sequence's prompt in every relay layer: a later multi-token forward is
        a continuation (stored whole, evicted by the decode rule: capacity mode only), not a
        chunk of the prompt that ratio mode evicts to its budget (docs/design.md, "Cache life
        cycle")."""
        for layer in self._relay_layers():
            layer.prompt_open = [False] * len(layer.prompt_open)
