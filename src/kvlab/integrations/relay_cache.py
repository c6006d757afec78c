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
is :class:`kvlab.relay.evictor.Evictor` (torch only); this module is the ``transformers`` glue.
The forward's checks and plan are :mod:`kvlab.integrations.forward`.

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
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.attention import CacheView
from kvlab.integrations.forward import (
    ForwardPlan,
    ForwardState,
    Pending,
    Planner,
    StoredShape,
    check_states,
    plan_forward,
)
from kvlab.integrations.model_support import ForwardGuard, layer_rotary, plan_model
from kvlab.relay.attention import ragged_attention
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.evictor import Evictor
from kvlab.relay.reconstruction import (
    ReconstructionSpan,
    join_max,
    observe,
    reconstruct_row,
    split_by_scores,
)
from kvlab.relay.scorers import Scorer
from kvlab.relay.storage import RelayStore
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = [
    "EvictionConfig",
    "EvictionEvent",
    "ReconstructionSpan",
    "RelayLayer",
    "RelayModelCache",
    "RelayView",
]


class RelayView(CacheView):
    """Returned by :meth:`RelayLayer.update`: commits the stashed tokens, attends over the
    layer's ragged storage in one call, and evicts when due (:meth:`RelayLayer.attend`).
    Handles left-padded batches (``supports_padding``)."""

    supports_padding = True
    # model-matrix: Gemma 2 logit soft-capping and GPT-OSS learned sinks (kvlab.attention_logits)
    supported_features = frozenset({"softcap", "s_aux"})

    def __init__(self, layer: RelayLayer) -> None:
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
        """See :meth:`RelayLayer.attend`."""
        return self.layer.attend(
            query, scaling=scaling, attention_mask=attention_mask, kwargs=kwargs
        )

    def refusal_guard(self) -> AbstractContextManager[None]:
        """A refusal drops the layer's stash and puts back the window layers stored before the
        forward's first full-attention layer (:class:`~kvlab.integrations.model_support.
        ForwardGuard`)."""
        return self.layer.forward_state.guard.checking(self.layer.drop_stash)


