"""The per-method summaries of ``kvlab eval``'s protocols: task results (JSON-ready, from the
task store or a live run alike) merged into the figures a table, the raw JSON and the artifact
report (:mod:`kvlab.evaluation.report` writes them).

* :func:`summarize_prefill_score` — perplexity, ΔPPL and KL to the full cache pooled over every
  scored token of every window, the cache's bytes (as stored, at 16 bits, held, per layer kind)
  and times;
* :func:`summarize_stream` — perplexity within and beyond the model's trained context;
* :func:`summarize_needle` — exact-match accuracy per (length, depth);
* :func:`window_score` / :func:`window_metrics` — one window's figures against its reference.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.evaluation.methods import Method
from kvlab.evaluation.metrics import CacheStorage, percentile, perplexity
from kvlab.evaluation.plan import Task
from kvlab.evaluation.protocols import WindowScore

__all__ = [
    "method_fields",
    "summarize_needle",
    "summarize_prefill_score",
    "summarize_stream",
    "window_metrics",
    "window_score",
]


def window_score(result: Mapping[str, Any]) -> WindowScore:
    """A stored prefill-score task result as a :class:`WindowScore` (float64 tensors)."""
    import torch

    return WindowScore(
        nll=torch.tensor(result["nll"], dtype=torch.float64),
        kl=torch.tensor(result["kl"], dtype=torch.float64),
        storage_prefill=CacheStorage(**result["storage_prefill"]),
        storage_final=CacheStorage(**result["storage_final"]),
        model_seconds=result["model_seconds"],
        details=result["details"],
    )


def method_fields(method: Method, settings: Mapping[str, Any], scored: int) -> dict[str, Any]:
    """The entries every protocol's summary starts with."""
    return {
        "method": method.name,
        "family": method.family,
        "description": method.description,
        "settings": dict(settings),
        "scored_tokens": scored,
    }


