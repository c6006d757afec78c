"""KVzip's reconstruction-pass attention over one sequence's cached tokens, and the scores it
yields (Kim et al. 2025, arXiv:2505.23416; the formula of NVIDIA kvpress 0.5.5's
``KVzipPress``): this module owns the arithmetic of the pass — :func:`reconstruction_attention`
(PyTorch's CPU flash attention over disjoint key sets, mixed by log-sum-exp, with the per-slot
max probability from one matmul per block of queries) and
:func:`reconstruction_attention_reference` (materialized softmax; the path for ``softcap`` and
off-CPU tensors, and the float64 reference of tests) — while :mod:`kvlab.relay.kvzip` owns the
repeat prompt and the scorer, and :mod:`kvlab.relay.reconstruction` runs the pass per row of a
store. The score of cached token ``i`` of kv head ``h`` is the largest softmax probability any
query of the pass, in any query head of ``h``'s GQA group, gives it (normalized over the score
columns, the pass's own causal tokens and any learned sink); torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.attention_logits import softcap_logits, softmax_with_sinks

__all__ = ["reconstruction_attention", "reconstruction_attention_reference"]

#: PyTorch's CPU flash attention returning the log-sum-exp, or ``None`` in a build without it.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def reconstruction_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    block_queries: int = 256,
) -> tuple[Tensor, Tensor]:
    """Attention of one sequence's reconstruction-pass queries, and the KVzip scores.

    On CPU (without ``softcap``, with ``Dv == D`` and ``Q >= 1``) it runs PyTorch's CPU flash
    attention (``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns each
    query's log-sum-exp) over three disjoint key sets: the score columns, the other valid
    cached slots and, causally, the own tokens; ``out`` is their log-sum-exp-weighted mix
    (exact: the softmax over a union of key sets), and the score of a slot is ``max exp(scale
    * q . k - lse)`` over the queries and the group, with ``lse`` the log-sum-exp of the score
    columns, the own tokens and the sink (one matmul and a max per block of queries; no
    softmax is materialized). Elsewhere :func:`reconstruction_attention_reference` computes the same
    thing; the two agree up to float32 rounding (tests/relay/test_kvzip.py).

    Args:
        query: ``[1, H_q, Q, D]`` the pass's queries (rotated at the positions following the
            cache).
        keys: ``[1, H, S, D]`` the sequence's cached keys per kv head (padded view);
            values: ``[1, H, S, Dv]``.
        valid: bool ``[1, H, S]``: the cached slots (others never attended, scored 0).
        own_keys: ``[1, H, Q, D]`` the pass's own keys (same rotation); own_values:
            ``[1, H, Q, Dv]``. Query ``j`` sees own tokens ``0 .. j``.
        scale: softmax scale of the logits.
        score_columns: bool ``[1, H, S]`` or ``None``: the cached slots the *scores* are
            normalized over (a later chunk: the first sinks and the chunk); ``None`` = every
            valid slot (then the scores are the attention probabilities themselves). Slots
            outside it score 0.
        softcap: Gemma 2 attention-logit soft-cap, or ``None``; s_aux: ``[H_q]`` learned sink
            logits (GPT-OSS), or ``None`` (both as in :mod:`kvlab.attention_logits`).
        block_queries: queries per block (bounds the float32 logits held at once; on the CPU
            path the block counts query rows of the whole group: ``[H, S, block_queries]``).

    Returns:
        ``(out, scores)``: ``out`` ``[1, H_q, Q, Dv]`` in the query dtype (exact softmax
        attention over the cached slots and the causal own tokens, computed in float32);
        ``scores`` float32 ``[1, H, S]``: per slot, the max over the queries and the GQA
        group's query heads of its softmax probability (:mod:`kvlab.relay.kvzip`), 0 where not
        scored.

    Raises:
        ValueError: shapes that do not fit together (``H_q`` not a multiple of ``H``).
    """
    _check_shapes(query, keys, values, valid, own_keys, own_values)
    if (
        _CPU_FLASH is None
        or softcap is not None
        or query.device.type != "cpu"
        or values.shape[-1] != keys.shape[-1]
        or query.shape[2] == 0  # the kernel divides by zero (SIGFPE) on an empty sequence
    ):
        return reconstruction_attention_reference(
            query,
            keys,
            values,
            valid,
            own_keys,
            own_values,
            scale=scale,
            score_columns=score_columns,
            softcap=softcap,
            s_aux=s_aux,
            block_queries=block_queries,
        )
    return _flash_reconstruction(
        query,
        keys,
        values,
        valid,
        own_keys,
        own_values,
        scale=scale,
        score_columns=score_columns,
        s_aux=s_aux,
        block_queries=block_queries,
    )


def _check_shapes(
    query: Tensor, keys: Tensor, values: Tensor, valid: Tensor, own_keys: Tensor, own_values: Tensor
) -> None:
    """Raise ``ValueError`` unless the arguments of :func:`reconstruction_attention` fit."""
    _, q_heads, q_len, dim = query.shape
    heads = keys.shape[1]
    if (
        query.shape[0] != 1
        or keys.shape[0] != 1
        or q_heads % heads
        or keys.shape[-1] != dim
        or own_keys.shape != (1, heads, q_len, dim)
        or values.shape[:3] != keys.shape[:3]
        or own_values.shape[:3] != own_keys.shape[:3]
        or own_values.shape[-1] != values.shape[-1]
        or valid.shape != keys.shape[:3]
    ):
        raise ValueError(
            f"reconstruction_attention: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)}, valid {tuple(valid.shape)}, own keys "
            f"{tuple(own_keys.shape)}, own values {tuple(own_values.shape)} do not fit"
        )


def _gather_slots(keys: Tensor, values: Tensor, chosen: Tensor) -> tuple[Tensor, ...]:
    """The slots ``chosen`` (bool ``[H, S]``) of ``keys`` / ``values`` (``[H, S, D]``), packed
    to the front per head in slot order and padded to the largest count ``n``: keys and values
    ``[H, n, D]`` (a slice when ``chosen`` is every slot), the slot index ``[H, n]`` (padding:
    ``S``), the count per head ``[H]`` and an additive mask ``[H, 1, n]`` (0 / ``-inf``) or
    ``None`` when nothing is padding."""
    heads, slots = chosen.shape
    counts = chosen.sum(dim=1)
    n = int(counts.max()) if heads else 0
    if n == slots and bool(chosen.all()):
        index = torch.arange(slots, device=keys.device).expand(heads, slots)
        return keys, values, index, counts, None
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :n]  # chosen first
    filled = torch.arange(n, device=keys.device).view(1, n) < counts.view(heads, 1)
    k = keys.gather(1, order.unsqueeze(-1).expand(heads, n, keys.shape[-1]))
    v = values.gather(1, order.unsqueeze(-1).expand(heads, n, values.shape[-1]))
    index = order.masked_fill(~filled, slots)
    mask = None
    if not bool(filled.all()):
        mask = torch.zeros(heads, 1, n, dtype=keys.dtype, device=keys.device)
        mask = mask.masked_fill(~filled.view(heads, 1, n), float("-inf"))
    return k, v, index, counts, mask


def _flash_part(
    query: Tensor, keys: Tensor, values: Tensor, counts: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``query`` ``[H, R, D]`` over ``keys`` / ``values`` ``[H, n, D]``
    (``n >= 1``; ``mask`` additive ``[H, 1, n]`` or ``None``): ``out [H, R, D]`` and the
    natural log-sum-exp ``[H, R]`` of the scaled logits, ``-inf`` (and ``out`` 0) for a head
    with ``counts == 0`` (the kernel reports 0 there)."""
    out, lse = _CPU_FLASH(
        query.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        0.0,
        False,
        attn_mask=None if mask is None else mask.unsqueeze(0),
        scale=scale,
    )
    out, lse = out[0], lse[0]
    empty = (counts == 0).view(-1, 1)
    if bool(empty.any()):
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _flash_reconstruction(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None,
    s_aux: Tensor | None,
    block_queries: int,
) -> tuple[Tensor, Tensor]:
    """:func:`reconstruction_attention` by CPU flash attention (its docstring)."""
    _, q_heads, q_len, dim = query.shape
    heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    f32 = torch.float32
    # rows r = g * Q + j of kv head h: every query of the group (none is causal over the cache)
    q = query.to(f32)[0].reshape(heads, group * q_len, dim)
    k, v = keys.to(f32)[0], values.to(f32)[0]
    cached = valid[0]
    subset = cached if score_columns is None else cached & score_columns[0]
    parts: list[tuple[Tensor, Tensor]] = []  # (out [H, G*Q, Dv], lse [H, G*Q])
    k_sub, v_sub, index, counts, mask = _gather_slots(k, v, subset)
    sub_lse = None  # the score columns' log-sum-exp [H, G*Q]
    if k_sub.shape[1]:
        parts.append(_flash_part(q, k_sub, v_sub, counts, mask, scale))
        sub_lse = parts[-1][1]
    rest = cached & ~subset
    if bool(rest.any()):
        k_rest, v_rest, _, rest_counts, rest_mask = _gather_slots(k, v, rest)
        parts.append(_flash_part(q, k_rest, v_rest, rest_counts, rest_mask, scale))
    # own tokens, causally: the group's query heads as the batch (top-left causal = Q x Q)
    q_own = query.to(f32)[0].view(heads, group, q_len, dim).transpose(0, 1)
    k_own = own_keys.to(f32).expand(group, heads, q_len, dim)
    v_own = own_values.to(f32).expand(group, heads, q_len, own_values.shape[-1])
    out_own, lse_own = _CPU_FLASH(q_own, k_own, v_own, 0.0, True, scale=scale)
    out_own = out_own.transpose(0, 1).reshape(heads, group * q_len, -1)
    lse_own = lse_own.transpose(0, 1).reshape(heads, group * q_len)
    score_lse = lse_own if sub_lse is None else torch.logaddexp(sub_lse, lse_own)
    parts.append((out_own, lse_own))
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    if s_aux is not None:  # the sink: a logit without a value, in both normalizations
        sink = s_aux.to(f32).view(heads, group, 1).expand(heads, group, q_len)
        sink = sink.reshape(heads, group * q_len)
        total = torch.logaddexp(total, sink)
        score_lse = torch.logaddexp(score_lse, sink)
    out = sum(torch.exp(lse - total).unsqueeze(-1) * o for o, lse in parts)
    assert isinstance(out, Tensor)
    out = out.view(heads, group, q_len, -1).reshape(1, q_heads, q_len, -1).to(query.dtype)
    scores = torch.zeros(heads, slots + 1, dtype=f32, device=query.device)
    if k_sub.shape[1]:
        # logit - lse in one matmul: [scale * q, -lse] . [k, 1]
        q_aug = torch.cat([q * scale, -score_lse.unsqueeze(-1)], dim=-1).transpose(1, 2)
        k_aug = torch.cat([k_sub, k_sub.new_ones(heads, k_sub.shape[1], 1)], dim=-1)
        best = torch.full((heads, k_sub.shape[1]), float("-inf"), dtype=f32, device=q.device)
        rows = max(1, block_queries)
        for a in range(0, group * q_len, rows):
            logits = torch.bmm(k_aug, q_aug[:, :, a : a + rows])  # [H, n, rows]
            best = torch.maximum(best, logits.amax(dim=2))
        scores.scatter_(1, index, best.exp())
    scores = scores[:, :slots].masked_fill(~subset, 0.0)
    return out, scores.unsqueeze(0)


