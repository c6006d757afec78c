"""Attention over a :class:`~kvlab.relay.storage.RelayStore`: one call per layer for every
sequence and kv head (the torch reference the compiled decode kernel,
:mod:`kvlab.relay.kernels.cpu`, is tested against; decode steps it covers run on it by
default).

The store's segments share one capacity (its ``stride``), so its buffers are read as a padded
``[B * H_kv, G, S, D]`` view (:meth:`~kvlab.relay.storage.RelayStore.padded_view`: the group
axis a stride-0 broadcast; no gather, no copy) and attended with ONE PyTorch SDPA call whose
batch axis is the segments: each segment's ``G = H_q / H_kv`` query heads read its keys (GQA:
query head ``i`` reads kv head ``i // G``), the store's key-padding mask (a view of its
``key_bias`` rows) hides slots past a segment's length, and multi-token forwards are causal with
bottom-right alignment per segment (docs/design.md, "RoPE-Relay: Attention"). On CPU this
measured faster than a segment softmax over the flat buffer with index ops
(``benchmarks/relay_attention_layouts.py``); on one intra-op thread it gives the bits of one SDPA
call per head when the segments have equal lengths, and agrees to float32 rounding otherwise (with
more threads SDPA's CPU kernel splits a head's keys across them, which moves the last bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import backends
from kvlab.attention_logits import softcap_logits, softmax_with_sinks
from kvlab.relay.kernels import cpu as relay_cpu
from kvlab.relay.storage import RelayStore

__all__ = ["prefill_attention_with_lse", "ragged_attention"]


def ragged_attention(
    query: Tensor,
    store: RelayStore,
    *,
    scale: float,
    query_lengths: Sequence[int] | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    backend: str | None = None,
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
        backend: ``"auto"``, ``"torch"`` (SDPA, the reference) or ``"cpu"`` (the compiled decode
            kernel, :mod:`kvlab.relay.kernels.cpu`); default ``KVLAB_RELAY_BACKEND`` or
            ``"auto"``. The kernel runs decode steps over float32 CPU stores (see there); other
            calls use the reference whatever the backend.

    Returns:
        ``[B, H_q, Q, Dv]`` in the query dtype. Query ``j`` of a real row sees slots
        ``i <= length - Q + j`` of each of its segments (bottom-right causal alignment, the
        convention of ``transformers``' causal mask). Padding queries return zeros (finite).

    Raises:
        ValueError: batch or head counts that do not match the store, ``head_dim``, an
            ``s_aux`` that is not ``[H_q]``, or an unknown backend.
        RuntimeError: ``backend="cpu"`` and the kernel cannot be compiled.
    """
    batch, q_heads, q_len, dim = query.shape
    heads = store.heads
    if batch != store.batch or q_heads % heads or dim != store.head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit the store (B={store.batch}, "
            f"H_kv={heads}, D={store.head_dim}): H_q must be a multiple of H_kv"
        )
    if backend is None:
        backend = backends.env_backend("relay")
    else:
        backends.check_choice("relay", backend)
    if backend != "torch" and _kernel_covers(query, store, query_lengths, softcap, s_aux):
        module = relay_cpu.load()
        if module is not None:
            return relay_cpu.ragged_decode_cpu(module, query, store, scale)
        if backend == "cpu":
            raise RuntimeError(
                f"backend 'cpu': the RoPE-Relay CPU kernel is {relay_cpu.cpu_kernel_status()}"
            )
    group = q_heads // heads
    segments = batch * heads
    if (
        q_len > 1
        and softcap is None
        and s_aux is None
        and (query_lengths is None or all(r == q_len for r in query_lengths))
        and min(store.lengths) == max(store.lengths) >= q_len
    ):
        return _equal_segments_attention(query, store, scale)
    # [B*H, G, S, D] views of the buffers, the group a stride-0 axis: no copy
    view = store.padded_view(group)
    longest, keys, values = view.longest, view.keys, view.values
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.reshape(segments, group, q_len, dim)

    pad_queries = None  # bool [B, Q]: the first Q - query_lengths[b] queries of row b
    if query_lengths is not None and any(r != q_len for r in query_lengths):
        real = torch.tensor(list(query_lengths), dtype=torch.int64, device=query.device)
        pad_queries = torch.arange(q_len, device=query.device).view(1, -1) < (q_len - real).view(
            -1, 1
        )
    mask = None  # bool, broadcastable to [B*H, G, Q, S]
    if q_len > 1:
        # query j of segment s sees slots i <= length_s - Q + j
        slot = store.slots(longest)
        lengths = torch.tensor(store.lengths, dtype=torch.int64, device=query.device)
        row = torch.arange(q_len, device=query.device) - q_len
        limit = lengths.view(-1, 1) + row.view(1, -1)  # [B*H, Q]
        mask = (slot.view(1, 1, -1) <= limit.unsqueeze(-1)).unsqueeze(1)  # [B*H, 1, Q, S]
    elif view.bias is not None:
        # the store's key-padding mask, a [B*H, 1, 1, S] view of its additive form: for SDPA
        # what SDPA would make of the boolean one (same bits, no conversion per call)
        plain = softcap is None and s_aux is None and pad_queries is None
        mask = view.bias if plain and view.bias.dtype == query.dtype else view.valid
    elif pad_queries is not None:
        mask = torch.ones(segments, 1, 1, longest, dtype=torch.bool, device=query.device)
    if pad_queries is not None:
        # padding queries attend every slot (finite keys), then are zeroed below
        assert mask is not None
        mask = mask | pad_queries.repeat_interleave(heads, 0).view(segments, 1, q_len, 1)
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


