"""The ``prefill-score`` and ``stream`` protocols of ``kvlab eval`` (``needle``:
:mod:`kvlab.evaluation.needle`). Each function runs one method on one token sequence; planning,
executing many of them and reporting live in :mod:`~kvlab.evaluation.plan`,
:mod:`~kvlab.evaluation.execute` and :mod:`~kvlab.evaluation.report`.

``prefill-score`` (:func:`score_window`): a fixed window of ``P + S`` tokens. The method's cache
receives the first ``P`` tokens in one forward (the prefill — where eviction methods evict and
PN-Mix computes its mix mask; a KVzip cache then runs its reconstruction pass and evicts,
:func:`kvlab.integrations.kvzip.compress`, inside the prefill's timing), then the next ``S``
tokens are scored **one token at a time**: the prefill's last logits predict token ``P``;
feeding token ``P + j`` predicts ``P + j + 1``.
Chunked scoring would let a chunk's tokens attend to each other exactly and flatter quantized
caches. The full-cache (``DynamicCache``) run of the same window is the reference for the KL.

``stream`` (:func:`stream_tokens`): ``N`` tokens go through the method's cache in chunks of
``chunk`` tokens (each chunk one forward); the logits of every chunk score the tokens that follow,
so all ``N - 1`` next-token predictions are scored. Tokens are rotated at the cache's own RoPE
positions (:func:`position_kwargs`): the stream length for ``full`` and ``evict-no-relay``,
synchronized positions inside the cache for RoPE-Relay (``RelayModelCache.next_positions``,
which differ from its ``get_seq_length``, the tokens seen).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvlab.evaluation.foreign_cache import describe
from kvlab.evaluation.methods import Method, method_backends
from kvlab.evaluation.metrics import CacheStorage, cache_storage, kl_divergence, token_nll
from kvlab.integrations.attention import use_attention

__all__ = [
    "StreamScore",
    "WindowScore",
    "accepts_keyword",
    "cache_details",
    "cache_keyword",
    "position_kwargs",
    "rope_position_of",
    "score_window",
    "stream_tokens",
]


def cache_keyword(model: Any) -> str:
    """The forward keyword of the cache: ``"cache"`` (transformers >= 5.x renamed it) or
    ``"past_key_values"``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def accepts_keyword(model: Any, name: str) -> bool:
    """Whether ``model.forward`` takes keyword ``name``."""
    return name in inspect.signature(model.forward).parameters


@dataclass
class WindowScore:
    """One method on one prefill-score window.

    Attributes:
        nll: float64 ``[S]`` NLL (nats) of the ``S`` scored tokens.
        kl: float64 ``[S]`` KL(full || method) in nats, or ``None`` without a reference.
        storage_prefill: cache storage right after the prefill (after any eviction).
        storage_final: cache storage after the last scored token was fed.
        model_seconds: wall time of the model calls (prefill and ``S - 1`` one-token steps).
        reference_logprobs: float32 ``[S, V]`` log-softmax, kept only when requested (the full
            reference run).
        details: method-specific facts (eviction counts, PN-Mix attention calls, positions).
    """

    nll: Tensor
    kl: Tensor | None
    storage_prefill: CacheStorage
    storage_final: CacheStorage
    model_seconds: float
    reference_logprobs: Tensor | None = None
    details: dict[str, Any] = field(default_factory=dict)


def cache_details(cache: Any) -> dict[str, Any]:
    """Method-specific facts of a cache after a run (JSON-ready;
    :meth:`kvlab.integrations.cache_protocol.KVLabCache.details`)."""
    return describe(cache).details()


def position_kwargs(cache: Any, num_new: int) -> dict[str, Tensor]:
    """``position_ids`` at the cache's own RoPE positions when it keeps its own
    (:attr:`~kvlab.integrations.cache_protocol.KVLabCache.explicit_positions`, e.g.
    :class:`~kvlab.integrations.RelayModelCache`: the model then rotates there directly, no
    re-rotation by the cache), else nothing."""
    view = describe(cache)
    return {"position_ids": view.position_ids(num_new)} if view.explicit_positions else {}


def rope_position_of(cache: Any) -> int:
    """The RoPE position the next token would get."""
    return describe(cache).rope_position()


def _load_kernels(method: Method) -> None:
    """Compile (first use on this machine) or load the CPU kernels ``method`` runs, before any
    timing starts: a compilation must not count as model time. Skipped for the backends that
    do not use them (``KVLAB_*_BACKEND=torch``, ``triton``)."""
    from kvlab.backends import preload

    preload(method_backends(method))


