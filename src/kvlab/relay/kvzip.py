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

This module holds the model-free parts: the prompt (:class:`ReconstructionPrompt`), the
attention of one pass over one sequence that also returns the scores
(:func:`reconstruction_attention`) and the scorer (:class:`KVzipScorer`) that turns the scores
into keep-scores for the eviction policy (:mod:`kvlab.relay.budgets`). The pass itself runs in
:class:`kvlab.integrations.RelayModelCache` (docs/design.md, "RoPE-Relay: Reconstruction
scoring"), driven by :func:`kvlab.integrations.kvzip.compress`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from kvlab.attention_logits import softcap_logits, softmax_with_sinks
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


#: PyTorch's CPU flash attention returning the log-sum-exp, or ``None`` in a build without it.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def reconstruction_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    block_queries: int = 256,
) -> tuple[Tensor, Tensor]:
    """Attention of one sequence's reconstruction-pass queries, and the KVzip scores.

    On CPU (without ``softcap``, with ``Dv == D`` and ``Q >= 1``) it runs PyTorch's CPU flash
    attention (``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns each
    query's log-sum-exp) over three disjoint key sets: the score columns, the other valid
    cached slots and, causally, the own tokens; ``out`` is their log-sum-exp-weighted mix
    (exact: the softmax over a union of key sets), and the score of a slot is ``max exp(scale
    * q . k - lse)`` over the queries and the group, with ``lse`` the log-sum-exp of the score
    columns, the own tokens and the sink (one matmul and a max per block of queries; no
    softmax is materialized). Elsewhere :func:`reconstruction_attention_reference` computes the same
    thing; the two agree up to float32 rounding (tests/relay/test_kvzip.py).

    Args:
        query: ``[1, H_q, Q, D]`` the pass's queries (rotated at the positions following the
            cache).
        keys: ``[1, H, S, D]`` the sequence's cached keys per kv head (padded view);
            values: ``[1, H, S, Dv]``.
        valid: bool ``[1, H, S]``: the cached slots (others never attended, scored 0).
        own_keys: ``[1, H, Q, D]`` the pass's own keys (same rotation); own_values:
            ``[1, H, Q, Dv]``. Query ``j`` sees own tokens ``0 .. j``.
        scale: softmax scale of the logits.
        score_columns: bool ``[1, H, S]`` or ``None``: the cached slots the *scores* are
            normalized over (a later chunk: the first sinks and the chunk); ``None`` = every
            valid slot (then the scores are the attention probabilities themselves). Slots
            outside it score 0.
        softcap: Gemma 2 attention-logit soft-cap, or ``None``; s_aux: ``[H_q]`` learned sink
            logits (GPT-OSS), or ``None`` (both as in :mod:`kvlab.attention_logits`).
        block_queries: queries per block (bounds the float32 logits held at once; on the CPU
            path the block counts query rows of the whole group: ``[H, S, block_queries]``).

    Returns:
        ``(out, scores)``: ``out`` ``[1, H_q, Q, Dv]`` in the query dtype (exact softmax
        attention over the cached slots and the causal own tokens, computed in float32);
        ``scores`` float32 ``[1, H, S]``: per slot, the max over the queries and the GQA
        group's query heads of its softmax probability (module docstring), 0 where not
        scored.

    Raises:
        ValueError: shapes that do not fit together (``H_q`` not a multiple of ``H``).
    """
    _check_shapes(query, keys, values, valid, own_keys, own_values)
    if (
        _CPU_FLASH is None
        or softcap is not None
        or query.device.type != "cpu"
        or values.shape[-1] != keys.shape[-1]
        or query.shape[2] == 0  # the kernel divides by zero (SIGFPE) on an empty sequence
    ):
        return reconstruction_attention_reference(
            query,
            keys,
            values,
            valid,
            own_keys,
            own_values,
            scale=scale,
            score_columns=score_columns,
            softcap=softcap,
            s_aux=s_aux,
            block_queries=block_queries,
        )
    return _flash_reconstruction(
        query,
        keys,
        values,
        valid,
        own_keys,
        own_values,
        scale=scale,
        score_columns=score_columns,
        s_aux=s_aux,
        block_queries=block_queries,
    )


def _check_shapes(
    query: Tensor, keys: Tensor, values: Tensor, valid: Tensor, own_keys: Tensor, own_values: Tensor
) -> None:
    """Raise ``ValueError`` unless the arguments of :func:`reconstruction_attention` fit."""
    _, q_heads, q_len, dim = query.shape
    heads = keys.shape[1]
    if (
        query.shape[0] != 1
        or keys.shape[0] != 1
        or q_heads % heads
        or keys.shape[-1] != dim
        or own_keys.shape != (1, heads, q_len, dim)
        or values.shape[:3] != keys.shape[:3]
        or own_values.shape[:3] != own_keys.shape[:3]
        or own_values.shape[-1] != values.shape[-1]
        or valid.shape != keys.shape[:3]
    ):
        raise ValueError(
            f"reconstruction_attention: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)}, valid {tuple(valid.shape)}, own keys "
            f"{tuple(own_keys.shape)}, own values {tuple(own_values.shape)} do not fit"
        )


