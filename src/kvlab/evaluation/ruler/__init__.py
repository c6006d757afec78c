"""RULER's synthetic tasks, generated offline (no model runs): samples split into a context
(compressed) and a question, fitted to a token length with the model's tokenizer, and RULER's
scoring.

Follows NVIDIA/RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv:2404.06654) ``scripts/data/synthetic/`` and
``scripts/synthetic.yaml``; the split follows kvpress's RULER dataset (query-agnostic
compression). The 11 synthetic tasks: ``niah_single_1..3``, ``niah_multikey_1..3``,
``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``. RULER's QA tasks
(``qa_1`` SQuAD, ``qa_2`` HotpotQA) are left out: they need those datasets downloaded.
The essay haystack is a public-domain text (the KJV Bible by default) instead of Paul Graham's
essays. docs/ruler.md describes the tasks and every difference from RULER.

* :mod:`.templates` — RULER's templates, answer prefixes, tokens to generate; the chat split.
* :mod:`.haystack` — noise/essay haystacks, RULER's depths, wonderwords lists.
* :mod:`.tasks` — :data:`TASKS`, the generators, :func:`generate_samples`.
* :mod:`.scoring` — postprocessing, ``string_match_all`` / ``string_match_part``.
* :mod:`.samples` — :class:`RulerSample`, JSONL io, :func:`samples_digest`.
"""

from __future__ import annotations

from kvlab.evaluation.ruler.samples import RulerSample, read_jsonl, samples_digest, write_jsonl
from kvlab.evaluation.ruler.scoring import (
    postprocess_prediction,
    score_answer,
    score_prediction,
    string_match_all,
    string_match_part,
)
from kvlab.evaluation.ruler.tasks import TASKS, TaskConfig, generate_samples

__all__ = [
    "TASKS",
    "RulerSample",
    "TaskConfig",
    "generate_samples",
    "postprocess_prediction",
    "read_jsonl",
    "samples_digest",
    "score_answer",
    "score_prediction",
    "string_match_all",
    "string_match_part",
    "write_jsonl",
]
