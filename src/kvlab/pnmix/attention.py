"""Attention that reads a :class:`~kvlab.pnmix.cache.PNMixCache`'s packed codes directly.

For a block of quantized groups (at most ``block_groups`` at a time) the codes are unpacked to
small integers and used as follows (``L = 2**bits - 1``, pair-slot convention of
:mod:`kvlab.pnmix.quantizers`, GQA queries folded to ``M = (H_q / H_kv) * Q`` rows per kv head):

* **Cartesian channels** (per-channel scale ``s_d`` and zero ``z_d`` per group):
  ``q · k_hat_t = Σ_d q_d z_d + Σ_d (q_d s_d) c_td`` — a per-group folded query ``q * s``
  times the code matrix, plus one per-group constant.
* **Phase–Norm pairs** (norm levels ``n_l = z + l s``, phase levels ``φ_l``): per group and
  pair a table ``T[m, p, l] = q_a cos φ_l + q_b sin φ_l`` of the query projected on the
  ``2**bits`` phase levels; the logit contribution is ``n(code_norm) * T[code_phase]``,
  computed as a matmul of the table with the one-hot phase codes weighted by the norm level.
* **Per-token keys** (``key_coding="per_token"``, scale ``s_t``, zero ``z_t``):
  ``q · k_hat_t = z_t Σ_d q_d + s_t (q · c_t)``.
* **Values** (per-token ``s_t``, ``z_t``): ``Σ_t p_t v_hat_t = (Σ_t p_t z_t) 1 +
  Σ_t (p_t s_t) c_t``.

Sinks and residual are exact and attend normally. Logits of all parts are concatenated in
sequence order, masked, and soft-maxed together (a global softmax), then each part's values
are weighted by its slice of the probabilities. The cache is never dequantized as a whole:
the largest code-derived temporary is one block's unpacked codes
(``B * H_kv * block_groups * group_tokens * D`` floats) and, for Phase–Norm, its one-hot
weights (``... * U * 2**bits``, ``U`` the pairs that any sequence or head codes in Phase–Norm;
the others skip this path). The logits ``[B, H_kv, M, seq_length]`` are materialized,
as in unfused attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.attention_logits import softcap_logits, softmax_with_sinks
from kvlab.pnmix.cache import PackedGroup, PNMixCache
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.quantizers import phase_levels

__all__ = ["pnmix_attention"]


def _stack(groups: list[PackedGroup], name: str) -> Tensor:
    return torch.stack([getattr(g, name).float() for g in groups], dim=2)


def _block_codes(groups: list[PackedGroup], name: str, width: int) -> Tensor:
    """Codes of ``n`` same-size groups, unpacked in one call: uint8 ``[B, H_kv, n, T, width]``."""
    g0 = groups[0]
    packed = torch.stack([getattr(g, name) for g in groups], dim=2)  # [B,H,n,bytes]
    codes = unpack_codes(packed, g0.bits, g0.num_tokens * width)
    return codes.reshape(*codes.shape[:-1], g0.num_tokens, width)


def _block_logits(
    q: Tensor,
    groups: list[PackedGroup],
    cache: PNMixCache,
    pn_pairs: Tensor | None,
    any_phase_norm: bool,
) -> Tensor:
    """Raw logits ``[B, H_kv, M, n * T]`` of query rows ``q [B, H_kv, M, D]`` (float32) against
    the keys of ``n`` consecutive groups, from their codes. ``pn_pairs``: bool ``[B, H_kv, P]``
    Phase–Norm pairs (channel-wise codings), ``any_phase_norm``: whether any is set."""
    cfg = cache.config
    codes = _block_codes(groups, "key_codes", groups[0].head_dim).float()  # [B,H,n,T,D]
    scale = _stack(groups, "key_scale")
    zero = _stack(groups, "key_zero")
    b, h, n, t, _ = codes.shape
    qn = q.unsqueeze(2)  # [B,H,1,M,D]
    if cfg.key_coding == "per_token":
        # scale, zero: [B,H,n,T]
        dots = qn @ codes.transpose(-1, -2)  # [B,H,n,M,T]
        logits = dots * scale.unsqueeze(-2) + q.sum(-1)[:, :, None, :, None] * zero.unsqueeze(-2)
    else:
        assert pn_pairs is not None
        first, second = cache.pair_indices
        first, second = first.to(q.device), second.to(q.device)
        # scale, zero: [B,H,n,D]; Cartesian channels: all but the Phase–Norm pairs' slots
        pn = pn_pairs.to(q.device)  # [B,H,P]
        cart = torch.ones(b, h, cache.head_dim, dtype=torch.bool, device=q.device)
        cart[:, :, first] = ~pn
        cart[:, :, second] = ~pn
        q_cart = qn * cart.unsqueeze(2).unsqueeze(3)  # [B,H,1,M,D]
        folded = q_cart * scale.unsqueeze(-2)  # [B,H,n,M,D]
        const = (q_cart * zero.unsqueeze(-2)).sum(-1, keepdim=True)  # [B,H,n,M,1]
        logits = folded @ codes.transpose(-1, -2) + const  # [B,H,n,M,T]
        if any_phase_norm:
            # only the pairs some (sequence, head) codes in Phase–Norm: usually a few of P
            used = pn.flatten(0, 1).any(0).nonzero().squeeze(1)  # [U]
            fu, su, pn_u = first[used], second[used], pn[..., used].float()  # pn_u [B,H,U]
            bits = cfg.bits
            n_levels = 1 << bits
            lv = phase_levels(zero[..., su], scale[..., su], bits)  # [B,H,n,U,Lv]
            q_a = q[..., fu][:, :, None, :, :, None]  # [B,H,1,M,U,1]
            q_b = q[..., su][:, :, None, :, :, None]
            table = q_a * torch.cos(lv).unsqueeze(3) + q_b * torch.sin(lv).unsqueeze(3)
            # norm level of each (token, pair): z + code * s, zero where the pair is Cartesian
            norm_zero = zero[..., fu].unsqueeze(-2)  # [B,H,n,1,U]
            norm_scale = scale[..., fu].unsqueeze(-2)
            norm = (norm_zero + codes[..., fu] * norm_scale) * pn_u[:, :, None, None, :]
            onehot = F.one_hot(codes[..., su].long(), n_levels).float()  # [B,H,n,T,U,Lv]
            weights = (onehot * norm.unsqueeze(-1)).flatten(-2)  # [B,H,n,T,U*Lv]
            logits = logits + table.flatten(-2) @ weights.transpose(-1, -2)
    return logits.permute(0, 1, 3, 2, 4).reshape(b, h, q.shape[2], n * t)


def _block_output(p: Tensor, groups: list[PackedGroup]) -> Tensor:
    """``Σ_t p_t v_hat_t`` ``[B, H_kv, M, Dv]`` for probabilities ``p [B, H_kv, M, n * T]``
    over ``n`` groups, from the value codes."""
    codes = _block_codes(groups, "value_codes", groups[0].value_head_dim).float()  # [B,H,n,T,Dv]
    scale = _stack(groups, "value_scale")  # [B,H,n,T]
    zero = _stack(groups, "value_zero")
    b, h, n, t, _ = codes.shape
    pb = p.reshape(b, h, p.shape[2], n, t).transpose(2, 3)  # [B,H,n,M,T]
    const = (pb * zero.unsqueeze(-2)).sum(-1, keepdim=True)  # [B,H,n,M,1]
    out = (pb * scale.unsqueeze(-2)) @ codes + const  # [B,H,n,M,Dv]
    return out.sum(dim=2)


def pnmix_attention(
    query: Tensor,
    cache: PNMixCache,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_groups: int | None = None,
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Softmax attention of ``query`` over a PN-Mix cache, consuming its packed codes.

    Args:
        query: ``[B, H_q, Q, D]``, any floating dtype, already RoPE-rotated at its positions.
            The ``Q`` queries belong to the last ``Q`` tokens appended to ``cache``: query
            ``j`` sits at position ``seq_length - Q + j``.
        cache: the layer's :class:`PNMixCache` (``H_q`` a multiple of its ``H_kv``; query head
            ``i`` reads kv head ``i // (H_q / H_kv)``, GQA).
        scale: softmax scale of the logits (default ``1 / sqrt(D)``).
        causal: query ``j`` sees cache positions ``<= seq_length - Q + j`` (bottom-right
            aligned); ``False`` = every query sees the whole cache.
        block_groups: quantized groups unpacked at a time (bounds temporary memory);
            default: as many as make 1,024 tokens (at least one).
        logit_softcap: Gemma 2 attention-logit soft-cap applied to the scaled logits before
            the causal mask (:func:`kvlab.attention_logits.softcap_logits`), or ``None``.
        sink_logits: ``[H_q]`` learned sink logits (GPT-OSS ``s_aux``): one extra logit per
            query head in the softmax, with no value
            (:func:`kvlab.attention_logits.softmax_with_sinks`), or ``None``.

    Returns:
        ``[B, H_q, Q, Dv]`` in ``query``'s dtype and device, computed in float32. Agrees with
        ``cache.dequantize()`` followed by standard attention up to float32 rounding.
        Increments ``cache.attention_calls`` by one.

    Raises:
        ValueError: wrong rank, dtype or shape; ``H_q`` not a multiple of ``H_kv``; ``Q``
            larger than the cache; an empty cache; ``block_groups < 1``; ``sink_logits`` not
            ``[H_q]``; ``logit_softcap`` not a positive number.
    """
    if not isinstance(cache, PNMixCache):
        raise ValueError(f"cache must be a PNMixCache, got {type(cache).__name__}")
    if not isinstance(query, Tensor) or not query.is_floating_point() or query.dim() != 4:
        raise ValueError("query must be a 4-D floating tensor [B, H_q, Q, D]")
    if block_groups is None:
        block_groups = max(1, 1024 // cache.config.group_tokens)
    if isinstance(block_groups, bool) or not isinstance(block_groups, int) or block_groups < 1:
        raise ValueError(f"block_groups must be an int >= 1, got {block_groups!r}")
    b, hq, nq, d = query.shape
    hkv, seq = cache.num_key_value_heads, cache.seq_length
    if b != cache.batch_size:
        raise ValueError(f"query batch {b} != cache batch_size {cache.batch_size}")
    if d != cache.head_dim:
        raise ValueError(f"query head_dim {d} != cache head_dim {cache.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of num_key_value_heads {hkv}")
    if seq == 0:
        raise ValueError("cache is empty: append keys and values before attending")
    if sink_logits is not None and tuple(sink_logits.shape) != (hq,):
        raise ValueError(f"sink_logits must be [H_q] = [{hq}], got {tuple(sink_logits.shape)}")
    if not 1 <= nq <= seq:
        raise ValueError(f"query count {nq} must lie in 1..seq_length={seq}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    rep = hq // hkv
    q = query.to(device=cache.device, dtype=torch.float32).reshape(b, hkv, rep * nq, d) * scale

    groups = list(cache.groups)
    blocks = [groups[i : i + block_groups] for i in range(0, len(groups), block_groups)]
    pn_pairs = cache.phase_norm_pairs
    any_pn = pn_pairs is not None and bool(pn_pairs.any())
    sink_k, res_k = cache.sink_keys, cache.residual_keys
    parts = [q @ sink_k.float().transpose(-1, -2)]
    parts += [_block_logits(q, blk, cache, pn_pairs, any_pn) for blk in blocks]
    parts.append(q @ res_k.float().transpose(-1, -2))
    logits = softcap_logits(torch.cat(parts, dim=-1), logit_softcap)  # [B, H_kv, M, seq]
    if causal and nq > 1:
        rows = torch.arange(rep * nq, device=q.device) % nq
        visible_to = seq - nq + rows  # last visible key position per row
        hidden = torch.arange(seq, device=q.device)[None, :] > visible_to[:, None]
        logits = logits.masked_fill(hidden, float("-inf"))
    sinks = None
    if sink_logits is not None:  # row r*nq + j of kv head h is query head h*rep + r
        sinks = sink_logits.detach().to(device=q.device, dtype=torch.float32).view(hkv, rep, 1)
        sinks = sinks.expand(hkv, rep, nq).reshape(1, hkv, rep * nq, 1)
    probs = softmax_with_sinks(logits, sinks)

    n_sink = sink_k.shape[2]
    out = probs[..., :n_sink] @ cache.sink_values.float()
    pos = n_sink
    for blk in blocks:
        width = sum(g.num_tokens for g in blk)
        out = out + _block_output(probs[..., pos : pos + width], blk)
        pos += width
    out = out + probs[..., pos:] @ cache.residual_values.float()
    cache._record_attention_call()
    return out.reshape(b, hq, nq, -1).to(device=query.device, dtype=query.dtype)
