"""The composed cache layer: eviction, then PN-Mix codes for the kept tokens, in one
full-attention decoder layer of a :class:`~kvlab.integrations.composed_cache.ComposedModelCache`
(its module docstring: the prefill, packing, later forwards, KVzip; docs/design.md, "Eviction
composed with PN-Mix").

:class:`ComposedLayer` composes two stages and forwards nothing: its eviction stage, a
:class:`~kvlab.integrations.relay_layer.RelayLayer` (:attr:`ComposedLayer.relay_layer`: the
prefill's ragged storage, exact attention and eviction, and the stream's counters and positions,
read there), whose forwards the composed layer plans (:meth:`ComposedLayer.check_forward`); and a
:class:`kvlab.pnmix.PNMixCache` (:attr:`ComposedLayer.pnmix`) that holds the kept tokens as codes
once the prefill is evicted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvlab.integrations.cache_protocol import CacheStorage
from kvlab.integrations.decode_steps import attend_decode_tokens, rollback_decode_tokens
from kvlab.integrations.forward import (
    ForwardPlan,
    ForwardState,
    Pending,
    StoredShape,
    check_states,
    plan_decode,
)
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.layer import Forward, KVLabLayer, LayerView
from kvlab.integrations.relay_layer import RelayLayer
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step
from kvlab.pnmix.quantizers import round_to_storage
from kvlab.relay.config import EvictionConfig
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["ComposedLayer", "ComposedView"]


class ComposedView(LayerView):
    """Returned by :meth:`ComposedLayer.update`: attends through the composed layer
    (:meth:`ComposedLayer.attend`)."""


class ComposedLayer(KVLabLayer):
    """One full-attention decoder layer of a
    :class:`~kvlab.integrations.composed_cache.ComposedModelCache` (module docstring).

    Args:
        config: the eviction (``ratio`` mode).
        rotary: the model's RoPE (the relay's rotations).
        layer_idx: the decoder layer.
        forward_state: shared by the cache's composed layers and their eviction stages.
        uses_rope: False for a NoPE layer (``relay=False`` only).
        pnmix_config: the PN-Mix configuration of this layer (a NoPE layer's codec in its own
            frame).
        pnmix_rotary: the RoPE a position-aware codec rotates with (``None`` otherwise).
        record_kept: keep each row's kept stream indices (:attr:`kept_positions`; diagnostics,
            not counted in bytes).

    Attributes:
        relay_layer: the eviction stage (its ``store`` is dropped once the prefill is packed;
            its counters — ``seen_tokens``, ``stream_lengths``, ``next_positions``, ``events``
            — are the layer's).
        pnmix: the layer's :class:`~kvlab.pnmix.PNMixCache` (``None`` until the prefill is
            packed).
        kept_positions: with ``record_kept``, ``(stream_indices, counts)`` — int64 ``[B, H_kv,
            W]`` on the device, each (row, head)'s kept stream indices in stream order (left
            aligned, ``counts [B, H_kv]`` host ints valid), as packed; else ``None``.
    """

    kind = "composed"
    view_class = ComposedView

    def __init__(
        self,
        config: EvictionConfig,
        rotary: RotaryConfig,
        layer_idx: int,
        forward_state: ForwardState,
        *,
        uses_rope: bool = True,
        pnmix_config: PNMixConfig,
        pnmix_rotary: RotaryConfig | None,
        record_kept: bool = False,
    ) -> None:
        # the stage first: is_initialized (set by the base) is the stage's
        self.relay_layer = RelayLayer(
            config, rotary, layer_idx, forward_state, uses_rope=uses_rope, planner=self
        )
        # the kept tokens are packed after the first forward: a prompt is evicted once
        self.relay_layer.reevict_prompt = False
        super().__init__(forward_state, layer_idx)
        self.shared: ForwardState
        self.pnmix_config = pnmix_config
        self.pnmix_rotary = pnmix_rotary
        self.record_kept = record_kept
        self._clear_packed()

    def _clear_packed(self) -> None:
        self.pnmix: PNMixCache | None = None
        # a deferred (KVzip) eviction: the prefill's queries at cache positions and real
        # query counts per row, kept until evict_reconstructed packs the kept tokens
        self._prefill_queries: tuple[Tensor, list[int]] | None = None
        self._inference = InferenceModeTracker()
        self.kept_positions: tuple[Tensor, np.ndarray] | None = None
        # while recording: an undo point per decode-phase token of the last forward
        self._undo = []

    # ---------------------------------------------------------------- the layer contract
    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        """Whether the layer has received its first tokens (its eviction stage has)."""
        return self.relay_layer.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        self.relay_layer.is_initialized = value

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """The eviction stage's (:meth:`RelayLayer.lazy_initialization`)."""
        self.relay_layer.lazy_initialization(key_states, value_states)

    def get_seq_length(self) -> int:
        """Tokens seen (columns, left padding included)."""
        return self.relay_layer.seen_tokens

    def check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        """Refuse states that do not fit the packed storage (the eviction stage checks its own
        when it stashes them).

        Raises:
            ValueError: shapes, dtype or device that differ from what the layer stores.
        """
        check_states(key_states, value_states, self.layer_idx, self._packed_shape())

    def _packed_shape(self) -> StoredShape | None:
        pnmix = self.pnmix
        if pnmix is None:
            return None
        return StoredShape(
            pnmix.batch_size,
            pnmix.num_key_value_heads,
            pnmix.head_dim,
            pnmix.value_head_dim,
            self.relay_layer.dtype,
            pnmix.device,
            dtype_verb="takes",
        )

    def held_store(self) -> PNMixCache | None:
        return self.pnmix  # the eviction stage releases its own

    def deferred_store(self) -> PNMixCache | None:
        return self.pnmix

    def stash_states(
        self, key_states: Tensor, value_states: Tensor, kwargs: dict[str, Any]
    ) -> None:
        """Stash in the eviction stage (:meth:`RelayLayer.update`: its checks, then the
        stash)."""
        self.relay_layer.update(key_states, value_states, **kwargs)

    def drop_stash(self) -> None:
        self.relay_layer.drop_stash()

    def reset(self) -> None:
        self.relay_layer.reset()
        self._clear_packed()

    def rollback(self, entries: list[Any]) -> None:
        """Roll the PN-Mix cache back to the first entry's undo point
        (:meth:`kvlab.pnmix.PNMixCache.rollback` puts the codes, residual and tables back byte
        for byte) and the stream counters with it."""
        assert self.pnmix is not None
        rollback_decode_tokens(self.pnmix, entries)
        remove = len(entries)
        relay = self.relay_layer
        relay.stream_lengths = [n - remove for n in relay.stream_lengths]
        relay.next_positions = [n - remove for n in relay.next_positions]
        relay.seen_tokens -= remove

    def batch_rows(self) -> int:
        return len(self.relay_layer.stream_lengths)

    def select_batch(self, index: Tensor) -> None:
        """Row-select the storage (reads the indices to the host)."""
        self._select_rows([int(i) for i in index.tolist()])

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
                first forward; a deferred check that fails; more of an open prompt after the
                forward it was evicted and packed in (a split prompt, whose budget a composed
                cache cannot honour).
        """
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
            self.shared.check()
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
            raise ValueError(
                f"ComposedModelCache: rows {late} would receive more of their prompt after the "
                "forward it was evicted and packed in (a multi-token forward before any decode "
                "step after that eviction); a composed cache evicts a prompt once, at the "
                "cache's first forward, and cannot honour the budget of a split prompt: feed the "
                "prompt in one forward, use RelayModelCache (which evicts every chunk of a prompt "
                "to its budget), or call cache.end_prompt() first if these tokens continue the "
                "conversation; nothing was stored"
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
    def begin(self, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> Forward:
        """The stash (the cache's first forward: refused if the PN-Mix storage could not hold
        it) and the forward's plan (:meth:`check_forward`, built by the forward's first
        layer); decode-phase tokens start at the plan's ``decode_from``.

        Raises:
            ValueError: see :meth:`check_forward`; keys or values the PN-Mix storage cannot
                hold in the first forward; nothing is stored.
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        relay = self.relay_layer
        reconstructing = self.shared.reconstruction is not None
        stash = relay.stash
        if self.pnmix is None and stash is not None and not reconstructing:
            self._check_storable(stash.keys, stash.values)  # before the RelayStore commits
        pending, plan = relay.take_pending(attention_mask, kwargs)
        total = plan.num_new
        prompt = plan.decode_from
        if reconstructing:
            prompt = total
        elif prompt is None:
            prompt = total if self.pnmix is None else self.decode_start(relay.seen_tokens, total)
        positions = list(relay.next_positions) or [0] * plan.batch
        return Forward(pending.keys, pending.values, prompt, plan, not reconstructing, positions)

    def attend_prompt(
        self, query: Tensor, forward: Forward, columns: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The cache's first forward: the eviction stage's (:meth:`RelayLayer.attend_part`:
        commit, exact attention, eviction), then the kept tokens are packed (:meth:`_pack`;
        a KVzip eviction waits for its reconstruction pass). Later forwards: append to
        :attr:`pnmix` and attend over the packed codes (a single-token forward in one step,
        :func:`kvlab.pnmix.pnmix_decode_step`, as a PN-Mix layer does)."""
        relay = self.relay_layer
        plan: ForwardPlan = forward.plan
        keys, values = forward.keys, forward.values
        if columns < forward.num_new:  # the prompt's columns of a forward with decode steps
            keys, values = keys[:, :, :columns], values[:, :, :columns]
            plan = ForwardPlan(
                plan.forward_index,
                plan.batch,
                columns,
                [columns] * plan.batch,
                plan.shift,
                first_eviction=plan.first_eviction,
            )
        rotate = plan.shift is not None and relay.uses_rope
        if self.pnmix is None:
            out = relay.attend_part(query, keys, values, plan, scaling, kwargs)
            if self.shared.reconstruction is not None:  # KVzip's pass: scored, nothing stored
                return out
            if rotate:
                query = rotate_by_delta(query, plan.shift, relay.rotary)
            if relay.deferred:  # packed by pack_reconstructed, after the KVzip eviction
                self._prefill_queries = (query, list(plan.real))
            else:
                self._pack(query, plan)
            return out
        if rotate:
            keys = rotate_by_delta(keys, plan.shift, relay.rotary)
            query = rotate_by_delta(query, plan.shift, relay.rotary)
        softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
        if forward.num_new == 1:
            # append + attend as a PN-Mix layer does: one compiled call on the CPU backend when
            # the token only fills a residual slot (the same bytes and logits as the two calls)
            out = pnmix_decode_step(
                query,
                keys,
                values,
                self.pnmix,
                scale=scaling,
                logit_softcap=softcap,
                sink_logits=s_aux,
            )
            relay.advance(plan)
            return out
        # later forwards never pad (the plan refuses padding after a row's first token)
        self.pnmix.append(keys, values, checks="eager", queries=query)
        relay.advance(plan)
        return pnmix_attention(
            query,
            self.pnmix,
            scale=scaling,
            causal=True,
            logit_softcap=softcap,  # model-matrix: Gemma 2
            sink_logits=s_aux,  # model-matrix: GPT-OSS learned sinks
        ).to(query.dtype)

    def attend_decoded(
        self, query: Tensor, forward: Forward, start: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The columns from ``start`` on as PN-Mix decode steps at the positions the relay
        moved them to: stored one append each (an undo point before each while the cache
        records), attended in one call with the decode steps' numbers
        (:mod:`kvlab.integrations.decode_steps`) — what the one-token forwards of a plain run
        store and see. They close the prompt."""
        relay = self.relay_layer
        relay.prompt_open = [False] * len(relay.prompt_open)
        pnmix = self.pnmix
        assert pnmix is not None  # the plan refuses a first forward without a prompt
        plan: ForwardPlan = forward.plan
        # the relay moved every decode-phase token by the same shift (one position each)
        shift = relay.shift_after(forward, start)
        keys, values = forward.keys[:, :, start:], forward.values[:, :, start:]
        if shift is not None and relay.uses_rope:
            keys = rotate_by_delta(keys, shift, relay.rotary)
            query = rotate_by_delta(query, shift, relay.rotary)
        undo = self._undo if self.shared.recording else None
        out = attend_decode_tokens(query, keys, values, pnmix, undo, scaling, kwargs)
        for _ in range(keys.shape[2]):
            relay.advance(ForwardPlan(plan.forward_index, plan.batch, 1, [1] * plan.batch, None))
        return out

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
        waiting = [b for b, e in enumerate(self.relay_layer.evicted) if not e]
        if waiting:
            raise RuntimeError(
                f"layer {self.layer_idx}: rows {waiting} have not evicted; a composed cache "
                "packs every row at once"
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

    def storage(self) -> CacheStorage:
        """The used bytes (:meth:`nbytes`: the PN-Mix storage once packed) in both counts (its
        exact parts and scales are stored in 2 bytes), no index bytes (positions are ``offset
        + stream index``), and the bytes held (:meth:`held_bytes`)."""
        return CacheStorage(self.nbytes(), self.nbytes(), 0, self.held_bytes())
