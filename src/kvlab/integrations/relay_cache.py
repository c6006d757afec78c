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

Eviction, per sequence (a row's result never depends on its batch neighbours; docs/design.md,
"RoPE-Relay: Eviction policy"):

1. the layer's budget in tokens per kv head — ``capacity``, or ``(1 - ratio) * tokens`` split
   across layers by ``EvictionConfig.layer_budget`` (:mod:`kvlab.relay.layer_budgets`) — and
   the protected recent window (``window_tokens``, or ``window_fraction`` of that budget) are
   fixed first;
2. a scorer (:mod:`kvlab.relay.scorers`: recency, key norm, SnapKV, ExpectedAttention, TOVA,
   combinations) scores every token of every head — SnapKV and TOVA from the per-query-head
   attention probabilities of the forward's last queries (the observation window), which the
   attention function has at hand; ExpectedAttention from the forward's queries;
3. the layer budget is split into per-head counts (:mod:`kvlab.relay.budgets`), sinks and the
   recent window always kept;
4. with ``relay=True`` (RoPE-Relay) the kept keys are relayed with :func:`kvlab.relay.relay` —
   each head's kept tokens at positions ``E - k_h + 1 .. E``, keys rotated by the position
   delta (pure rotation, rotary channels only: partial rotary, llama3 and yarn scaling through
   :meth:`kvlab.rope.RotaryConfig.from_hf_config`), values untouched — with one endpoint ``E``
   shared by every head and layer (``E = slots - 1``), so the next token sits at ``E + 1``
   everywhere; with ``relay=False`` the kept tokens keep their original positions. The kept
   tokens are then compacted to the front of their segments, in stream order.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.attention import CacheView
from kvlab.integrations.cache_protocol import CacheStorage, dense_layer_storage, sum_storage
from kvlab.integrations.model_support import ForwardGuard, layer_rotary, plan_model
from kvlab.relay.attention import ragged_attention
from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.core import relay
from kvlab.relay.kvzip import reconstruction_attention
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.scorers import ScoreInputs, Scorer, get_scorer
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


