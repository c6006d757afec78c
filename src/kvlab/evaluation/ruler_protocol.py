"""The ``ruler`` protocol of ``kvlab eval``: RULER's synthetic tasks
(:mod:`kvlab.evaluation.ruler`, generated offline), each sample's context compressed once per
method and its question answered by greedy decoding (:mod:`kvlab.evaluation.questions`:
query-agnostic, the shape of kvpress's RULER leaderboard), scored by RULER's string match.

Planning (:func:`ruler_units`): for every length, task and sample index, the sample's token ids
(context then question) and the unit that decides the result: the task, the context's token
count, the references, RULER's ``tokens_to_generate`` and the stop tokens. Execution
(:func:`run_ruler_task`): with ``shared_prefill`` (the default) the context's prefill is
captured once per sample and process (:func:`kvlab.integrations.prefill_replay.capture_prefill`,
under ``sdpa``) and replayed into every method's cache; the ``full`` method answers on the
capture's own cache. Reporting: :mod:`kvlab.evaluation.ruler_report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CAPTURE_ATTENTION", "ruler_units", "run_ruler_task", "stop_token_ids"]

#: The attention implementation a shared prefill is captured under (the ``full`` method's).
CAPTURE_ATTENTION = "sdpa"

#: End-of-turn tokens of chat templates (Qwen/ChatML, Gemma, Llama 3): a stop token when the
#: tokenizer knows it.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The token ids that end an answer: the tokenizer's EOS and every end-of-turn token of
    :data:`_END_OF_TURN` its vocabulary has (sorted, distinct)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in _END_OF_TURN:
        if token in vocab:
            ids.add(int(vocab[token]))
    return sorted(ids)


def ruler_units(
    tokenizer: Any,
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int,
    seed: int,
    haystack_text: str | None,
    chat: bool | None,
    shared_prefill: bool,
) -> list[tuple[dict[str, Any], dict[str, Any], list[int]]]:
    """``(unit, where, token_ids)`` of every sample (module docstring), lengths outermost,
    then tasks, then sample indices.

    Args:
        tasks: RULER task names (:data:`kvlab.evaluation.ruler.TASKS`); empty: all of them.
        lengths: total token budgets (prompt plus ``tokens_to_generate``).
        samples: samples per task and length.
        chat: render with the tokenizer's chat template (``None``: when it has one).

    Raises:
        ValueError: an unknown task, or a length too short for a task (from the generator).
    """
    from kvlab.evaluation.ruler import TASKS, generate_samples

    names = list(tasks) or list(TASKS)
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(
            f"unknown RULER task(s) {unknown}; known: {', '.join(TASKS)} (RULER's QA tasks "
            "need the SQuAD / HotpotQA data and are not generated)"
        )
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    stops = stop_token_ids(tokenizer)
    units = []
    for length in lengths:
        for name in names:
            for sample in generate_samples(
                name,
                length,
                samples,
                seed,
                tokenizer,
                haystack_text=haystack_text,
                chat=use_chat,
            ):
                unit = {
                    "task": name,
                    "length": length,
                    "seed": seed,
                    "chat": use_chat,
                    "context_tokens": len(sample.context_ids),
                    "outputs": list(sample.outputs),
                    "metric": sample.metric,
                    "max_new_tokens": sample.max_new_tokens,
                    "stop_token_ids": stops,
                    "shared_prefill": shared_prefill,
                }
                where = {"task": name, "length": length, "index": sample.index}
                units.append((unit, where, [*sample.context_ids, *sample.question_ids]))
    return units


def run_ruler_task(
    model: Any,
    tokenizer: Any,
    tokens: Any,
    method: Any,
    unit: Mapping[str, Any],
    *,
    prepared: Mapping[str, Any] | None = None,
    capture: Any = None,
) -> dict[str, Any]:
    """Compress the context of one sample with ``method``, answer its question, score it.

    Args:
        tokens: int64 ``[T]`` context then question ids, on the model's device.
        unit: the task's unit (:func:`ruler_units`).
        capture: the context's :class:`~kvlab.integrations.prefill_replay.PrefillCapture` to
            replay (``None``: the method's own prefill).

    Returns:
        JSON-ready: ``prediction`` (decoded, special tokens skipped), ``generated_tokens``,
        ``score`` (RULER string match in [0, 1]), ``stopped``, ``storage`` (bytes after the
        compression) and ``storage_final``, ``compress_seconds``, ``answer_seconds``,
        ``replayed``, ``details``.
    """
    from kvlab.evaluation.metrics import storage_record
    from kvlab.evaluation.questions import answer, compress_context
    from kvlab.evaluation.ruler import score_answer

    split = int(unit["context_tokens"])
    context = tokens[:split].view(1, -1)
    question = tokens[split:].view(1, -1)
    compressed = compress_context(model, context, method, prepared=prepared, capture=capture)
    reply = answer(
        model,
        compressed,
        question,
        max_new_tokens=int(unit["max_new_tokens"]),
        stop_token_ids=unit["stop_token_ids"],
        copy_cache=False,
    )
    stops = set(unit["stop_token_ids"])
    generated = [t for t in reply.tokens if t not in stops]
    prediction = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "prediction": prediction,
        "generated_tokens": reply.tokens,
        "score": float(score_answer(prediction, list(unit["outputs"]), unit["metric"])),
        "stopped": reply.stopped,
        "storage": storage_record(compressed.storage),
        "storage_final": storage_record(reply.storage),
        "compress_seconds": compressed.seconds,
        "answer_seconds": reply.seconds,
        "model_seconds": compressed.seconds + reply.seconds,
        "replayed": compressed.replayed,
        "details": compressed.details,
    }
