"""RoPE-Relay eviction inside a ``transformers`` model: a cache with ragged per-head storage.

``RelayModelCache(model.config, EvictionConfig(...))`` is a ``transformers.Cache``. Each layer
stores, per kv head ``h``, its own ``[B, n_h, D]`` keys and ``[B, n_h, Dv]`` values (plus the
tokens' stream indices and current rotary positions): evicted tokens are physically gone, so
:meth:`RelayModelCache.nbytes` shrinks by the evicted fraction.

Eviction happens inside the forward, in the ``"kvlab"`` attention function, right after a
layer's attention over the current tokens (the prefill, or a streaming chunk), when the layer is
due: once after the prefill (``EvictionConfig.ratio``) or whenever it holds more than
``capacity`` tokens per head on average (``EvictionConfig.capacity``). Then:

1. a scorer (:mod:`kvlab.relay.scorers`: recency, key norm, SnapKV, ExpectedAttention, TOVA,
   combinations) scores every token
   of every head — SnapKV from the attention of the current forward's last ``window_tokens``
   queries, which the attention function has at hand;
2. the layer budget (``capacity`` or ``(1 - ratio) * tokens`` per head, times the kv heads; the
   global budget is the sum over layers) is split into heterogeneous per-head counts
   (:mod:`kvlab.relay.budgets`), sinks and the recent window always kept;
3. with ``relay=True`` (RoPE-Relay, SPEC §2) the kept keys are relayed with
   :func:`kvlab.relay.relay` — every head's kept tokens right-aligned at positions
   ``E - k_h + 1 .. E``, keys rotated by the position delta (pure rotation, rotary channels
   only: partial rotary, llama3 and yarn scaling through
   :meth:`kvlab.rope.RotaryConfig.from_hf_config`), values untouched — with one endpoint ``E``
   shared by every head and layer (``E = slots - 1``, ``slots`` being the per-head cap), so the
   next token sits at ``E + 1`` everywhere; with ``relay=False`` the same kept tokens keep their
   original positions and later tokens continue from the original stream length.

Positions: :meth:`RelayModelCache.get_seq_length` returns the layer's next position (``E + 1``
plus tokens appended since, or the stream length without relay), so a forward without
``position_ids`` rotates new tokens at the synchronized positions. If a caller (e.g.
``generate``, which counts tokens from its attention mask) passes other ``position_ids``, the
layer re-rotates the new keys — and the attention function the queries — by the difference:
a pure rotation, exact up to float rounding, so relay works under ``generate`` as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.attention import CacheView
from kvlab.relay.budgets import allocate_counts, protected_mask, select_keep
from kvlab.relay.core import relay
from kvlab.relay.layer_budgets import pyramid_layer_budgets, split_layer_budget
from kvlab.relay.scorers import ScoreInputs, Scorer, get_scorer
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["EvictionConfig", "EvictionEvent", "RelayLayer", "RelayModelCache", "RelayView"]


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
            :mod:`kvlab.relay.layer_budgets`), or one positive weight per layer (budgets
            proportional to them, e.g. from a calibration); always the same total.
        pyramid_beta: PyramidKV's steepness ``beta`` (``k_min = k / beta``), >= 1.
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
        if self.observation_tokens is not None and self.observation_tokens < 1:
            raise ValueError(f"observation_tokens must be >= 1, got {self.observation_tokens}")
        if isinstance(self.layer_budget, str):
            if self.layer_budget not in ("uniform", "pyramid"):
                raise ValueError(
                    "layer_budget must be 'uniform', 'pyramid' or per-layer weights, got "
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
        get_scorer(self.scorer)  # validates the name

    def head_slots(self, tokens_per_head: int) -> int:
        """The per-head cap (relay slots) for an eviction of heads holding ``tokens_per_head``."""
        if self.max_head_tokens is not None:
            return self.max_head_tokens
        if self.capacity is not None:
            return 2 * self.capacity
        return tokens_per_head


@dataclass(frozen=True)
class EvictionEvent:
    """What one eviction did in one layer: ``tokens_before``/``tokens_after`` per head
    (lists, length ``H_kv``), the shared ``endpoint`` (``None`` without relay) and the stream
    length at the time."""

    layer_idx: int
    stream_length: int
    tokens_before: list[int]
    tokens_after: list[int]
    endpoint: int | None


def _position_shift(position_ids: Tensor | None, expected_start: int, length: int) -> int:
    """``expected_start - position_ids[..., 0]`` (0 when ``position_ids`` is None), after
    checking the ids are consecutive and equal across the batch.

    Raises:
        ValueError: non-consecutive or batch-dependent position ids.
    """
    if position_ids is None:
        return 0
    ids = position_ids.reshape(-1, position_ids.shape[-1])
    if ids.shape[-1] != length:
        raise ValueError(f"position_ids length {ids.shape[-1]} != {length} new tokens")
    start = ids[:, :1]
    ramp = torch.arange(length, device=ids.device).unsqueeze(0)
    if not bool((ids == start + ramp).all()) or not bool((start == start[:1]).all()):
        raise ValueError("kvlab relay caches need consecutive position_ids, equal across the batch")
    return expected_start - int(start[0, 0])


class RelayView(CacheView):
    """Returned by :meth:`RelayLayer.update`: attends head by head over the ragged storage and
    runs the layer's eviction afterwards when it is due."""

    def __init__(self, layer: RelayLayer, num_new: int, shift: int) -> None:
        self.layer = layer
        self.num_new = num_new
        self.shift = shift

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """Causal attention of ``query`` ``[B, H_q, Q, D]`` over every head's tokens (GQA:
        query head ``i`` reads kv head ``i // (H_q / H_kv)``), exact softmax (PyTorch SDPA),
        then eviction if due. Returns ``[B, H_q, Q, Dv]`` in the query dtype."""
        layer = self.layer
        if self.shift:
            query = rotate_by_delta(query, self.shift, layer.rotary)
        batch, hq, q_len, _ = query.shape
        heads = len(layer.keys_per_head)
        if hq % heads:
            raise ValueError(f"query heads {hq} must be a multiple of kv heads {heads}")
        group = hq // heads
        outs = []
        for h in range(heads):
            keys, values = layer.keys_per_head[h], layer.values_per_head[h]
            n = keys.shape[1]
            q = query[:, h * group : (h + 1) * group]
            mask = None
            if q_len > 1:
                rows = torch.arange(q_len, device=q.device).unsqueeze(-1) + (n - q_len)
                mask = torch.arange(n, device=q.device).unsqueeze(0) <= rows
            outs.append(
                F.scaled_dot_product_attention(
                    q,
                    keys.unsqueeze(1).expand(batch, group, n, keys.shape[-1]).to(q.dtype),
                    values.unsqueeze(1).expand(batch, group, n, values.shape[-1]).to(q.dtype),
                    attn_mask=mask,
                    scale=scaling,
                )
            )
        out = torch.cat(outs, dim=1)
        if layer.eviction_due(self.num_new):
            layer.evict(query, scaling)
        return out