@dataclass(frozen=True)
class EvictionConfig:
    """When and how a :class:`RelayModelCache` evicts.

    Exactly one of ``ratio`` and ``capacity`` is set.

    Attributes:
        ratio: fraction of the tokens evicted once, right after the prefill (the first forward
            of a layer): each layer keeps ``round((1 - ratio) * n) * H_kv`` tokens. In [0, 1).
        capacity: tokens per kv head (layer average) kept after every forward that leaves the
            layer above it (streaming).
        scorer: a name of :data:`kvlab.relay.SCORERS` (``"recency"``, ``"keynorm"``,
            ``"snapkv"``, ``"expected-attention"``, ``"tova"``, ``"combined"``) or a
            :class:`Scorer`.
        allocation: ``"adaptive"`` (heterogeneous per-head budgets), ``"uniform"``, or ``None``
            for the scorer's default (uniform for recency, adaptive otherwise).
        relay: RoPE-Relay the kept keys (True) or leave them at their original positions.
        sink_tokens: first stream tokens always kept (attention sinks).
        window_tokens: most recent tokens always kept; also SnapKV's observation window
            (unless ``observation_tokens`` is set; ``window_fraction`` replaces it).
        max_head_tokens: per-head cap (the relay's slots; ``E = slots - 1``). Default: the tokens
            a head holds at eviction (ratio) or ``2 * capacity`` (capacity).
        observation_tokens: queries of the observation window the attention scorers read
            (SnapKV), or ``None`` for ``window_tokens`` (the protected window is then also the
            observation window). A scorer may fix its own (TOVA reads the last query only).
        layer_budget: how the model's budget is split across layers (``ratio`` only):
            ``"uniform"`` (every layer ``(1 - ratio) * n``), ``"pyramid"`` (PyramidKV, see
            :mod:`kvlab.relay.layer_budgets`), or one positive weight per decoder layer
            (budgets proportional to them, e.g. from a calibration); always the same total;
            or ``"scores"`` (a reconstruction scorer only, e.g. KVzip: the model's budget goes
            to the top scores over every layer and kv head — KVzip's cross-layer selection,
            Kim et al. 2025, arXiv:2505.23416 — so each layer keeps what its scores win;
            ``scores_share`` of it, the rest split uniformly).
            Anything but ``"uniform"`` needs every decoder layer to be full attention.
        pyramid_beta: PyramidKV's steepness ``beta`` (``k_min = k / beta``), >= 1.
        scores_share: with ``layer_budget="scores"``, the share of each layer's budget that
            follows the scores: layer ``l`` keeps ``s * T_l + (1 - s) * T / L`` tokens
            (``T_l`` its winners over every layer, ``T`` the model's budget; integers by
            largest remainder). In (0, 1]; 1 is KVzip's own split.
        window_fraction: when set, the protected recent window of each eviction is this
            fraction of the layer's per-head budget (``round(f * k)`` tokens, at most
            ``k - sink_tokens``) instead of ``window_tokens``; in [0, 1).
    """

    ratio: float | None = None
    capacity: int | None = None
    scorer: str | Scorer = "snapkv"
    allocation: str | None = None
    relay: bool = True
    sink_tokens: int = 4
    window_tokens: int = 32
    max_head_tokens: int | None = None
    observation_tokens: int | None = None
    layer_budget: str | tuple[float, ...] = "uniform"
    pyramid_beta: float = 20.0
    window_fraction: float | None = None
    scores_share: float = 1.0

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.capacity is None):
            raise ValueError("set exactly one of EvictionConfig.ratio and EvictionConfig.capacity")
        if self.ratio is not None and not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"ratio must lie in [0, 1), got {self.ratio}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 token per head, got {self.capacity}")
        if self.sink_tokens < 0 or self.window_tokens < 0:
            raise ValueError("sink_tokens and window_tokens must be >= 0")
        if self.capacity is not None and self.capacity < self.sink_tokens + self.window_tokens:
            raise ValueError(
                f"capacity {self.capacity} is below sink_tokens + window_tokens = "
                f"{self.sink_tokens + self.window_tokens}"
            )
        if self.allocation not in (None, "uniform", "adaptive"):
            raise ValueError(f"allocation must be uniform, adaptive or None, got {self.allocation}")
        if self.max_head_tokens is not None and self.max_head_tokens < 1:
            raise ValueError("max_head_tokens must be >= 1")
        if (
            self.capacity is not None
            and self.max_head_tokens is not None
            and self.max_head_tokens < self.capacity
        ):
            # the layer keeps capacity * H_kv tokens, more than H_kv heads of this cap hold
            raise ValueError(
                f"max_head_tokens {self.max_head_tokens} is below capacity {self.capacity}"
            )
        if self.observation_tokens is not None and self.observation_tokens < 1:
            raise ValueError(f"observation_tokens must be >= 1, got {self.observation_tokens}")
        if isinstance(self.layer_budget, str):
            if self.layer_budget not in ("uniform", "pyramid", "scores"):
                raise ValueError(
                    "layer_budget must be 'uniform', 'pyramid', 'scores' or per-layer weights, got "
                    f"{self.layer_budget!r}"
                )
        else:
            weights = tuple(float(w) for w in self.layer_budget)
            if not weights or any(not w > 0 for w in weights):
                raise ValueError(f"layer_budget weights must be > 0, got {self.layer_budget}")
            object.__setattr__(self, "layer_budget", weights)
        if self.layer_budget != "uniform" and self.capacity is not None:
            raise ValueError("layer_budget other than 'uniform' needs ratio (prefill eviction)")
        if self.window_fraction is not None and not 0.0 <= self.window_fraction < 1.0:
            raise ValueError(f"window_fraction must lie in [0, 1), got {self.window_fraction}")
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta must be >= 1, got {self.pyramid_beta}")
        if get_scorer(self.scorer).needs_reconstruction and self.ratio is None:
            raise ValueError(
                f"scorer {get_scorer(self.scorer).name!r} scores the tokens by a reconstruction "
                "pass after a prefill (kvlab.integrations.kvzip.compress): it needs ratio, not "
                "capacity"
            )
        if not 0.0 < self.scores_share <= 1.0:
            raise ValueError(f"scores_share must lie in (0, 1], got {self.scores_share}")
        if self.scores_share != 1.0 and self.layer_budget != "scores":
            raise ValueError("scores_share needs layer_budget='scores'")
        if self.layer_budget == "scores" and not get_scorer(self.scorer).needs_reconstruction:
            raise ValueError(
                "layer_budget 'scores' splits the budget by a reconstruction pass's scores over "
                f"every layer; scorer {get_scorer(self.scorer).name!r} scores layer by layer"
            )

    def head_slots(self, tokens_per_head: int) -> int:
        """The per-head cap (relay slots) for an eviction of heads holding ``tokens_per_head``."""
        if self.max_head_tokens is not None:
            return self.max_head_tokens
        if self.capacity is not None:
            return 2 * self.capacity
        return tokens_per_head