def _gather_slots(keys: Tensor, values: Tensor, chosen: Tensor) -> tuple[Tensor, ...]:
    """The slots ``chosen`` (bool ``[H, S]``) of ``keys`` / ``values`` (``[H, S, D]``), packed
    to the front per head in slot order and padded to the largest count ``n``: keys and values
    ``[H, n, D]`` (a slice when ``chosen`` is every slot), the slot index ``[H, n]`` (padding:
    ``S``), the count per head ``[H]`` and an additive mask ``[H, 1, n]`` (0 / ``-inf``) or
    ``None`` when nothing is padding."""
    heads, slots = chosen.shape
    counts = chosen.sum(dim=1)
    n = int(counts.max()) if heads else 0
    if n == slots and bool(chosen.all()):
        index = torch.arange(slots, device=keys.device).expand(heads, slots)
        return keys, values, index, counts, None
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :n]  # chosen first
    filled = torch.arange(n, device=keys.device).view(1, n) < counts.view(heads, 1)
    k = keys.gather(1, order.unsqueeze(-1).expand(heads, n, keys.shape[-1]))
    v = values.gather(1, order.unsqueeze(-1).expand(heads, n, values.shape[-1]))
    index = order.masked_fill(~filled, slots)
    mask = None
    if not bool(filled.all()):
        mask = torch.zeros(heads, 1, n, dtype=keys.dtype, device=keys.device)
        mask = mask.masked_fill(~filled.view(heads, 1, n), float("-inf"))
    return k, v, index, counts, mask


