"""The cache layer of RoPE-Relay eviction inside a ``transformers`` model: one full-attention
decoder layer of a :class:`kvlab.integrations.relay_cache.RelayModelCache` (module docstring
there: a forward, positions).

:class:`RelayLayer` keeps its tokens in a :class:`kvlab.relay.storage.RelayStore` (one segment
per (sequence, kv head)); ``update`` stashes, :meth:`RelayLayer.attend` (through
:class:`RelayView`) checks the forward (first layer: :mod:`kvlab.integrations.forward`),
commits, attends in one call (:func:`kvlab.relay.attention.ragged_attention`) and evicts when
due through its :class:`kvlab.relay.evictor.Evictor`; during a reconstruction pass it scores
instead (:mod:`kvlab.relay.reconstruction`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from kvlab.integrations.attention import outputs_unused, unused_output
from kvlab.integrations.cache_protocol import CacheStorage
from kvlab.integrations.forward import (
    ForwardPlan,
    ForwardState,
    Pending,
    Planner,
    StoredShape,
    check_states,
    plan_forward,
)
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.layer import Forward, KVLabLayer, LayerView
from kvlab.integrations.relay_eviction import RelayEviction
from kvlab.relay.attention import ragged_attention
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.evictor import Evictor
from kvlab.relay.scorers import Scorer
from kvlab.relay.storage import RelayStore
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["RelayLayer", "RelayView"]


class RelayView(LayerView):
    """Returned by :meth:`RelayLayer.update`: commits the stashed tokens, attends over the
    layer's ragged storage in one call, and evicts when due (:meth:`RelayLayer.attend`)."""