@dataclass(frozen=True)
class EvictionEvent:
    """What one eviction did to one sequence (``row``) of one layer: ``tokens_before`` /
    ``tokens_after`` per kv head (lists, length ``H_kv``), the shared ``endpoint`` (``None``
    without relay) and the sequence's stream length (its real tokens) at the time."""

    layer_idx: int
    stream_length: int
    tokens_before: list[int]
    tokens_after: list[int]
    endpoint: int | None
    row: int = 0


@dataclass
class _Pending:
    """What ``update`` stashed for the attention call of the same layer and forward."""

    keys: Tensor  # [B, H_kv, T, D], rotated by the model at its position ids
    values: Tensor  # [B, H_kv, T, Dv]
    position_ids: Tensor | None


@dataclass
class _ForwardPlan:
    """One forward's checked inputs, shared by every layer (built by the first layer).

    ``real[b]``: real (non-padding) new tokens of row ``b`` — the last ``real[b]`` of the
    ``num_new`` columns; ``shift``: per-row RoPE delta (cache position - model position) as a
    ``[B, 1, 1]`` device tensor, or ``None`` when known to be zero; ``first_eviction``: rows
    whose prefill this is (ratio mode evicts them)."""

    forward_index: int
    batch: int
    num_new: int
    real: list[int]
    shift: Tensor | None
    first_eviction: list[int] = field(default_factory=list)
    reconstruction: bool = False

    @property
    def padded(self) -> bool:
        return any(r != self.num_new for r in self.real)


@dataclass(frozen=True)
class ReconstructionSpan:
    """What a reconstruction pass rebuilds in one sequence: the stored tokens with stream
    indices ``start .. end - 1`` (scored in this pass), and the first ``sinks`` tokens that
    join the scores' normalization when ``start > 0`` (KVzip's chunked scoring,
    :mod:`kvlab.relay.kvzip`)."""

    start: int
    end: int
    sinks: int = 4


class _ForwardState:
    """Shared by the layers of one :class:`RelayModelCache`: the current forward's plan,
    during a reconstruction pass the span of each sequence (``None`` for a sequence the pass
    does not feed), and the guard that puts back the window layers a refused forward changed
    (set by the cache)."""

    def __init__(self) -> None:
        self.plan: _ForwardPlan | None = None
        self.reconstruction: list[ReconstructionSpan | None] | None = None
        self.guard = ForwardGuard()


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
        return self.layer.forward_state.guard.checking(self.layer._drop_stash)


def _leading_zeros(values: list[int]) -> int:
    count = 0
    for v in values:
        if v:
            break
        count += 1
    return count