class RelayLayer(CacheLayerMixin):
    """One full-attention decoder layer of a :class:`RelayModelCache`.

    ``forward_state`` is shared by the layers of one cache (the first layer of a forward checks
    its inputs for all); ``uses_rope=False`` (a NoPE layer, only with ``relay=False``) never
    re-rotates keys or queries; ``planner`` checks and plans each forward in place of
    :meth:`check_forward` (a :class:`kvlab.integrations.composed_cache.ComposedLayer` holding
    this layer adds its own checks). The eviction policy is :attr:`evictor`
    (:class:`kvlab.relay.evictor.Evictor`).

    Attributes:
        store: the :class:`~kvlab.relay.storage.RelayStore` (``None`` before the first token).
        seen_tokens: columns (tokens, left padding included) received: ``get_seq_length``.
        padding: per row, the leading padding columns received.
        stream_lengths: per row, real tokens received (the stream index of the next token).
        next_positions: per row, RoPE position of the next token (synchronized after a relay).
        forwards: forwards committed.
        events: the :class:`EvictionEvent` list of this layer.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        config: EvictionConfig,
        rotary: RotaryConfig,
        layer_idx: int,
        forward_state: ForwardState | None = None,
        *,
        uses_rope: bool = True,
        planner: Planner | None = None,
    ) -> None:
        super().__init__()
        # who checks a forward's inputs and plans it (a composed layer adds its checks)
        self.planner = planner
        self.eviction = config
        self.rotary = rotary
        self.uses_rope = uses_rope
        self.layer_idx = layer_idx
        # the eviction policy (torch only): budgets, protected window, scorer, selection, relay
        self.evictor = Evictor(config, rotary, layer_idx, uses_rope=uses_rope)
        self.scorer: Scorer = self.evictor.scorer
        self.allocation = self.evictor.allocation
        # a scorer fed by a reconstruction pass: the ratio eviction waits for it
        self.deferred = self.evictor.deferred
        self.forward_state = forward_state if forward_state is not None else ForwardState()
        self._clear()

    @property
    def num_layers(self) -> int:
        """Decoder layers the model's budget is split over (set by :class:`RelayModelCache`;
        per-layer budgets need it)."""
        return self.evictor.num_layers

    @num_layers.setter
    def num_layers(self, value: int) -> None:
        self.evictor.num_layers = value

    def _clear(self) -> None:
        self.store: RelayStore | None = None
        self.seen_tokens = 0
        self.padding: list[int] = []
        self.stream_lengths: list[int] = []
        self.next_positions: list[int] = []
        self.forwards = 0
        self.events: list[EvictionEvent] = []
        self.reconstruction_scores: list[Tensor | None] = []
        # per row: the prefill's observation-window attention (KVzipScorer(prefill_queries=w))
        self.observation_scores: list[Tensor | None] = []
        self.evicted: list[bool] = []
        self._pending: Pending | None = None
        self.is_initialized = False

    # ---------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Create the empty store for ``[B, H_kv, T, D]`` keys / ``[B, H_kv, T, Dv]`` values."""
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.store = RelayStore(
            batch, heads, dim, value_states.shape[-1], dtype=self.dtype, device=self.device
        )
        self.padding = [0] * batch
        self.stream_lengths = [0] * batch
        self.next_positions = [0] * batch
        self.reconstruction_scores = [None] * batch
        self.observation_scores = [None] * batch
        self.evicted = [False] * batch
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[RelayView, RelayView]:
        """Stash ``[B, H_kv, T, D]`` rotated keys and ``[B, H_kv, T, Dv]`` values for this
        forward's :meth:`attend` (nothing is stored yet).

        Raises:
            ValueError: shapes, dtype or device that differ from what the layer stores.
        """
        with self.forward_state.guard.checking(accept=False):
            self._check_states(key_states, value_states)
        inner = kwargs.get("kwargs") or {}
        self._pending = Pending(key_states, value_states, inner.get("position_ids"))
        view = RelayView(self)
        return view, view

    @property
    def stash(self) -> Pending | None:
        """What :meth:`update` stashed for this forward's :meth:`attend` (``None``: nothing)."""
        return self._pending

    def drop_stash(self) -> None:
        """Forget the stash of :meth:`update` (a refused forward)."""
        self._pending = None

    def get_seq_length(self) -> int:
        """Tokens seen (columns, left padding included) — what ``transformers`` means; the RoPE
        positions are :attr:`next_positions`."""
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self._clear()

    def select_rows(self, rows: list[int]) -> None:
        """Keep sequences ``rows`` (in that order; repeats allowed) of every per-row state."""
        if self.store is None:
            return
        self.store.select_rows(rows)
        self.padding = [self.padding[b] for b in rows]
        self.stream_lengths = [self.stream_lengths[b] for b in rows]
        self.next_positions = [self.next_positions[b] for b in rows]
        self.reconstruction_scores = [self.reconstruction_scores[b] for b in rows]
        self.observation_scores = [self.observation_scores[b] for b in rows]
        self.evicted = [self.evicted[b] for b in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select the storage by ``beam_idx`` (beam search; reads the indices to the host)."""
        self.select_rows([int(i) for i in torch.as_tensor(beam_idx).tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = range(len(self.stream_lengths))
        self.select_rows([b for b in rows for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` is supported.

        Raises:
            NotImplementedError: ``tokens_to_remove != 0``.
        """
        if tokens_to_remove != 0:
            raise NotImplementedError("relay caches cannot be cropped")

    # ---------------------------------------------------------------- sizes
    def tokens_per_head(self, row: int = 0) -> list[int]:
        """Tokens stored per kv head of sequence ``row`` (empty before the first token)."""
        return [] if self.store is None else self.store.counts(row)

    def max_tokens(self) -> int:
        """The most tokens any (sequence, kv head) stores."""
        return 0 if self.store is None else max(self.store.lengths, default=0)

    def segment(self, row: int, head: int) -> Any:
        """Views of the stored tokens of (``row``, kv ``head``):
        :class:`kvlab.relay.storage.Segment` (``keys [n, D]``, ``values [n, Dv]``,
        ``original_positions`` and ``rotary_positions`` int64 ``[n]``, stream order).

        Raises:
            RuntimeError: before the first token.
        """
        if self.store is None:
            raise RuntimeError("the layer stores nothing yet")
        return self.store.segment(row, head)

    def nbytes(self) -> int:
        """Bytes of the stored (used) keys and values (headroom excluded)."""
        return 0 if self.store is None else self.store.nbytes()

    def numel(self) -> int:
        """Stored key and value elements."""
        return 0 if self.store is None else self.store.numel()

    def reserved_bytes(self) -> int:
        """Bytes allocated for keys and values (used + headroom)."""
        return 0 if self.store is None else self.store.reserved_bytes()

    def index_bytes(self) -> int:
        """Bytes of the used position bookkeeping (two int64 per stored token)."""
        return 0 if self.store is None else self.store.index_bytes()

    # ---------------------------------------------------------------- checks (no state change)
    def _stored_shape(self) -> StoredShape | None:
        store = self.store
        if store is None:
            return None
        return StoredShape(
            store.batch, store.heads, store.head_dim, store.value_dim, store.dtype, store.device
        )

    def _check_states(self, keys: Tensor, values: Tensor) -> None:
        check_states(keys, values, self.layer_idx, self._stored_shape())

    def check_forward(
        self,
        pending: Pending,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
        *,
        reconstruction: bool = False,
    ) -> ForwardPlan:
        """Check this forward's inputs against the layer's state and derive the plan
        (:func:`kvlab.integrations.forward.plan_forward`), then the rows whose prefill this is
        and their first eviction's budget checks (ratio mode, not deferred). A
        ``reconstruction`` pass stores nothing and plans no eviction.

        Raises:
            ValueError: see :func:`~kvlab.integrations.forward.plan_forward`; a prompt too
                short for the first eviction.
        """
        batch, heads = pending.keys.shape[:2]
        stream = self.stream_lengths or [0] * batch
        plan = plan_forward(
            pending,
            attention_mask,
            kwargs,
            seen=self.seen_tokens,
            stream=stream,
            nexts=self.next_positions or [0] * batch,
            padding=self.padding or [0] * batch,
            forward_index=self.forwards,
            reconstruction=reconstruction,
        )
        if self.eviction.ratio is not None and not self.deferred and not reconstruction:
            first = [b for b in range(batch) if stream[b] == 0 and plan.real[b] > 1]
            for b in first:
                self.evictor.check_first_eviction(plan.real[b], heads, b)
            plan.first_eviction = first
        return plan

    # ---------------------------------------------------------------- the forward
    def attend(
        self,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """This layer's part of a forward: check (first layer), commit, attend, evict.

        Args:
            query: ``[B, H_q, T, D]`` rotated by the model at its ``position_ids``.
            scaling: the model's softmax scale.
            attention_mask: ``None`` or the 2-D keep mask ``[B, seen + T]`` (left padding).
            kwargs: the attention kwargs (``position_ids``; ``softcap`` and ``s_aux``, see
                :func:`kvlab.relay.attention.ragged_attention`).

        Returns:
            ``[B, H_q, T, Dv]`` in the query dtype; padding queries give zeros.

        Raises:
            ValueError: see :meth:`check_forward`; raised by the first layer of a forward,
                before any layer changes.
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        pending, plan = self.take_pending(attention_mask, kwargs)
        spans = self.forward_state.reconstruction
        keys = pending.keys
        if plan.shift is not None and self.uses_rope:
            keys = rotate_by_delta(keys, plan.shift, self.rotary)
            query = rotate_by_delta(query, plan.shift, self.rotary)
        if spans is not None:
            return self._attend_reconstruction(query, keys, pending.values, scaling, plan, kwargs)
        self._commit(keys, pending.values, plan)
        assert self.store is not None
        out = ragged_attention(
            query,
            self.store,
            scale=scaling,
            query_lengths=plan.real if plan.padded else None,
            softcap=kwargs.get("softcap"),  # model-matrix: Gemma 2
            s_aux=kwargs.get("s_aux"),  # model-matrix: GPT-OSS learned sinks
        )
        if self.deferred and getattr(self.scorer, "prefill_queries", 0):
            self._observe(query, scaling, plan)
        due = self._rows_due(plan)
        for b in due:
            self.evict(query[b : b + 1, :, plan.num_new - plan.real[b] :], scaling, row=b)
        if due:
            self.store.shrink()
        return out

    def take_pending(
        self, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> tuple[Pending, ForwardPlan]:
        """The stash of this forward and its plan: the one the forward's first layer built
        (shared through :attr:`forward_state`), or a new one (:meth:`check_forward`, or the
        :attr:`planner`'s, which checks every input before any layer changes).

        Raises:
            RuntimeError: no stash (``attend`` without a preceding ``update``).
            ValueError: see :meth:`check_forward`.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("RelayView.attend called without a preceding update()")
        spans = self.forward_state.reconstruction
        plan = self.forward_state.plan
        if (
            plan is None
            or plan.forward_index != self.forwards
            or (plan.batch, plan.num_new) != tuple(pending.keys.shape[0:3:2])
            or plan.reconstruction != (spans is not None)
        ):
            planner = self if self.planner is None else self.planner
            plan = planner.check_forward(
                pending, attention_mask, kwargs, reconstruction=spans is not None
            )
            self.forward_state.plan = plan
        return pending, plan

    def _observe(self, query: Tensor, scaling: float, plan: ForwardPlan) -> None:
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

    def _attend_reconstruction(
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
        and, causally, the pass's own tokens (:func:`kvlab.relay.kvzip.reconstruction_attention`),
        the per-slot scores are max-accumulated into :attr:`reconstruction_scores`, and nothing
        is stored. Sequence by sequence, so a row's scores never depend on its neighbours.

        Raises:
            ValueError: a sequence that already evicted, or that receives tokens without a span.
        """
        assert self.store is not None and self.forward_state.reconstruction is not None
        spans = self.forward_state.reconstruction
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

    def _commit(self, keys: Tensor, values: Tensor, plan: ForwardPlan) -> None:
        """Append each row's real new tokens at its stream indices and RoPE positions."""
        if self.store is None:
            self.lazy_initialization(keys, values)
        assert self.store is not None
        self.store.append(
            keys,
            values,
            real=plan.real,
            original_start=self.stream_lengths,
            rotary_start=self.next_positions,
        )
        self.advance(plan)

    def advance(self, plan: ForwardPlan) -> None:
        """Count the forward's tokens: padding, stream lengths, RoPE positions, columns seen."""
        for b, r in enumerate(plan.real):
            self.padding[b] += plan.num_new - r
            self.stream_lengths[b] += r
            self.next_positions[b] += r
        self.seen_tokens += plan.num_new
        self.forwards += 1

    def _rows_due(self, plan: ForwardPlan) -> list[int]:
        """Rows to evict after this forward (see :class:`EvictionConfig`)."""
        if self.eviction.ratio is not None:
            return plan.first_eviction
        assert self.store is not None
        return self.evictor.over_capacity(self.store)

    # ---------------------------------------------------------------- eviction
    def evict(
        self,
        query: Tensor | None,
        scaling: float | None,
        row: int = 0,
        *,
        reconstruction: Tensor | None = None,
        layer_total: int | None = None,
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
                :meth:`RelayModelCache.evict_reconstructed`), or ``None``.

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
        )
        if next_position is not None:
            self.next_positions[row] = next_position
        self.evicted[row] = True
        self.events.append(event)
        return event


class RelayModelCache(Cache):
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
            longrope, ...), or per-layer budgets (``config.layer_budget``) with window layers or
            with a weight count other than the decoder layers'.
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
        layers = len(plan.layers)
        if config.layer_budget != "uniform":
            # per-layer budgets split the model's budget over evicting layers: all of them
            if plan.window_layers:
                raise ValueError(
                    f"EvictionConfig.layer_budget {config.layer_budget!r} needs every decoder "
                    f"layer to be full attention; layers {list(plan.window_layers)} are "
                    "sliding/chunked (they keep their window and do not evict)"
                )
            if not isinstance(config.layer_budget, str) and len(config.layer_budget) != layers:
                raise ValueError(
                    f"layer_budget has {len(config.layer_budget)} weights for {layers} layers"
                )
        if config.resolved_scorer.needs_reconstruction and plan.window_layers:
            # a reconstruction pass must store nothing; window layers store every forward
            raise ValueError(
                f"scorer {config.resolved_scorer.name!r} needs every decoder layer to be full "
                f"attention (its reconstruction pass stores nothing); layers "
                f"{list(plan.window_layers)} are sliding/chunked"
            )
        self.plan = plan
        self.eviction = config
        self.rotary = rotary or layer_rotary(text_config)
        state = self._forward_state()  # shared by the relay layers: one input check per forward
        super().__init__(
            layers=plan.build_layers(
                lambda i: self._full_layer(i, state),
                rotary=lambda layer_type: layer_rotary(text_config, layer_type),
            )
        )
        for layer in self._relay_layers():
            layer.num_layers = layers
        state.guard = ForwardGuard(self.layers)  # atomic failure with leading window layers

    def _forward_state(self) -> ForwardState:
        """The forward state the full-attention layers share (a subclass may extend it)."""
        return ForwardState()

    def _full_layer(self, index: int, state: ForwardState) -> CacheLayerMixin:
        """The cache layer of full-attention decoder layer ``index`` (a subclass's layer kind,
        e.g. :class:`kvlab.integrations.composed_cache.ComposedLayer`)."""
        return RelayLayer(
            self.eviction, self.rotary, index, state, uses_rope=self.plan.layers[index].uses_rope
        )

    def _relay_layers(self) -> list[RelayLayer]:
        """The full-attention layers (model-matrix: window layers are WindowLayer)."""
        return [layer for layer in self.layers if isinstance(layer, RelayLayer)]

    def nbytes(self) -> int:
        """Bytes of every layer's stored (used) keys and values; see :meth:`reserved_bytes`."""
        return sum(layer.nbytes() for layer in self.layers)

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
        positions and storage unchanged). Used by :func:`kvlab.integrations.kvzip.compress`.

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
        state = self._relay_layers()[0].forward_state
        state.plan, state.reconstruction = None, list(spans)
        try:
            yield
        finally:
            state.plan, state.reconstruction = None, None

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
