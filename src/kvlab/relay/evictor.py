"""RoPE-Relay's eviction of one layer, on its :class:`~kvlab.relay.storage.RelayStore`
(docs/design.md, "RoPE-Relay: Eviction policy"). Torch only: no ``transformers`` import.

Per sequence (a row's result never depends on its batch neighbours):

1. the layer's budget in tokens per kv head — ``capacity``, or ``(1 - ratio) * tokens`` split
   across layers by ``EvictionConfig.layer_budget`` (:mod:`kvlab.relay.layer_budgets`) — and
   the protected recent window (``window_tokens``, or ``window_fraction`` of that budget) are
   fixed first (:meth:`Evictor.layer_budget`, :meth:`Evictor.protected_window`);
2. a scorer (:mod:`kvlab.relay.scorers`: recency, key norm, SnapKV, ExpectedAttention, TOVA,
   combinations) scores every token of every head — SnapKV and TOVA from the per-query-head
   attention probabilities of the forward's last queries (the observation window,
   :func:`kvlab.relay.observation.window_attention`), which the attention function has at
   hand; ExpectedAttention from the forward's queries; KVzip from a reconstruction pass's
   scores;
3. the layer budget is split into per-head counts (:mod:`kvlab.relay.budgets`), sinks and the
   recent window always kept;
4. with ``relay=True`` (RoPE-Relay) the kept keys are relayed with :func:`kvlab.relay.relay` —
   each head's kept tokens at positions ``E - k_h + 1 .. E``, keys rotated by the position
   delta (pure rotation, rotary channels only: partial rotary, llama3 and yarn scaling through
   :meth:`kvlab.rope.RotaryConfig.from_hf_config`), values untouched — with one endpoint ``E``
   shared by every head and layer (``E = slots - 1``), so the next token sits at ``E + 1``
   everywhere; with ``relay=False`` the kept tokens keep their original positions. The kept
   tokens are then compacted to the front of their segments, in stream order.

The ``transformers`` layer that calls it inside a forward is
:class:`kvlab.integrations.relay_cache.RelayLayer`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.config import EvictionConfig, EvictionEvent
from kvlab.relay.core import relay
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.observation import window_attention, window_attention_from_lse
from kvlab.relay.scorers import ScoreInputs, Scorer
from kvlab.relay.storage import RelayStore
from kvlab.rope import RotaryConfig

__all__ = ["Evictor"]


class Evictor:
    """The eviction policy of one decoder layer (module docstring).

    Args:
        config: the :class:`~kvlab.relay.config.EvictionConfig` (its scorer resolved once).
        rotary: the model's RoPE (the relay's rotations, the scorers' positions).
        layer_idx: the decoder layer (events and messages).
        uses_rope: False for a NoPE layer (scorers then get no rotary).
        num_layers: evicting layers the model's budget is split over (per-layer budgets): the
            full-attention layers (window layers keep their window and take no share).
        budget_index: this layer's entry among those ``num_layers`` (default ``layer_idx``:
            every decoder layer evicts).

    Attributes:
        scorer: the resolved :class:`~kvlab.relay.scorers.Scorer`.
        allocation: ``"uniform"`` or ``"adaptive"`` (the config's, else the scorer's default).
        deferred: whether a ratio eviction waits for a reconstruction pass (KVzip).
    """

    def __init__(
        self,
        config: EvictionConfig,
        rotary: RotaryConfig,
        layer_idx: int,
        *,
        uses_rope: bool = True,
        num_layers: int = 1,
        budget_index: int | None = None,
    ) -> None:
        self.config = config
        self.rotary = rotary
        self.layer_idx = layer_idx
        self.uses_rope = uses_rope
        self.num_layers = num_layers
        self.budget_index = layer_idx if budget_index is None else budget_index
        self.scorer: Scorer = config.resolved_scorer
        self.allocation = config.resolved_allocation
        # a scorer fed by a reconstruction pass: the ratio eviction waits for it
        self.deferred = self.scorer.needs_reconstruction

    # ---------------------------------------------------------------- budgets
    def protected_window(self, per_head: int) -> int:
        """The protected recent window (tokens) of an eviction to ``per_head`` tokens per head
        (layer average): ``window_tokens``, or ``round(window_fraction * per_head)`` capped at
        ``per_head - sink_tokens`` when ``window_fraction`` is set."""
        cfg = self.config
        if cfg.window_fraction is None:
            return cfg.window_tokens
        return max(0, min(round(cfg.window_fraction * per_head), per_head - cfg.sink_tokens))

    def observation_tokens(self, recent: int) -> int:
        """Queries in the observation window: the scorer's own, else ``observation_tokens``,
        else the protected recent window ``recent``."""
        cfg = self.config
        if self.scorer.observation_tokens is not None:
            return self.scorer.observation_tokens
        return cfg.observation_tokens if cfg.observation_tokens is not None else recent

    def layer_budgets(self, tokens: int, slots: int) -> list[int]:
        """Every layer's budget in tokens per kv head for a ratio eviction of heads holding
        ``tokens`` (``EvictionConfig.layer_budget``; the sum over layers is the same for every
        setting: ``L * max(1, round((1 - ratio) * tokens))``). Each layer keeps at least its
        sinks and ``window_tokens`` (one recent token with ``window_fraction``) and at most
        ``min(slots, tokens)``.

        Raises:
            ValueError: per-layer weights whose count is not :attr:`num_layers`, or a total
                the bounds cannot meet (:func:`kvlab.relay.layer_budgets.split_layer_budget`).
        """
        cfg = self.config
        assert cfg.ratio is not None
        mean = max(1, round((1.0 - cfg.ratio) * tokens))
        if cfg.layer_budget in ("uniform", "scores") or self.num_layers == 1:
            # "scores": the split is decided by the scores at eviction (evict_reconstructed);
            # its per-layer bounds are the uniform ones
            return [mean] * self.num_layers
        top = min(slots, tokens)
        recent = cfg.window_tokens if cfg.window_fraction is None else 1
        floor = min(top, cfg.sink_tokens + recent)
        if cfg.layer_budget == "pyramid":
            weights = pyramid_layer_budgets(
                mean, self.num_layers, beta=cfg.pyramid_beta, max_tokens=top
            )
        else:
            weights = list(cfg.layer_budget)
            if len(weights) != self.num_layers:
                raise ValueError(
                    f"layer_budget has {len(weights)} weights for {self.num_layers} layers"
                )
        return split_layer_budget(
            mean * self.num_layers,
            weights,
            low=[floor] * self.num_layers,
            high=[top] * self.num_layers,
        )

    def layer_tokens_per_head(self, tokens: int, slots: int) -> int:
        """This layer's entry (:attr:`budget_index`) of :meth:`layer_budgets`."""
        budgets = self.layer_budgets(tokens, slots)
        return budgets[self.budget_index] if len(budgets) > 1 else budgets[0]

    def layer_budget(self, before: list[int], tokens: int | None = None) -> tuple[int, int]:
        """``(tokens each kv head keeps on average, per-head cap)`` for an eviction of heads
        holding ``before`` tokens (see :class:`EvictionConfig`; with ``ratio``, this layer's
        share of the model's budget, :meth:`layer_tokens_per_head`, of ``tokens`` — the
        sequence's prompt tokens so far, default ``max(before)``: equal at a prompt's first
        eviction, larger when a prompt arriving in several forwards is evicted again)."""
        cfg = self.config
        n = max(before) if tokens is None else max(tokens, max(before))
        slots = cfg.head_slots(n)
        if cfg.ratio is not None:
            return self.layer_tokens_per_head(n, slots), slots
        assert cfg.capacity is not None
        return cfg.capacity, slots

    def check_first_eviction(self, tokens: int, heads: int, row: int) -> None:
        """Run the budget checks of the first eviction (ratio mode) of every layer on a
        synthetic prefill of ``tokens`` tokens in ``heads`` kv heads, so an impossible budget
        fails before anything is stored.

        Raises:
            ValueError: a budget the eviction could not meet, naming the settings.
        """
        cfg = self.config
        positions = torch.arange(tokens).expand(1, heads, tokens)
        valid = torch.ones(1, heads, tokens, dtype=torch.bool)
        try:
            slots = cfg.head_slots(tokens)
            for per_head in sorted(set(self.layer_budgets(tokens, slots))):
                protected = protected_mask(
                    positions,
                    valid,
                    stream_length=tokens,
                    sink_tokens=cfg.sink_tokens,
                    window_tokens=self.protected_window(per_head),
                )
                allocate_counts(
                    torch.zeros(1, heads, tokens),
                    valid,
                    protected,
                    total=per_head * heads,
                    allocation=self.allocation,
                    cap=slots,
                )
        except ValueError as error:
            raise ValueError(
                f"RelayModelCache cannot evict after the {tokens}-token prefill of row {row} "
                f"(ratio {cfg.ratio}, sink_tokens {cfg.sink_tokens}, "
                f"window_tokens {cfg.window_tokens}, window_fraction {cfg.window_fraction}, "
                f"layer_budget {cfg.layer_budget!r}): {error}; use a longer prompt, "
                "a smaller ratio or fewer protected tokens"
            ) from None

    def over_capacity(self, store: RelayStore) -> list[int]:
        """Rows holding more than ``capacity`` tokens per kv head on average (capacity mode)."""
        assert self.config.capacity is not None
        limit = self.config.capacity * store.heads
        return [b for b in range(store.batch) if sum(store.counts(b)) > limit]

    # ---------------------------------------------------------------- scores
    def split_keys(
        self,
        store: RelayStore,
        row: int,
        reconstruction: Tensor,
        *,
        stream_length: int,
        next_position: int,
    ) -> Tensor:
        """The keys by which ``layer_budget="scores"`` ranks this layer's stored tokens of
        sequence ``row`` against every other layer's: float32 ``[H, S]`` (padded view) — the
        scorer's scores, ``+inf`` where protected (sinks and the uniform split's recent window,
        as :meth:`evict` protects them), ``-inf`` on empty slots.

        Args:
            store: the layer's storage; ``row``: the sequence.
            reconstruction: ``[1, H, S]`` its reconstruction scores (:meth:`evict`).
            stream_length: the row's real tokens; ``next_position``: its next RoPE position.
        """
        per_head, _ = self.layer_budget(store.counts(row))
        view = store.padded([row])
        scores = self.scorer.score(
            ScoreInputs(
                keys=view.keys,
                values=view.values,
                valid=view.valid,
                original_positions=view.original_positions,
                rotary=self.rotary if self.uses_rope else None,
                next_position=next_position,
                reconstruction=reconstruction,
            )
        ).float()
        protected = protected_mask(
            view.original_positions,
            view.valid,
            stream_length=stream_length,
            sink_tokens=self.config.sink_tokens,
            window_tokens=self.protected_window(per_head),
        )
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(~view.valid, float("-inf"))[0]

    # ---------------------------------------------------------------- eviction
    def evict(
        self,
        store: RelayStore,
        row: int,
        query: Tensor | None,
        scaling: float | None,
        *,
        stream_length: int,
        next_position: int,
        reconstruction: Tensor | None = None,
        layer_total: int | None = None,
        window_lse: Tensor | None = None,
    ) -> tuple[EvictionEvent, int | None]:
        """Evict in sequence ``row`` of ``store``: budget and protected window, score,
        allocate, select, relay (or not), compact (module docstring). Does not shrink the
        store's buffers.

        Args:
            store: the layer's storage (changed in place).
            row: the sequence.
            query: that row's real queries of the current forward ``[1, H_q, Q, D]`` at cache
                positions (the scorers' observation window and ExpectedAttention's queries), or
                ``None`` for a scorer that reads neither (a reconstruction scorer).
            scaling: the model's softmax scale (``None`` with ``query``).
            stream_length: the row's real tokens received; ``next_position``: the RoPE position
                of its next token.
            reconstruction: ``[1, H, S]`` float32 reconstruction scores of the row's padded
                view (KVzip), for a scorer with ``needs_reconstruction``.
            layer_total: tokens this layer keeps summed over its kv heads, replacing the
                configured layer budget (``layer_budget="scores"``), or ``None``.
            window_lse: ``[1, H_q, Q]`` float32 logsumexp of ``query``'s scaled causal logits
                when the forward's attention returned it (a prompt's one-forward prefill:
                :func:`kvlab.relay.attention.prefill_attention_with_lse`), or ``None``. With a
                scorer that has a ``window_reach``, over a row whose every head holds all its
                ``Q`` tokens, the observation window then skips the protected window's own
                logits (:func:`kvlab.relay.observation.window_attention_from_lse`).

        Returns:
            ``(event, next_position)``: the :class:`EvictionEvent` (``layer_idx`` this
            evictor's), and the row's new next RoPE position after a relay (``None`` without
            relay: unchanged).

        Raises:
            ValueError: ``query`` missing for a scorer that needs it.
        """
        if query is None and (self.scorer.needs_window_attention or self.scorer.needs_queries):
            raise ValueError(f"the {self.scorer.name} scorer needs the forward's queries")
        cfg = self.config
        before = store.counts(row)
        heads = len(before)
        # the budget and the protected window first: the observation window follows them
        per_head, slots = self.layer_budget(before, stream_length)
        # layer_total replaces the budget, not the protected window (that of the uniform split,
        # which the split over layers protected: docs/design.md, "RoPE-Relay: Reconstruction
        # scoring")
        total = per_head * heads if layer_total is None else layer_total
        recent = self.protected_window(per_head)
        view = store.padded([row])
        keys, values, valid = view.keys, view.values, view.valid
        orig, rot = view.original_positions, view.rotary_positions
        observed = None
        if self.scorer.needs_window_attention:
            assert query is not None and scaling is not None
            window = self.observation_tokens(recent)
            reach = self.scorer.window_reach
            if (
                window_lse is not None
                and reach is not None
                and keys.shape[2] == query.shape[2] == stream_length
                and bool(valid.all())
            ):
                # the slots before the protected recent window, and what their scores read
                columns = keys.shape[2] - recent + reach
                observed = window_attention_from_lse(
                    query, scaling, keys, window, window_lse, columns
                )
            else:
                observed = window_attention(query, scaling, keys, valid, window)
        query_positions = None
        if query is not None:
            q_len = query.shape[2]
            query_positions = torch.arange(
                next_position - q_len, next_position, device=query.device
            )
        scores = self.scorer.score(
            ScoreInputs(
                keys=keys,
                values=values,
                valid=valid,
                original_positions=orig,
                window_attention=None if observed is None else observed.total,
                window_groups=None if observed is None else observed.groups,
                window_last=None if observed is None else observed.last,
                queries=query if self.scorer.needs_queries else None,
                query_positions=query_positions,
                rotary=self.rotary if self.uses_rope else None,  # None: a NoPE layer
                next_position=next_position,
                reconstruction=reconstruction,
            )
        )
        protected = protected_mask(
            orig,
            valid,
            stream_length=stream_length,
            sink_tokens=cfg.sink_tokens,
            window_tokens=recent,
        )
        counts = allocate_counts(
            scores,
            valid,
            protected,
            total=total,
            allocation=self.allocation,
            cap=slots,
            comparable_across_heads=self.scorer.comparable_across_heads,
        )
        keep = select_keep(scores, valid, protected, counts)
        kept = [int(k) for k in counts.tolist()]
        endpoint: int | None = None
        new_next: int | None = None
        s = keys.shape[2]
        if cfg.relay:
            endpoint = slots - 1
            # the model's states as they are: a row whose model produced NaN/inf keeps them
            # (its outputs are NaN, as with transformers' caches), the other rows are unaffected
            out = relay(keys, values, rot, keep, self.rotary, endpoint=endpoint, check_finite=False)
            new_orig = orig.gather(-1, out.source_index.clamp_min(0))
            # relayed tokens are right-aligned in the padded output: slots s - k .. s - 1
            store.write_front(
                row,
                kept,
                [s - k for k in kept],
                out.keys[0],
                out.values[0],
                new_orig[0],
                out.positions[0],
            )
            new_next = out.next_position
        else:
            # kept slots first, in stream order (stable sort on the keep flag)
            order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)[0]  # [H, S]
            store.write_front(
                row,
                kept,
                [0] * heads,
                keys[0].gather(1, order.unsqueeze(-1).expand(-1, -1, keys.shape[-1])),
                values[0].gather(1, order.unsqueeze(-1).expand(-1, -1, values.shape[-1])),
                orig[0].gather(1, order),
                rot[0].gather(1, order),
            )
        event = EvictionEvent(
            layer_idx=self.layer_idx,
            stream_length=stream_length,
            tokens_before=before,
            tokens_after=store.counts(row),
            endpoint=endpoint,
            row=row,
        )
        return event, new_next