class RelayLayer(RelayEviction, KVLabLayer):
    """One full-attention decoder layer of a
    :class:`~kvlab.integrations.relay_cache.RelayModelCache`.

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

    kind = "relay"
    view_class = RelayView
    #: ratio mode: evict again after each later multi-token forward of an open prompt (False
    #: for the composed cache's eviction stage, which packs after the first forward)
    reevict_prompt = True
    #: free rows per segment the store keeps after an eviction (docs/design.md, "RoPE-Relay:
    #: Segment layout and growth"): its buffers shrink to the kept tokens plus this
    PROMPT_ROOM = 64

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
        super().__init__(ForwardState() if forward_state is None else forward_state, layer_idx)
        self.shared: ForwardState
        # who checks a forward's inputs and plans it (a composed layer adds its checks)
        self.planner = planner
        self.eviction = config
        self.rotary = rotary
        self.uses_rope = uses_rope
        # the eviction policy (torch only): budgets, protected window, scorer, selection, relay
        self.evictor = Evictor(config, rotary, layer_idx, uses_rope=uses_rope)
        self.scorer: Scorer = self.evictor.scorer
        self.allocation = self.evictor.allocation
        # a scorer fed by a reconstruction pass: the ratio eviction waits for it
        self.deferred = self.evictor.deferred
        self._clear()

    def _clear(self) -> None:
        self.store: RelayStore | None = None
        self._inference = InferenceModeTracker()
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
        # per row: its prompt is still arriving (no single-token forward after its first
        # tokens yet): ratio mode evicts after each of its multi-token forwards
        self.prompt_open: list[bool] = []
        self.prompt_forwards: list[int] = []  # per row: forwards its prompt arrived in
        self._pending: Pending | None = None
        # while recording, per decode-phase token of the last forward: the layer's state
        # before it when that step may evict (capacity mode), else None
        self._undo: list[dict[str, Any] | None] = []
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
        self.prompt_open = [True] * batch
        self.prompt_forwards = [0] * batch
        self.is_initialized = True

    def stash_states(
        self, key_states: Tensor, value_states: Tensor, kwargs: dict[str, Any]
    ) -> None:
        """Stash the states and the model's ``position_ids`` (``update``'s inner kwargs) for
        this forward's :meth:`attend` (nothing is stored yet)."""
        inner = kwargs.get("kwargs") or {}
        self._pending = Pending(key_states, value_states, inner.get("position_ids"))

    def held_store(self) -> RelayStore | None:
        return self.store

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

    def reset(self) -> None:
        """Empty the layer as a new one (``Cache.reset``), and the forward state it shares."""
        self._clear()
        self.shared.reset()

    def select_rows(self, rows: list[int]) -> None:
        """Keep sequences ``rows`` (in that order; repeats allowed) of every per-row state, and
        of the store when it has one (the composed cache's eviction stage hands its tokens to
        PN-Mix and keeps only the per-row state)."""
        if not self.stream_lengths:
            return
        if self.store is not None:
            self.store.select_rows(rows)
        self.padding = [self.padding[b] for b in rows]
        self.stream_lengths = [self.stream_lengths[b] for b in rows]
        self.next_positions = [self.next_positions[b] for b in rows]
        self.reconstruction_scores = [self.reconstruction_scores[b] for b in rows]
        self.observation_scores = [self.observation_scores[b] for b in rows]
        self.evicted = [self.evicted[b] for b in rows]
        self.prompt_open = [self.prompt_open[b] for b in rows]
        self.prompt_forwards = [self.prompt_forwards[b] for b in rows]

    def batch_rows(self) -> int:
        return len(self.stream_lengths)

    def select_batch(self, index: Tensor) -> None:
        """Row-select the storage (reads the indices to the host)."""
        self.select_rows([int(i) for i in index.tolist()])

    def rollback(self, entries: list[Any]) -> None:
        """Remove the decode-phase tokens of ``entries`` — appended after the prompt's
        eviction, so every segment's last tokens; past an evicting step (capacity mode), the
        copy taken before it comes back first."""
        remove = len(entries)
        first = next((i for i, p in enumerate(entries) if p is not None), None)
        if first is not None:  # an evicting step among the removed ones: its copy, then cut
            state = entries[first]
            assert state is not None
            for name in self._SNAPSHOT:
                setattr(self, name, state[name])
            self.store = state["store"]
            del self.events[state["events"] :]
            remove = first
        assert self.store is not None
        self.store.truncate(remove)
        self.stream_lengths = [n - remove for n in self.stream_lengths]
        self.next_positions = [n - remove for n in self.next_positions]
        self.seen_tokens -= remove

    def storage(self) -> CacheStorage:
        """The used key/value bytes (:meth:`nbytes`; headroom is not stored data), their
        elements at 2 bytes, the used bookkeeping (positions and ``key_bias``), and every
        buffer held, headroom included (:meth:`held_bytes`; docs/design.md, RoPE-Relay "Byte
        accounting")."""
        return CacheStorage(self.nbytes(), self.numel() * 2, self.index_bytes(), self.held_bytes())

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
        """Bytes of the used bookkeeping (two int64 positions and a ``key_bias`` element per
        stored token)."""
        return 0 if self.store is None else self.store.index_bytes()

    def held_bytes(self) -> int:
        """Bytes of every buffer the layer's store holds, headroom included
        (:meth:`kvlab.relay.storage.RelayStore.held_bytes`)."""
        return 0 if self.store is None else self.store.held_bytes()

    # ---------------------------------------------------------------- checks (no state change)
    def _stored_shape(self) -> StoredShape | None:
        store = self.store
        if store is None:
            return None
        return StoredShape(
            store.batch, store.heads, store.head_dim, store.value_dim, store.dtype, store.device
        )

    def check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        """Refuse states of another rank, batch, head shape, dtype or device than stored.

        Raises:
            ValueError: naming the layer and what differs.
        """
        check_states(key_states, value_states, self.layer_idx, self._stored_shape())

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
        prompt_real = plan.real
        if not reconstruction:
            plan.decode_from = self._decode_from(plan)
            if plan.decode_from < plan.num_new:
                prompt_real = [plan.decode_from] * batch
        if self.eviction.ratio is not None and not self.deferred and not reconstruction:
            # a prompt may arrive in several forwards (chunked prefill, a first token then the
            # rest): every multi-token forward of an open prompt evicts, to the budget of the
            # prompt's tokens so far (docs/design.md, "Cache life cycle")
            opened = self.prompt_open or [True] * batch
            first = [
                b
                for b in range(batch)
                if prompt_real[b] > 1 and (stream[b] == 0 or (self.reevict_prompt and opened[b]))
            ]
            for b in first:
                self.evictor.check_first_eviction(stream[b] + prompt_real[b], heads, b)
            plan.first_eviction = first
        return plan

    def _decode_from(self, plan: ForwardPlan) -> int:
        """The new columns before the prompt's end (:meth:`decode_start`); the rest are
        decode-phase tokens.

        Raises:
            ValueError: a multi-token first forward without ``expect_prompt``, or padding in a
                forward with decode-phase tokens.
        """
        prompt = self.decode_start(self.seen_tokens, plan.num_new)
        if prompt < plan.num_new and plan.padded:
            raise ValueError(
                "a relay cache recording for speculative decoding takes no padding in a forward "
                "with decode-phase tokens"
            )
        return prompt

    # ---------------------------------------------------------------- the forward
    def begin(self, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> Forward:
        """The stash and the forward's plan (:meth:`take_pending`: the first layer checks every
        input before any layer changes); its decode-phase tokens start at the plan's
        ``decode_from`` (a reconstruction pass has none and accepts nothing).

        Raises:
            ValueError: see :meth:`check_forward`.
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        pending, plan = self.take_pending(attention_mask, kwargs)
        accepts = self.shared.reconstruction is None
        prompt = plan.num_new
        if accepts and plan.decode_from is not None:
            prompt = plan.decode_from
            if self.eviction.capacity is None and not plan.first_eviction:
                # ratio mode: no eviction in the prompt's columns and none while decoding, so
                # the decode-phase tokens attend as the plain way does, in the same call
                prompt = plan.num_new
        positions = list(self.next_positions) or [0] * plan.batch
        return Forward(pending.keys, pending.values, prompt, plan, accepts, positions)

    def attend_prompt(
        self, query: Tensor, forward: Forward, columns: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """Commit, attend (one call over all heads and sequences), evict when due
        (:meth:`attend_part`); the first ``columns`` of a forward with decode-phase tokens go
        as a forward of their own (a prompt evicts at its end)."""
        plan: ForwardPlan = forward.plan
        if columns == forward.num_new:
            out = self.attend_part(query, forward.keys, forward.values, plan, scaling, kwargs)
            decoded = 0 if plan.decode_from is None else columns - plan.decode_from
            if decoded and forward.accepts:  # decode-phase tokens in this call: they close
                self.prompt_open = [False] * len(self.prompt_open)  # the prompt, and are
                if self.shared.recording:  # croppable (ratio mode: cut off the segments)
                    self._undo = [None] * decoded
            return out
        head = ForwardPlan(
            plan.forward_index,
            plan.batch,
            columns,
            [columns] * plan.batch,
            plan.shift,
            first_eviction=plan.first_eviction,
        )
        keys, values = forward.keys[:, :, :columns], forward.values[:, :, :columns]
        return self.attend_part(query, keys, values, head, scaling, kwargs)

    def shift_after(self, forward: Forward, column: int) -> Tensor | None:
        """The RoPE shift ``[B, 1, 1]`` of the forward's column ``column`` once the columns
        before it are stored: the plan's shift plus how far the relay moved the row's next
        position (``None``: none)."""
        plan: ForwardPlan = forward.plan
        moved = [
            n - b - column for n, b in zip(self.next_positions, forward.positions, strict=True)
        ]
        shift = plan.shift
        if any(moved):
            delta = torch.tensor(moved, dtype=torch.int64, device=forward.keys.device)
            delta = delta.view(-1, 1, 1)
            shift = delta if shift is None else shift + delta
        return shift

    def attend_decoded(
        self, query: Tensor, forward: Forward, start: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The forward's columns from ``start`` on, appended after the prompt part's eviction
        at the positions the relay moved them to, attending as one-token forwards would (exact
        attention over the stored tokens, causal): the eviction schedule of the plain run.
        Ratio mode never evicts while decoding (one call; an undo entry ``None`` per token);
        capacity mode runs one step per token (each may evict), keeping a copy of the layer's
        state before each while the cache records. They close the prompt."""
        plan: ForwardPlan = forward.plan
        batch, t = plan.batch, plan.num_new
        keys, values = forward.keys, forward.values
        recording = self.shared.recording
        self.prompt_open = [False] * len(self.prompt_open)
        if self.eviction.capacity is None:  # ratio mode: decoding never evicts
            tail = ForwardPlan(
                plan.forward_index,
                batch,
                t - start,
                [t - start] * batch,
                self.shift_after(forward, start),
            )
            out = self.attend_part(
                query, keys[:, :, start:], values[:, :, start:], tail, scaling, kwargs
            )
            if recording:
                self._undo = [None] * (t - start)
        else:  # capacity mode: one step per token, each may evict (a copy before it)
            outs: list[Tensor] = []
            for j in range(start, t):
                if recording:
                    self._undo.append(self._snapshot())
                step = ForwardPlan(
                    plan.forward_index, batch, 1, [1] * batch, self.shift_after(forward, j)
                )
                outs.append(
                    self.attend_part(
                        query[:, :, j - start : j - start + 1],
                        keys[:, :, j : j + 1],
                        values[:, :, j : j + 1],
                        step,
                        scaling,
                        kwargs,
                    )
                )
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        self.prompt_open = [False] * len(self.prompt_open)
        return out

    _SNAPSHOT = (
        "stream_lengths",
        "next_positions",
        "seen_tokens",
        "evicted",
        "prompt_open",
        "prompt_forwards",
        "padding",
        "observation_scores",
    )

    def _snapshot(self) -> dict[str, Any]:
        """The layer's state before a decode step that may evict (capacity mode): a copy of
        the store and of every per-row counter (:meth:`crop` puts it back)."""
        state: dict[str, Any] = {name: copy.copy(getattr(self, name)) for name in self._SNAPSHOT}
        state["store"] = copy.deepcopy(self.store)
        state["events"] = len(self.events)
        return state

    def attend_part(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        plan: ForwardPlan,
        scaling: float,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """The plain way of a relay forward (or of its prompt's columns): commit
        ``keys``/``values`` by ``plan``, attend with ``query`` in one call, evict when due; in a
        reconstruction pass, score instead (nothing stored)."""
        spans = self.shared.reconstruction
        pending = Pending(keys, values, None)
        if plan.shift is not None and self.uses_rope:
            keys = rotate_by_delta(keys, plan.shift, self.rotary)
            query = rotate_by_delta(query, plan.shift, self.rotary)
        if spans is not None:
            return self.attend_reconstruction(query, keys, pending.values, scaling, plan, kwargs)
        self._commit(keys, pending.values, plan)
        assert self.store is not None
        due = self._rows_due(plan)
        lse = None
        fused = (
            None if outputs_unused() else self._prefill_with_lse(query, scaling, plan, due, kwargs)
        )
        if outputs_unused():  # a replayed prefill: nothing reads this output
            out = unused_output(query, pending.values.shape[-1])
        elif fused is not None:  # the prompt's attention and its logsumexp, one call
            out, lse = fused
        else:
            out = ragged_attention(
                query,
                self.store,
                scale=scaling,
                query_lengths=plan.real if plan.padded else None,
                softcap=kwargs.get("softcap"),  # model-matrix: Gemma 2
                s_aux=kwargs.get("s_aux"),  # model-matrix: GPT-OSS learned sinks
            )
        if self.deferred and getattr(self.scorer, "prefill_queries", 0):
            self.observe_prefill(query, scaling, plan)
        for b in due:
            extra = {} if lse is None else {"window_lse": lse}
            self.evict(query[b : b + 1, :, plan.num_new - plan.real[b] :], scaling, row=b, **extra)
        if due:
            # the evicted rows leave the buffers: keep what the budget keeps, plus a little room
            # (a prompt's next chunk or the decode re-lays out with its own headroom)
            self.store.shrink(slack=1.0, room=self.PROMPT_ROOM)
        return out

    def take_pending(
        self, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> tuple[Pending, ForwardPlan]:
        """The stash of this forward and its plan: the one the forward's first layer built
        (shared through :attr:`shared`), or a new one (:meth:`check_forward`, or the
        :attr:`planner`'s, which checks every input before any layer changes).

        Raises:
            RuntimeError: no stash (``attend`` without a preceding ``update``).
            ValueError: see :meth:`check_forward`.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("RelayView.attend called without a preceding update()")
        spans = self.shared.reconstruction
        plan = self.shared.plan
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
            self.shared.plan = plan
        return pending, plan

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
            if r == 1 and self.evicted[b]:
                self.prompt_open[b] = False  # a decode step after the prompt's eviction
            elif r and self.prompt_open[b]:
                self.prompt_forwards[b] += 1
            self.padding[b] += plan.num_new - r
            self.stream_lengths[b] += r
            self.next_positions[b] += r
        self.seen_tokens += plan.num_new
        self.forwards += 1