class RelayLayer(CacheLayerMixin):
    """One decoder layer of a :class:`RelayModelCache` (ragged per-head storage).

    Attributes:
        keys_per_head / values_per_head: per kv head ``[B, n_h, D]`` / ``[B, n_h, Dv]``.
        original_positions: per head ``[B, n_h]`` int64 stream index of each token.
        rotary_positions: per head ``[B, n_h]`` int64 position each key is rotated at.
        stream_length: tokens received so far.
        next_position: position of the next token (the synchronized one after a relay).
        events: the :class:`EvictionEvent` list of this layer.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, config: EvictionConfig, rotary: RotaryConfig, layer_idx: int) -> None:
        super().__init__()
        self.eviction = config
        self.rotary = rotary
        self.layer_idx = layer_idx
        self.scorer = get_scorer(config.scorer)
        self.allocation = config.allocation or self.scorer.default_allocation
        self.num_layers = 1  # set by RelayModelCache (per-layer budgets need it)
        self._clear()

    def _clear(self) -> None:
        self.keys_per_head: list[Tensor] = []
        self.values_per_head: list[Tensor] = []
        self.original_positions: list[Tensor] = []
        self.rotary_positions: list[Tensor] = []
        self.stream_length = 0
        self.next_position = 0
        self.forwards = 0
        self.events: list[EvictionEvent] = []
        self.is_initialized = False

    # ---------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys_per_head = [key_states[:, h, :0] for h in range(heads)]
        self.values_per_head = [value_states[:, h, :0] for h in range(heads)]
        empty = torch.zeros((batch, 0), dtype=torch.int64, device=self.device)
        self.original_positions = [empty for _ in range(heads)]
        self.rotary_positions = [empty for _ in range(heads)]
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[RelayView, RelayView]:
        """Append ``[B, H_kv, T, D]`` rotated keys and ``[B, H_kv, T, Dv]`` values.

        If the model rotated them at positions other than the layer's next position (its
        ``position_ids``, found in the attention kwargs), they are re-rotated by the difference.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        inner = kwargs.get("kwargs") or {}
        t = key_states.shape[2]
        shift = _position_shift(inner.get("position_ids"), self.next_position, t)
        if shift:
            key_states = rotate_by_delta(key_states, shift, self.rotary)
        batch = key_states.shape[0]
        orig = torch.arange(self.stream_length, self.stream_length + t, device=self.device)
        rot = torch.arange(self.next_position, self.next_position + t, device=self.device)
        orig, rot = orig.expand(batch, t), rot.expand(batch, t)
        for h in range(len(self.keys_per_head)):
            self.keys_per_head[h] = torch.cat([self.keys_per_head[h], key_states[:, h]], dim=1)
            self.values_per_head[h] = torch.cat(
                [self.values_per_head[h], value_states[:, h]], dim=1
            )
            self.original_positions[h] = torch.cat([self.original_positions[h], orig], dim=1)
            self.rotary_positions[h] = torch.cat([self.rotary_positions[h], rot], dim=1)
        self.stream_length += t
        self.next_position += t
        self.forwards += 1
        view = RelayView(self, t, shift)
        return view, view

    def get_seq_length(self) -> int:
        """The next position (synchronized after a relay; the stream length without relay)."""
        return self.next_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_tokens() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self._clear()

    def _select_rows(self, index: Tensor) -> None:
        for name in ("keys_per_head", "values_per_head", "original_positions", "rotary_positions"):
            tensors = getattr(self, name)
            setattr(self, name, [t.index_select(0, index.to(t.device)) for t in tensors])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select every head's buffers by ``beam_idx`` (beam search)."""
        if self.is_initialized:
            self._select_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            batch = self.keys_per_head[0].shape[0]
            self._select_rows(torch.arange(batch).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` is supported.

        Raises:
            NotImplementedError: ``tokens_to_remove != 0``.
        """
        if tokens_to_remove != 0:
            raise NotImplementedError("relay caches cannot be cropped")

    # ---------------------------------------------------------------- sizes
    def tokens_per_head(self) -> list[int]:
        """Tokens stored per kv head."""
        return [int(k.shape[1]) for k in self.keys_per_head]

    def max_tokens(self) -> int:
        return max(self.tokens_per_head(), default=0)

    def nbytes(self) -> int:
        """Bytes of the stored key and value tensors (``numel * element_size``)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for k, v in zip(self.keys_per_head, self.values_per_head, strict=True)
        )

    def numel(self) -> int:
        """Stored key and value elements."""
        return sum(
            k.numel() + v.numel()
            for k, v in zip(self.keys_per_head, self.values_per_head, strict=True)
        )

    def index_bytes(self) -> int:
        """Bytes of the position bookkeeping (stream index and rotary position per token)."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in zip(self.original_positions, self.rotary_positions, strict=True)
        )

    # ---------------------------------------------------------------- eviction
    def eviction_due(self, num_new: int) -> bool:
        """Whether the forward that just appended ``num_new`` tokens must be followed by an
        eviction (see :class:`EvictionConfig`)."""
        counts = self.tokens_per_head()
        if self.eviction.ratio is not None:
            return self.forwards == 1 and self.stream_length == num_new and num_new > 1
        assert self.eviction.capacity is not None
        return sum(counts) > self.eviction.capacity * len(counts)

    def _padded(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Left-aligned padded copies: keys, values ``[B, H, S, *]``, valid, original and rotary
        positions ``[B, H, S]``."""
        counts = self.tokens_per_head()
        slots = max(counts)
        keys, values, orig, rot = [], [], [], []
        for h, n in enumerate(counts):
            pad = slots - n
            keys.append(F.pad(self.keys_per_head[h], (0, 0, 0, pad)))
            values.append(F.pad(self.values_per_head[h], (0, 0, 0, pad)))
            orig.append(F.pad(self.original_positions[h], (0, pad), value=-1))
            rot.append(F.pad(self.rotary_positions[h], (0, pad), value=0))
        index = torch.arange(slots, device=self.device)
        valid = index.unsqueeze(0) < torch.tensor(counts, device=self.device).unsqueeze(-1)
        batch = self.keys_per_head[0].shape[0]
        return (
            torch.stack(keys, 1),
            torch.stack(values, 1),
            valid.unsqueeze(0).expand(batch, -1, -1),
            torch.stack(orig, 1),
            torch.stack(rot, 1),
        )

    # ---- scoring inputs (issue 9: observation window size and per-query-head probabilities)
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

    def _layer_tokens_per_head(self, tokens: int, slots: int) -> int:
        """This layer's budget in tokens per kv head for a ratio eviction of heads holding
        ``tokens`` (``EvictionConfig.layer_budget``; the sum over layers is the same for every
        setting: ``L * max(1, round((1 - ratio) * tokens))``)."""
        cfg = self.eviction
        assert cfg.ratio is not None
        mean = max(1, round((1.0 - cfg.ratio) * tokens))
        if cfg.layer_budget == "uniform" or self.num_layers == 1:
            return mean
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
        budgets = split_layer_budget(
            mean * self.num_layers,
            weights,
            low=[floor] * self.num_layers,
            high=[top] * self.num_layers,
        )
        return budgets[self.layer_idx]

    # ---- end of scoring inputs

    def evict(self, query: Tensor, scaling: float) -> EvictionEvent:
        """Score, allocate, select, relay (or not) and physically rebuild the storage.

        Args:
            query: the current forward's queries ``[B, H_q, Q, D]`` at cache positions.
            scaling: the model's softmax scale.
        """
        cfg = self.eviction
        before = self.tokens_per_head()
        heads = len(before)
        keys, values, valid, orig, rot = self._padded()
        slots = cfg.head_slots(max(before))
        if cfg.ratio is not None:
            per_head = self._layer_tokens_per_head(max(before), slots)
        else:
            assert cfg.capacity is not None
            per_head = cfg.capacity
        recent = self._protected_window(per_head)
        window = probs = None
        if self.scorer.needs_window_attention:
            probs = self._window_attention(
                query, scaling, keys, valid, self._observation_tokens(recent)
            )
            window = probs.sum((2, 3))
        q_len = query.shape[2]
        scores = self.scorer.score(
            ScoreInputs(
                keys=keys,
                values=values,
                valid=valid,
                original_positions=orig,
                window_attention=window,
                window_probs=probs,
                queries=query if self.scorer.needs_queries else None,
                query_positions=torch.arange(
                    self.next_position - q_len, self.next_position, device=query.device
                ),
                rotary=self.rotary,
                next_position=self.next_position,
            )
        )
        protected = protected_mask(
            orig,
            valid,
            stream_length=self.stream_length,
            sink_tokens=cfg.sink_tokens,
            window_tokens=recent,
        )
        counts = allocate_counts(
            scores,
            valid,
            protected,
            total=per_head * heads,
            allocation=self.allocation,
            cap=slots,
            comparable_across_heads=self.scorer.comparable_across_heads,
        )
        keep = select_keep(scores, valid, protected, counts)
        endpoint: int | None = None
        if cfg.relay:
            endpoint = slots - 1
            out = relay(keys, values, rot, keep, self.rotary, endpoint=endpoint)
            s = keys.shape[2]
            source = out.source_index.clamp_min(0)
            new_orig = orig.gather(-1, source)
            for h in range(heads):
                k = int(counts[h])
                self.keys_per_head[h] = out.keys[:, h, s - k :].clone()
                self.values_per_head[h] = out.values[:, h, s - k :].clone()
                self.original_positions[h] = new_orig[:, h, s - k :].clone()
                self.rotary_positions[h] = out.positions[:, h, s - k :].clone()
            self.next_position = out.next_position
        else:
            # kept slots first, in stream order (stable sort on the keep flag)
            order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
            for h in range(heads):
                k = int(counts[h])
                idx = order[:, h, :k]
                self.keys_per_head[h] = keys[:, h].gather(
                    1, idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
                )
                self.values_per_head[h] = values[:, h].gather(
                    1, idx.unsqueeze(-1).expand(-1, -1, values.shape[-1])
                )
                self.original_positions[h] = orig[:, h].gather(1, idx)
                self.rotary_positions[h] = rot[:, h].gather(1, idx)
        event = EvictionEvent(
            layer_idx=self.layer_idx,
            stream_length=self.stream_length,
            tokens_before=before,
            tokens_after=self.tokens_per_head(),
            endpoint=endpoint,
        )
        self.events.append(event)
        return event


class RelayModelCache(Cache):
    """A ``transformers`` cache that evicts per (layer, kv head) and relays kept keys.

    Args:
        model_config: the model's ``PretrainedConfig`` (layers, RoPE).
        config: the :class:`EvictionConfig`.
        rotary: the model's RoPE; default :meth:`RotaryConfig.from_hf_config` of the config.

    Raises:
        ValueError: non-full-attention layers, or an unsupported RoPE (dynamic, longrope, ...).
    """

    def __init__(
        self,
        model_config: Any,
        config: EvictionConfig,
        *,
        rotary: RotaryConfig | None = None,
    ) -> None:
        text_config = model_config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                "RelayModelCache supports full-attention decoders only; layer types "
                f"{sorted(set(layer_types))} found"
            )
        self.eviction = config
        self.rotary = rotary or RotaryConfig.from_hf_config(text_config)
        super().__init__(
            layers=[
                RelayLayer(config, self.rotary, i) for i in range(text_config.num_hidden_layers)
            ]
        )
        for layer in self.layers:
            layer.num_layers = text_config.num_hidden_layers

    def nbytes(self) -> int:
        """Bytes of every layer's stored key and value tensors."""
        return sum(layer.nbytes() for layer in self.layers)

    def numel(self) -> int:
        """Stored key and value elements over all layers."""
        return sum(layer.numel() for layer in self.layers)

    def index_bytes(self) -> int:
        """Bytes of the per-token position bookkeeping over all layers."""
        return sum(layer.index_bytes() for layer in self.layers)

    @property
    def stream_length(self) -> int:
        """Tokens received so far (original stream length)."""
        return self.layers[0].stream_length if self.layers else 0

    @property
    def next_position(self) -> int:
        """Position of the next token (same in every layer)."""
        return self.layers[0].next_position if self.layers else 0

    def events(self) -> list[EvictionEvent]:
        """Every eviction of every layer, in layer order."""
        return [event for layer in self.layers for event in layer.events]
