"""Attention over a :class:`~kvlab.relay.storage.RelayStore`: one call per layer for every
sequence and kv head (the torch reference a kernel for the ragged layout is tested against).

The store's segments are gathered into a padded ``[B * H_kv, G, S, D]`` view (the group axis a
stride-0 broadcast, no copy) and attended with ONE PyTorch SDPA call whose batch axis is the
segments: each segment's ``G = H_q / H_kv`` query heads read its keys (GQA: query head ``i`` reads
kv head ``i // G``), a key-padding mask hides slots past a segment's length, and multi-token
forwards are causal with bottom-right alignment per segment (docs/design.md, "RoPE-Relay:
Attention"). On CPU this measured faster than a segment softmax over the flat buffer with index
ops (``benchmarks/relay_attention_layouts.py``); it gives the bits of one SDPA call per head
when the segments have equal lengths, and agrees to float32 rounding otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.attention_logits import softcap_logits, softmax_with_sinks
from kvlab.relay.storage import RelayStore

__all__ = ["ragged_attention"]


def ragged_attention(
    query: Tensor,
    store: RelayStore,
    *,
    scale: float,
    query_lengths: Sequence[int] | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
) -> Tensor:
    """Exact softmax attention of ``query`` over every segment of ``store``.

    Args:
        query: ``[B, H_q, Q, D]`` (``B == store.batch``, ``H_q`` a multiple of ``store.heads``);
            row ``b``'s last ``query_lengths[b]`` queries are the last tokens of each of its
            segments (already stored); its first ``Q - query_lengths[b]`` queries are padding.
        store: the layer's storage.
        scale: softmax scale of the logits.
        query_lengths: real queries per row (host ints); default all ``Q``.
        softcap: Gemma 2 attention-logit soft-cap, or ``None``; s_aux: ``[H_q]`` GPT-OSS
            learned sink logits, or ``None``. With either, logits and softmax are computed in
            float32 with :mod:`kvlab.attention_logits` (the formulas of ``transformers``' eager
            attentions) instead of SDPA.

    Returns:
        ``[B, H_q, Q, Dv]`` in the query dtype. Query ``j`` of a real row sees slots
        ``i <= length - Q + j`` of each of its segments (bottom-right causal alignment, the
        convention of ``transformers``' causal mask). Padding queries return zeros (finite).

    Raises:
        ValueError: batch or head counts that do not match the store, ``head_dim``, or an
            ``s_aux`` that is not ``[H_q]``.
    """
    batch, q_heads, q_len, dim = query.shape
    heads = store.heads
    if batch != store.batch or q_heads % heads or dim != store.head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit the store (B={store.batch}, "
            f"H_kv={heads}, D={store.head_dim}): H_q must be a multiple of H_kv"
        )
    group = q_heads // heads
    index, lengths, longest = store.gather_index()
    flat = index.reshape(-1)
    # [B*H, 1, S, D] gathered once, broadcast over the group (stride 0, no copy)
    keys = store.keys.index_select(0, flat).to(query.dtype)
    values = store.values.index_select(0, flat).to(query.dtype)
    keys = keys.view(batch * heads, 1, longest, dim).expand(-1, group, -1, -1)
    values = values.view(batch * heads, 1, longest, store.value_dim).expand(-1, group, -1, -1)
    q = query.reshape(batch * heads, group, q_len, dim)

    pad_queries = None  # bool [B, Q]: the first Q - query_lengths[b] queries of row b
    if query_lengths is not None and any(r != q_len for r in query_lengths):
        real = torch.tensor(list(query_lengths), dtype=torch.int64, device=query.device)
        pad_queries = torch.arange(q_len, device=query.device).view(1, -1) < (q_len - real).view(
            -1, 1
        )
    mask = None
    if q_len > 1 or pad_queries is not None or min(store.lengths) != longest:
        slot = store.slots(longest)
        if q_len > 1:
            # query j of segment s sees slots i <= length_s - Q + j
            row = torch.arange(q_len, device=query.device) - q_len
            limit = lengths.view(-1, 1) + row.view(1, -1)  # [B*H, Q]
            mask = slot.view(1, 1, -1) <= limit.unsqueeze(-1)  # [B*H, Q, S]
        else:
            mask = (slot.view(1, -1) < lengths.view(-1, 1)).unsqueeze(1)  # [B*H, 1, S]
        if pad_queries is not None:
            # padding queries attend every slot (finite keys), then are zeroed below
            mask = mask | pad_queries.repeat_interleave(heads, 0).unsqueeze(-1)
        mask = mask.unsqueeze(1)  # [B*H, 1, Q, S]: broadcast over the group
    if softcap is None and s_aux is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:
        if s_aux is not None and tuple(s_aux.shape) != (q_heads,):
            raise ValueError(f"s_aux must be [H_q] = [{q_heads}], got {tuple(s_aux.shape)}")
        logits = softcap_logits((q.float() @ keys.float().transpose(-1, -2)) * scale, softcap)
        if mask is not None:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        sinks = None if s_aux is None else s_aux.float().view(1, heads, group)
        if sinks is not None:
            sinks = sinks.expand(batch, heads, group).reshape(batch * heads, group, 1, 1)
        out = (softmax_with_sinks(logits, sinks) @ values.float()).to(query.dtype)
    out = out.reshape(batch, q_heads, q_len, store.value_dim)
    if pad_queries is not None:
        out = out.masked_fill(pad_queries.view(batch, 1, q_len, 1), 0)
    return out
