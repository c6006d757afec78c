"""The task store: one sealed JSON file per finished task, ``<folder>/<key>.json``.

Each file is ``{"key", "task", "result", "content_sha256"}`` (:mod:`kvlab.evaluation.runfiles`:
the task's record, its JSON-ready result, the checksum of both), written atomically
(:func:`kvlab.artifacts.write_json_atomic`) as soon as the task finishes, so a rerun skips every
task whose file is there (resumable runs; an interrupted run loses at most the tasks that were
running). A file that is there but damaged — not JSON, a checksum that does not match, a result
its protocol's schema refuses (a missing ``kl``), the key or protocol of another task, a score
of another length — is reported (a warning naming the file) and its task runs again.

Not listed in :data:`kvlab.evaluation.plan.RESULT_MODULES`: how results are kept does not
decide them, so editing this module keeps every task key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.artifacts.io import write_json_atomic
from kvlab.evaluation.runfiles import (
    RESULT_SCHEMAS,
    DamagedRunFile,
    StoredTask,
    read_sealed,
    seal,
    warn_damaged,
)
from kvlab.userinput import quote

if TYPE_CHECKING:
    from kvlab.evaluation.plan import Task

__all__ = ["TaskStore", "result_problem"]


def result_problem(protocol: str, result: Any) -> str | None:
    """Why ``result`` is not a result of ``protocol`` (its schema,
    :data:`~kvlab.evaluation.runfiles.RESULT_SCHEMAS`), or ``None`` when it is one.

    Raises:
        KeyError: an unknown protocol.
    """
    from pydantic import ValidationError

    try:
        RESULT_SCHEMAS[protocol].model_validate(result)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in ("result", *first["loc"]))
        return f"its result is not a {protocol} result: {where}: {first['msg']}"
    return None


def _task_problem(task: Task, document: Mapping[str, Any]) -> str | None:
    """What makes a stored document, schema-valid as a :class:`StoredTask`, unusable as the
    result of ``task``; ``None`` when nothing does."""
    if document["key"] != task.key:
        return f"it holds task {document['key'][:12]}..., not {task.key[:12]}..."
    protocol = document["task"].get("protocol")
    if protocol != task.protocol:
        return f"it holds a {quote(protocol)} task, not a {task.protocol!r} one"
    problem = result_problem(task.protocol, document["result"])
    if problem is None and task.protocol == "prefill-score":
        score = int(task.unit["score"])
        lengths = {len(document["result"]["nll"]), len(document["result"]["kl"])}
        if lengths != {score}:
            problem = f"its result scores {sorted(lengths)} tokens, not {score}"
    return problem


class TaskStore:
    """Finished task results, one sealed JSON file per task key (module docstring).

    Args:
        folder: where the files live, or ``None`` to keep nothing on disk.
        warn: receives one line per damaged file set aside (default: :func:`warnings.warn`
            with :class:`~kvlab.evaluation.runfiles.DamagedRunFileWarning`).
    """

    def __init__(self, folder: Path | None, warn: Callable[[str], None] | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self.warn = warn
        #: the damaged files :meth:`load` set aside, in order
        self.damaged: list[DamagedRunFile] = []

    def path(self, key: str) -> Path:
        if self.folder is None:
            raise ValueError("this task store keeps nothing on disk")
        return self.folder / f"{key}.json"

    def load(self, task: Task) -> dict[str, Any] | None:
        """The stored result of ``task``, or ``None`` when there is none or its file is
        damaged (then a warning names the file, and the rerun replaces it)."""
        if self.folder is None:
            return None
        try:
            document = read_sealed(
                self.path(task.key),
                StoredTask,
                require_checksum=False,
                check=lambda document: _task_problem(task, document),
            )
        except DamagedRunFile as damaged:
            self.damaged.append(damaged)
            warn_damaged(damaged, "task file", self.warn)
            return None
        return None if document is None else document["result"]

    def save(self, task: Task, result: Mapping[str, Any]) -> None:
        """Write ``task``'s result, sealed, atomically (no-op without a folder)."""
        if self.folder is not None:
            document = {"key": task.key, "task": task.record(), "result": dict(result)}
            write_json_atomic(self.path(task.key), seal(document))