def summarize_prefill_score(
    method: Method,
    scores: Sequence[WindowScore],
    reference: Sequence[WindowScore],
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Pooled figures of one method over all windows (NLL/KL pooled over every scored token;
    bytes averaged over windows; time summed). ``settings``: as recorded (default: the
    method's)."""
    import torch

    nll = torch.cat([s.nll for s in scores])
    ref_ppl = perplexity(torch.cat([s.nll for s in reference]))
    kl = torch.cat([s.kl for s in scores]) if scores[0].kl is not None else torch.zeros_like(nll)
    ref_bytes = statistics.mean(s.storage_final.kv_bytes_16bit for s in reference)
    seconds = sum(s.model_seconds for s in scores)
    ppl = perplexity(nll)
    kv16 = statistics.mean(s.storage_final.kv_bytes_16bit for s in scores)
    return {
        **method_fields(method, method.settings if settings is None else settings, nll.numel()),
        "ppl": ppl,
        "delta_ppl_pct": 100.0 * (ppl / ref_ppl - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_p95": percentile(kl, 0.95),
        "kv_bytes": statistics.mean(s.storage_final.kv_bytes for s in scores),
        "kv_bytes_16bit": kv16,
        "kv_fraction_of_full": kv16 / ref_bytes,
        "prefill_kv_bytes": statistics.mean(s.storage_prefill.kv_bytes for s in scores),
        "prefill_kv_bytes_16bit": statistics.mean(s.storage_prefill.kv_bytes_16bit for s in scores),
        "index_bytes": statistics.mean(s.storage_final.index_bytes for s in scores),
        "held_bytes": statistics.mean(_held(s.storage_final) for s in scores),
        "model_seconds": seconds,
        "tokens_per_second": nll.numel() / seconds if seconds > 0 else 0.0,
        **_kind_fields([s.storage_final for s in scores], [s.storage_final for s in reference]),
        "details": [s.details for s in scores],
    }


def _kind_fields(
    storages: Sequence[CacheStorage], reference: Sequence[CacheStorage]
) -> dict[str, Any]:
    """``kv_bytes_by_layer_kind``: per layer kind (full-attention, sliding-window), its layer
    count and its stored and 16-bit bytes averaged over windows, with ``fraction_of_full``
    (16-bit, against the full cache's layers of that kind); absent when a cache did not
    measure per layer."""
    if any(s.layer_kinds is None for s in [*storages, *reference]):
        return {}
    kinds: dict[str, Any] = {}
    for kind in sorted({k for s in storages for k in (s.layer_kinds or {})}):
        rows = [(s.layer_kinds or {}).get(kind) for s in storages]
        refs = [(s.layer_kinds or {}).get(kind) for s in reference]
        counts = [r for r in rows if r is not None]
        entry: dict[str, Any] = {
            "layers": max(int(r["layers"]) for r in counts),
            "kv_bytes": statistics.mean(int(r["kv_bytes"]) if r else 0 for r in rows),
            "kv_bytes_16bit": statistics.mean(int(r["kv_bytes_16bit"]) if r else 0 for r in rows),
        }
        ref16 = statistics.mean(int(r["kv_bytes_16bit"]) if r else 0 for r in refs)
        entry["fraction_of_full"] = entry["kv_bytes_16bit"] / ref16 if ref16 else None
        kinds[kind] = entry
    return {"kv_bytes_by_layer_kind": kinds}


def _held(storage: CacheStorage) -> int:
    """Bytes held (``kv_bytes + index_bytes`` where a cache did not say)."""
    if storage.held_bytes is None:
        return storage.kv_bytes + storage.index_bytes
    return storage.held_bytes


def window_metrics(score: WindowScore, reference: WindowScore) -> dict[str, float]:
    """One scored window's figures against the ``full`` cache's on the same window: ``ppl``,
    ``delta_ppl_pct`` (percent), ``kl_mean`` and ``kl_p95`` (nats per scored token; 0 where the
    score holds no KL), the final and prefill KV bytes (stored and 16-bit), ``model_seconds``
    and the storage's other counters."""
    import torch

    ppl = perplexity(score.nll)
    kl = score.kl if score.kl is not None else torch.zeros_like(score.nll)
    return {
        "ppl": ppl,
        "delta_ppl_pct": 100.0 * (ppl / perplexity(reference.nll) - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_p95": percentile(kl, 0.95),
        "kv_bytes": score.storage_final.kv_bytes,
        "kv_bytes_16bit": score.storage_final.kv_bytes_16bit,
        "prefill_kv_bytes_16bit": score.storage_prefill.kv_bytes_16bit,
        "model_seconds": score.model_seconds,
        **{
            f"{kind}_{key}": float(counts[key])
            for kind, counts in sorted((score.storage_final.layer_kinds or {}).items())
            for key in ("kv_bytes", "kv_bytes_16bit")
        },
    }


def summarize_stream(
    method: Method,
    nll: Any,
    *,
    context: int,
    segment: int,
    final_position: int,
    peak_kv_bytes: int,
    peak_kv_bytes_16bit: int,
    model_seconds: float,
    details: dict[str, Any],
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Stream figures: perplexity overall, of targets at stream index ``< context`` and
    ``>= context``, and per ``segment`` tokens. ``nll[t]`` (float64 tensor) scores stream
    token ``t + 1``."""
    import torch

    target_index = torch.arange(1, nll.numel() + 1)
    within = nll[target_index < context]
    beyond = nll[target_index >= context]
    ppl_within = perplexity(within) if within.numel() else None
    ppl_beyond = perplexity(beyond) if beyond.numel() else None
    segments = []
    for start in range(0, nll.numel() + 1, segment):
        part = nll[(target_index >= start) & (target_index < start + segment)]
        if part.numel():
            segments.append((int(min(start + segment, nll.numel() + 1)), perplexity(part)))
    return {
        **method_fields(method, method.settings if settings is None else settings, nll.numel()),
        "ppl": perplexity(nll),
        "ppl_within_context": ppl_within,
        "ppl_beyond_context": ppl_beyond,
        "beyond_over_within": (ppl_beyond / ppl_within) if ppl_within and ppl_beyond else None,
        "segments": segments,
        "final_position": final_position,
        "peak_kv_bytes": peak_kv_bytes,
        "peak_kv_bytes_16bit": peak_kv_bytes_16bit,
        "model_seconds": model_seconds,
        "tokens_per_second": nll.numel() / model_seconds if model_seconds > 0 else 0.0,
        "details": details,
    }


def summarize_needle(
    method: Method,
    tasks: Sequence[Task],
    results: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Needle figures of one method: exact-match accuracy overall and per (length, depth)."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for task, result in zip(tasks, results, strict=True):
        cells.setdefault((task.where["length"], task.where["depth"]), []).append(
            bool(result["correct"])
        )
    correct = [bool(r["correct"]) for r in results]
    seconds = sum(r["model_seconds"] for r in results)
    prompt_tokens = sum(len(t.tokens) for t in tasks)
    return {
        **method_fields(method, method.settings if settings is None else settings, 0),
        "accuracy": sum(correct) / len(correct),
        "cells": [
            {
                "length": length,
                "depth": depth,
                "trials": len(hits),
                "correct": sum(hits),
                "accuracy": sum(hits) / len(hits),
            }
            for (length, depth), hits in cells.items()
        ],
        "max_final_position": max(r["final_position"] for r in results),
        "peak_kv_bytes": max(r["peak_kv_bytes"] for r in results),
        "peak_kv_bytes_16bit": max(r["peak_kv_bytes_16bit"] for r in results),
        "model_seconds": seconds,
        "tokens_per_second": prompt_tokens / seconds if seconds > 0 else 0.0,
        "details": [r["details"] for r in results],
    }