class RelayLayer(CacheLayerMixin):
    """One full-attention decoder layer of a :class:`RelayModelCache`.

    ``forward_state`` is shared by the layers of one cache (the first layer of a forward checks
    its inputs for all); ``uses_rope=False`` (a NoPE layer, only with ``relay=False``) never
    re-rotates keys or queries.

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
        forward_state: _ForwardState | None = None,
        *,
        uses_rope: bool = True,
    ) -> None:
        super().__init__()
        self.eviction = config
        self.rotary = rotary
        self.uses_rope = uses_rope
        self.layer_idx = layer_idx
        self.scorer: Scorer = get_scorer(config.scorer)
        self.allocation = config.allocation or self.scorer.default_allocation
        # a scorer fed by a reconstruction pass: the ratio eviction waits for it
        self.deferred = self.scorer.needs_reconstruction
        self.forward_state = forward_state if forward_state is not None else _ForwardState()
        self.num_layers = 1  # set by RelayModelCache (per-layer budgets need it)
        self._clear()

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
        self._pending: _Pending | None = None
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
        self._pending = _Pending(key_states, value_states, inner.get("position_ids"))
        view = RelayView(self)
        return view, view

    def _drop_stash(self) -> None:
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

    def _select_rows(self, rows: list[int]) -> None:
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
        self._select_rows([int(i) for i in torch.as_tensor(beam_idx).tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = range(len(self.stream_lengths))
        self._select_rows([b for b in rows for _ in range(repeats)])

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
    def _check_states(self, keys: Tensor, values: Tensor) -> None:
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be "
                "[B, H_kv, T, D] and [B, H_kv, T, Dv]"
            )
        store = self.store
        if store is None:
            return
        expected = (store.batch, store.heads, store.head_dim, store.value_dim)
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != expected:
            raise ValueError(
                f"layer {self.layer_idx} stores [B, H_kv, D, Dv] = {expected}, got {got} "
                "(a new batch needs a new cache or reset())"
            )
        if keys.dtype != store.dtype or values.dtype != store.dtype:
            raise ValueError(f"layer {self.layer_idx} stores {store.dtype}, got {keys.dtype}")
        if keys.device != store.device:
            raise ValueError(f"layer {self.layer_idx} stores on {store.device}, got {keys.device}")

    def _plan(
        self,
        pending: _Pending,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
        *,
        reconstruction: bool = False,
    ) -> _ForwardPlan:
        """Check this forward's inputs against the layer's state and derive the plan. Reads the
        device at most once per forward (one transfer: the mask check and new columns, the
        position ids), and not at all when neither is given. A ``reconstruction`` pass stores
        nothing: its rows may be all padding, and it plans no eviction.

        Raises:
            ValueError: a mask that is not 2-D ``[B, seen + T]``, not left padding, or
                disagrees with the padding stored; position ids that are not ``[1|B, T]`` or not
                consecutive over a row's real tokens; a prompt too short for the first
                eviction.
        """
        batch, heads, t, _ = pending.keys.shape
        seen = self.seen_tokens
        stream = self.stream_lengths or [0] * batch
        nexts = self.next_positions or [0] * batch
        padding = self.padding or [0] * batch
        device = pending.keys.device
        position_ids = pending.position_ids
        if position_ids is None:
            position_ids = kwargs.get("position_ids")

        parts: list[Tensor] = []
        if attention_mask is not None:
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seen + t):
                raise ValueError(
                    "RelayModelCache takes a 2-D attention_mask [B, seen + new] = "
                    f"[{batch}, {seen + t}] (left padding), got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.to(device=device, dtype=torch.bool)
            column = torch.arange(seen, device=device)
            expected = column.view(1, -1) >= torch.tensor(padding, device=device).view(-1, 1)
            parts += [(mask[:, :seen] == expected).all(-1, keepdim=True), mask[:, seen:]]
        if position_ids is not None:
            if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"RelayModelCache needs position_ids [1 or B, T], got "
                    f"{tuple(position_ids.shape)}"
                )
            if position_ids.shape[-1] != t:
                raise ValueError(f"position_ids length {position_ids.shape[-1]} != {t} new tokens")
            parts.append(position_ids.to(device).expand(batch, t))
        host = torch.cat([p.to(torch.int64) for p in parts], 1).tolist() if parts else None

        real = [t] * batch
        if attention_mask is not None:
            assert host is not None
            for b in range(batch):
                if not host[b][0]:
                    raise ValueError(
                        f"attention_mask row {b}: its first {seen} columns differ from the "
                        f"padding the cache stored ({padding[b]} leading zeros, then ones)"
                    )
                new = host[b][1 : 1 + t]
                zeros = _leading_zeros(new)
                if not all(new[zeros:]):
                    raise ValueError(
                        f"attention_mask row {b} has a zero after a one: RelayModelCache "
                        "supports left padding only"
                    )
                if zeros and stream[b] > 0 and not reconstruction:
                    raise ValueError(
                        f"attention_mask row {b} pads after real tokens; left padding must "
                        "come before a sequence's first token"
                    )
                real[b] = t - zeros

        if position_ids is None:
            # transformers' default: positions seen + 0 .. T - 1
            deltas = [nexts[b] - (seen + t - real[b]) for b in range(batch)]
        else:
            assert host is not None
            offset = 1 + t if attention_mask is not None else 0
            deltas = []
            for b in range(batch):
                ids = host[b][offset + t - real[b] : offset + t]
                if any(ids[j] != ids[0] + j for j in range(len(ids))):
                    raise ValueError(
                        f"RelayModelCache needs consecutive position_ids over each row's real "
                        f"tokens; row {b} has {ids[:8]}{'...' if len(ids) > 8 else ''}"
                    )
                deltas.append(nexts[b] - ids[0] if ids else 0)
        shift = None
        if any(deltas):
            shift = torch.tensor(deltas, dtype=torch.int64, device=device).view(-1, 1, 1)

        first = []
        if self.eviction.ratio is not None and not self.deferred and not reconstruction:
            first = [b for b in range(batch) if stream[b] == 0 and real[b] > 1]
            for b in first:
                self._check_first_eviction(real[b], heads, b)
        return _ForwardPlan(
            forward_index=self.forwards,
            batch=batch,
            num_new=t,
            real=real,
            shift=shift,
            first_eviction=first,
            reconstruction=reconstruction,
        )

    def _layer_budget(self, before: list[int]) -> tuple[int, int]:
        """``(tokens each kv head keeps on average, per-head cap)`` for an eviction of heads
        holding ``before`` tokens (see :class:`EvictionConfig`; with ``ratio``, this layer's
        share of the model's budget, :meth:`_layer_tokens_per_head`)."""
        cfg = self.eviction
        slots = cfg.head_slots(max(before))
        if cfg.ratio is not None:
            return self._layer_tokens_per_head(max(before), slots), slots
        assert cfg.capacity is not None
        return cfg.capacity, slots

    def _check_first_eviction(self, tokens: int, heads: int, row: int) -> None:
        """Run the budget checks of the first eviction (ratio mode) of every layer on a
        synthetic prefill of ``tokens`` tokens, so an impossible budget fails before anything
        is stored."""
        cfg = self.eviction
        positions = torch.arange(tokens).expand(1, heads, tokens)
        valid = torch.ones(1, heads, tokens, dtype=torch.bool)
        try:
            slots = cfg.head_slots(tokens)
            for per_head in sorted(set(self._layer_budgets(tokens, slots))):
                protected = protected_mask(
                    positions,
                    valid,
                    stream_length=tokens,
                    sink_tokens=cfg.sink_tokens,
                    window_tokens=self._protected_window(per_head),
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
            ValueError: see :meth:`_plan`; raised by the first layer of a forward, before any
                layer changes.
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        pending, plan = self._take_pending(attention_mask, kwargs)
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

    def _take_pending(
        self, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> tuple[_Pending, _ForwardPlan]:
        """The stash of this forward and its plan: the one the forward's first layer built
        (shared through :attr:`forward_state`), or a new one (:meth:`_plan`, which checks every
        input before any layer changes).

        Raises:
            RuntimeError: no stash (``attend`` without a preceding ``update``).
            ValueError: see :meth:`_plan`.
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
            plan = (
                self._plan(pending, attention_mask, kwargs)
                if spans is None
                else self._plan(pending, attention_mask, kwargs, reconstruction=True)
            )
            self.forward_state.plan = plan
        return pending, plan

    def _observe(self, query: Tensor, scaling: float, plan: _ForwardPlan) -> None:
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
            view = self.store.padded([b])
            probs = self._window_attention(
                query[b : b + 1, :, plan.num_new - real :],
                scaling,
                view.keys,
                view.valid,
                self.scorer.prefill_queries,  # type: ignore[attr-defined]
            )
            self.observation_scores[b] = probs.amax(dim=(2, 3))

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
        plan: _ForwardPlan,
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
            view = self.store.padded([b])
            pos = view.original_positions
            chunk = view.valid & (pos >= span.start) & (pos < span.end)
            columns = None
            if span.start > 0 or span.end < self.stream_lengths[b]:
                columns = chunk | (view.valid & (pos < min(span.sinks, span.start)))
            o, scores = reconstruction_attention(
                query[b : b + 1, :, t - real :],
                view.keys,
                view.values,
                view.valid,
                keys[b : b + 1, :, t - real :],
                values[b : b + 1, :, t - real :],
                scale=scaling,
                score_columns=columns,
                softcap=kwargs.get("softcap"),
                s_aux=kwargs.get("s_aux"),
            )
            out[b, :, t - real :] = o[0]
            scores = scores.masked_fill(~chunk, 0.0)
            previous = self.reconstruction_scores[b]
            self.reconstruction_scores[b] = (
                scores if previous is None else torch.maximum(previous, scores)
            )
        return out

    def split_keys(self, row: int, reconstruction: Tensor) -> Tensor:
        """The keys by which ``layer_budget="scores"`` ranks this layer's stored tokens of
        sequence ``row`` against every other layer's: float32 ``[H, S]`` (padded view) — the
        scorer's scores, ``+inf`` where protected (sinks and the uniform split's recent window,
        as :meth:`evict` protects them), ``-inf`` on empty slots.

        Args:
            row: the sequence.
            reconstruction: ``[1, H, S]`` its reconstruction scores (:meth:`evict`).
        """
        assert self.store is not None
        per_head, _ = self._layer_budget(self.store.counts(row))
        view = self.store.padded([row])
        scores = self.scorer.score(
            ScoreInputs(
                keys=view.keys,
                values=view.values,
                valid=view.valid,
                original_positions=view.original_positions,
                rotary=self.rotary if self.uses_rope else None,
                next_position=self.next_positions[row],
                reconstruction=reconstruction,
            )
        ).float()
        protected = protected_mask(
            view.original_positions,
            view.valid,
            stream_length=self.stream_lengths[row],
            sink_tokens=self.eviction.sink_tokens,
            window_tokens=self._protected_window(per_head),
        )
        scores = scores.masked_fill(protected, float("inf"))
        return scores.masked_fill(~view.valid, float("-inf"))[0]

    def _commit(self, keys: Tensor, values: Tensor, plan: _ForwardPlan) -> None:
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
        self._advance(plan)

    def _advance(self, plan: _ForwardPlan) -> None:
        """Count the forward's tokens: padding, stream lengths, RoPE positions, columns seen."""
        for b, r in enumerate(plan.real):
            self.padding[b] += plan.num_new - r
            self.stream_lengths[b] += r
            self.next_positions[b] += r
        self.seen_tokens += plan.num_new
        self.forwards += 1

    def _rows_due(self, plan: _ForwardPlan) -> list[int]:
        """Rows to evict after this forward (see :class:`EvictionConfig`)."""
        if self.eviction.ratio is not None:
            return plan.first_eviction
        assert self.eviction.capacity is not None and self.store is not None
        limit = self.eviction.capacity * self.store.heads
        return [b for b in range(self.store.batch) if sum(self.store.counts(b)) > limit]

    # ---------------------------------------------------------------- eviction policy inputs
    def _protected_window(self, per_head: int) -> int:
        """The protected recent window (tokens) of an eviction to ``per_head`` tokens per head
        (layer average): ``window_tokens``, or ``round(window_fraction * per_head)`` capped at
        ``per_head - sink_tokens`` when ``window_fraction`` is set."""
        cfg = self.eviction
        if cfg.window_fraction is None:
            return cfg.window_tokens
        return max(0, min(round(cfg.window_fraction * per_head), per_head - cfg.sink_tokens))

    def _observation_tokens(self, recent: int) -> int:
        """Queries in the observation window: the scorer's own, else ``observation_tokens``,
        else the protected recent window ``recent``."""
        cfg = self.eviction
        if self.scorer.observation_tokens is not None:
            return self.scorer.observation_tokens
        return cfg.observation_tokens if cfg.observation_tokens is not None else recent

    def _window_attention(
        self, query: Tensor, scaling: float, keys: Tensor, valid: Tensor, window: int
    ) -> Tensor:
        """Softmax probabilities ``[B, H, G, w, S]`` (float32) of the last ``w = window``
        queries (at most the forward's) over the padded ``keys``, per query head ``g`` of each
        GQA group; the queries are the newest tokens of every head, rotated at cache
        positions, and see the slots up to their own (causal)."""
        batch, hq, q_len, dim = query.shape
        heads = keys.shape[1]
        group = hq // heads
        w = max(1, min(window, q_len))
        q = query[:, :, q_len - w :].float().reshape(batch, heads, group * w, dim)
        logits = q @ keys.float().transpose(-1, -2) * scaling  # [B, H, G*w, S]
        counts = valid[0].sum(-1)  # [H]
        # query j of the window is the token at per-head slot counts - w + j: causal mask
        j = torch.arange(w, device=query.device).repeat(group)  # [G*w]
        limit = counts.view(heads, 1) - w + j.view(1, -1)  # [H, G*w]
        slot = torch.arange(keys.shape[2], device=query.device)
        allowed = slot.view(1, 1, -1) <= limit.unsqueeze(-1)  # [H, G*w, S]
        allowed = allowed.unsqueeze(0) & valid.unsqueeze(2)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return probs.reshape(batch, heads, group, w, keys.shape[2])

    def _layer_budgets(self, tokens: int, slots: int) -> list[int]:
        """Every layer's budget in tokens per kv head for a ratio eviction of heads holding
        ``tokens`` (``EvictionConfig.layer_budget``; the sum over layers is the same for every
        setting: ``L * max(1, round((1 - ratio) * tokens))``). Each layer keeps at least its
        sinks and ``window_tokens`` (one recent token with ``window_fraction``) and at most
        ``min(slots, tokens)``.

        Raises:
            ValueError: per-layer weights whose count is not :attr:`num_layers`, or a total
                the bounds cannot meet (:func:`kvlab.relay.layer_budgets.split_layer_budget`).
        """
        cfg = self.eviction
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

    def _layer_tokens_per_head(self, tokens: int, slots: int) -> int:
        """This layer's entry of :meth:`_layer_budgets`."""
        budgets = self._layer_budgets(tokens, slots)
        return budgets[self.layer_idx] if len(budgets) > 1 else budgets[0]

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
        relay (or not), compact (docs/design.md, "RoPE-Relay: Eviction policy").

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
        if query is None and (self.scorer.needs_window_attention or self.scorer.needs_queries):
            raise ValueError(f"the {self.scorer.name} scorer needs the forward's queries")
        cfg = self.eviction
        before = self.store.counts(row)
        heads = len(before)
        # the budget and the protected window first: the observation window follows them
        per_head, slots = self._layer_budget(before)
        # layer_total replaces the budget, not the protected window (that of the uniform split,
        # which the split over layers protected: docs/design.md, "RoPE-Relay: Reconstruction
        # scoring")
        total = per_head * heads if layer_total is None else layer_total
        recent = self._protected_window(per_head)
        view = self.store.padded([row])
        keys, values, valid = view.keys, view.values, view.valid
        orig, rot = view.original_positions, view.rotary_positions
        window = probs = None
        if self.scorer.needs_window_attention:
            assert query is not None and scaling is not None
            probs = self._window_attention(
                query, scaling, keys, valid, self._observation_tokens(recent)
            )
            window = probs.sum((2, 3))
        next_position = self.next_positions[row]
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
                window_attention=window,
                window_probs=probs,
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
            stream_length=self.stream_lengths[row],
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
        s = keys.shape[2]
        if cfg.relay:
            endpoint = slots - 1
            out = relay(keys, values, rot, keep, self.rotary, endpoint=endpoint)
            new_orig = orig.gather(-1, out.source_index.clamp_min(0))
            # relayed tokens are right-aligned in the padded output: slots s - k .. s - 1
            self.store.write_front(
                row,
                kept,
                [s - k for k in kept],
                out.keys[0],
                out.values[0],
                new_orig[0],
                out.positions[0],
            )
            self.next_positions[row] = out.next_position
        else:
            # kept slots first, in stream order (stable sort on the keep flag)
            order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)[0]  # [H, S]
            self.store.write_front(
                row,
                kept,
                [0] * heads,
                keys[0].gather(1, order.unsqueeze(-1).expand(-1, -1, keys.shape[-1])),
                values[0].gather(1, order.unsqueeze(-1).expand(-1, -1, values.shape[-1])),
                orig[0].gather(1, order),
                rot[0].gather(1, order),
            )
        self.evicted[row] = True
        event = EvictionEvent(
            layer_idx=self.layer_idx,
            stream_length=self.stream_lengths[row],
            tokens_before=before,
            tokens_after=self.store.counts(row),
            endpoint=endpoint,
            row=row,
        )
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
        if get_scorer(config.scorer).needs_reconstruction and plan.window_layers:
            # a reconstruction pass must store nothing; window layers store every forward
            raise ValueError(
                f"scorer {get_scorer(config.scorer).name!r} needs every decoder layer to be full "
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

    def _forward_state(self) -> _ForwardState:
        """The forward state the full-attention layers share (a subclass may extend it)."""
        return _ForwardState()

    def _full_layer(self, index: int, state: _ForwardState) -> RelayLayer:
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
        return sum(
            layer.reserved_bytes() if isinstance(layer, RelayLayer) else layer.nbytes()
            for layer in self.layers
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
        return get_scorer(self.eviction.scorer).needs_reconstruction

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
            ValueError: a budget the eviction could not meet (see ``_check_first_eviction``).
        """
        layer = self._relay_layers()[0]
        assert layer.store is not None
        for b in rows:
            layer._check_first_eviction(layer.stream_lengths[b], layer.store.heads, b)

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
            per_head, _ = layer._layer_budget(layer.store.counts(row))
            budget += per_head * layer.store.heads
        sizes = [k.numel() for k in keys]
        top = torch.topk(torch.cat(keys), budget, sorted=False).indices
        owner = torch.bucketize(top, torch.tensor(sizes, device=top.device).cumsum(0), right=True)
        won = [int(n) for n in torch.bincount(owner, minlength=len(layers)).tolist()]
        share = self.eviction.scores_share
        if share == 1.0:
            return won
        # s * won + (1 - s) * uniform, to integers by largest remainder (same total); each
        # layer stays between its protected tokens and what it holds (both splits do)
        want = [share * w + (1.0 - share) * budget / len(layers) for w in won]
        out = [int(w) for w in want]
        order = sorted(range(len(want)), key=lambda i: want[i] - out[i], reverse=True)
        for i in order[: budget - sum(out)]:
            out[i] += 1
        return out

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    #: the RoPE positions are the cache's own (:meth:`position_ids`; with RoPE-Relay they
    #: differ from the tokens seen): every forward passes them
    explicit_positions = True

    def rope_position(self) -> int:
        """:attr:`next_position` (ValueError when the sequences of the batch differ)."""
        return self.next_position

    def details(self) -> dict[str, Any]:
        """``evictions`` (events over all layers), ``next_position``, ``stream_length`` and
        ``first_eviction_tokens_per_head`` (the ``tokens_after`` of the first ``len(layers)``
        events)."""
        events = self.events()
        per_head = [e.tokens_after for e in events[: len(self.layers)]]
        return {
            "evictions": len(events),
            "next_position": self.next_position,
            "stream_length": self.stream_length,
            "first_eviction_tokens_per_head": per_head,
        }

    def storage(self) -> CacheStorage:
        """Relay layers: the used key/value bytes (:meth:`RelayLayer.nbytes`; headroom is not
        stored data), their elements at 2 bytes, the used position bookkeeping
        (docs/design.md, RoPE-Relay "Byte accounting"); window layers as held
        (:func:`~kvlab.integrations.cache_protocol.dense_layer_storage`). The store's
        ``key_bias`` buffer and reserved headroom are not counted; bytes a later accounting
        adds go here."""
        return sum_storage(
            CacheStorage(layer.nbytes(), layer.numel() * 2, layer.index_bytes())
            if isinstance(layer, RelayLayer)
            else dense_layer_storage(layer)
            for layer in self.layers
        )
