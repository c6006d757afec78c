"""The ``needle`` protocol: passkey retrieval through a KV cache.

A passkey — ``digits`` random decimal digits, drawn from a seeded generator — is hidden at a
depth of 0–100 % inside filler text, and the model is asked for it at the end (the passkey
retrieval test of Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300, as used by
the long-context evaluations of SnapKV, PyramidKV and the KV-quantization papers)::

    <PREFIX> filler[:i] <NEEDLE with the key> filler[i:] <QUESTION>

``length`` is the prompt's total token count; the filler is ``length`` minus the three fixed
parts, a contiguous run of the evaluation text's tokens starting at a seeded offset (the same
for every depth of one length and trial), and ``i = round(depth / 100 * filler_tokens)``.

The prompt goes through the method's cache in chunks of ``chunk`` tokens, as in the ``stream``
protocol (so an eviction method with a capacity keeps its cache, and with RoPE-Relay its
positions, bounded while the prompt runs past the model's context); then ``max_new_tokens``
tokens are decoded greedily, one at a time, through the same cache. The answer is correct when
the first run of digits in the decoded text equals the passkey (exact match).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NEEDLE",
    "PREFIX",
    "QUESTION",
    "NeedlePrompt",
    "answer_is_correct",
    "build_needle_prompt",
    "filler_offset",
    "make_passkey",
    "run_needle",
]

PREFIX = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def make_passkey(seed: int, length: int, depth: float, trial: int, digits: int = 5) -> str:
    """``digits`` decimal digits (first one nonzero) from :class:`random.Random` seeded with
    the string ``"passkey:<seed>:<length>:<depth>:<trial>"`` (string seeds hash with SHA-512:
    the same on every machine and process)."""
    rng = random.Random(f"passkey:{seed}:{length}:{depth:g}:{trial}")
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def filler_offset(seed: int, length: int, trial: int, text_tokens: int, filler: int) -> int:
    """Where the filler starts in the text's tokens (seeded; the same for every depth)."""
    rng = random.Random(f"filler:{seed}:{length}:{trial}")
    return rng.randint(0, text_tokens - filler)


@dataclass(frozen=True)
class NeedlePrompt:
    """A needle prompt.

    Attributes:
        tokens: the prompt's token ids (``length`` of them).
        passkey: the hidden digits.
        needle_start: token index where the needle text starts.
        filler_tokens: filler tokens around the needle.
    """

    tokens: tuple[int, ...]
    passkey: str
    needle_start: int
    filler_tokens: int


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def build_needle_prompt(
    tokenizer: Any,
    text_tokens: Sequence[int],
    *,
    length: int,
    depth: float,
    trial: int,
    seed: int,
    digits: int = 5,
) -> NeedlePrompt:
    """The needle prompt of one (length, depth, trial) cell (module docstring).

    Args:
        tokenizer: the model's tokenizer (``tokenizer(text)["input_ids"]``).
        text_tokens: the filler text's token ids.
        length: prompt tokens in all.
        depth: needle depth in percent of the filler, 0–100.

    Raises:
        ValueError: ``depth`` outside 0–100, ``length`` too short for the fixed parts, or a
            text with fewer tokens than the filler needs.
    """
    if not 0.0 <= depth <= 100.0:
        raise ValueError(f"needle depth must lie in 0..100 (percent), got {depth}")
    passkey = make_passkey(seed, length, depth, trial, digits)
    prefix = _encode(tokenizer, PREFIX)
    needle = _encode(tokenizer, NEEDLE.format(key=passkey))
    question = _encode(tokenizer, QUESTION)
    filler = length - len(prefix) - len(needle) - len(question)
    if filler < 0:
        raise ValueError(
            f"needle length {length} is shorter than the prompt's fixed parts "
            f"({length - filler} tokens)"
        )
    if filler > len(text_tokens):
        raise ValueError(
            f"the text has {len(text_tokens)} tokens; a needle prompt of {length} tokens needs "
            f"{filler} tokens of filler"
        )
    start = filler_offset(seed, length, trial, len(text_tokens), filler)
    body = list(text_tokens[start : start + filler])
    cut = round(depth / 100.0 * filler)
    tokens = prefix + body[:cut] + needle + body[cut:] + question
    return NeedlePrompt(tuple(tokens), passkey, len(prefix) + cut, filler)


def answer_is_correct(answer: str, passkey: str) -> bool:
    """Exact match: the first run of digits in ``answer`` equals ``passkey``."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group(0) == passkey


def run_needle(
    model: Any,
    tokenizer: Any,
    tokens: Sequence[int],
    method: Any,
    *,
    passkey: str,
    chunk: int,
    max_new_tokens: int,
    prepared: Mapping[str, Any] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Feed a needle prompt through ``method``'s cache in chunks, decode greedily, score.

    Returns:
        JSON-ready ``{"answer", "correct", "generated_tokens", "final_position",
        "peak_kv_bytes", "peak_kv_bytes_16bit", "model_seconds", "details"}``.

    Raises:
        ValueError: ``chunk < 1``, ``max_new_tokens < 1`` or an empty prompt.
    """
    import torch

    from kvlab.evaluation.metrics import CacheStorage, cache_storage
    from kvlab.evaluation.protocols import (  # the stream protocol's position handling
        accepts_keyword,
        cache_details,
        cache_keyword,
        position_kwargs,
        rope_position_of,
    )
    from kvlab.integrations.attention import use_attention

    if chunk < 1 or max_new_tokens < 1 or not tokens:
        raise ValueError("run_needle needs chunk >= 1, max_new_tokens >= 1 and a prompt")
    device = next(model.parameters()).device
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=device)
    cache = method.make_cache(model.config, prepared)
    key = cache_keyword(model)
    extra = {"logits_to_keep": 1} if accepts_keyword(model, "logits_to_keep") else {}
    seconds = 0.0
    peak = CacheStorage(0, 0, 0)
    generated: list[int] = []
    with torch.no_grad(), use_attention(model, method.attention):
        for start in range(0, ids.numel(), chunk):
            piece = ids[start : start + chunk]
            began = time.perf_counter()
            out = model(
                piece.view(1, -1),
                use_cache=True,
                **{key: cache},
                **extra,
                **position_kwargs(cache, piece.numel()),
            )
            seconds += time.perf_counter() - began
            storage = cache_storage(cache)
            if storage.kv_bytes > peak.kv_bytes:
                peak = storage
            if on_tokens is not None:
                on_tokens(piece.numel())
        for step in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            if step + 1 == max_new_tokens:
                break
            began = time.perf_counter()
            out = model(
                torch.tensor([[token]], device=device),
                use_cache=True,
                **{key: cache},
                **extra,
                **position_kwargs(cache, 1),
            )
            seconds += time.perf_counter() - began
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "answer": answer,
        "correct": answer_is_correct(answer, passkey),
        "generated_tokens": generated,
        "final_position": rope_position_of(cache),
        "peak_kv_bytes": peak.kv_bytes,
        "peak_kv_bytes_16bit": peak.kv_bytes_16bit,
        "model_seconds": seconds,
        "details": cache_details(cache),
    }
