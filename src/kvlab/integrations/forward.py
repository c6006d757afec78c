"""One forward through a kvlab model cache with evicting layers: the stash an ``update`` leaves
for the attention call, the forward's checked inputs (the *plan*, built once by the forward's
first layer and shared by the others), and the checks themselves (docs/design.md, "RoPE-Relay:
A forward").

Shared by :class:`kvlab.integrations.relay_layer.RelayLayer` and
:class:`kvlab.integrations.composed_layer.ComposedLayer`. The guard that puts back the window
layers of a refused forward is :class:`kvlab.integrations.window_layer.ForwardGuard`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from kvlab.integrations.layer import SharedState
from kvlab.relay.reconstruction import ReconstructionSpan

__all__ = [
    "ForwardPlan",
    "ForwardState",
    "Pending",
    "Planner",
    "StoredShape",
    "check_states",
    "leading_zeros",
    "plan_decode",
    "plan_forward",
]


@dataclass
class Pending:
    """What ``update`` stashed for the attention call of the same layer and forward."""

    keys: Tensor  # [B, H_kv, T, D], rotated by the model at its position ids
    values: Tensor  # [B, H_kv, T, Dv]
    position_ids: Tensor | None


@dataclass
class ForwardPlan:
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
    #: while the cache records (speculative decoding): the new columns before this index are
    #: the prompt's, the later ones decode-phase tokens (``num_new``: all the prompt's)
    decode_from: int | None = None

    @property
    def padded(self) -> bool:
        return any(r != self.num_new for r in self.real)


class Planner(Protocol):
    """Checks a forward's inputs before any layer changes and plans it (the forward's first
    layer calls it; the plan is shared through :class:`ForwardState`)."""

    def check_forward(
        self,
        pending: Pending,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
        *,
        reconstruction: bool = False,
    ) -> ForwardPlan:
        """The plan of the forward whose stash is ``pending``.

        Raises:
            ValueError: inputs the cache refuses.
        """
        ...


class ForwardState(SharedState):
    """Shared by the evicting layers of one model cache (besides
    :class:`~kvlab.integrations.layer.SharedState`): the current forward's plan, and during a
    reconstruction pass the span of each sequence (``None`` for a sequence the pass does not
    feed)."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: ForwardPlan | None = None
        self.reconstruction: list[ReconstructionSpan | None] | None = None

    def reset(self) -> None:
        """Forget the current forward's plan and reconstruction spans (``Cache.reset``: a
        plan left by the last forward must not be taken for the next conversation's first,
        whose layers count forwards from 0 again), and stop recording; the guard and the
        layers stay."""
        super().reset()
        self.plan = None
        self.reconstruction = None


def leading_zeros(values: list[int]) -> int:
    """How many entries of ``values`` precede its first nonzero one."""
    count = 0
    for v in values:
        if v:
            break
        count += 1
    return count


@dataclass(frozen=True)
class StoredShape:
    """What a layer's storage holds, to check new states against (:func:`check_states`):
    ``[B, H_kv, D, Dv]``, the dtype and device, and the verb its dtype error uses."""

    batch: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    dtype_verb: str = "stores"


def check_states(
    keys: Tensor, values: Tensor, layer_idx: int, stored: StoredShape | None = None
) -> None:
    """Refuse keys ``[B, H_kv, T, D]`` / values ``[B, H_kv, T, Dv]`` of the wrong rank, or (with
    ``stored``) another batch, head shape, dtype or device than the layer stores.

    Raises:
        ValueError: naming the layer and what differs.
    """
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be "
            "[B, H_kv, T, D] and [B, H_kv, T, Dv]"
        )
    if stored is None:
        return
    expected = (stored.batch, stored.heads, stored.head_dim, stored.value_dim)
    got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
    if got != expected:
        raise ValueError(
            f"layer {layer_idx} stores [B, H_kv, D, Dv] = {expected}, got {got} "
            "(a new batch needs a new cache or reset())"
        )
    if keys.dtype != stored.dtype or values.dtype != stored.dtype:
        raise ValueError(f"layer {layer_idx} {stored.dtype_verb} {stored.dtype}, got {keys.dtype}")
    if keys.device != stored.device:
        raise ValueError(f"layer {layer_idx} stores on {stored.device}, got {keys.device}")


