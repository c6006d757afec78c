"""RoPE-Relay: heterogeneous per-head eviction with a relay to one shared endpoint
(docs/design.md, "RoPE-Relay: Relay").

After eviction every (batch, kv head) keeps its own number ``r_h`` of tokens. The relay moves
the survivors of each head, in their original order, into the right-most slots
``S - r_h .. S - 1`` and re-positions them at ``E - r_h + 1 .. E`` for one endpoint ``E``
shared by every head (and layer). Keys are already rotated (RoPE; Su et al. 2021), so moving a
key from position ``p`` to ``p'`` is a pure rotation by ``p' - p`` on its rotary channels
(:func:`kvlab.rope.rotate_by_delta`): ``R(p' - p) R(p) k = R(p') k``. Values and non-rotary
key channels are copied bit-identically. Every head then continues at the same
``next_position = E + 1``, so the queries that follow (question or answer tokens) are
rotated at synchronized positions ``E + 1, E + 2, ...`` for every head.

Slot arithmetic: output slot ``j`` of any head, when valid, holds position
``j + E - (S - 1)``; head ``h`` is valid in slots ``j >= S - r_h``.

Everything is vectorized (argsort/gather/where, no Python loop over heads), never writes to
its inputs, and is differentiable with autograd with respect to keys, values and queries.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.rope import RotaryConfig, apply_rotary, rotate_by_delta

__all__ = [
    "EMPTY_POSITION",
    "RelayedCache",
    "relay",
    "relay_attention",
    "relay_logits",
]

#: Position (and source index) stored in empty slots of a :class:`RelayedCache`.
EMPTY_POSITION: int = -1


@dataclass
class RelayedCache:
    """One layer's KV cache after a relay (the output of :func:`relay`).

    Shapes: ``B`` batch, ``H_kv`` kv heads (``num_key_value_heads``), ``S`` slots, ``D``
    head_dim, ``Dv`` value head dim.

    Attributes:
        keys: ``[B, H_kv, S, D]``, input dtype. Rotated keys at their new positions; empty
            slots are zero.
        values: ``[B, H_kv, S, Dv]``, input dtype. Bit-identical copies; empty slots zero.
        valid: ``[B, H_kv, S]`` bool. True for the right-aligned kept slots
            ``S - kept_counts[b, h] .. S - 1``.
        positions: ``[B, H_kv, S]`` int64. New position of each valid slot
            (``slot + next_position - S``), ``EMPTY_POSITION`` (-1) in empty slots.
        next_position: the endpoint plus one: the position of the next token, the same for
            every head (and every layer relayed with the same endpoint).
        kept_counts: ``[B, H_kv]`` int64, tokens kept per head (``r_h >= 1``).
        source_index: ``[B, H_kv, S]`` int64. Input slot index of each valid slot's token,
            ``EMPTY_POSITION`` (-1) in empty slots.
    """

    keys: Tensor
    values: Tensor
    valid: Tensor
    positions: Tensor
    next_position: int
    kept_counts: Tensor
    source_index: Tensor

    @property
    def endpoint(self) -> int:
        """The shared endpoint ``E = next_position - 1`` (position of every head's last slot)."""
        return self.next_position - 1

    def query_positions(self, num_queries: int) -> Tensor:
        """Synchronized positions of the next ``num_queries`` tokens: int64 ``[num_queries]``,
        ``next_position, next_position + 1, ...``, on the cache's device."""
        return torch.arange(
            self.next_position,
            self.next_position + num_queries,
            dtype=torch.int64,
            device=self.keys.device,
        )


def _format_heads(mask: Tensor, limit: int = 8) -> str:
    heads = mask.nonzero().tolist()
    text = ", ".join(f"(b={b}, h={h})" for b, h in heads[:limit])
    return text + (f" and {len(heads) - limit} more" if len(heads) > limit else "")


def relay(
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    keep: Tensor,
    cfg: RotaryConfig,
    endpoint: int | None = None,
    *,
    check_finite: bool = True,
) -> RelayedCache:
    """Relay each head's kept tokens to right-aligned slots at positions ending at ``endpoint``.

    Args:
        keys: rotated keys ``[B, H_kv, S, D]`` (``D == cfg.head_dim``), floating, finite.
        values: ``[B, H_kv, S, Dv]``, same dtype and device as ``keys``, finite.
        positions: original (rotation) positions of the slots, integer, ``[S]`` (shared) or
            ``[B, H_kv, S]``.
        keep: bool ``[B, H_kv, S]``; every head keeps at least one token.
        cfg: the rotary configuration the keys were rotated with.
        endpoint: ``E``, the new position of every head's last kept token. Default ``S - 1``
            (fixed-size cache: positions never exceed slots); the streaming variant passes the
            last original position. Must be ``>= max(kept count) - 1`` so no position is
            negative.
        check_finite: refuse non-finite keys or values (default). ``False`` relays them as
            they are (a NaN stays NaN; a finite key that overflows is still refused): a cache
            relaying a
            sequence whose model produced non-finite states, which transformers' own caches
            store as they are (docs/design.md, "Cache life cycle").

    Returns:
        A :class:`RelayedCache`: head ``(b, h)``'s ``r`` kept tokens sit in slots
        ``S - r .. S - 1`` in their original slot order, at positions ``E - r + 1 .. E``, keys
        rotated by ``new - old`` position on the rotary channels only
        (:func:`kvlab.rope.rotate_by_delta`, float32 or better), values and non-rotary key
        channels bit-identical, empty slots zero and invalid, ``next_position = E + 1``.

    Raises:
        ValueError: a head with zero kept tokens (names the (b, h)), a keep mask with more
            slots than the cache, shape, dtype or device mismatches, non-integer positions,
            a non-bool keep mask, non-finite keys or values, an endpoint below
            ``max(kept count) - 1``, or relayed keys that overflow the input dtype.
    """
    if not isinstance(keys, Tensor) or keys.dim() != 4:
        raise ValueError(f"keys must be a [B, H_kv, S, D] tensor, got {_shape(keys)}")
    if not keys.is_floating_point():
        raise ValueError(f"keys must be floating point, got dtype {keys.dtype}")
    if keys.shape[-1] != cfg.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]} but cfg.head_dim={cfg.head_dim}")
    batch, heads, slots, _ = keys.shape
    if batch == 0 or heads == 0 or slots == 0:
        raise ValueError(f"keys must be non-empty, got shape {tuple(keys.shape)}")
    if not isinstance(values, Tensor) or values.dim() != 4:
        raise ValueError(f"values must be a [B, H_kv, S, Dv] tensor, got {_shape(values)}")
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"values shape {tuple(values.shape)} does not match keys [B, H_kv, S] = "
            f"{tuple(keys.shape[:3])}"
        )
    if values.dtype != keys.dtype:
        raise ValueError(f"values dtype {values.dtype} differs from keys dtype {keys.dtype}")
    if not isinstance(keep, Tensor):
        raise ValueError(f"keep must be a bool [B, H_kv, S] tensor, got {type(keep).__name__}")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor, got dtype {keep.dtype}")
    if keep.dim() == 3 and keep.shape[:2] == keys.shape[:2] and keep.shape[2] > slots:
        raise ValueError(
            f"keep has {keep.shape[2]} slots per head but the cache has S={slots}: "
            "a head cannot keep more tokens than there are slots"
        )
    if keep.shape != keys.shape[:3]:
        raise ValueError(
            f"keep shape {tuple(keep.shape)} does not match keys [B, H_kv, S] = "
            f"{tuple(keys.shape[:3])}"
        )
    if not isinstance(positions, Tensor):
        raise ValueError(f"positions must be an integer tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if positions.shape not in (torch.Size([slots]), keys.shape[:3]):
        raise ValueError(
            f"positions must have shape [S] = ({slots},) or [B, H_kv, S] = "
            f"{tuple(keys.shape[:3])}, got {tuple(positions.shape)}"
        )
    for name, tensor in (("values", values), ("positions", positions), ("keep", keep)):
        if tensor.device != keys.device:
            raise ValueError(f"{name} is on {tensor.device} but keys are on {keys.device}")
    if check_finite and not bool(torch.isfinite(keys).all()):
        raise ValueError("keys contain non-finite values (inf or nan)")
    if check_finite and not bool(torch.isfinite(values).all()):
        raise ValueError("values contain non-finite values (inf or nan)")

    counts = keep.sum(dim=-1, dtype=torch.int64)  # [B, H]
    empty = counts == 0
    if bool(empty.any()):
        raise ValueError(
            f"every head must keep at least one token; zero kept tokens at {_format_heads(empty)}"
        )
    max_kept = int(counts.max())
    if endpoint is None:
        end = slots - 1
    else:
        if isinstance(endpoint, bool):
            raise ValueError(f"endpoint must be an int, got {endpoint!r}")
        try:
            end = operator.index(endpoint)
        except TypeError:
            raise ValueError(f"endpoint must be an int, got {endpoint!r}") from None
    if end < max_kept - 1:
        raise ValueError(
            f"endpoint={end} is smaller than max kept count - 1 = {max_kept - 1}: "
            "relayed positions would be negative"
        )

    # Stable sort on the keep flag puts the S - r evicted slots first and the r kept slots
    # last, each group in original slot order: sorted slot j is output slot j.
    source = torch.argsort(keep.to(torch.uint8), dim=-1, stable=True)  # [B, H, S]
    slot = torch.arange(slots, dtype=torch.int64, device=keys.device)
    valid = slot >= (slots - counts).unsqueeze(-1)  # [B, H, S]
    new_positions = slot + (end + 1 - slots)  # [S]; valid slots only

    # only the last max_kept slots hold kept tokens: move and rotate those, the rest is zero
    tail = slots - max_kept
    source_tail = source[..., tail:]
    valid_tail = valid[..., tail:]
    old_positions = positions.to(torch.int64).expand(batch, heads, slots).gather(-1, source_tail)
    delta = torch.where(valid_tail, new_positions[tail:] - old_positions, 0)
    moved_keys = keys.gather(2, source_tail.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    moved_values = values.gather(2, source_tail.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
    relayed_keys = rotate_by_delta(moved_keys, delta, cfg)
    overflow = ~torch.isfinite(relayed_keys)
    if not check_finite:  # a token with a non-finite channel stays so; finite ones must not
        overflow &= torch.isfinite(moved_keys).all(-1, keepdim=True)
    if bool(overflow.any()):
        raise ValueError(
            f"relayed keys overflow {keys.dtype}: a rotated pair exceeds the dtype's range "
            "(its norm is preserved, but one coordinate can grow by up to sqrt(2)); relay in "
            "float32 or bfloat16"
        )

    empty_slot = ~valid_tail.unsqueeze(-1)
    out_keys = keys.new_zeros(keys.shape)
    out_values = values.new_zeros(values.shape)
    out_keys[..., tail:, :] = relayed_keys.masked_fill(empty_slot, 0)
    out_values[..., tail:, :] = moved_values.masked_fill(empty_slot, 0)
    return RelayedCache(
        keys=out_keys,
        values=out_values,
        valid=valid,
        positions=torch.where(valid, new_positions, EMPTY_POSITION),
        next_position=end + 1,
        kept_counts=counts,
        source_index=torch.where(valid, source, EMPTY_POSITION),
    )


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def _grouped_query(
    query: Tensor,
    relayed: RelayedCache,
    cfg: RotaryConfig,
    query_positions: Tensor | None,
) -> tuple[Tensor, torch.dtype]:
    """Validate; rotate the raw query; return it grouped ``[B, H_kv, G, Q, D]`` in the
    compute dtype (float64 for float64 queries, else float32)."""
    if not isinstance(query, Tensor) or query.dim() != 4:
        raise ValueError(f"query must be a [B, H_q, Q, D] tensor, got {_shape(query)}")
    if not query.is_floating_point():
        raise ValueError(f"query must be floating point, got dtype {query.dtype}")
    if query.shape[-1] != cfg.head_dim:
        raise ValueError(f"query has head_dim {query.shape[-1]} but cfg.head_dim={cfg.head_dim}")
    keys = relayed.keys
    batch, kv_heads = keys.shape[:2]
    if keys.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"relayed keys have head_dim {keys.shape[-1]} but cfg.head_dim={cfg.head_dim}"
        )
    if relayed.valid.shape != keys.shape[:3] or relayed.values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            "inconsistent RelayedCache: keys, values and valid must share [B, H_kv, S]"
        )
    if query.shape[0] != batch:
        raise ValueError(f"query batch {query.shape[0]} differs from the cache's batch {batch}")
    q_heads = query.shape[1]
    if q_heads % kv_heads:
        raise ValueError(
            f"query heads H_q={q_heads} must be a multiple of kv heads H_kv={kv_heads} (GQA)"
        )
    if query.dtype != keys.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from relayed keys dtype {keys.dtype}")
    if query.device != keys.device:
        raise ValueError(f"query is on {query.device} but the cache is on {keys.device}")
    if not bool(relayed.valid.any(dim=-1).all()):
        raise ValueError("every head of the relayed cache must have at least one valid slot")

    if query_positions is None:
        query_positions = relayed.query_positions(query.shape[2])
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    # Upcasting first is exact, so this equals rotating in `compute` without a round trip
    # through the query dtype.
    try:
        rotated = apply_rotary(query.to(compute), query_positions, cfg)
    except ValueError as error:
        raise ValueError(f"query_positions: {error}") from None
    return rotated.unflatten(1, (kv_heads, q_heads // kv_heads)), compute


def relay_logits(
    query: Tensor,
    relayed: RelayedCache,
    cfg: RotaryConfig,
    *,
    query_positions: Tensor | None = None,
) -> Tensor:
    """Raw attention logits ``q . k`` (no ``1/sqrt(D)`` scale, no mask) against a relayed cache.

    Args:
        query: RAW (not yet rotated) queries ``[B, H_q, Q, D]``, same dtype/device as the cache;
            ``H_q`` a multiple of ``H_kv`` (query head ``i`` reads kv head ``i // (H_q/H_kv)``).
        relayed: the output of :func:`relay`.
        cfg: the rotary configuration.
        query_positions: positions at which to rotate the queries, integer or floating,
            broadcastable to ``[B, H_q, Q]``. Default: the synchronized positions
            ``relayed.next_position + arange(Q)``. Pass e.g. each query's original-stream
            position to measure a desynchronized query.

    Returns:
        ``[B, H_q, Q, S]`` in float32 (float64 for float64 queries). Empty slots hold exactly 0
        (their keys are zero); select real slots with ``relayed.valid``.

    Raises:
        ValueError: shape, head-count (GQA), dtype or device mismatches, or a head without
            valid slots.
    """
    grouped, compute = _grouped_query(query, relayed, cfg, query_positions)
    keys = relayed.keys.to(compute).unsqueeze(2)  # [B, H_kv, 1, S, D]
    logits = grouped @ keys.transpose(-1, -2)  # [B, H_kv, G, Q, S]
    return logits.flatten(1, 2)


def relay_attention(
    query: Tensor,
    relayed: RelayedCache,
    cfg: RotaryConfig,
    *,
    scale: float | None = None,
    query_positions: Tensor | None = None,
) -> Tensor:
    """Attention of question queries over a relayed cache (softmax over the valid slots only).

    The ``Q`` queries are independent question tokens: each attends to the relayed cache only,
    not to the other queries (no causal block among them). They are rotated at the
    synchronized positions ``next_position, next_position + 1, ...`` (or ``query_positions``)
    with a pure rotation (no yarn attention factor; pre-scale the query if your keys carry it).

    Args:
        query: RAW queries ``[B, H_q, Q, D]``, same dtype/device as the cache; GQA: query head
            ``i`` attends kv head ``i // (H_q / H_kv)``.
        relayed: the output of :func:`relay`.
        cfg: the rotary configuration.
        scale: logit scale, default ``1 / sqrt(D)``; finite and > 0.
        query_positions: see :func:`relay_logits`.

    Returns:
        ``[B, H_q, Q, Dv]`` in the query's dtype. Logits, softmax and the value sum are
        computed in float32 (float64 for float64 queries); invalid slots get exactly zero
        weight (logits masked to ``-inf`` before the softmax; no sentinel keys or values).
        Differentiable with respect to query, keys and values.

    Raises:
        ValueError: as :func:`relay_logits`, or an invalid ``scale``.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(cfg.head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    logits = relay_logits(query, relayed, cfg, query_positions=query_positions)
    kv_heads = relayed.valid.shape[1]
    logits = logits.unflatten(1, (kv_heads, -1)) * scale  # [B, H_kv, G, Q, S]
    masked = logits.masked_fill(~relayed.valid[:, :, None, None, :], float("-inf"))
    weights = torch.softmax(masked, dim=-1)
    values = relayed.values.to(logits.dtype).unsqueeze(2)  # [B, H_kv, 1, S, Dv]
    return (weights @ values).flatten(1, 2).to(query.dtype)