def _flash_part(
    query: Tensor, keys: Tensor, values: Tensor, counts: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``query`` ``[H, R, D]`` over ``keys`` / ``values`` ``[H, n, D]``
    (``n >= 1``; ``mask`` additive ``[H, 1, n]`` or ``None``): ``out [H, R, D]`` and the
    natural log-sum-exp ``[H, R]`` of the scaled logits, ``-inf`` (and ``out`` 0) for a head
    with ``counts == 0`` (the kernel reports 0 there)."""
    out, lse = _CPU_FLASH(
        query.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        0.0,
        False,
        attn_mask=None if mask is None else mask.unsqueeze(0),
        scale=scale,
    )
    out, lse = out[0], lse[0]
    empty = (counts == 0).view(-1, 1)
    if bool(empty.any()):
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _flash_reconstruction(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None,
    s_aux: Tensor | None,
    block_queries: int,
) -> tuple[Tensor, Tensor]:
    """:func:`reconstruction_attention` by CPU flash attention (its docstring)."""
    _, q_heads, q_len, dim = query.shape
    heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    f32 = torch.float32
    # rows r = g * Q + j of kv head h: every query of the group (none is causal over the cache)
    q = query.to(f32)[0].reshape(heads, group * q_len, dim)
    k, v = keys.to(f32)[0], values.to(f32)[0]
    cached = valid[0]
    subset = cached if score_columns is None else cached & score_columns[0]
    parts: list[tuple[Tensor, Tensor]] = []  # (out [H, G*Q, Dv], lse [H, G*Q])
    k_sub, v_sub, index, counts, mask = _gather_slots(k, v, subset)
    sub_lse = None  # the score columns' log-sum-exp [H, G*Q]
    if k_sub.shape[1]:
        parts.append(_flash_part(q, k_sub, v_sub, counts, mask, scale))
        sub_lse = parts[-1][1]
    rest = cached & ~subset
    if bool(rest.any()):
        k_rest, v_rest, _, rest_counts, rest_mask = _gather_slots(k, v, rest)
        parts.append(_flash_part(q, k_rest, v_rest, rest_counts, rest_mask, scale))
    # own tokens, causally: the group's query heads as the batch (top-left causal = Q x Q)
    q_own = query.to(f32)[0].view(heads, group, q_len, dim).transpose(0, 1)
    k_own = own_keys.to(f32).expand(group, heads, q_len, dim)
    v_own = own_values.to(f32).expand(group, heads, q_len, own_values.shape[-1])
    out_own, lse_own = _CPU_FLASH(q_own, k_own, v_own, 0.0, True, scale=scale)
    out_own = out_own.transpose(0, 1).reshape(heads, group * q_len, -1)
    lse_own = lse_own.transpose(0, 1).reshape(heads, group * q_len)
    score_lse = lse_own if sub_lse is None else torch.logaddexp(sub_lse, lse_own)
    parts.append((out_own, lse_own))
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    if s_aux is not None:  # the sink: a logit without a value, in both normalizations
        sink = s_aux.to(f32).view(heads, group, 1).expand(heads, group, q_len)
        sink = sink.reshape(heads, group * q_len)
        total = torch.logaddexp(total, sink)
        score_lse = torch.logaddexp(score_lse, sink)
    out = sum(torch.exp(lse - total).unsqueeze(-1) * o for o, lse in parts)
    assert isinstance(out, Tensor)
    out = out.view(heads, group, q_len, -1).reshape(1, q_heads, q_len, -1).to(query.dtype)
    scores = torch.zeros(heads, slots + 1, dtype=f32, device=query.device)
    if k_sub.shape[1]:
        # logit - lse in one matmul: [scale * q, -lse] . [k, 1]
        q_aug = torch.cat([q * scale, -score_lse.unsqueeze(-1)], dim=-1).transpose(1, 2)
        k_aug = torch.cat([k_sub, k_sub.new_ones(heads, k_sub.shape[1], 1)], dim=-1)
        best = torch.full((heads, k_sub.shape[1]), float("-inf"), dtype=f32, device=q.device)
        rows = max(1, block_queries)
        for a in range(0, group * q_len, rows):
            logits = torch.bmm(k_aug, q_aug[:, :, a : a + rows])  # [H, n, rows]
            best = torch.maximum(best, logits.amax(dim=2))
        scores.scatter_(1, index, best.exp())
    scores = scores[:, :slots].masked_fill(~subset, 0.0)
    return out, scores.unsqueeze(0)


def reconstruction_attention_reference(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    own_keys: Tensor,
    own_values: Tensor,
    *,
    scale: float,
    score_columns: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    block_queries: int = 256,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The reference of :func:`reconstruction_attention` (same arguments and results), and
    its path for ``softcap`` and for tensors off the CPU: per block of ``block_queries``
    queries it materializes the logits ``[H, G, block, S + Q]`` over the cached slots and the
    own tokens, masks them and softmaxes them (twice with ``score_columns``: once over every
    allowed slot for ``out``, once over the score columns for ``scores``). Several passes over
    large tensors per block: slow on CPU, simple to check.

    Args:
        query, keys, values, valid, own_keys, own_values, scale, score_columns, softcap, s_aux:
            as :func:`reconstruction_attention`.
        block_queries: queries per block (bounds the logits held at once).
        compute_dtype: the dtype of the arithmetic (``torch.float64`` for a test's
            reference); ``scores`` come in it too.

    Returns:
        as :func:`reconstruction_attention`, computed (and ``scores`` given) in
        ``compute_dtype``.

    Raises:
        ValueError: shapes that do not fit together (``H_q`` not a multiple of ``H``).
    """
    _check_shapes(query, keys, values, valid, own_keys, own_values)
    _, q_heads, q_len, dim = query.shape
    heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    k_all = torch.cat([keys, own_keys], dim=2).to(compute_dtype)[0]  # [H, S + Q, D]
    v_all = torch.cat([values, own_values], dim=2).to(compute_dtype)[0]  # [H, S + Q, Dv]
    q = query.to(compute_dtype)[0].reshape(heads, group, q_len, dim)
    sinks = None if s_aux is None else s_aux.to(compute_dtype).view(heads, group, 1, 1)
    cached = valid[0].view(heads, 1, 1, slots)
    subset = None if score_columns is None else (score_columns[0] & valid[0])
    own_index = torch.arange(q_len, device=query.device)
    out = torch.empty(heads, group, q_len, v_all.shape[-1], dtype=compute_dtype, device=q.device)
    scores = torch.zeros(heads, slots, dtype=compute_dtype, device=q.device)
    for a in range(0, q_len, block_queries):
        b = min(a + block_queries, q_len)
        logits = torch.einsum("hgqd,hkd->hgqk", q[:, :, a:b], k_all) * scale
        logits = softcap_logits(logits, softcap)
        causal = own_index.view(1, -1) <= own_index[a:b].view(-1, 1)  # [b - a, Q]
        allowed = torch.cat(
            [
                cached.expand(heads, 1, b - a, slots),
                causal.view(1, 1, b - a, q_len).expand(heads, 1, -1, -1),
            ],
            dim=-1,
        )
        logits = logits.masked_fill(~allowed, float("-inf"))
        probs = softmax_with_sinks(logits, sinks)  # [H, G, b - a, S + Q]
        out[:, :, a:b] = torch.einsum("hgqk,hkd->hgqd", probs, v_all)
        if subset is not None:
            keep = torch.cat(
                [
                    subset.view(heads, 1, 1, slots).expand(heads, 1, b - a, slots),
                    causal.view(1, 1, b - a, q_len).expand(heads, 1, -1, -1),
                ],
                dim=-1,
            )
            probs = softmax_with_sinks(logits.masked_fill(~keep, float("-inf")), sinks)
            probs = probs[..., :slots].masked_fill(~subset.view(heads, 1, 1, slots), 0.0)
        block_max = probs[..., :slots].amax(dim=(1, 2))  # [H, S]
        scores = torch.maximum(scores, block_max)
    scores = scores.masked_fill(~valid[0], 0.0)
    out = out.reshape(1, q_heads, q_len, v_all.shape[-1]).to(query.dtype)
    return out, scores.unsqueeze(0)


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
