"""The entry points of attention over a PN-Mix cache that reads its packed buffers directly
(docs/design.md, "Attention", "Kernels"): :func:`pnmix_attention` and the fused decode step
:func:`pnmix_decode_step`.

Both hand the cache's :class:`~kvlab.pnmix.store.PackedKV` (its buffers, host counts and codec
description: :meth:`~kvlab.pnmix.cache_decode.CacheDecode.packed_kv`) to the backend that
:func:`~kvlab.pnmix.kernels.dispatch.select_backend` picks: the torch reference
(:func:`~kvlab.pnmix.reference.packed_attention_reference`; its algorithm is described in
:mod:`kvlab.pnmix.reference`) or the compiled kernel that the dispatch table returns for the
store (:func:`~kvlab.pnmix.kernels.dispatch.attention_kernel`). The reference's names stay
importable from here.
"""

from __future__ import annotations

import math

from torch import Tensor

from kvlab.attention_logits import softcap_logits
from kvlab.pnmix.cache import PNMixCache
from kvlab.pnmix.kernels.dispatch import (
    BACKENDS,
    attention_kernel,
    decode_step_kernel,
    has_decode_step,
    select_backend,
)
from kvlab.pnmix.reference import (
    apply_key_payload,
    decode_key_block,
    packed_attention_reference,
    reference_keys,
    rotate_to_positions,
    transform_values,
)
from kvlab.pnmix.store import PackedKV

__all__ = [
    "BACKENDS",
    "PackedKV",
    "apply_key_payload",
    "decode_key_block",
    "packed_attention_reference",
    "packed_kv",
    "pnmix_attention",
    "pnmix_decode_step",
    "reference_keys",
    "rotate_to_positions",
    "transform_values",
]

_DEFAULT_BLOCK_TOKENS = 4096


def packed_kv(cache: PNMixCache) -> PackedKV:
    """The :class:`~kvlab.pnmix.store.PackedKV` of ``cache`` (views of its buffers, copies of
    its counts): :meth:`~kvlab.pnmix.cache_decode.CacheDecode.packed_kv`."""
    return cache.packed_kv()


