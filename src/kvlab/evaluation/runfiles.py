"""Run files: the JSON files kvlab writes and later reads back as inputs — a task's result
(``<output-dir>/tasks/<key>.json``, :class:`~kvlab.evaluation.store.TaskStore`) and a
calibration entry (``<calibration cache>/<key>.json``, :mod:`kvlab.evaluation.calibration`).

Each is written *sealed* (:func:`seal`): the document plus ``content_sha256``, the sha256 of
the canonical JSON (:func:`kvlab.evaluation.fingerprint.canonical_json`: sorted keys, no
white space) of everything else in it. Reading one back (:func:`read_sealed`) checks, in order:
it parses as a JSON object; its ``content_sha256``, when present, matches its content (so an
edit, even to a value that stays in range, is caught; white space is not content); it
validates against its schema (:class:`StoredTask` with the result schema of its protocol,
:class:`CalibrationEntry`). A file that fails any check is *damaged*: :class:`DamagedRunFile`
names the file and the reason, and the caller recomputes what it held, with a warning — a
damaged file is never used and never ends a run with a bare key error.

Files written before the checksum existed have no ``content_sha256``. A task file without one
is accepted when it validates (committed run folders hold such files, and later runs resume
from them); a calibration entry without one is recomputed (``require_checksum``): the
calibration cache is a cache, and a silently edited entry is how a calibration "for another
model" reached a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvlab.artifacts.io import read_json
from kvlab.evaluation.fingerprint import content_hash

__all__ = [
    "CHECKSUM_FIELD",
    "RESULT_SCHEMAS",
    "CalibrationEntry",
    "DamagedRunFile",
    "DamagedRunFileWarning",
    "StoredTask",
    "as_read_back",
    "read_sealed",
    "seal",
    "warn_damaged",
]

#: The field a sealed file keeps its checksum in.
CHECKSUM_FIELD = "content_sha256"

_HEX64 = r"^[0-9a-f]{64}$"


class DamagedRunFile(ValueError):
    """A run file that exists but cannot be used: ``path`` (shown whole: it is the file to
    look at) and ``reason`` (one line)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class DamagedRunFileWarning(UserWarning):
    """Issued (:func:`warn_damaged`) when a damaged run file is set aside and recomputed."""


def warn_damaged(
    damaged: DamagedRunFile, what: str, warn: Callable[[str], None] | None = None
) -> None:
    """Say that ``damaged`` is recomputed: ``warn(line)``, or :func:`warnings.warn` with
    :class:`DamagedRunFileWarning` when ``warn`` is ``None``. ``what`` names the file's kind
    (``"task file"``, ``"calibration entry"``)."""
    line = f"{what} {damaged}; recomputing it (the damaged file is replaced)"
    if warn is not None:
        warn(line)
        return
    import warnings

    warnings.warn(line, DamagedRunFileWarning, stacklevel=3)