def _equal_segments_attention(query: Tensor, store: RelayStore, scale: float) -> Tensor:
    """A multi-token forward of real queries over segments that all hold ``S >= Q`` tokens (a
    prefill, or a chunk of one, before any eviction): one SDPA call on ``[B, H_q, Q, D]`` over
    ``[B, H_kv, S, D]`` views of the buffers (GQA without copying the kv heads), causal —
    SDPA's own ``is_causal`` when ``S == Q`` (no mask; the blocks above the diagonal are never
    computed), else the bottom-right band ``[Q, S]`` shared by every segment. The bits of the
    per-segment masked call it replaces (tests/relay/test_prefill_attention.py)."""
    q_heads, q_len = query.shape[1], query.shape[2]
    length = store.lengths[0]
    keys, values = _segment_views(store, query.dtype)
    mask = None
    if length > q_len:
        row = torch.arange(q_len, device=query.device).view(-1, 1) + (length - q_len)
        mask = store.slots(length).view(1, -1) <= row  # [Q, S]
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        is_causal=mask is None,
        enable_gqa=q_heads != store.heads,
    )


def _segment_views(store: RelayStore, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``[B, H_kv, S, D|Dv]`` views of the buffers of a store whose segments all hold ``S``
    tokens (no copy unless ``dtype`` differs from the store's)."""
    batch, heads, stride, length = store.batch, store.heads, store.stride, store.lengths[0]
    d, dv = store.head_dim, store.value_dim
    keys = store.keys.as_strided((batch, heads, length, d), (heads * stride * d, stride * d, d, 1))
    values = store.values.as_strided(
        (batch, heads, length, dv), (heads * stride * dv, stride * dv, dv, 1)
    )
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


def prefill_attention_with_lse(
    query: Tensor, store: RelayStore, *, scale: float
) -> tuple[Tensor, Tensor] | None:
    """A whole prompt's causal attention in one call on the CPU, with each query's logsumexp:
    ``(output [B, H_q, Q, Dv], lse [B, H_q, Q] float32)``, where every segment holds exactly the
    ``Q`` real tokens of ``query`` ``[B, H_q, Q, D]`` (one forward's prefill, before its
    eviction). The output is :func:`ragged_attention`'s, bit for bit: the fused CPU kernel
    ``torch.nn.functional.scaled_dot_product_attention`` dispatches that call to
    (``aten::_scaled_dot_product_flash_attention_for_cpu``), which also returns the natural-log
    logsumexp of every query's scaled logits; an eviction's observation window then needs no
    softmax of its own (:func:`kvlab.relay.observation.window_attention_from_lse`).
    ``None`` (nothing computed) off the CPU, for other segment lengths, for a value head_dim
    other than the key's, or for a query dtype other than float32 / bfloat16."""
    q_len = query.shape[2]
    if (
        query.device.type != "cpu"
        or query.dtype not in (torch.float32, torch.bfloat16)
        or q_len < 2
        or min(store.lengths) != q_len
        or max(store.lengths) != q_len
        or query.shape[0] != store.batch
        or store.value_dim != store.head_dim  # the fused kernel's own requirement
    ):
        return None
    keys, values = _segment_views(store, query.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, 0.0, True, scale=scale
    )
    return out, lse


def _kernel_covers(
    query: Tensor,
    store: RelayStore,
    query_lengths: Sequence[int] | None,
    softcap: float | None,
    s_aux: Tensor | None,
) -> bool:
    """Whether the compiled decode kernel computes this call: one real query per sequence,
    float32 on the CPU, no soft-cap or sinks, every segment non-empty."""
    return (
        query.shape[2] == 1
        and softcap is None
        and s_aux is None
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and store.dtype == torch.float32
        and (query_lengths is None or min(query_lengths) == 1)
        and min(store.lengths) >= 1
    )
