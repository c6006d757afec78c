"""KVzip: score cached tokens by how much the model attends to them while re-reading the context
(Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv:2505.23416; the formula of NVIDIA kvpress 0.5.5's ``KVzipPress``).

After the prefill of a context ``C`` (nothing evicted yet), a *reconstruction pass* feeds, on
top of the cache, ``prompt + suffix + C`` — "Repeat the previous context exactly." and the
context itself, teacher-forced. In every layer the pass's queries attend over the cached
context and, causally, over the pass's own tokens; the score of cached token ``i`` of kv head
``h`` is the largest softmax probability any query of the pass, in any query head of ``h``'s
GQA group, gives it::

    score[h, i] = max_{g in group(h), j in pass} softmax_j(scale * q_{g,j} . [K_C ; K_pass])[i]

The softmax runs over every cached context token and the pass tokens up to ``j`` (KVzip's
normalization; the pass's own tokens take part in it but are never scored). Long contexts are
reconstructed in chunks (KVzip's ``chunk_size``, 2048 tokens): the pass for the chunk
``[s, e)`` still attends over the whole cache (its hidden states are exact), but its scores
are normalized over the first ``min(n_sink, s)`` context tokens, the chunk and the pass's own
tokens only, and only the chunk's tokens are scored (kvpress's ``_compute_cross_attention``).
The pass's tokens are never stored: the cache keeps the context only.

A context rendered in the model's chat template (it starts with the template's text before a
user message, as a chat model's prompt does in kvpress's pipeline and in RULER) is rebuilt as
kvpress does for a tokenizer with a template: the request is followed by the template's end of
the user turn and start of the assistant's (``"<|im_end|>\\n<|im_start|>assistant\\n"`` for
Qwen2.5) instead of ``"\\n"``, and only the tokens after the template's prefix are rebuilt and
scored (chunks start there; the prefix is never scored, so it stays only where the policy's
sinks or protected window keep it).

This module holds the model-free parts: the prompt (:class:`ReconstructionPrompt`) and the
scorer (:class:`KVzipScorer`) that turns the scores into keep-scores for the eviction policy
(:mod:`kvlab.relay.budgets`); the attention of one pass over one sequence that also returns the
scores (:func:`reconstruction_attention`) lives in :mod:`kvlab.relay.kvzip_attention` and is
re-exported here. The pass itself runs in
:class:`kvlab.integrations.RelayModelCache` (docs/design.md, "RoPE-Relay: Reconstruction
scoring"), driven by :func:`kvlab.integrations.kvzip.compress`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from kvlab.relay.kvzip_attention import (
    reconstruction_attention,
    reconstruction_attention_reference,
)
from kvlab.relay.scorers import SCORERS, ScoreInputs, Scorer, pool_scores

__all__ = [
    "FIRST_PROMPT",
    "NEXT_PROMPT",
    "KVzipScorer",
    "ReconstructionChunk",
    "ReconstructionPrompt",
    "chat_template_parts",
    "reconstruction_attention",
    "reconstruction_attention_reference",
]

#: KVzip's repeat request for the first chunk of a context.
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
#: KVzip's repeat request for later chunks, followed by the last tokens of the previous chunk.
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class ReconstructionChunk:
    """One reconstruction pass of one sequence: it rebuilds the context tokens ``start .. end -
    1`` (stream indices) and feeds ``ids`` (prompt, suffix, those tokens)."""

    start: int
    end: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class ReconstructionPrompt:
    """The token ids of KVzip's repeat request, for raw-text contexts and, when the tokenizer
    has a chat template, for contexts rendered in it.

    A context that starts with ``chat_prefix_ids`` (the template's text before a user message:
    a chat model's prompt as kvpress's pipeline and RULER lay it out) is reconstructed the way
    kvpress 0.5.5's ``KVzipPress`` does for a tokenizer with a chat template: the passes rebuild
    the tokens after that prefix only (so the prefix is never scored: it stays where the
    policy's sink tokens or protected window keep it), and the request is followed by
    ``chat_suffix_ids`` (the template's end of the user turn and start of the assistant's) in
    place of ``suffix_ids``. Any other context (raw text) uses ``suffix_ids`` and is rebuilt
    whole.

    Attributes:
        first_ids: ``FIRST_PROMPT`` tokenized (no special tokens).
        next_ids: ``NEXT_PROMPT`` tokenized; later chunks append the previous chunk's last
            ``overlap`` tokens to it.
        suffix_ids: what separates the request from the repeated text of a raw-text context
            (KVzip's ``"\\n"`` for models without a chat template).
        chunk_tokens: context tokens reconstructed per pass (KVzip's 2048).
        overlap: tokens of the previous chunk quoted in a later chunk's request (KVzip's 8).
        chat_prefix_ids: the chat template's ids before a user message (kvpress's
            ``prefix_length`` of them), or ``()`` without a template.
        chat_suffix_ids: the chat template's ids after a user message with the generation
            prompt (kvpress's ``_suffix_ids``), or ``()``; set with ``chat_prefix_ids``.

    Raises:
        ValueError: empty ``first_ids``, ``chunk_tokens < 1``, ``overlap < 0``, or only one of
            ``chat_prefix_ids`` and ``chat_suffix_ids`` given.
    """

    first_ids: tuple[int, ...]
    next_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    chunk_tokens: int = 2048
    overlap: int = 8
    chat_prefix_ids: tuple[int, ...] = ()
    chat_suffix_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.first_ids:
            raise ValueError("first_ids must not be empty")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.overlap < 0:
            raise ValueError(f"overlap must be >= 0, got {self.overlap}")
        if bool(self.chat_prefix_ids) != bool(self.chat_suffix_ids):
            raise ValueError("chat_prefix_ids and chat_suffix_ids are set together")
        for name in ("first_ids", "next_ids", "suffix_ids", "chat_prefix_ids", "chat_suffix_ids"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        suffix: str = "\n",
        chunk_tokens: int = 2048,
        overlap: int = 8,
        chat: bool = True,
    ) -> ReconstructionPrompt:
        """KVzip's prompts tokenized by ``tokenizer`` (``tokenizer.encode(text,
        add_special_tokens=False)``), with the chat template's prefix and suffix when it has a
        template and ``chat`` (:func:`chat_template_parts`) and the template puts text before a
        user message (without such text a templated context cannot be told from raw text: every
        context is then rebuilt as raw text, where kvpress would use the template's suffix)."""

        def encode(text: str) -> tuple[int, ...]:
            return tuple(int(i) for i in tokenizer.encode(text, add_special_tokens=False))

        parts = chat_template_parts(tokenizer) if chat else None
        if parts is not None and not parts[0]:
            # no text before the user message: a templated context cannot be told from raw
            # text, so every context is rebuilt as raw text
            parts = None
        return cls(
            first_ids=encode(FIRST_PROMPT),
            next_ids=encode(NEXT_PROMPT),
            suffix_ids=encode(suffix),
            chunk_tokens=chunk_tokens,
            overlap=overlap,
            chat_prefix_ids=encode(parts[0]) if parts else (),
            chat_suffix_ids=encode(parts[1]) if parts else (),
        )

    def settings(self) -> dict[str, Any]:
        """JSON-ready fields (the constructor's keyword arguments)."""
        return {
            "first_ids": list(self.first_ids),
            "next_ids": list(self.next_ids),
            "suffix_ids": list(self.suffix_ids),
            "chunk_tokens": self.chunk_tokens,
            "overlap": self.overlap,
            "chat_prefix_ids": list(self.chat_prefix_ids),
            "chat_suffix_ids": list(self.chat_suffix_ids),
        }

    def templated(self, context: Sequence[int]) -> bool:
        """Whether ``context`` starts with the chat template's prefix (and holds more)."""
        p = len(self.chat_prefix_ids)
        return bool(p) and len(context) > p and tuple(context[:p]) == self.chat_prefix_ids

    def chunks(self, context: Sequence[int]) -> list[ReconstructionChunk]:
        """The passes that reconstruct ``context`` (a sequence's stored tokens, stream order):
        with ``p`` the length of the chat prefix when the context is :meth:`templated` (else
        0), chunk ``c`` covers ``[p + c * chunk_tokens, p + (c + 1) * chunk_tokens)``; its ids
        are ``first_ids`` (chunk 0) or ``next_ids`` + the previous chunk's last ``overlap``
        ids (the whole chunk when it is shorter), then ``chat_suffix_ids`` (templated) or
        ``suffix_ids``, then the chunk's ids (kvpress's ``KVzipPress.prepare``)."""
        ctx = [int(i) for i in context]
        chat = self.templated(ctx)
        first = len(self.chat_prefix_ids) if chat else 0
        suffix = list(self.chat_suffix_ids if chat else self.suffix_ids)
        out = []
        for start in range(first, len(ctx), self.chunk_tokens):
            end = min(start + self.chunk_tokens, len(ctx))
            if start == first:
                request = list(self.first_ids)
            else:
                quoted = min(self.overlap, self.chunk_tokens)  # from the previous chunk only
                request = list(self.next_ids) + ctx[start - quoted : start]
            ids = tuple(request + suffix + ctx[start:end])
            out.append(ReconstructionChunk(start=start, end=end, ids=ids))
        return out


def chat_template_parts(tokenizer: Any) -> tuple[str, str] | None:
    """The text a tokenizer's chat template puts before and after a user message (the latter
    with the generation prompt), found as kvpress 0.5.5's ``KVzipPress`` finds them: render a
    dummy message followed by a separator, split there. ``None`` without a chat template.

    Raises:
        ValueError: a template that does not render the dummy message as given.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    head, found, suffix = text.partition(separator)
    prefix, dummy_found, _ = head.partition(dummy)
    if not found or not dummy_found:
        raise ValueError("the chat template does not render a user message as given")
    return prefix, suffix


@dataclass(frozen=True, repr=False, kw_only=True)
class KVzipScorer(Scorer):
    """The reconstruction-pass attention of each cached token (KVzip), optionally times the
    value norm and max-pooled over neighbours.

    Scores are attention probabilities, on one scale across heads and layers, so the adaptive
    per-head allocation (Ada-KV) compares them directly — as KVzip's own selection does, which
    keeps the model's top scores over every layer and head.

    Args:
        value_norm: multiply the score by ``||v||_2`` of the token (the value-norm rescaling
            of ExpectedAttention / CriticalKV; KVzip+ uses ``||W_O v||``).
        kernel_size: odd max-pooling width in tokens (1, the default, is KVzip's: no pooling).
        prompt: the repeat request's token ids that :func:`kvlab.integrations.kvzip.compress`
            uses by default, or ``None`` (then ``compress`` must be given one).
        prefill_queries: also score by the attention of the prefill's last ``prefill_queries``
            queries (SnapKV's observation window, Li et al. 2024, arXiv:2404.14469): per slot
            the max of its reconstruction score and of the probability any of those queries,
            in any query head of the GQA group, gives it — the observation window's queries
            treated as more reconstruction queries. 0 (KVzip's own): none.

    Raises:
        ValueError: an even or non-positive ``kernel_size``, a negative ``prefill_queries``;
            at scoring time, missing
            reconstruction scores (the cache ran no reconstruction pass).
    """

    name = "kvzip"
    needs_reconstruction = True

    value_norm: bool = False
    kernel_size: int = 1
    prompt: ReconstructionPrompt | None = None
    prefill_queries: int = 0

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd int >= 1, got {self.kernel_size}")
        if self.prefill_queries < 0:
            raise ValueError(f"prefill_queries must be >= 0, got {self.prefill_queries}")

    def with_prompt(self, prompt: ReconstructionPrompt) -> KVzipScorer:
        """This scorer with the repeat prompt ``prompt`` (a copy)."""
        return replace(self, prompt=prompt)

    def score(self, inputs: ScoreInputs) -> Tensor:
        if inputs.reconstruction is None:
            raise ValueError(
                "the kvzip scorer needs reconstruction scores: run kvlab.integrations.kvzip."
                "compress(model, cache, input_ids) after the prefill"
            )
        out = pool_scores(inputs.reconstruction, inputs.valid, self.kernel_size, "max")
        if self.value_norm:
            out = out * torch.linalg.vector_norm(inputs.values.float(), dim=-1)
        return out

    def __repr__(self) -> str:
        return (
            f"KVzipScorer(value_norm={self.value_norm}, kernel_size={self.kernel_size}, "
            f"prefill_queries={self.prefill_queries})"
        )


SCORERS["kvzip"] = KVzipScorer
