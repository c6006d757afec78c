"""Compress a context once, answer questions on it: the shape of kvpress's pipeline
(``KVPressTextGenerationPipeline``: the press compresses the context, then each question is fed
on a copy of the compressed cache and its answer decoded greedily). The compression never sees
a question (query-agnostic, as kvpress's RULER leaderboard).

    compressed = compress_context(model, context_ids, method)          # one compressed cache
    for q in questions:
        reply = answer(model, compressed, q, max_new_tokens=32, stop_token_ids=eos_ids)

:func:`compress_context` builds the method's cache either by its own prefill forward over the
context, or — given a :class:`~kvlab.integrations.prefill_replay.PrefillCapture` of the same
context — by replaying the captured prefill into the method's cache
(:func:`~kvlab.integrations.prefill_replay.replay_prefill`: the attention modules only, no
second full forward; equivalence: that module's docstring). A KVzip method then runs its own
reconstruction pass (:func:`kvlab.integrations.kvzip.compress`) either way. After compression
the cache's prompt is closed (:meth:`~kvlab.integrations.cache_protocol.KVLabCache.end_prompt`):
a question is a continuation, never part of the prompt an eviction cache evicts.

:func:`answer` feeds the question's tokens in one forward (at the cache's own RoPE positions
where it keeps them), then decodes greedily one token at a time until a stop token or
``max_new_tokens``; each answer runs on a deep copy of the compressed cache unless told
otherwise, so several questions see the same compressed context. :func:`answer_nll` scores a
given answer instead (teacher forcing): the negative log-likelihood of its tokens after the
question, a per-sample measure of how far a compressed cache moves the model from a reference
answer (e.g. the full cache's own), finer than a right-or-wrong score.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvlab.evaluation.foreign_cache import describe
from kvlab.evaluation.methods import Method
from kvlab.evaluation.methods.method import check_method
from kvlab.evaluation.metrics import CacheStorage, cache_storage
from kvlab.evaluation.protocols import cache_keyword, position_kwargs
from kvlab.integrations.attention import use_attention
from kvlab.integrations.prefill_replay import PrefillCapture, replay_prefill

__all__ = ["Answer", "CompressedContext", "answer", "answer_nll", "compress_context"]


@dataclass
class CompressedContext:
    """A context compressed by one method.

    Attributes:
        cache: the method's cache holding the compressed context.
        method: the method.
        context_tokens: tokens of the context.
        storage: the cache's storage after compression (bytes).
        seconds: wall time of the compression (own prefill or replay, plus any extra pass).
        replayed: whether the cache was filled from a captured prefill.
        details: the cache's method-specific facts after compression.
    """

    cache: Any
    method: Method
    context_tokens: int
    storage: CacheStorage
    seconds: float
    replayed: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Answer:
    """One question's greedy answer.

    Attributes:
        tokens: the generated token ids (the stop token, when one ended it, included).
        stopped: whether a stop token ended it (``False``: ``max_new_tokens`` reached).
        seconds: wall time of the question forward and the decode steps.
        storage: the cache's storage after the last step (bytes).
    """

    tokens: list[int]
    stopped: bool
    seconds: float
    storage: CacheStorage


def _check_ids(name: str, ids: Tensor) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(
            f"{name} must be a torch int64 tensor [1, T] (e.g. torch.tensor([ids])), got "
            f"{type(ids).__name__}"
        )
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype != torch.int64 or ids.shape[1] < 1:
        raise ValueError(
            f"{name} must be int64 [1, T] with T >= 1, got {ids.dtype} {tuple(ids.shape)}"
        )


def _check_model(model: Any) -> None:
    """A ``TypeError`` unless ``model`` is a model (a callable with a ``config``), saying to
    pass ``loaded.model`` for a :class:`~kvlab.models.LoadedModel`."""
    from kvlab.models import LoadedModel

    if isinstance(model, LoadedModel):
        raise TypeError(
            "model must be the transformers model, got a LoadedModel: pass loaded.model "
            "(loaded = kvlab.load_model(...))"
        )
    if not callable(model) or not hasattr(model, "config"):
        raise TypeError(
            f"model must be a transformers causal LM (e.g. kvlab.load_model(...).model), got "
            f"{type(model).__name__}"
        )


def _check_compressed(compressed: Any) -> None:
    if not isinstance(compressed, CompressedContext):
        raise TypeError(
            "compressed must be what kvlab.compress_context(...) returned (a CompressedContext), "
            f"got {type(compressed).__name__}"
        )


@torch.no_grad()
def compress_context(
    model: Any,
    context_ids: Tensor,
    method: Method,
    *,
    prepared: Mapping[str, Any] | None = None,
    capture: PrefillCapture | None = None,
) -> CompressedContext:
    """Compress ``context_ids`` (int64 ``[1, T]``) with ``method`` (module docstring).

    Args:
        model: a ``transformers`` causal LM in eval mode.
        prepared: the method's prepared state, if it has a preparation.
        capture: a capture of this context's prefill to replay instead of a forward; for
            ``full`` its own ``DynamicCache`` is used as is (deep-copied). KVzip methods
            replaying one capture share its reconstruction scores (the first runs the pass;
            :func:`kvlab.integrations.kvzip.compress`).

    Raises:
        TypeError: ``model`` not a model (e.g. the :class:`~kvlab.models.LoadedModel`: pass
            ``loaded.model``), ``context_ids`` not a tensor, ``method`` not a :class:`Method`
            (e.g. its name: call :func:`~kvlab.evaluation.methods.parse_method` first).
        ValueError: ``context_ids`` not ``[1, T]`` int64, or a capture of other tokens or of
            another model; what the
            method's cache raises for the prompt (e.g. too short for its budget).
    """
    _check_model(model)
    _check_ids("context_ids", context_ids)
    check_method(method)
    if capture is not None and not torch.equal(capture.input_ids, context_ids):
        raise ValueError("the capture was made on other tokens than context_ids")
    if capture is not None and capture.model is not None and capture.model() is not model:
        raise ValueError("the capture was made on another model; capture this model's prefill")
    start = time.perf_counter()
    if capture is not None and method.family == "full":
        cache = copy.deepcopy(capture.cache)
    else:
        cache = method.make_cache(model.config, prepared)
        if capture is not None:
            replay_prefill(model, capture, cache, attention=method.attention)
        else:
            with use_attention(model, method.attention):
                model(
                    context_ids,
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_keyword(model): cache},
                    **position_kwargs(cache, context_ids.shape[1]),
                )
        if getattr(cache, "needs_reconstruction", False):
            from kvlab.integrations.kvzip import compress

            memo = None if capture is None else capture.derived.setdefault("kvzip_scores", {})
            compress(model, cache, context_ids, scores=memo)
    describe(cache).end_prompt()
    seconds = time.perf_counter() - start
    return CompressedContext(
        cache=cache,
        method=method,
        context_tokens=int(context_ids.shape[1]),
        storage=cache_storage(cache),
        seconds=seconds,
        replayed=capture is not None,
        details=describe(cache).details(),
    )


def _copy_cache(compressed: CompressedContext) -> Any:
    """A deep copy of the compressed cache, or a ``ValueError`` saying how to answer without
    one."""
    try:
        return copy.deepcopy(compressed.cache)
    except RuntimeError as error:
        raise ValueError(
            f"method {compressed.method.name!r}: its cache ({type(compressed.cache).__name__}) "
            f"cannot be copied ({str(error).splitlines()[0][:120]}); answer one question per "
            "compression with answer(..., copy_cache=False)"
        ) from None


@torch.no_grad()
def answer(
    model: Any,
    compressed: CompressedContext,
    question_ids: Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    copy_cache: bool = True,
) -> Answer:
    """Feed ``question_ids`` (int64 ``[1, Q]``) after the compressed context and decode
    greedily (module docstring).

    Args:
        max_new_tokens: the most tokens to generate (``>= 1``).
        stop_token_ids: token ids that end the answer (e.g. the tokenizer's EOS and the chat
            template's end-of-turn).
        copy_cache: answer on a deep copy of the compressed cache (``False``: consume it).

    Raises:
        TypeError: ``model`` not a model (pass ``loaded.model``), ``compressed`` not a
            :class:`CompressedContext`, ``question_ids`` not a tensor.
        ValueError: ``question_ids`` not ``[1, Q]`` int64, or ``max_new_tokens < 1``; a cache
            that cannot be copied (``transformers``' ``QuantizedCache`` with quanto: its
            tensors refuse ``deepcopy``) with ``copy_cache=True``.
    """
    _check_model(model)
    _check_compressed(compressed)
    _check_ids("question_ids", question_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = _copy_cache(compressed) if copy_cache else compressed.cache
    key = cache_keyword(model)
    stops = {int(t) for t in stop_token_ids}
    tokens: list[int] = []
    stopped = False
    start = time.perf_counter()
    with use_attention(model, compressed.method.attention):
        ids = question_ids
        for _ in range(max_new_tokens):
            out = model(
                ids,
                use_cache=True,
                logits_to_keep=1,
                **{key: cache},
                **position_kwargs(cache, ids.shape[1]),
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if token in stops:
                stopped = True
                break
            ids = torch.tensor([[token]], dtype=torch.int64, device=question_ids.device)
    return Answer(
        tokens=tokens,
        stopped=stopped,
        seconds=time.perf_counter() - start,
        storage=cache_storage(cache),
    )


@torch.no_grad()
def answer_nll(
    model: Any,
    compressed: CompressedContext,
    question_ids: Tensor,
    answer_ids: Tensor,
) -> list[float]:
    """Teacher-forced negative log-likelihood of ``answer_ids`` (int64 ``[1, A]``) after the
    compressed context and ``question_ids`` (int64 ``[1, Q]``), on a deep copy of the cache:
    one forward of the ``Q + A`` tokens (at the cache's own RoPE positions where it keeps
    them) whose answer tokens are decode-phase tokens (the question's end marked,
    :meth:`~kvlab.integrations.cache_protocol.KVLabCache.expect_prompt`): the cache stores
    and attends them as :func:`answer`'s question forward followed by its decode steps would
    (a PN-Mix-family cache: the exact residual as it stood at each step, not the question and
    answer stored, flushed, then attended; docs/design.md, "Cache life cycle").

    Returns:
        ``A`` values in nats (float64 of the float32 logits' log-softmax): token ``i``'s
        ``-log p(answer_ids[i] | context, question, answer_ids[:i])``.

    Raises:
        TypeError: ``model`` not a model (pass ``loaded.model``), ``compressed`` not a
            :class:`CompressedContext`, ``question_ids`` or ``answer_ids`` not a tensor.
        ValueError: ``question_ids`` or ``answer_ids`` not ``[1, n]`` int64; a cache that
            cannot be copied (as :func:`answer`).
    """
    _check_model(model)
    _check_compressed(compressed)
    _check_ids("question_ids", question_ids)
    _check_ids("answer_ids", answer_ids)
    cache = _copy_cache(compressed)
    describe(cache).expect_prompt(int(cache.get_seq_length()) + question_ids.shape[1])
    ids = torch.cat([question_ids, answer_ids.to(question_ids.device)], dim=1)
    a = answer_ids.shape[1]
    with use_attention(model, compressed.method.attention):
        out = model(
            ids,
            use_cache=True,
            logits_to_keep=a + 1,
            **{cache_keyword(model): cache},
            **position_kwargs(cache, ids.shape[1]),
        )
    # logits_to_keep=a+1 keeps positions q-1 .. q+a-1; the last one predicts past the answer
    logits = out.logits[0, :a].double()
    nll = -torch.log_softmax(logits, dim=-1).gather(1, answer_ids[0].view(-1, 1).to(logits.device))
    return [float(x) for x in nll.view(-1)]
