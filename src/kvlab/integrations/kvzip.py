"""KVzip compression of a prefilled :class:`~kvlab.integrations.RelayModelCache`: the
reconstruction pass(es) through the model, then the eviction (Kim et al. 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416).

A cache whose scorer is :class:`kvlab.relay.KVzipScorer` (``EvictionConfig(ratio=R,
scorer=KVzipScorer(...))``) stores its prefill without evicting. :func:`compress` then feeds,
on top of it, KVzip's repeat request followed by the context itself (teacher-forced; long
contexts chunk by chunk, :meth:`kvlab.relay.ReconstructionPrompt.chunks`) inside
:meth:`RelayModelCache.reconstruction_pass`, which scores every stored token by the attention
the pass pays it and stores nothing; finally :meth:`RelayModelCache.evict_reconstructed` evicts
``R`` of each sequence's tokens with the cache's policy (per-layer budgets, protected sinks and
recent window, per-head allocation, RoPE-Relay or not). Flow and rules: docs/design.md,
"RoPE-Relay: Reconstruction scoring". Cost: one extra forward over ``prompt + context``
tokens per sequence (KVzip's 2-3x prefill cost), whose logits are not computed.

Shared scores: the reconstruction scores depend on the stored prefill, the prompt, the
protected sinks and the model, not on the eviction ratio or on what stores the kept tokens. A
``scores`` mapping passed to :func:`compress` keeps each pass's scores under a key of those
(the context's ids, the prompt, the sinks, the scorer's observation queries and every layer's
score shape), with the model they were computed on (a weak reference: another model, or one
garbage-collected, is a miss; weights changed in place are not detected). A later
:func:`compress` of another cache holding the same prefill (another ratio, or the cache
composed with PN-Mix) takes them from it instead of running the pass, and evicts exactly as
after its own pass (tests/integrations/test_kvzip.py). The evaluation keeps one such mapping
per shared prefill capture (:attr:`kvlab.integrations.prefill_replay.PrefillCapture.derived`).

    cache = RelayModelCache(model.config, EvictionConfig(ratio=0.5, scorer=KVzipScorer()))
    with use_attention(model, "kvlab"):
        out = model(ids, cache=cache, use_cache=True)        # stores, does not evict
    compress(model, cache, ids, prompt=ReconstructionPrompt.from_tokenizer(tokenizer))
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor

from kvlab.integrations.attention import KVLAB_ATTENTION, use_attention
from kvlab.integrations.relay_cache import EvictionEvent, ReconstructionSpan, RelayModelCache
from kvlab.relay.kvzip import ReconstructionChunk, ReconstructionPrompt

__all__ = ["ScoreMemo", "compress", "reconstruction_prompt"]

#: Reconstruction scores kept across caches holding one prefill (module docstring): key ->
#: ``(weak reference to the model, per relay layer, per sequence, float32 [1, H, S] scores or
#: None)``.
ScoreMemo = MutableMapping[tuple[Any, ...], tuple[Any, list[list[Tensor | None]]]]


def reconstruction_prompt(cache: RelayModelCache) -> ReconstructionPrompt | None:
    """The :class:`ReconstructionPrompt` the cache's scorer carries (``KVzipScorer.prompt``),
    or ``None``."""
    from kvlab.relay.scorers import get_scorer

    return getattr(get_scorer(cache.eviction.scorer), "prompt", None)


def _cache_keyword(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def compress(
    model: Any,
    cache: RelayModelCache,
    input_ids: Tensor,
    *,
    prompt: ReconstructionPrompt | None = None,
    scores: ScoreMemo | None = None,
) -> list[EvictionEvent]:
    """Score the cache's stored context by KVzip's reconstruction pass(es), then evict.

    Args:
        model: the ``transformers`` causal LM the cache was filled by.
        cache: a :class:`RelayModelCache` whose scorer needs a reconstruction pass, holding
            the prefill of every sequence (nothing evicted yet).
        input_ids: int64 ``[B, seen]``: every column fed to the cache so far, left padding
            included (as given to the prefill forwards); row ``b``'s context is its last
            ``cache.stream_lengths[b]`` columns.
        prompt: KVzip's repeat request as token ids; default the scorer's
            (``KVzipScorer(prompt=...)``).
        scores: a memo of reconstruction scores shared by caches holding the same prefill
            (module docstring): scores found there replace the pass; a pass's scores are
            added to it. ``None``: run the pass, keep nothing.

    Returns:
        the :class:`EvictionEvent` s of the eviction, layer by layer.

    Raises:
        ValueError: a cache that needs no reconstruction pass or has evicted already, no
            prompt, ``input_ids`` not ``[B, seen]``, a sequence with fewer than 2 tokens, or
            a budget the eviction cannot meet — all before the model runs; nothing changes.
    """
    if not isinstance(cache, RelayModelCache) or not cache.needs_reconstruction:
        raise ValueError("compress needs a RelayModelCache whose scorer needs a reconstruction")
    prompt = prompt or reconstruction_prompt(cache)
    if prompt is None:
        raise ValueError(
            "compress needs the repeat prompt's token ids: pass prompt="
            "ReconstructionPrompt.from_tokenizer(tokenizer) or build the scorer with one"
        )
    seen = cache.get_seq_length()
    lengths = cache.stream_lengths
    if input_ids.dim() != 2 or tuple(input_ids.shape) != (len(lengths), seen) or seen == 0:
        raise ValueError(
            f"input_ids must be the [B, seen] = [{len(lengths)}, {seen}] columns fed to the "
            f"cache, got {tuple(input_ids.shape)}"
        )
    awaiting = cache.awaiting_reconstruction()
    for b, (n, wait) in enumerate(zip(lengths, awaiting, strict=True)):
        if not wait or n < 2:
            held = f"{n} token" if n == 1 else f"{n} tokens"
            raise ValueError(
                f"row {b} cannot be compressed: "
                + (
                    "it has evicted already"
                    if n and not wait
                    else f"it holds {held}; KVzip needs at least 2"
                )
            )
    cache.check_reconstruction_eviction(list(range(len(lengths))))

    layers = cache.relay_layers()
    memo_key = None if scores is None else _score_key(cache, input_ids, prompt)
    entry = None if scores is None else scores.get(memo_key)
    if entry is not None and entry[0]() is model:  # scores of another model are not reused
        for layer, saved in zip(layers, entry[1], strict=True):
            layer.reconstruction_scores = _copied(saved)
        try:
            return cache.evict_reconstructed()
        finally:
            cache.discard_reconstruction()
    host = input_ids.tolist()
    plans: list[list[ReconstructionChunk]] = [
        prompt.chunks(row[seen - n :]) for row, n in zip(host, lengths, strict=True)
    ]
    sinks = cache.eviction.sink_tokens
    device = input_ids.device
    key = _cache_keyword(model)
    padding = [seen - n for n in lengths]
    extra = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )
    try:
        with use_attention(model, KVLAB_ATTENTION):
            for c in range(max(len(p) for p in plans)):
                chunks = [p[c] if c < len(p) else None for p in plans]
                width = max(len(ch.ids) if ch else 0 for ch in chunks)
                ids = torch.zeros(len(chunks), width, dtype=torch.int64)
                positions = torch.zeros(len(chunks), width, dtype=torch.int64)
                new_mask = torch.zeros(len(chunks), width, dtype=torch.int64)
                for b, (ch, start) in enumerate(zip(chunks, cache.next_positions, strict=True)):
                    real = len(ch.ids) if ch else 0
                    positions[b] = start
                    if real:
                        ids[b, width - real :] = torch.tensor(ch.ids)
                        positions[b, width - real :] = start + torch.arange(real)
                        new_mask[b, width - real :] = 1
                kwargs: dict[str, Any] = {"position_ids": positions.to(device)}
                if any(padding) or not bool(new_mask.all()):
                    old = torch.arange(seen).view(1, -1) >= torch.tensor(padding).view(-1, 1)
                    mask = torch.cat([old.to(torch.int64), new_mask], dim=1)
                    kwargs["attention_mask"] = mask.to(device)
                spans = [
                    ReconstructionSpan(ch.start, ch.end, sinks) if ch else None for ch in chunks
                ]
                with cache.reconstruction_pass(spans):
                    model(ids.to(device), use_cache=True, **{key: cache}, **kwargs, **extra)
        if scores is not None:
            scores[memo_key] = (
                weakref.ref(model),
                [_copied(layer.reconstruction_scores) for layer in layers],
            )
        return cache.evict_reconstructed()
    finally:
        cache.discard_reconstruction()


def _score_key(
    cache: RelayModelCache, input_ids: Tensor, prompt: ReconstructionPrompt
) -> tuple[Any, ...]:
    """What decides a cache's reconstruction scores (module docstring, "Shared scores")."""
    shapes = tuple(
        tuple(None if t is None else tuple(t.shape) for t in layer.observation_scores)
        for layer in cache.relay_layers()
    )
    observed = getattr(cache.eviction.resolved_scorer, "prefill_queries", None)
    return (
        tuple(map(tuple, input_ids.tolist())),
        dataclasses.astuple(prompt),
        cache.eviction.sink_tokens,
        observed,
        tuple(cache.stream_lengths),
        shapes,
    )


def _copied(scores: list[Tensor | None]) -> list[Tensor | None]:
    """A copy of one layer's per-sequence scores (the memo and the caches never share them)."""
    return [None if t is None else t.clone() for t in scores]
