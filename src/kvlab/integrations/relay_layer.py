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
from transformers.cache_utils import CacheLayerMixin

from kvlab.integrations.attention import outputs_unused, unused_output
from kvlab.integrations.cache_protocol import crop_count
from kvlab.integrations.forward import (
    ForwardPlan,
    ForwardState,
    LayerView,
    Pending,
    Planner,
    StoredShape,
    check_states,
    plan_forward,
)
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.relay.attention import ragged_attention
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.evictor import Evictor
from kvlab.relay.reconstruction import join_max, observe, reconstruct_row
from kvlab.relay.scorers import Scorer
from kvlab.relay.storage import RelayStore
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["RelayLayer", "RelayView"]


class RelayView(LayerView):
    """Returned by :meth:`RelayLayer.update`: commits the stashed tokens, attends over the
    layer's ragged storage in one call, and evicts when due (:meth:`RelayLayer.attend`)."""


class RelayLayer(CacheLayerMixin):
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

    is_compileable = False
    is_sliding = False
    #: ratio mode: evict again after each later multi-token forward of an open prompt (False
    #: for the composed cache's eviction stage, which packs after the first forward)
    reevict_prompt = True

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
    def is_croppable(self) -> bool:  # type: ignore[override]
        """True while the cache records (speculative decoding): :meth:`crop` then removes
        the decode-phase tokens of the last forward."""
        return self.forward_state.recording

    @property
    def num_layers(self) -> int:
        """Evicting (full-attention) layers the model's budget is split over (set by the model
        cache; per-layer budgets need it)."""
        return self.evictor.num_layers

    @num_layers.setter
    def num_layers(self, value: int) -> None:
        self.evictor.num_layers = value

    @property
    def budget_index(self) -> int:
        """This layer's entry among the :attr:`num_layers` evicting layers (its position
        among the model's full-attention layers; set by the model cache)."""
        return self.evictor.budget_index

    @budget_index.setter
    def budget_index(self, value: int) -> None:
        self.evictor.budget_index = value

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
        # while recording: decode-phase tokens the last forward appended (croppable), and per
        # token the layer's state before it when that step may evict (capacity mode)
        self.undo_tokens = 0
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
        # filled under torch.inference_mode(), continued outside it: release the store once
        self._inference.before_update(self.store)
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
        """Empty the layer as a new one (``Cache.reset``), and the forward state it shares."""
        self._clear()
        self.forward_state.reset()

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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select the storage by ``beam_idx`` (beam search; reads the indices to the host)."""
        self.select_rows([int(i) for i in torch.as_tensor(beam_idx).tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = range(len(self.stream_lengths))
        self.select_rows([b for b in rows for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (``transformers``' convention;
        ``crop(0)`` does nothing): only decode-phase tokens of the last forward while the cache
        records — appended after the prompt's eviction, so every segment's last tokens.

        Raises:
            NotImplementedError: a crop of a cache that does not record.
            ValueError: a positive count, or more tokens than the last forward's decode-phase
                tokens (a prompt token, an earlier forward's); nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        if remove == 0:
            return
        if not self.forward_state.recording:
            raise NotImplementedError(
                "a relay cache can be cropped only while it records (Cache."
                "activate_past_recording(), which generate(assistant_model=...) calls)"
            )
        if remove > self.undo_tokens:
            raise ValueError(
                f"a relay layer can crop only the {self.undo_tokens} decode-phase tokens of its "
                f"last forward (never into the prompt); asked to remove {remove}"
            )
        points = self._undo[-remove:]
        first = next((i for i, p in enumerate(points) if p is not None), None)
        if first is not None:  # an evicting step among the removed ones: its copy, then cut
            state = points[first]
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
        del self._undo[-len(points) :]
        self.undo_tokens = len(self._undo)

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
        prompt_real = plan.real
        if self.forward_state.recording and not reconstruction:
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
        """While recording: the new columns before the prompt's end (``prompt_end``); the
        rest are decode-phase tokens.

        Raises:
            ValueError: a multi-token first forward without ``expect_prompt``, or padding in a
                forward with decode-phase tokens.
        """
        end = self.forward_state.prompt_end
        if end is None:
            if self.seen_tokens == 0 and plan.num_new > 1:
                raise ValueError(
                    "a relay cache recording for speculative decoding (generate(assistant_model"
                    "=...) or prompt_lookup_num_tokens) cannot tell the prompt from the draft in "
                    "transformers' first forward, which feeds both: call "
                    "cache.expect_prompt(input_ids.shape[1]) before generate"
                )
            end = self.seen_tokens
        prompt = min(max(end - self.seen_tokens, 0), plan.num_new)
        if prompt < plan.num_new and plan.padded:
            raise ValueError(
                "a relay cache recording for speculative decoding takes no padding in a forward "
                "with decode-phase tokens"
            )
        return prompt

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
        if spans is None:
            self.undo_tokens = 0  # a new forward: the last one was accepted
            self._undo = []
        prompt = plan.decode_from
        if spans is None and prompt is not None and prompt < plan.num_new:
            return self._attend_recording(query, pending, plan, prompt, scaling, kwargs)
        return self._attend_part(query, pending.keys, pending.values, plan, scaling, kwargs)

    def _attend_recording(
        self,
        query: Tensor,
        pending: Pending,
        plan: ForwardPlan,
        prompt: int,
        scaling: float,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """A recording forward with decode-phase tokens: its first ``prompt`` columns go as a
        forward of their own (a prompt evicts at its end), then the rest are appended after
        that eviction, at the positions the relay moved them to, and attend as one-token
        forwards would (exact attention over the stored tokens, causal): the eviction schedule
        of the plain run. They close the prompt and are croppable (:meth:`crop`)."""
        batch, t = plan.batch, plan.num_new
        keys, values = pending.keys, pending.values
        outs: list[Tensor] = []
        before = list(self.next_positions) or [0] * batch
        if prompt:
            head = ForwardPlan(
                plan.forward_index,
                batch,
                prompt,
                [prompt] * batch,
                plan.shift,
                first_eviction=plan.first_eviction,
            )
            outs.append(
                self._attend_part(
                    query[:, :, :prompt],
                    keys[:, :, :prompt],
                    values[:, :, :prompt],
                    head,
                    scaling,
                    kwargs,
                )
            )
        # model position of column `prompt` -> the cache position the relay left it
        moved = [n - b - prompt for n, b in zip(self.next_positions, before, strict=True)]
        shift = plan.shift
        if any(moved):
            delta = torch.tensor(moved, dtype=torch.int64, device=keys.device).view(-1, 1, 1)
            shift = delta if shift is None else shift + delta
        self.prompt_open = [False] * len(self.prompt_open)
        if self.eviction.capacity is None:  # ratio mode: decoding never evicts
            tail = ForwardPlan(plan.forward_index, batch, t - prompt, [t - prompt] * batch, shift)
            outs.append(
                self._attend_part(
                    query[:, :, prompt:],
                    keys[:, :, prompt:],
                    values[:, :, prompt:],
                    tail,
                    scaling,
                    kwargs,
                )
            )
            self._undo = [None] * (t - prompt)
        else:  # capacity mode: one step per token, each may evict (a copy before it)
            undo: list[dict[str, Any] | None] = []
            for j in range(prompt, t):
                undo.append(self._snapshot())
                moved = [n - b - j for n, b in zip(self.next_positions, before, strict=True)]
                shift = plan.shift
                if any(moved):
                    delta = torch.tensor(moved, dtype=torch.int64, device=keys.device)
                    delta = delta.view(-1, 1, 1)
                    shift = delta if shift is None else shift + delta
                step = ForwardPlan(plan.forward_index, batch, 1, [1] * batch, shift)
                outs.append(
                    self._attend_part(
                        query[:, :, j : j + 1],
                        keys[:, :, j : j + 1],
                        values[:, :, j : j + 1],
                        step,
                        scaling,
                        kwargs,
                    )
                )
            self._undo = undo
        self.prompt_open = [False] * len(self.prompt_open)
        self.undo_tokens = t - prompt
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

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

    def _attend_part(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        plan: ForwardPlan,
        scaling: float,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """Commit ``keys``/``values`` by ``plan``, attend with ``query``, evict when due (the
        body of :meth:`attend`)."""
        spans = self.forward_state.reconstruction
        pending = Pending(keys, values, None)
        if plan.shift is not None and self.uses_rope:
            keys = rotate_by_delta(keys, plan.shift, self.rotary)
            query = rotate_by_delta(query, plan.shift, self.rotary)
        if spans is not None:
            return self._attend_reconstruction(query, keys, pending.values, scaling, plan, kwargs)
        self._commit(keys, pending.values, plan)
        assert self.store is not None
        if outputs_unused():  # a replayed prefill: nothing reads this output
            out = unused_output(query, pending.values.shape[-1])
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
            if r == 1 and self.evicted[b]:
                self.prompt_open[b] = False  # a decode step after the prompt's eviction
            elif r and self.prompt_open[b]:
                self.prompt_forwards[b] += 1
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
                :meth:`kvlab.integrations.RelayModelCache.evict_reconstructed`), or ``None``.

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
