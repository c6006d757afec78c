"""RULER's scoring: prediction postprocessing and the two string-match metrics.

Sources: NVIDIA/RULER ``scripts/eval/evaluate.py`` (``postprocess_pred``) and
``scripts/eval/synthetic/constants.py`` (``string_match_all`` for niah, variable_tracking,
common_words_extraction and freq_words_extraction; ``string_match_part`` for qa). For references
``refs`` of one sample and its postprocessed prediction ``pred``:

* ``all``:  ``sum(r.lower() in pred.lower() for r in refs) / len(refs)`` — the fraction of the
  references found (case-insensitive substring);
* ``part``: ``max(r.lower() in pred.lower() for r in refs)`` — 1 if any reference is found.

:func:`score_prediction` returns that per-sample value as a fraction in [0, 1];
:func:`string_match_all` / :func:`string_match_part` return RULER's task score, the mean over
samples times 100 rounded to 2 decimals (a percentage), as RULER prints it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvlab.evaluation.ruler.samples import METRICS, RulerSample

__all__ = [
    "match_all",
    "match_part",
    "postprocess_prediction",
    "score_answer",
    "score_prediction",
    "string_match_all",
    "string_match_part",
]

_NON_PRINTABLE = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    """RULER ``postprocess_pred``: strip, replace every character ``\\x00``-``\\x1f`` (newlines
    and tabs included) by ``"\\n"``, strip again."""
    return _NON_PRINTABLE.sub("\n", prediction.strip()).strip()


def match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` that occur in ``prediction`` (case-insensitive substring),
    on the raw prediction (no postprocessing).

    Raises:
        ValueError: no reference.
    """
    if not references:
        raise ValueError("RULER scoring needs at least one reference")
    pred = prediction.lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` occurs in ``prediction`` (case-insensitive substring), else
    0.0, on the raw prediction.

    Raises:
        ValueError: no reference.
    """
    if not references:
        raise ValueError("RULER scoring needs at least one reference")
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


def score_answer(prediction: str, outputs: Sequence[str], metric: str) -> float:
    """A prediction's RULER score in [0, 1]: ``metric`` (``"all"``: the fraction of
    ``outputs`` found; ``"part"``: whether any is) on the postprocessed prediction.

    Raises:
        ValueError: an unknown metric or no reference.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown RULER metric {metric!r}; known: {METRICS}")
    fn = match_all if metric == "all" else match_part
    return fn(postprocess_prediction(prediction), outputs)


def score_prediction(prediction: str, sample: RulerSample) -> float:
    """The sample's RULER score in [0, 1]: :func:`score_answer` with the sample's metric and
    references.

    Raises:
        ValueError: an unknown metric or no reference.
    """
    return score_answer(prediction, sample.outputs, sample.metric)


def _task_score(fn, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:  # type: ignore[no-untyped-def]
    if not preds or len(preds) != len(refs):
        raise ValueError(
            f"RULER task scores need as many predictions as references (>= 1), got "
            f"{len(preds)} and {len(refs)}"
        )
    return round(sum(fn(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds) * 100, 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER ``string_match_all``: mean of :func:`match_all` over samples x 100, rounded to 2
    decimals (predictions taken as given: postprocess them first, as RULER's evaluate.py does).

    Raises:
        ValueError: empty or mismatched lists, or a sample without references.
    """
    return _task_score(match_all, preds, refs)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER ``string_match_part``: mean of :func:`match_part` over samples x 100, rounded to
    2 decimals.

    Raises:
        ValueError: empty or mismatched lists, or a sample without references.
    """
    return _task_score(match_part, preds, refs)
