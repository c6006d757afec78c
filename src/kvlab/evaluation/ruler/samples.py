"""One RULER sample, its JSONL form and a digest for pairing samples across tools."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["METRICS", "RulerSample", "read_jsonl", "samples_digest", "write_jsonl"]

#: RULER's metrics by sample field value: ``"all"`` = ``string_match_all``, ``"part"`` =
#: ``string_match_part`` (:mod:`kvlab.evaluation.ruler.scoring`).
METRICS = ("all", "part")


@dataclass(frozen=True)
class RulerSample:
    """One RULER prompt, split for query-agnostic compression.

    Attributes:
        task: the task name (a key of :data:`kvlab.evaluation.ruler.TASKS`).
        length: the token budget it was fitted to: ``len(context_ids) + len(question_ids) +
            max_new_tokens <= length``.
        index: the sample's number within (task, length, seed).
        seed: the seed it was drawn with.
        context: what gets compressed: the chat template's prefix (or BOS text), the task
            instruction and the haystack, everything before the question text.
        question: the rest: the question text, the chat template's assistant opening (chat) and
            the answer prefix.
        context_ids / question_ids: ``context`` / ``question`` tokenized separately with
            ``add_special_tokens=False`` (so a BOS token appears once, in the context).
        outputs: the reference answers.
        max_new_tokens: RULER's ``tokens_to_generate`` for the task.
        metric: ``"all"`` (string_match_all) or ``"part"`` (string_match_part).
    """

    task: str
    length: int
    index: int
    seed: int
    context: str
    question: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    outputs: tuple[str, ...]
    max_new_tokens: int
    metric: str

    @property
    def prompt_tokens(self) -> int:
        """``len(context_ids) + len(question_ids)``."""
        return len(self.context_ids) + len(self.question_ids)

    def to_json(self) -> dict[str, Any]:
        """Every field; tuples as lists."""
        out = asdict(self)
        for name in ("context_ids", "question_ids", "outputs"):
            out[name] = list(out[name])
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RulerSample:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: a field is missing or unknown, or has the wrong type.
        """
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a RULER sample needs exactly the fields {names}, got {got}")
        try:
            sample = cls(
                task=_typed(data["task"], str),
                length=_typed(data["length"], int),
                index=_typed(data["index"], int),
                seed=_typed(data["seed"], int),
                context=_typed(data["context"], str),
                question=_typed(data["question"], str),
                context_ids=tuple(_typed(i, int) for i in _typed(data["context_ids"], list)),
                question_ids=tuple(_typed(i, int) for i in _typed(data["question_ids"], list)),
                outputs=tuple(_typed(o, str) for o in _typed(data["outputs"], list)),
                max_new_tokens=_typed(data["max_new_tokens"], int),
                metric=_typed(data["metric"], str),
            )
        except TypeError as err:
            raise ValueError(f"bad RULER sample: {err}") from None
        if sample.metric not in METRICS:
            raise ValueError(f"a RULER sample's metric is one of {METRICS}, got {sample.metric!r}")
        return sample


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {value!r:.40}")
    return value


def write_jsonl(path: str | Path, samples: Iterable[RulerSample]) -> Path:
    """Write one JSON object (:meth:`RulerSample.to_json`) a line, UTF-8; returns the path.
    The file is written whole to a temporary name, then renamed over ``path``."""
    path = Path(path)
    lines = [json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in samples]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> list[RulerSample]:
    """The samples of a file written by :func:`write_jsonl` (blank lines skipped).

    Raises:
        ValueError: a line is not JSON or not a sample (the message gives the line number).
    """
    out = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                out.append(RulerSample.from_json(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as err:
                raise ValueError(f"{path}:{number}: {err}") from None
    return out


def samples_digest(samples: Sequence[RulerSample]) -> str:
    """Hex sha256 over the samples' ``context_ids``, ``question_ids`` and ``outputs``, in order
    (canonical JSON, one list per sample): two tools that hold the same digest feed the same
    tokens and score against the same references."""
    payload = [[list(s.context_ids), list(s.question_ids), list(s.outputs)] for s in samples]
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