def as_read_back(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` as it reads back from its JSON file (tuples become lists, keys strings):
    what a stored document is compared with.

    Raises:
        ValueError: a non-finite float.
        TypeError: not JSON-serializable.
    """
    return json.loads(json.dumps(dict(document), allow_nan=False))


def seal(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` (a JSON-ready mapping without :data:`CHECKSUM_FIELD`) with its checksum
    added (module docstring), ready for :func:`kvlab.artifacts.write_json_atomic`.

    Raises:
        ValueError: ``document`` already has the field, or holds a non-finite float.
        TypeError: ``document`` is not JSON-serializable.
    """
    if CHECKSUM_FIELD in document:
        raise ValueError(f"the document already has {CHECKSUM_FIELD!r}")
    normal = as_read_back(document)
    return {**normal, CHECKSUM_FIELD: content_hash(normal)}


# --- schemas --------------------------------------------------------------------------------


class _Schema(BaseModel):
    """Fields a reader needs; more may be present (a newer kvlab may record more)."""

    model_config = ConfigDict(extra="allow", strict=False)


class Storage(_Schema):
    """Byte counts of a cache (:func:`kvlab.evaluation.metrics.storage_record`)."""

    kv_bytes: int = Field(ge=0)
    kv_bytes_16bit: int = Field(ge=0)
    index_bytes: int = Field(default=0, ge=0)
    held_bytes: int | None = None
    layer_kinds: dict[str, dict[str, int]] | None = None


class _Result(_Schema):
    """What every protocol's task result holds (:meth:`kvlab.evaluation.execute.Runtime.run`)."""

    model_seconds: float
    details: dict[str, Any]
    context: int
    model_load_seconds: float | None = None
    worker_pid: int | None = None
    prepared: dict[str, Any] | None = None


class PrefillScoreResult(_Result):
    nll: list[float] = Field(min_length=1)
    kl: list[float] = Field(min_length=1)
    storage_prefill: Storage
    storage_final: Storage


class StreamResult(_Result):
    nll: list[float] = Field(min_length=1)
    peak_storage: Storage
    final_storage: Storage
    final_position: int


class NeedleResult(_Result):
    answer: str
    correct: bool
    generated_tokens: list[int]
    final_position: int
    peak_kv_bytes: int = Field(ge=0)
    peak_kv_bytes_16bit: int = Field(ge=0)


class RulerResult(_Result):
    prediction: str
    generated_tokens: list[int]
    score: float
    stopped: bool
    storage: Storage
    storage_final: Storage
    compress_seconds: float
    answer_seconds: float
    replayed: bool
    capture_seconds: float = 0.0


#: The result schema of each protocol.
RESULT_SCHEMAS: dict[str, type[_Result]] = {
    "prefill-score": PrefillScoreResult,
    "stream": StreamResult,
    "needle": NeedleResult,
    "ruler": RulerResult,
}


class StoredTask(_Schema):
    """A task file: its key, the task's record (:meth:`~kvlab.evaluation.plan.Task.record`)
    and its result (checked against :data:`RESULT_SCHEMAS` by the reader, which knows the
    protocol)."""

    key: str = Field(pattern=_HEX64)
    task: dict[str, Any]
    result: dict[str, Any]


class CalibrationEntry(_Schema):
    """A calibration entry: the fields its key hashes
    (:func:`~kvlab.evaluation.calibration.calibration_key`) and the prepared state."""

    key: dict[str, Any]
    prepared: dict[str, Any]


def _problem(error: ValidationError) -> str:
    """The first validation problem as ``result.kl: Field required``."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def read_sealed(
    path: Path,
    schema: type[BaseModel],
    *,
    require_checksum: bool,
    check: Callable[[dict[str, Any]], str | None] | None = None,
) -> dict[str, Any] | None:
    """The document at ``path`` when it is sound (module docstring), ``None`` when there is no
    file.

    Args:
        schema: the pydantic model the document must validate against.
        require_checksum: a document without :data:`CHECKSUM_FIELD` is damaged.
        check: ``check(document) -> problem or None`` after the schema (e.g. the key).

    Returns:
        The document as read (with its checksum field), or ``None``.

    Raises:
        DamagedRunFile: the file exists and fails a check (the reason says which).
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        document = read_json(path)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise DamagedRunFile(path, f"not readable as JSON ({exc})") from None
    if not isinstance(document, dict):
        raise DamagedRunFile(path, f"a JSON {type(document).__name__}, not an object")
    content = {k: v for k, v in document.items() if k != CHECKSUM_FIELD}
    if CHECKSUM_FIELD in document:
        try:
            digest = content_hash(content)
        except ValueError:  # a NaN or Infinity typed in
            digest = None
        if document[CHECKSUM_FIELD] != digest:
            raise DamagedRunFile(
                path, "its content does not match its content_sha256 (edited or damaged)"
            )
    elif require_checksum:
        raise DamagedRunFile(path, "no content_sha256 (written before kvlab sealed these files)")
    try:
        schema.model_validate(content)
    except ValidationError as exc:
        raise DamagedRunFile(path, f"not a valid {schema.__name__}: {_problem(exc)}") from None
    problem = check(content) if check is not None else None
    if problem is not None:
        raise DamagedRunFile(path, problem)
    return document
