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
"Cache life cycle"), without one nothing. Size (~730 lines): the layer (its forward plan,
packing, attention and row bookkeeping) and the thin model cache stay together because the
layer is the planner of its own eviction stage and the cache only chooses it; splitting them
would put one protocol's two halves in two files.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvlab.integrations.cache_protocol import (
    CacheStorage,
    crop_count,
    dense_layer_storage,
    layers_storage,
)
from kvlab.integrations.forward import (
    ForwardPlan,
    ForwardState,
    LayerView,
    Pending,
    StoredShape,
    check_states,
    plan_decode,
)
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.model_support import layer_rotary
from kvlab.integrations.pnmix_cache import pnmix_config_for_model
from kvlab.integrations.relay_cache import RelayModelCache
from kvlab.integrations.relay_layer import RelayLayer
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step
from kvlab.pnmix.cache import UndoPoint
from kvlab.pnmix.quantizers import round_to_storage
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.evictor import Evictor
from kvlab.relay.storage import RelayStore
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["ComposedLayer", "ComposedModelCache", "ComposedView"]


class _ComposedState(ForwardState):
    """What the composed layers of one cache share: the forward's plan (as relay layers do)
    and the layers (their deferred PN-Mix value checks are read together, once)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[ComposedLayer] = []

    def check(self) -> None:
        """Read every deferred flag with one device read (none when nothing is pending).

        Raises:
            ValueError: naming the offending layer.
        """
        flags: list[Tensor] = []
        for layer in self.layers:
            if layer.pnmix is not None and layer.pnmix.pending_check() is not None:
                flags.append(layer.pnmix.pending_check())
        if not flags:
            return
        ok = bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
        for layer in self.layers:
            if layer.pnmix is not None:
                try:
                    layer.pnmix.check_values(assume_valid=ok)
                except ValueError as err:
                    raise ValueError(f"layer {layer.layer_idx}: {err}") from err


class ComposedView(LayerView):
    """Returned by :meth:`ComposedLayer.update`: attends through the composed layer
    (:meth:`ComposedLayer.attend`)."""


class ComposedLayer(CacheLayerMixin):
    """One full-attention decoder layer of a :class:`ComposedModelCache`: its eviction stage, a
    :class:`~kvlab.integrations.relay_cache.RelayLayer` (:attr:`relay_layer`: the prefill's
    ragged storage, exact attention and eviction, and the stream's counters), then a
    :class:`kvlab.pnmix.PNMixCache` (:attr:`pnmix`) holding the kept tokens as codes. The
    composed layer plans every forward (:meth:`check_forward`, the relay layer's planner).

    Args:
        config: the eviction (``ratio`` mode).
        rotary: the model's RoPE (the relay's rotations).
        layer_idx: the decoder layer.
        forward_state: shared by the cache's composed layers.
        uses_rope: False for a NoPE layer (``relay=False`` only).
        pnmix_config: the PN-Mix configuration of this layer (a NoPE layer's codec in its own
            frame).
        pnmix_rotary: the RoPE a position-aware codec rotates with (``None`` otherwise).
        record_kept: keep each row's kept stream indices (:attr:`kept_positions`; diagnostics,
            not counted in bytes).

    Attributes:
        relay_layer: the eviction stage (its ``store`` is dropped once the prefill is packed).
        pnmix: the layer's :class:`~kvlab.pnmix.PNMixCache` (``None`` until the prefill is
            packed).
        kept_positions: with ``record_kept``, ``(stream_indices, counts)`` — int64 ``[B, H_kv,
            W]`` on the device, each (row, head)'s kept stream indices in stream order (left
            aligned, ``counts [B, H_kv]`` host ints valid), as packed; else ``None``.
    """

    is_compileable = False
    is_sliding = False

    def __init__(
        self,
        config: EvictionConfig,
        rotary: RotaryConfig,
        layer_idx: int,
        forward_state: _ComposedState,
        *,
        uses_rope: bool = True,
        pnmix_config: PNMixConfig,
        pnmix_rotary: RotaryConfig | None,
        record_kept: bool = False,
    ) -> None:
        self.relay_layer = RelayLayer(
            config, rotary, layer_idx, forward_state, uses_rope=uses_rope, planner=self
        )
        # the kept tokens are packed after the first forward: a prompt is evicted once
        self.relay_layer.reevict_prompt = False
        super().__init__()
        self.pnmix_config = pnmix_config
        self.pnmix_rotary = pnmix_rotary
        self.record_kept = record_kept
        self._clear_packed()
        forward_state.layers.append(self)

    def _clear_packed(self) -> None:
        self.pnmix: PNMixCache | None = None
        # a deferred (KVzip) eviction: the prefill's queries at cache positions and real
        # query counts per row, kept until evict_reconstructed packs the kept tokens
        self._prefill_queries: tuple[Tensor, list[int]] | None = None
        self._inference = InferenceModeTracker()
        self.kept_positions: tuple[Tensor, np.ndarray] | None = None
        # while recording: an undo point per decode-phase token of the last forward
        self._undo: list[UndoPoint] = []

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """True while the cache records (speculative decoding)."""
        return self.forward_state.recording

    @property
    def undo_tokens(self) -> int:
        """Tokens :meth:`crop` can remove now: the last forward's decode-phase tokens."""
        return len(self._undo)

    # ---------------------------------------------------------------- the stream's state
    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        """Whether the layer has received its first tokens."""
        return self.relay_layer.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        self.relay_layer.is_initialized = value

    @property
    def layer_idx(self) -> int:
        return self.relay_layer.layer_idx

    @property
    def eviction(self) -> EvictionConfig:
        return self.relay_layer.eviction

    @property
    def rotary(self) -> RotaryConfig:
        return self.relay_layer.rotary

    @property
    def uses_rope(self) -> bool:
        return self.relay_layer.uses_rope

    @property
    def forward_state(self) -> ForwardState:
        return self.relay_layer.forward_state

    @property
    def evictor(self) -> Evictor:
        """The eviction policy (the relay layer's :class:`~kvlab.relay.evictor.Evictor`)."""
        return self.relay_layer.evictor

    @property
    def evicted(self) -> list[bool]:
        return self.relay_layer.evicted

    @property
    def store(self) -> RelayStore | None:
        """The prefill's RelayStore (``None`` before the first token and once packed)."""
        return self.relay_layer.store

    @property
    def seen_tokens(self) -> int:
        return self.relay_layer.seen_tokens

    @property
    def padding(self) -> list[int]:
        return self.relay_layer.padding

    @property
    def stream_lengths(self) -> list[int]:
        return self.relay_layer.stream_lengths

    @property
    def next_positions(self) -> list[int]:
        return self.relay_layer.next_positions

    @property
    def forwards(self) -> int:
        return self.relay_layer.forwards

    @property
    def events(self) -> list[EvictionEvent]:
        return self.relay_layer.events

    @property
    def dtype(self) -> torch.dtype:
        return self.relay_layer.dtype

    # ---------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """See :meth:`RelayLayer.lazy_initialization`."""
        self.relay_layer.lazy_initialization(key_states, value_states)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[ComposedView, ComposedView]:
        """Check ``[B, H_kv, T, D]`` rotated keys and ``[B, H_kv, T, Dv]`` values against the
        packed storage, then stash them in the eviction stage (:meth:`RelayLayer.update`) for
        this forward's :meth:`attend`.

        Raises:
            ValueError: shapes, dtype or device that differ from what the layer stores.
        """
        with self.forward_state.guard.checking(accept=False):
            check_states(key_states, value_states, self.layer_idx, self._packed_shape())
        # filled under torch.inference_mode(), continued outside it: release the packed
        # storage once (the eviction stage releases its own)
        self._inference.before_update(self.pnmix)
        self.relay_layer.update(key_states, value_states, *args, **kwargs)
        view = ComposedView(self)
        return view, view

    def drop_stash(self) -> None:
        """Forget the eviction stage's stash (a refused forward)."""
        self.relay_layer.drop_stash()

    def _packed_shape(self) -> StoredShape | None:
        pnmix = self.pnmix
        if pnmix is None:
            return None
        return StoredShape(
            pnmix.batch_size,
            pnmix.num_key_value_heads,
            pnmix.head_dim,
            pnmix.value_head_dim,
            self.dtype,
            pnmix.device,
            dtype_verb="takes",
        )

    def get_seq_length(self) -> int:
        """Tokens seen (columns, left padding included)."""
        return self.relay_layer.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.relay_layer.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.relay_layer.reset()
        self._clear_packed()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (``transformers``' convention): only
        the decode-phase tokens of the last forward while the cache records, each appended to
        the PN-Mix cache as one decode step (:meth:`kvlab.pnmix.PNMixCache.rollback` puts the
        codes, residual and tables back byte for byte; the stream counters go back).

        Raises:
            NotImplementedError: a crop of a cache that does not record.
            ValueError: a positive count, or more tokens than the last forward's decode-phase
                tokens; nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        if remove == 0:
            return
        if not self.forward_state.recording:
            raise NotImplementedError(
                "a composed cache can be cropped only while it records (Cache."
                "activate_past_recording(), which generate(assistant_model=...) calls)"
            )
        if remove > len(self._undo):
            raise ValueError(
                f"a composed layer can crop only the {len(self._undo)} decode-phase tokens of "
                f"its last forward (never into the prompt); asked to remove {remove}"
            )
        assert self.pnmix is not None
        self.pnmix.rollback(self._undo[-remove:])
        del self._undo[-remove:]
        relay = self.relay_layer
        relay.stream_lengths = [n - remove for n in relay.stream_lengths]
        relay.next_positions = [n - remove for n in relay.next_positions]
        relay.seen_tokens -= remove

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select the storage by ``beam_idx`` (beam search; reads the indices to the host)."""
        self._select_rows([int(i) for i in torch.as_tensor(beam_idx).tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = range(len(self.stream_lengths))
        self._select_rows([b for b in rows for _ in range(repeats)])

    def _select_rows(self, rows: list[int]) -> None:
        relay = self.relay_layer
        if self.pnmix is None:
            relay.select_rows(rows)
            if self._prefill_queries is not None:
                queries, real = self._prefill_queries
                index = torch.tensor(rows, dtype=torch.int64, device=queries.device)
                self._prefill_queries = (queries.index_select(0, index), [real[b] for b in rows])
            return
        self.pnmix.select_batch(torch.tensor(rows, dtype=torch.int64))
        relay.select_rows(rows)  # its per-row state (its store, if any, is empty by now)
        if self.kept_positions is not None:
            positions, counts = self.kept_positions
            index = torch.tensor(rows, dtype=torch.int64, device=positions.device)
            self.kept_positions = (positions.index_select(0, index), counts[rows])

    # ---------------------------------------------------------------- checks and plan
    def check_forward(
        self,
        pending: Pending,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
        *,
        reconstruction: bool = False,
    ) -> ForwardPlan:
        """The forward's plan (built by its first layer, before any layer changes): the
        relay layer's checks (:meth:`RelayLayer.check_forward`), plus — in the cache's first
        forward — a real token in every row, and — in later multi-token forwards — the deferred
        checks of earlier single-token forwards. A single-token forward after the prefill reads
        its attention mask, if it has one, once (:func:`kvlab.integrations.forward.plan_decode`)
        and nothing else.

        Raises:
            ValueError: see :meth:`RelayLayer.check_forward`; a row with no real token in the
                first forward; a deferred check that fails.
        """
        state = self.forward_state
        assert isinstance(state, _ComposedState)
        relay = self.relay_layer
        if self._prefill_queries is not None and not reconstruction:
            raise ValueError(
                "this ComposedModelCache's eviction waits for a reconstruction pass (scorer "
                f"{relay.scorer.name!r}): feed the whole prompt in one forward, then run "
                "kvlab.integrations.kvzip.compress(model, cache, input_ids), which evicts and "
                "packs, before any other forward (a second prompt chunk or a decode step is "
                "refused until then); nothing was stored"
            )
        if self.pnmix is not None and pending.keys.shape[2] == 1:
            return plan_decode(
                pending,
                attention_mask,
                kwargs,
                seen=relay.seen_tokens,
                nexts=relay.next_positions,
                padding=relay.padding,
                forward_index=relay.forwards,
            )
        if self.pnmix is not None:
            state.check()
        plan = relay.check_forward(pending, attention_mask, kwargs, reconstruction=reconstruction)
        if self.pnmix is None and plan.decode_from == 0:
            raise ValueError(
                "a recording ComposedModelCache evicts and packs its first forward's prompt: "
                "expect_prompt must mark at least one token of it"
            )
        late = []
        if self.pnmix is not None:
            prompt = plan.real
            if plan.decode_from is not None:  # recording: only the prompt's columns count
                prompt = [min(r, plan.decode_from) for r in plan.real]
            late = [b for b, r in enumerate(prompt) if r > 1 and relay.prompt_open[b]]
        if late:
            warnings.warn(
                f"ComposedModelCache: rows {late} receive more of their prompt after the "
                "forward it was evicted in; a composed cache evicts a prompt once, after the "
                "cache's first forward, and stores later tokens whole (details()['"
                "prompt_forwards']); feed the prompt in one forward, or use RelayModelCache, "
                "which evicts every chunk of a prompt to its budget",
                UserWarning,
                stacklevel=2,
            )
        if self.pnmix is None:
            empty = [b for b, r in enumerate(plan.real) if r == 0]
            if empty:
                raise ValueError(
                    f"ComposedModelCache evicts and packs at the cache's first forward; rows "
                    f"{empty} have no real token in it (all padding)"
                )
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
        """This layer's part of a forward. The cache's first forward: the relay layer's
        (:meth:`RelayLayer.attend`: checks, commit, exact attention, eviction), then the kept
        tokens are packed (:meth:`_pack`). Later forwards: checks (a single-token forward reads
        nothing back), append to :attr:`pnmix`, packed attention.

        Args:
            query: ``[B, H_q, T, D]`` rotated by the model at its ``position_ids``.
            scaling: the model's softmax scale.
            attention_mask: ``None`` or the 2-D keep mask ``[B, seen + T]`` (left padding).
            kwargs: the attention kwargs (``position_ids``; ``softcap``, ``s_aux``).

        Returns:
            ``[B, H_q, T, Dv]`` in the query dtype.

        Raises:
            ValueError: bad inputs (first layer of a forward, before any layer changes); keys or
                values beyond the PN-Mix storage range in a multi-token forward (raised by the
                layer storing them before it changes; earlier layers have stored theirs: reset
                the cache).
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        relay = self.relay_layer
        if self.forward_state.recording and self.forward_state.reconstruction is None:
            return self._attend_recording(query, scaling, attention_mask, kwargs)
        if self.pnmix is None:
            reconstructing = self.forward_state.reconstruction is not None
            stash = relay.stash
            if stash is not None and not reconstructing:  # before the RelayStore commits
                self._check_storable(stash.keys, stash.values)
            out = relay.attend(query, scaling=scaling, attention_mask=attention_mask, kwargs=kwargs)
            if reconstructing:  # KVzip's pass: scored by the relay stage, nothing stored
                return out
            plan = self.forward_state.plan
            assert plan is not None
            if plan.shift is not None and self.uses_rope:
                query = rotate_by_delta(query, plan.shift, self.rotary)
            if relay.deferred:  # packed by pack_reconstructed, after the KVzip eviction
                self._prefill_queries = (query, list(plan.real))
            else:
                self._pack(query, plan)
            return out
        pending, plan = relay.take_pending(attention_mask, kwargs)
        keys = pending.keys
        if plan.shift is not None and self.uses_rope:
            keys = rotate_by_delta(keys, plan.shift, self.rotary)
            query = rotate_by_delta(query, plan.shift, self.rotary)
        if plan.num_new == 1:
            # append + attend as PNMixView does: one compiled call on the CPU backend when the
            # token only fills a residual slot (the same bytes and logits as the two calls)
            out = pnmix_decode_step(
                query,
                keys,
                pending.values,
                self.pnmix,
                scale=scaling,
                logit_softcap=kwargs.get("softcap"),  # model-matrix: Gemma 2
                sink_logits=kwargs.get("s_aux"),  # model-matrix: GPT-OSS learned sinks
            )
            relay.advance(plan)
            return out
        # later forwards never pad (the plan refuses padding after a row's first token)
        self.pnmix.append(
            keys,
            pending.values,
            checks="eager",
            queries=query,
        )
        relay.advance(plan)
        return pnmix_attention(
            query,
            self.pnmix,
            scale=scaling,
            causal=True,
            logit_softcap=kwargs.get("softcap"),  # model-matrix: Gemma 2
            sink_logits=kwargs.get("s_aux"),  # model-matrix: GPT-OSS learned sinks
        ).to(query.dtype)

    def _attend_recording(
        self,
        query: Tensor,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """A forward while the cache records (speculative decoding): its columns before the
        prompt's end go the plain way (the first forward: exact attention, eviction, packing),
        each later one is one PN-Mix decode step (:func:`kvlab.pnmix.pnmix_decode_step`) at
        the position the relay moved it to, with an undo point for :meth:`crop` — what the
        one-token forwards of a plain run store and see. They close the prompt."""
        relay = self.relay_layer
        if self.pnmix is None:
            stash = relay.stash
            if stash is not None:  # before the RelayStore commits anything
                self._check_storable(stash.keys, stash.values)
        pending, plan = relay.take_pending(attention_mask, kwargs)
        self._undo = []
        batch, t = plan.batch, plan.num_new
        prompt = plan.decode_from
        if prompt is None:  # a single-token forward after the prefill (plan_decode)
            prompt = 0 if self.pnmix is not None else t
        keys, values = pending.keys, pending.values
        softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
        before = list(relay.next_positions) or [0] * batch
        outs: list[Tensor] = []
        if prompt:
            real = plan.real if prompt == t else [prompt] * batch
            head = ForwardPlan(
                plan.forward_index,
                batch,
                prompt,
                real,
                plan.shift,
                first_eviction=plan.first_eviction,
            )
            hq, hk, hv = query[:, :, :prompt], keys[:, :, :prompt], values[:, :, :prompt]
            if self.pnmix is None:
                outs.append(relay._attend_part(hq, hk, hv, head, scaling, kwargs))
                if plan.shift is not None and self.uses_rope:
                    hq = rotate_by_delta(hq, plan.shift, self.rotary)
                self._pack(hq, head)
            else:  # more of a prompt after the prefill: appended whole, as outside recording
                if plan.shift is not None and self.uses_rope:
                    hk = rotate_by_delta(hk, plan.shift, self.rotary)
                    hq = rotate_by_delta(hq, plan.shift, self.rotary)
                self.pnmix.append(hk, hv, checks="eager", queries=hq)
                relay.advance(head)
                outs.append(
                    pnmix_attention(
                        hq,
                        self.pnmix,
                        scale=scaling,
                        causal=True,
                        logit_softcap=softcap,
                        sink_logits=s_aux,
                    ).to(query.dtype)
                )
        if prompt < t:
            relay.prompt_open = [False] * len(relay.prompt_open)
            assert self.pnmix is not None  # the plan refuses a first forward without a prompt
            for j in range(prompt, t):
                moved = [n - b - j for n, b in zip(relay.next_positions, before, strict=True)]
                shift = plan.shift
                if any(moved):
                    delta = torch.tensor(moved, dtype=torch.int64, device=keys.device)
                    delta = delta.view(-1, 1, 1)
                    shift = delta if shift is None else shift + delta
                kj, qj = keys[:, :, j : j + 1], query[:, :, j : j + 1]
                if shift is not None and self.uses_rope:
                    kj = rotate_by_delta(kj, shift, self.rotary)
                    qj = rotate_by_delta(qj, shift, self.rotary)
                self._undo.append(self.pnmix.undo_point())
                outs.append(
                    pnmix_decode_step(
                        qj,
                        kj,
                        values[:, :, j : j + 1],
                        self.pnmix,
                        scale=scaling,
                        logit_softcap=softcap,
                        sink_logits=s_aux,
                    )
                )
                relay.advance(ForwardPlan(plan.forward_index, batch, 1, [1] * batch, None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _check_storable(self, keys: Tensor, values: Tensor) -> None:
        """Refuse a first forward whose keys or values (padding included) the PN-Mix storage
        cannot hold — NaN, inf, or beyond the storage dtype's range — before the layer
        stores or evicts anything (:meth:`_pack` would fail after both, and every later
        forward would repack the same tokens).

        Raises:
            ValueError: as :func:`kvlab.pnmix.quantizers.round_to_storage`.
        """
        dtype = self.pnmix_config.storage_dtype
        round_to_storage(keys, dtype, name="keys")
        round_to_storage(values, dtype, name="values")

    def pack_reconstructed(self) -> None:
        """Pack the kept tokens of a deferred (KVzip) eviction with the prefill's queries
        (:meth:`_pack`); called by :meth:`ComposedModelCache.evict_reconstructed` once every
        row has evicted.

        Raises:
            RuntimeError: no deferred prefill waits, or a row has not evicted yet.
        """
        if self._prefill_queries is None or self.pnmix is not None:
            raise RuntimeError(f"layer {self.layer_idx}: no deferred prefill waits to be packed")
        if not all(self.relay_layer.evicted):
            raise RuntimeError(
                f"layer {self.layer_idx}: rows {[b for b, e in enumerate(self.evicted) if not e]} "
                "have not evicted; a composed cache packs every row at once"
            )
        queries, real = self._prefill_queries
        self._pack_rows(queries, real)
        self._prefill_queries = None

    def _pack(self, query: Tensor, plan: ForwardPlan) -> None:
        self._pack_rows(query, plan.real)

    def _pack_rows(self, query: Tensor, real: list[int]) -> None:
        """Move every (row, head)'s tokens — after the eviction, its kept ones, relayed or
        not — from the RelayStore into a new PN-Mix cache, right-aligned with per-(row, head)
        lengths, at position offsets ``next_position - count``; the per-pair tables read the
        forward's real queries ``query`` (at cache positions). Drops the RelayStore."""
        relay = self.relay_layer
        store = relay.store
        assert store is not None
        counts = np.asarray([store.counts(b) for b in range(store.batch)], dtype=np.int64)
        view = store.padded()
        width = int(counts.max(initial=0))
        # right-align: output slot j of row (b, h) reads slot j - (width - count) of the view
        source = np.arange(width)[None, None, :] - (width - counts)[..., None]
        index = torch.from_numpy(np.maximum(source, 0)).to(store.device).unsqueeze(-1)
        keys = view.keys.gather(2, index.expand(-1, -1, -1, store.head_dim))
        values = view.values.gather(2, index.expand(-1, -1, -1, store.value_dim))
        pnmix = PNMixCache(
            self.pnmix_config,
            batch_size=store.batch,
            num_key_value_heads=store.heads,
            head_dim=store.head_dim,
            value_head_dim=store.value_dim,
            device=store.device,
            rotary=self.pnmix_rotary,
        )
        if pnmix.codec.position_aware:
            pnmix.set_position_offsets(np.asarray(relay.next_positions)[:, None] - counts)
        pnmix.append(keys, values, counts, checks="eager", queries=query, query_lengths=real)
        if self.record_kept:
            self.kept_positions = (view.original_positions, counts)
        self.pnmix = pnmix
        relay.store = None

    # ---------------------------------------------------------------- sizes
    def tokens_per_head(self, row: int = 0) -> list[int]:
        """Tokens stored per kv head of sequence ``row`` (empty before the first token)."""
        if self.pnmix is None:
            return self.relay_layer.tokens_per_head(row)
        return [int(n) for n in self.pnmix.seq_lengths[row]]

    def max_tokens(self) -> int:
        """The most tokens any (sequence, kv head) stores."""
        if self.pnmix is None:
            return self.relay_layer.max_tokens()
        return int(self.pnmix.seq_lengths.max(initial=0))

    def segment(self, row: int, head: int) -> Any:
        """Only before the prefill is packed (the RelayStore's segment).

        Raises:
            RuntimeError: the tokens are packed (read :attr:`pnmix`, e.g. ``dequantize()``).
        """
        if self.pnmix is not None:
            raise RuntimeError(
                "the layer's tokens are packed as PN-Mix codes: read layer.pnmix (e.g. "
                "dequantize(), seq_lengths)"
            )
        return self.relay_layer.segment(row, head)

    def nbytes(self) -> int:
        """Used bytes of the PN-Mix storage (sinks, groups, residual, tables; docs/design.md,
        "PN-Mix: Byte accounting")."""
        if self.pnmix is None:
            return self.relay_layer.nbytes()
        return self.pnmix.persistent_bytes

    def numel(self) -> int:
        """Key and value elements of the stored tokens (``tokens * (D + Dv)``; packed)."""
        if self.pnmix is None:
            return self.relay_layer.numel()
        p = self.pnmix
        return int(p.seq_lengths.sum()) * (p.head_dim + p.value_head_dim)

    def reserved_bytes(self) -> int:
        """Bytes allocated for the storage (spare group slots and residual slots included)."""
        if self.pnmix is None:
            return self.relay_layer.reserved_bytes()
        return sum(self.pnmix.reserved_bytes().values())

    def index_bytes(self) -> int:
        """0 once packed: positions are ``offset + stream index`` (host ints)."""
        return self.relay_layer.index_bytes() if self.pnmix is None else 0

    def held_bytes(self) -> int:
        """Bytes of every buffer held: the PN-Mix storage's allocation (spare slots included)
        and the eviction stage's store while it has one."""
        packed = 0 if self.pnmix is None else sum(self.pnmix.reserved_bytes().values())
        waiting = self._prefill_queries
        queries = 0 if waiting is None else waiting[0].numel() * waiting[0].element_size()
        return packed + queries + self.relay_layer.held_bytes()


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

    #: crops (RelayModelCache.crop) are bounded by the composed layers' undo state
    _crop_label = "composed"

    def _crop_layers(self) -> list[Any]:
        return self._composed_layers()

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
        self._check_pnmix(text_config)
        super().__init__(model_config, eviction, rotary=rotary)

    def _check_pnmix(self, text_config: Any) -> None:
        """Build an empty one-row PN-Mix cache of the model's head shape, so that a
        configuration PN-Mix refuses fails here, before any forward."""
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        codec = self.pnmix_config.key_codec
        PNMixCache(
            self.pnmix_config,
            batch_size=1,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary=layer_rotary(text_config) if codec.position_aware else None,
        )

    def _forward_state(self) -> _ComposedState:
        return _ComposedState()

    def _full_layer(self, index: int, state: ForwardState) -> ComposedLayer:
        assert isinstance(state, _ComposedState)
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

    def check_values(self) -> None:
        """Check every single-token forward since the last check (values finite and within the
        storage range, mask columns): one device read for all layers, none if there is
        nothing to check.

        Raises:
            ValueError: naming the first offending layer (its storage holds the bad values).
        """
        state = self._composed_layers()[0].forward_state if self._composed_layers() else None
        if isinstance(state, _ComposedState):
            state.check()

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

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    def details(self) -> dict[str, Any]:
        """:meth:`RelayModelCache.details` and ``packed_attention_calls``
        (:meth:`attention_calls`)."""
        details = super().details()
        details["packed_attention_calls"] = self.attention_calls()
        return details

    def storage(self) -> CacheStorage:
        """Composed layers at their used bytes (:meth:`ComposedLayer.nbytes`: the PN-Mix
        storage once packed) in both counts (its exact parts and scales are stored in 2
        bytes), no index bytes (positions are ``offset + stream index``), and the bytes held
        (:meth:`ComposedLayer.held_bytes`); window layers as held
        (:func:`~kvlab.integrations.cache_protocol.dense_layer_storage`)."""
        return layers_storage(
            (
                layer,
                CacheStorage(layer.nbytes(), layer.nbytes(), 0, layer.held_bytes())
                if isinstance(layer, ComposedLayer)
                else dense_layer_storage(layer),
            )
            for layer in self.layers
        )
