"""One prefill, many caches: capture what every attention layer receives in one forward, then
replay those calls into another cache.

A method whose compression depends only on the prefill's per-layer attention inputs (SnapKV-
style scorers read the prefill's queries and keys, PN-Mix its keys, quantized caches their
keys and values) needs no forward of its own: :func:`capture_prefill` runs the model once over
a context with a plain ``transformers.DynamicCache`` and records, for every decoder layer's
attention module (``<decoder layer>.self_attn``, with a ``layer_idx``), the arguments of its
call — the normed hidden states ``[B, T, hidden]``, the RoPE ``position_embeddings``, the
attention mask the model built, ``position_ids`` and the rest. :func:`replay_prefill` then
calls each attention module again, in decoder order, with those arguments and the method's
cache in place of the capture's, under the method's attention implementation: the module
recomputes its queries, keys and values (the projections and RoPE are deterministic), the cache
stores (and evicts, quantizes, packs) exactly as in the method's own prefill, and the
attention outputs are dropped — under ``"kvlab"`` not even computed
(:func:`~kvlab.integrations.attention.attention_outputs_unused`: the projections, RoPE, the
stores and the eviction scorers run; the ``T x T`` attention of the prefill over itself does
not). Only the attention modules run: no MLP, no logits.

Equivalence with the method's own prefill (tests/integrations/test_prefill_replay.py): layer 0
receives the same inputs in both, so its stored state is bit-identical; a deeper layer's inputs
equal the own prefill's exactly when the method's prefill attention output equals the
capture's — true for caches that attend the exact prompt during the prefill (all of kvlab's:
eviction, quantization and packing happen after the prefill's attention), up to the rounding
of a different attention kernel (``"kvlab"`` versus ``"sdpa"``). The test bounds that
difference and checks the greedy tokens decoded from both are the same.

A method with its own extra pass over the context (KVzip's reconstruction,
:func:`kvlab.integrations.kvzip.compress`) runs that pass after the replay, as after its own
prefill. A capture holds every layer's hidden states: ``num_layers * T * hidden * 4`` bytes in
float32 (352 MiB for Qwen2.5-0.5B at 4,096 tokens).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvlab.integrations.attention import attention_outputs_unused, use_attention

__all__ = ["PrefillCapture", "attention_modules", "capture_prefill", "replay_prefill"]


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The decoder layers' attention modules of ``model``, in ``layer_idx`` order: every
    submodule named ``*.self_attn`` with an integer ``layer_idx``.

    Raises:
        ValueError: none found, or their ``layer_idx`` are not ``0 .. L-1``.
    """
    found = [
        m
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] == "self_attn" and isinstance(getattr(m, "layer_idx", None), int)
    ]
    found.sort(key=lambda m: m.layer_idx)
    if not found or [m.layer_idx for m in found] != list(range(len(found))):
        raise ValueError(
            f"{type(model).__name__}: cannot find its decoder layers' attention modules "
            "(submodules named 'self_attn' with layer_idx 0..L-1); replay needs them"
        )
    return found


@dataclass
class PrefillCapture:
    """What every attention layer received in one prefill forward.

    Attributes:
        input_ids: int64 ``[B, T]`` the context fed.
        calls: per layer, ``(args, kwargs)`` of its attention module's call (the cache keyword
            left out).
        cache: the ``DynamicCache`` the capture filled (the ``full`` method's prefilled cache).
        logits: float ``[B, V]`` of the context's last token.
        cache_keyword: the model's cache keyword (``"cache"`` or ``"past_key_values"``).
        attention: the attention implementation the capture ran under.
        model: a weak reference to the model the capture ran (a replay into another model's
            cache is refused), or ``None``.
        derived: results derived from this prefill that the methods replaying it share, by
            name (``"kvzip_scores"``: the reconstruction scores memo of
            :func:`kvlab.integrations.kvzip.compress`).
    """

    input_ids: Tensor
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    cache: Any
    logits: Tensor
    cache_keyword: str
    attention: str
    model: Any = field(default=None, repr=False, compare=False)
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def _cache_keyword(module: torch.nn.Module) -> str:
    """The cache keyword of ``module.forward``: ``"cache"`` (transformers >= 5.x) or
    ``"past_key_values"``."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def capture_prefill(model: Any, input_ids: Tensor, *, attention: str = "sdpa") -> PrefillCapture:
    """Run ``model`` once over ``input_ids`` (int64 ``[B, T]``) with a fresh
    ``transformers.DynamicCache`` under attention implementation ``attention``, recording every
    attention module's call (module docstring).

    Raises:
        ValueError: ``input_ids`` not 2-D int64 with ``T >= 1``; no attention modules found.
    """
    from transformers import DynamicCache

    if input_ids.dim() != 2 or input_ids.dtype != torch.int64 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids must be int64 [B, T] with T >= 1, got {input_ids.dtype} "
            f"{tuple(input_ids.shape)}"
        )
    modules = attention_modules(model)
    keyword = _cache_keyword(modules[0])
    calls: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * len(modules)

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kept = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
        calls[module.layer_idx] = (tuple(args), kept)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    cache = DynamicCache(config=model.config)
    extra = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )
    try:
        with use_attention(model, attention):
            out = model(input_ids, use_cache=True, **{_cache_keyword(model): cache}, **extra)
    finally:
        for handle in handles:
            handle.remove()
    if any(c is None for c in calls):
        missing = [i for i, c in enumerate(calls) if c is None]
        raise ValueError(f"capture saw no call of attention layers {missing}")
    return PrefillCapture(
        input_ids=input_ids,
        calls=[c for c in calls if c is not None],
        cache=cache,
        logits=out.logits[:, -1],
        cache_keyword=keyword,
        attention=attention,
        model=weakref.ref(model),
    )


@torch.no_grad()
def replay_prefill(
    model: Any,
    capture: PrefillCapture,
    cache: Any,
    *,
    attention: str,
    skip_outputs: bool = True,
) -> None:
    """Fill ``cache`` (a fresh cache for ``model``) with ``capture``'s prefill: every attention
    module is called again, in decoder order, with the captured arguments and ``cache``, under
    attention implementation ``attention``; outputs are dropped (module docstring).

    ``skip_outputs`` (default): under ``"kvlab"`` the prefill's attention over its own tokens
    is not computed (:func:`kvlab.integrations.attention.attention_outputs_unused`; the cache
    stores the same bits); ``False`` computes it as the method's own prefill does.

    Raises:
        ValueError: ``capture`` was made on another model (or one with another number of
            attention layers); ``cache`` already holds tokens; whatever the cache raises for
            the prefill (its own checks, e.g. a prompt too short for its budget) — then layers
            before the refusing one may have stored theirs: discard the cache.
    """
    modules = attention_modules(model)
    source = capture.model() if capture.model is not None else model
    if source is not model:
        raise ValueError("the capture was made on another model; capture this model's prefill")
    if len(modules) != len(capture.calls):
        raise ValueError(
            f"the capture has {len(capture.calls)} attention layers, the model {len(modules)}"
        )
    seen = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    if seen:
        raise ValueError(f"replay_prefill needs a fresh cache; this one holds {seen} tokens")
    unused = attention_outputs_unused() if skip_outputs else contextlib.nullcontext()
    with use_attention(model, attention), unused:
        for module, (args, kwargs) in zip(modules, capture.calls, strict=True):
            module(*args, **kwargs, **{capture.cache_keyword: cache})
