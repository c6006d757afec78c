"""When and how RoPE-Relay evicts: :class:`EvictionConfig`, and what one eviction did:
:class:`EvictionEvent` (docs/design.md, "RoPE-Relay: Eviction policy").

Torch-free settings (no ``transformers`` import), mirroring :mod:`kvlab.pnmix.config`; the
``transformers`` cache that reads them is :class:`kvlab.integrations.RelayModelCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.relay.scorers import Scorer, get_scorer

__all__ = ["EvictionConfig", "EvictionEvent"]


class _ResolvedScorer:
    """Holds a config's resolved scorer in a slot: outside the dataclass fields (equality,
    ``repr``, ``dataclasses.replace``) and outside ``vars(config)`` (which rebuilds a config)."""

    __slots__ = ("_resolved_scorer",)


@dataclass(frozen=True)
class EvictionConfig(_ResolvedScorer):
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
        # the scorer is resolved once, here (a name of SCORERS or the Scorer itself)
        scorer = get_scorer(self.scorer)
        object.__setattr__(self, "_resolved_scorer", scorer)
        if scorer.needs_reconstruction and self.ratio is None:
            raise ValueError(
                f"scorer {scorer.name!r} scores the tokens by a reconstruction "
                "pass after a prefill (kvlab.integrations.kvzip.compress): it needs ratio, not "
                "capacity"
            )
        if not 0.0 < self.scores_share <= 1.0:
            raise ValueError(f"scores_share must lie in (0, 1], got {self.scores_share}")
        if self.scores_share != 1.0 and self.layer_budget != "scores":
            raise ValueError("scores_share needs layer_budget='scores'")
        if self.layer_budget == "scores" and not scorer.needs_reconstruction:
            raise ValueError(
                "layer_budget 'scores' splits the budget by a reconstruction pass's scores over "
                f"every layer; scorer {scorer.name!r} scores layer by layer"
            )

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)  # the fields; the scorer is resolved again on load

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_resolved_scorer", get_scorer(self.scorer))

    @property
    def resolved_scorer(self) -> Scorer:
        """The :class:`Scorer` of :attr:`scorer` (resolved once, at construction)."""
        return self._resolved_scorer  # type: ignore[no-any-return]

    @property
    def resolved_allocation(self) -> str:
        """:attr:`allocation`, or the scorer's default (``"uniform"`` or ``"adaptive"``)."""
        return self.allocation or self.resolved_scorer.default_allocation

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
