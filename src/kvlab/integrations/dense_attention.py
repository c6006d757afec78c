"""Exact softmax attention over plain key/value tensors, with ``transformers``' masks and the
attention features the ``"kvlab"`` attention honours (soft-capping, learned sinks, sliding
windows): the dense path of :func:`kvlab.integrations.attention.kvlab_attention_forward` and a
PN-Mix prefill's attention over its own keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.attention_logits import softcap_logits, softmax_with_sinks

__all__ = ["dense_causal_attention", "softmax_attention"]


def softmax_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float,
    mask: Tensor | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
) -> Tensor:
    """Exact softmax attention with an explicit mask, logit soft-capping and learned sinks.

    Without ``softcap`` and ``s_aux`` this is PyTorch SDPA; with either, the logits are
    computed in float32 and transformed by :func:`kvlab.attention_logits.softcap_logits`
    (before the mask) and :func:`kvlab.attention_logits.softmax_with_sinks`, as the Gemma 2 and
    GPT-OSS eager attentions of ``transformers`` do.

    Args:
        query: ``[B, H_q, Q, D]``.
        key: ``[B, H_kv, K, D]``, ``H_q`` a multiple of ``H_kv`` (GQA: query head ``i`` reads kv
            head ``i // (H_q / H_kv)``).
        value: ``[B, H_kv, K, Dv]``.
        scaling: softmax scale of the logits.
        mask: ``None`` (every query sees every key), a boolean keep mask or an additive float
            mask, broadcastable to ``[B, H_q, Q, K]``.
        dropout: attention dropout probability (applied as given).
        softcap: Gemma 2 attention-logit soft-cap, or ``None``.
        s_aux: ``[H_q]`` learned sink logits (GPT-OSS), or ``None``.

    Returns:
        ``[B, H_q, Q, Dv]`` in the query dtype.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, or ``s_aux`` not ``[H_q]``.
    """
    hq, hkv = query.shape[1], key.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    rep = hq // hkv
    if rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if softcap is None and s_aux is None:
        return F.scaled_dot_product_attention(
            query,
            key.to(query.dtype),
            value.to(query.dtype),
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
        )
    if s_aux is not None and tuple(s_aux.shape) != (hq,):
        raise ValueError(f"s_aux must hold one sink logit per query head [{hq}], got {s_aux.shape}")
    logits = (query.float() @ key.float().transpose(-1, -2)) * scaling
    logits = softcap_logits(logits, softcap)
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + mask.to(logits.dtype)
    sinks = None if s_aux is None else s_aux.float().view(1, hq, 1, 1)  # keeps its gradient
    probs = softmax_with_sinks(logits, sinks)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    return (probs @ value.float()).to(query.dtype)


def _window_band(q_len: int, k_len: int, sliding_window: int, device: torch.device) -> Tensor:
    """``[1, 1, Q, K]`` True where key ``j`` lies in the last ``sliding_window`` keys of query
    ``i`` (itself included), bottom-right aligned: ``j > K - Q + i - sliding_window``
    (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``)."""
    rows = torch.arange(q_len, device=device).unsqueeze(-1) + (k_len - q_len)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return (cols > rows - sliding_window).view(1, 1, q_len, k_len)


def _no_padding(attention_mask: Tensor | None, k_len: int) -> bool:
    """Whether ``attention_mask`` masks nothing: ``None``, or a 2-D ``[B, K]`` keep mask of all
    ones on the CPU (read there, where reading costs no device sync; a mask elsewhere, a 4-D
    mask or a 2-D mask of another width is left to the masked path, which uses or refuses
    it)."""
    if attention_mask is None:
        return True
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != k_len:
        return False
    return attention_mask.device.type == "cpu" and bool(attention_mask.all())


def dense_causal_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float,
    attention_mask: Tensor | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    is_causal: bool = True,
) -> Tensor:
    """Exact softmax attention with bottom-right causal alignment, for plain tensors.

    Args:
        query: ``[B, H_q, Q, D]``; the queries are the last ``Q`` of the ``K`` keys.
        key: ``[B, H_kv, K, D]``, ``H_q`` a multiple of ``H_kv`` (GQA: query head ``i`` reads kv
            head ``i // (H_q / H_kv)``).
        value: ``[B, H_kv, K, Dv]``.
        scaling: softmax scale of the logits.
        attention_mask: ``None``; a 2-D ``[B, K]`` keep mask (1/True = attend; padding);
            or a 4-D ``[B, 1|H_q, Q, K]`` boolean keep mask or additive float mask, used as is
            (no causal mask added), as ``transformers``' SDPA attention does.
        dropout: attention dropout probability.
        sliding_window: a query sees only the last ``sliding_window`` keys, itself included
            (tokens; ``None`` = no window); intersected with a 4-D mask too.
        softcap: Gemma 2 attention-logit soft-cap (see :func:`softmax_attention`).
        s_aux: ``[H_q]`` GPT-OSS learned sink logits (see :func:`softmax_attention`).
        is_causal: ``False`` lets every query see every key when no 4-D mask is given (SDPA's
            ``is_causal=False``).

    Returns:
        ``[B, H_q, Q, Dv]`` in the query dtype.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, ``Q > K``, a 2-D mask that is not
            ``[B, K]``, or ``sliding_window < 1``.
    """
    _, hq, q_len, _ = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if q_len > k_len:
        raise ValueError(f"{q_len} queries but only {k_len} keys")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 token, got {sliding_window}")
    device = query.device
    if (
        is_causal
        and dropout == 0.0
        and softcap is None
        and s_aux is None
        and (sliding_window is None or k_len <= int(sliding_window))
        and _no_padding(attention_mask, k_len)
    ):
        # SDPA's own causal (or unmasked) attention, as transformers' "sdpa" runs it: no mask
        # materialized, blocks above the diagonal skipped, GQA without copying the kv heads;
        # bit-identical to the masked call below (tests/integrations/test_dense_attention.py)
        if q_len == k_len or q_len == 1:
            return F.scaled_dot_product_attention(
                query,
                key.to(query.dtype),
                value.to(query.dtype),
                dropout_p=dropout,
                is_causal=q_len > 1,
                scale=scaling,
                enable_gqa=hq != hkv,
            )
        attention_mask = None
    mask: Tensor | None
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
        if sliding_window is not None:
            band = _window_band(q_len, k_len, int(sliding_window), device)
            if mask.dtype == torch.bool:
                mask = mask & band
            else:
                mask = mask.masked_fill(~band, torch.finfo(mask.dtype).min)
    else:
        mask = None
        if is_causal and q_len > 1:
            offset = k_len - q_len
            rows = torch.arange(q_len, device=device).unsqueeze(-1) + offset
            cols = torch.arange(k_len, device=device).unsqueeze(0)
            mask = (cols <= rows).view(1, 1, q_len, k_len)
        if sliding_window is not None and k_len > int(sliding_window):
            band = _window_band(q_len, k_len, int(sliding_window), device)
            mask = band if mask is None else mask & band
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != k_len:
                raise ValueError(
                    f"2-D attention_mask must be [B, {k_len}], got {tuple(attention_mask.shape)}"
                )
            padding = attention_mask.bool().view(-1, 1, 1, k_len)
            mask = padding if mask is None else mask & padding
    return softmax_attention(
        query,
        key,
        value,
        scaling=scaling,
        mask=mask,
        dropout=dropout,
        softcap=softcap,
        s_aux=s_aux,
    )