@torch.no_grad()
def score_window(
    model: Any,
    tokens: Tensor,
    method: Method,
    *,
    prefill: int,
    score: int,
    reference_logprobs: Tensor | None = None,
    keep_logprobs: bool = False,
    on_token: Callable[[int], None] | None = None,
    prepared: Mapping[str, Any] | None = None,
) -> WindowScore:
    """Prefill ``prefill`` tokens into ``method``'s cache, then score ``score`` tokens one at a
    time (module docstring).

    Args:
        model: a ``transformers`` causal LM in eval mode.
        tokens: int64 ``[prefill + score]`` on the model's device.
        method: the cache method.
        reference_logprobs: float ``[score, V]`` full-cache log-softmax for the KL, or None.
        keep_logprobs: return this run's ``[score, V]`` log-softmax (for the reference run).
        on_token: progress callback, called with 1 after each scored token.
        prepared: the method's prepared state (:meth:`Method.make_cache`), if it has one.

    Raises:
        ValueError: ``tokens`` shorter than ``prefill + score``, or ``prefill < 1``/``score < 1``.
    """
    if prefill < 1 or score < 1:
        raise ValueError(f"prefill and score must be >= 1, got {prefill}, {score}")
    if tokens.numel() < prefill + score:
        raise ValueError(f"window has {tokens.numel()} tokens, needs {prefill + score}")
    cache = method.make_cache(model.config, prepared)
    key = cache_keyword(model)
    extra = {"logits_to_keep": 1} if accepts_keyword(model, "logits_to_keep") else {}
    targets = tokens[prefill : prefill + score]
    nll = torch.empty(score, dtype=torch.float64)
    kl = torch.empty(score, dtype=torch.float64) if reference_logprobs is not None else None
    kept = [] if keep_logprobs else None
    seconds = 0.0

    def consume(j: int, logits: Tensor) -> None:
        nll[j] = token_nll(logits.view(1, -1), targets[j : j + 1])[0]
        if kl is not None:
            kl[j] = kl_divergence(reference_logprobs[j : j + 1], logits.view(1, -1))[0]
        if kept is not None:
            kept.append(torch.log_softmax(logits.float(), dim=-1).cpu())
        if on_token is not None:
            on_token(1)

    if tokens.device.type == "cpu":
        _load_kernels(method)
    with use_attention(model, method.attention):
        start = time.perf_counter()
        out = model(
            tokens[:prefill].view(1, -1),
            use_cache=True,
            **{key: cache},
            **extra,
            **position_kwargs(cache, prefill),
        )
        if getattr(cache, "needs_reconstruction", False):
            # KVzip: the reconstruction pass scores the stored prefill, then the cache evicts
            from kvlab.integrations.kvzip import compress

            compress(model, cache, tokens[:prefill].view(1, -1))
        seconds += time.perf_counter() - start
        storage_prefill = cache_storage(cache)
        consume(0, out.logits[0, -1])
        for j in range(1, score):
            step = tokens[prefill + j - 1].view(1, 1)
            start = time.perf_counter()
            out = model(step, use_cache=True, **{key: cache}, **extra, **position_kwargs(cache, 1))
            seconds += time.perf_counter() - start
            consume(j, out.logits[0, -1])
    return WindowScore(
        nll=nll,
        kl=kl,
        storage_prefill=storage_prefill,
        storage_final=cache_storage(cache),
        model_seconds=seconds,
        reference_logprobs=torch.stack(kept) if kept is not None else None,
        details=cache_details(cache),
    )


@dataclass
class StreamScore:
    """One method over one stream.

    Attributes:
        nll: float64 ``[N - 1]``: NLL of token ``t + 1`` given tokens ``0..t`` (as cached).
        peak_storage: the largest cache storage seen after any chunk.
        final_storage: the cache storage at the end.
        final_position: the RoPE position the next token would get (for RoPE-Relay its
            synchronized position, not the tokens seen).
        model_seconds: wall time of the model calls.
        details: method-specific facts.
    """

    nll: Tensor
    peak_storage: CacheStorage
    final_storage: CacheStorage
    final_position: int
    model_seconds: float
    details: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def stream_tokens(
    model: Any,
    tokens: Tensor,
    method: Method,
    *,
    chunk: int,
    on_chunk: Callable[[int], None] | None = None,
    prepared: Mapping[str, Any] | None = None,
) -> StreamScore:
    """Stream ``tokens`` (int64 ``[N]``) through ``method``'s cache in chunks of ``chunk``
    (``prepared``: the method's prepared state, if it has one).

    Raises:
        ValueError: ``chunk < 1`` or fewer than 2 tokens.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    total = tokens.numel()
    if total < 2:
        raise ValueError("a stream needs at least 2 tokens")
    cache = method.make_cache(model.config, prepared)
    key = cache_keyword(model)
    nll_parts = []
    seconds = 0.0
    peak = CacheStorage(0, 0, 0)
    if tokens.device.type == "cpu":
        _load_kernels(method)
    with use_attention(model, method.attention):
        for start in range(0, total - 1, chunk):
            piece = tokens[start : min(start + chunk, total - 1)]
            begin = time.perf_counter()
            out = model(
                piece.view(1, -1),
                use_cache=True,
                **{key: cache},
                **position_kwargs(cache, piece.numel()),
            )
            seconds += time.perf_counter() - begin
            targets = tokens[start + 1 : start + 1 + piece.numel()]
            nll_parts.append(token_nll(out.logits[0], targets))
            storage = cache_storage(cache)
            if storage.kv_bytes > peak.kv_bytes:
                peak = storage
            if on_chunk is not None:
                on_chunk(piece.numel())
    return StreamScore(
        nll=torch.cat(nll_parts),
        peak_storage=peak,
        final_storage=cache_storage(cache),
        final_position=rope_position_of(cache),
        model_seconds=seconds,
        details=cache_details(cache),
    )