def plan_forward(
    pending: Pending,
    attention_mask: Tensor | None,
    kwargs: dict[str, Any],
    *,
    seen: int,
    stream: Sequence[int],
    nexts: Sequence[int],
    padding: Sequence[int],
    forward_index: int,
    reconstruction: bool = False,
) -> ForwardPlan:
    """Check a forward's inputs against the layer's counters and derive the plan (without
    ``first_eviction``: the caller's eviction policy adds it). Reads the device at most once
    (one transfer: the mask check and new columns, the position ids), and not at all when
    neither is given. A ``reconstruction`` pass stores nothing: its rows may be all padding.

    Args:
        pending: the stash of the layer's ``update``.
        attention_mask: ``None`` or the 2-D keep mask ``[B, seen + T]``.
        kwargs: the attention kwargs (``position_ids`` when the stash has none).
        seen: columns the layer has seen; ``stream``, ``nexts``, ``padding``: per row, real
            tokens received, RoPE position of the next token, leading padding columns.
        forward_index: forwards the layer has committed.
        reconstruction: a reconstruction pass.

    Raises:
        ValueError: a mask that is not 2-D ``[B, seen + T]``, not left padding, or disagrees
            with the padding stored; position ids that are not ``[1|B, T]`` or not consecutive
            over a row's real tokens.
    """
    batch, _, t, _ = pending.keys.shape
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
                f"RelayModelCache needs position_ids [1 or B, T], got {tuple(position_ids.shape)}"
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
            zeros = leading_zeros(new)
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
    return ForwardPlan(
        forward_index=forward_index,
        batch=batch,
        num_new=t,
        real=real,
        shift=shift,
        reconstruction=reconstruction,
    )


def plan_decode(
    pending: Pending,
    attention_mask: Tensor | None,
    kwargs: dict[str, Any],
    *,
    seen: int,
    nexts: Sequence[int],
    padding: Sequence[int],
    forward_index: int,
) -> ForwardPlan:
    """The plan of a single-token forward: the new token of every row is real; a mask, if
    given, is read once (one host sync; none without a mask) and refused before anything is
    stored unless its last column is all ones and its older columns are the stored padding (a
    hole in a past position is refused, never ignored: docs/design.md, "Cache life cycle");
    the RoPE shift to the cache's positions is a device tensor when the model passes
    ``position_ids``.

    Raises:
        ValueError: a mask of the wrong shape or pattern, or ``position_ids`` of the wrong
            shape.
    """
    batch = pending.keys.shape[0]
    device = pending.keys.device
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seen + 1):
            raise ValueError(
                "ComposedModelCache takes a 2-D attention_mask [B, seen + new] = "
                f"[{batch}, {seen + 1}] (left padding), got {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(device=device, dtype=torch.bool)
        pads = torch.tensor(padding, device=device).view(-1, 1)
        expected = torch.arange(seen, device=device).view(1, -1) >= pads
        if not bool(mask[:, -1].all() & (mask[:, :seen] == expected).all()):
            raise ValueError(
                "attention_mask of a single-token forward must mark the new token of every "
                "row as real and its older columns as the stored padding (left padding, then "
                "ones); a mask with a hole in a past position, or a padding new token, is "
                "refused"
            )
    position_ids = pending.position_ids
    if position_ids is None:
        position_ids = kwargs.get("position_ids")
    shift = None
    if position_ids is None:  # transformers' default: the columns seen
        deltas = [n - seen for n in nexts]
        if any(deltas):
            shift = torch.tensor(deltas, dtype=torch.int64, device=device).view(-1, 1, 1)
    else:
        if position_ids.dim() != 2 or tuple(position_ids.shape) not in ((1, 1), (batch, 1)):
            raise ValueError(
                f"ComposedModelCache needs position_ids [1 or B, 1] for one new token, got "
                f"{tuple(position_ids.shape)}"
            )
        next_ids = torch.tensor(list(nexts), dtype=torch.int64, device=device)
        model = position_ids.to(device=device, dtype=torch.int64).expand(batch, 1)[:, 0]
        shift = (next_ids - model).view(-1, 1, 1)  # a rotation by 0 is exact
    return ForwardPlan(
        forward_index=forward_index, batch=batch, num_new=1, real=[1] * batch, shift=shift
    )