def pnmix_attention(
    query: Tensor,
    cache: PNMixCache,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_groups: int | None = None,
    backend: str = "auto",
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Softmax attention of ``query`` over a PN-Mix cache, consuming its packed codes.

    Args:
        query: ``[B, H_q, Q, D]``, any floating dtype, already RoPE-rotated at its positions.
            The ``Q`` queries of row ``b`` belong to the last ``Q`` tokens of its stream
            (``n_b - Q + j``); with left padding, queries before a row's first token see
            nothing and return zeros.
        cache: the layer's :class:`PNMixCache` (``H_q`` a multiple of its ``H_kv``; query head
            ``i`` reads kv head ``i // (H_q / H_kv)``, GQA).
        scale: softmax scale of the logits (default ``1 / sqrt(D)``).
        causal: query ``j`` sees stream positions ``<= n_b - Q + j`` (bottom-right aligned);
            ``False`` = every query sees its row's whole stream.
        block_groups: quantized groups decoded at a time (bounds temporary memory);
            default: as many as make 4,096 tokens (at least one).
        backend: ``"torch"`` (the reference, :func:`packed_attention_reference`), ``"cpu"``
            (the compiled C++ kernel), ``"triton"`` (CUDA), or ``"auto"``: the argument wins,
            then the environment variable ``KVLAB_PNMIX_BACKEND``, then the automatic rule
            (CUDA: ``"triton"`` when installed, else ``"torch"``; CPU: ``"cpu"``, compiled on
            first use, else ``"torch"``; :mod:`kvlab.pnmix.kernels.dispatch`). Compiled
            backends agree with the reference to float32 rounding (docs/design.md,
            "Kernels").
        logit_softcap: Gemma 2 attention-logit soft-cap applied to the scaled logits before
            the causal mask (:func:`kvlab.attention_logits.softcap_logits`), or ``None``.
        sink_logits: ``[H_q]`` learned sink logits (GPT-OSS ``s_aux``): one extra logit per
            query head in the softmax, with no value
            (:func:`kvlab.attention_logits.softmax_with_sinks`), or ``None``.

    Returns:
        ``[B, H_q, Q, Dv]`` in ``query``'s dtype and device, computed in float32. Agrees with
        ``cache.dequantize()`` followed by standard attention up to float32 rounding of the
        logits and outputs. Increments ``cache.attention_calls`` by one (and
        ``cache.attention_backends`` for the backend that ran). Reads no device
        value back to the host.

    Raises:
        ValueError: wrong rank, dtype or shape; ``H_q`` not a multiple of ``H_kv``; ``Q``
            larger than the longest row; an empty cache; ``block_groups < 1``; an unknown
            backend; ``sink_logits`` not ``[H_q]``; ``logit_softcap`` not a positive number;
            an explicit compiled backend for a codec or device it does not handle.
        RuntimeError: an explicit backend that is unavailable here (not installed, not
            compiled).
    """
    if not isinstance(cache, PNMixCache):
        raise ValueError(f"cache must be a PNMixCache, got {type(cache).__name__}")
    if not isinstance(query, Tensor) or not query.is_floating_point() or query.dim() != 4:
        raise ValueError("query must be a 4-D floating tensor [B, H_q, Q, D]")
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if block_groups is None:
        block_groups = max(1, _DEFAULT_BLOCK_TOKENS // cache.config.group_tokens)
    if isinstance(block_groups, bool) or not isinstance(block_groups, int) or block_groups < 1:
        raise ValueError(f"block_groups must be an int >= 1, got {block_groups!r}")
    b, hq, nq, d = query.shape
    hkv = cache.num_key_value_heads
    longest = int(cache.seq_lengths.max(initial=0))
    if b != cache.batch_size:
        raise ValueError(f"query batch {b} != cache batch_size {cache.batch_size}")
    if d != cache.head_dim:
        raise ValueError(f"query head_dim {d} != cache head_dim {cache.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of num_key_value_heads {hkv}")
    if longest == 0:
        raise ValueError("cache is empty: append keys and values before attending")
    if not 1 <= nq <= longest:
        raise ValueError(f"query count {nq} must lie in 1..seq_length={longest}")
    if sink_logits is not None and tuple(sink_logits.shape) != (hq,):
        raise ValueError(f"sink_logits must be [H_q] = [{hq}], got {tuple(sink_logits.shape)}")
    if logit_softcap is not None:
        softcap_logits(query.new_zeros(()), logit_softcap)  # validates the cap
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    decode = cache.kernel_decode
    chosen = select_backend(backend, cache.device, decode)
    kv = cache.packed_kv()
    if chosen == "torch":
        out = packed_attention_reference(
            query,
            kv,
            scale=scale,
            causal=causal,
            block_groups=block_groups,
            logit_softcap=logit_softcap,
            sink_logits=sink_logits,
        )
    else:
        assert not isinstance(decode, str)
        kernel = attention_kernel(chosen, kv, decode)
        out = kernel(
            query,
            kv,
            decode,
            reference_keys(kv),
            scale=scale,
            causal=causal,
            logit_softcap=logit_softcap,
            sink_logits=sink_logits,
        )
    cache.note_attention_call(chosen)
    return out.to(device=query.device, dtype=query.dtype)


def _valid_cap(cap: float | None) -> bool:
    return cap is None or (isinstance(cap, (int, float)) and 0.0 < float(cap) < math.inf)


def pnmix_decode_step(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    cache: PNMixCache,
    *,
    scale: float | None = None,
    backend: str = "auto",
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """One decode step of one layer: ``cache.append(keys, values, checks="deferred",
    queries=query)`` (the queries when they match the tokens' ``[B, ., T, .]``), then
    ``pnmix_attention(query, cache, causal=True, ...)`` over the rows including the new token.

    When the append only writes one residual slot per row (:meth:`PNMixCache.single_token_fits`:
    one token per row, sinks full, no flush — all but one step in ``group_tokens``) and the
    backend's kernel has a fused decode step in the dispatch table (the ``"cpu"`` backend's:
    :func:`~kvlab.pnmix.kernels.dispatch.decode_step_kernel`), both run in ONE compiled call
    (docs/design.md, "Kernels"): the stored bytes and counts are exactly the append's; the
    output is that backend's. Otherwise the two calls run as written.

    Args:
        query: ``[B, H_q, Q, D]`` (the fast path needs ``Q = 1``).
        keys, values: ``[B, H_kv, T, D|Dv]`` new tokens (the fast path needs ``T = 1``).
        cache, scale, backend, logit_softcap, sink_logits: as in :func:`pnmix_attention`.

    Returns:
        ``[B, H_q, Q, Dv]`` in ``query``'s dtype.

    Raises:
        ValueError: what :meth:`PNMixCache.append` or :func:`pnmix_attention` raise.
        RuntimeError: an explicit backend that is unavailable.
    """
    if (
        isinstance(cache, PNMixCache)
        and isinstance(query, Tensor)
        and query.dim() == 4
        and query.shape[2] == 1
        and query.is_floating_point()
        and query.shape[0] == cache.batch_size
        and query.shape[3] == cache.head_dim
        and query.shape[1] % cache.num_key_value_heads == 0
        and query.device == cache.device
        and isinstance(keys, Tensor)
        and isinstance(values, Tensor)
        and _valid_cap(logit_softcap)
        and (sink_logits is None or tuple(sink_logits.shape) == (query.shape[1],))
    ):
        decode = cache.kernel_decode
        chosen = (
            select_backend(backend, cache.device, decode)
            if cache.single_token_fits(keys, values)
            else "torch"
        )
        if chosen != "torch" and has_decode_step(chosen):
            assert not isinstance(decode, str)
            kv = cache.packed_kv()
            step = decode_step_kernel(chosen, kv, decode)
            if step is not None:
                out = step(
                    query,
                    keys,
                    values,
                    kv,
                    decode,
                    cache.deferred_flag(),
                    scale=1.0 / math.sqrt(query.shape[3]) if scale is None else scale,
                    logit_softcap=logit_softcap,
                    sink_logits=sink_logits,
                )
                cache.commit_single_token()
                cache.note_attention_call(chosen)
                return out if out.dtype == query.dtype else out.to(query.dtype)
    # the forward's queries feed a query-aware per-pair table computed by this append (a row's
    # first flush), exactly as the two-call path of the model integration passes them
    queries = (
        query
        if isinstance(query, Tensor)
        and isinstance(keys, Tensor)
        and query.dim() == 4
        and keys.dim() == 4
        and tuple(query.shape[::2]) == (keys.shape[0], keys.shape[2])
        else None
    )
    cache.append(keys, values, checks="deferred", queries=queries)
    return pnmix_attention(
        query,
        cache,
        scale=scale,
        causal=True,
        backend=backend,
        logit_softcap=logit_softcap,
        sink_logits=sink_logits,
    )