def reconstruction_attention_reference(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    block_queries: int = 256,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The reference of :func:`reconstruction_attention` (same arguments and results), and
    its path for ``softcap`` and for tensors off the CPU: per block of ``block_queries``
    queries it materializes the logits ``[H, G, block, S + Q]`` over the cached slots and the
    own tokens, masks them and softmaxes them (twice with ``score_columns``: once over every
    allowed slot for ``out``, once over the score columns for ``scores``). Several passes over
    large tensors per block: slow on CPU, simple to check.

    Args:
        query, keys, values, valid, own_keys, own_values, scale, score_columns, softcap, s_aux:
            as :func:`reconstruction_attention`.
        block_queries: queries per block (bounds the logits held at once).
        compute_dtype: the dtype of the arithmetic (``torch.float64`` for a test's
            reference); ``scores`` come in it too.

    Returns:
        as :func:`reconstruction_attention`, computed (and ``scores`` given) in
        ``compute_dtype``.

    Raises:
        ValueError: shapes that do not fit together (``H_q`` not a multiple of ``H``).
    """
    _check_shapes(query, keys, values, valid, own_keys, own_values)
    _, q_heads, q_len, dim = query.shape
    heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    k_all = torch.cat([keys, own_keys], dim=2).to(compute_dtype)[0]  # [H, S + Q, D]
    v_all = torch.cat([values, own_values], dim=2).to(compute_dtype)[0]  # [H, S + Q, Dv]
    q = query.to(compute_dtype)[0].reshape(heads, group, q_len, dim)
    sinks = None if s_aux is None else s_aux.to(compute_dtype).view(heads, group, 1, 1)
    cached = valid[0].view(heads, 1, 1, slots)
    subset = None if score_columns is None else (score_columns[0] & valid[0])
    own_index = torch.arange(q_len, device=query.device)
    out = torch.empty(heads, group, q_len, v_all.shape[-1], dtype=compute_dtype, device=q.device)
    scores = torch.zeros(heads, slots, dtype=compute_dtype, device=q.device)
    for a in range(0, q_len, block_queries):
        b = min(a + block_queries, q_len)
        logits = torch.einsum("hgqd,hkd->hgqk", q[:, :, a:b], k_all) * scale
        logits = softcap_logits(logits, softcap)
        causal = own_index.view(1, -1) <= own_index[a:b].view(-1, 1)  # [b - a, Q]
        allowed = torch.cat(
            [
                cached.expand(heads, 1, b - a, slots),
                causal.view(1, 1, b - a, q_len).expand(heads, 1, -1, -1),
            ],
            dim=-1,
        )
        logits = logits.masked_fill(~allowed, float("-inf"))
        probs = softmax_with_sinks(logits, sinks)  # [H, G, b - a, S + Q]
        out[:, :, a:b] = torch.einsum("hgqk,hkd->hgqd", probs, v_all)
        if subset is not None:
            keep = torch.cat(
                [
                    subset.view(heads, 1, 1, slots).expand(heads, 1, b - a, slots),
                    causal.view(1, 1, b - a, q_len).expand(heads, 1, -1, -1),
                ],
                dim=-1,
            )
            probs = softmax_with_sinks(logits.masked_fill(~keep, float("-inf")), sinks)
            probs = probs[..., :slots].masked_fill(~subset.view(heads, 1, 1, slots), 0.0)
        block_max = probs[..., :slots].amax(dim=(1, 2))  # [H, S]
        scores = torch.maximum(scores, block_max)
    scores = scores.masked_fill(~valid[0], 0.0)
    out = out.reshape(1, q_heads, q_len, v_all.shape[-1]).to(query.dtype)
    return out, scores.unsqueeze(0)
