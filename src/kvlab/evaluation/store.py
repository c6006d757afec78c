"""The task store: one sealed JSON file per finished task, ``<folder>/<key>.json``.

Each file is ``{"key", "task", "result", "content_sha256"}`` (:mod:`kvlab.evaluation.runfiles`:
the task's record, its JSON-ready result, the checksum of both), written atomically
(:func:`kvlab.artifacts.write_json_atomic`) as soon as the task finishes, so a rerun skips every
task whose file is there (resumable runs; an interrupted run loses at most the tasks that were
running). A file that is there but damaged — not JSON, a checksum that does not match, a result
its protocol's schema refuses (a missing ``kl``), the key or protocol of another task, a score
of another length — is reported (a warning naming the file) and its task runs again.

A prefill-score ``full`` task's result holds no log-probabilities (``[score, vocab]`` float32:
tens of MB per window, for the KL of its window's other tasks). While some of those tasks are
still to run, the store keeps them beside the task file, ``<key>.logprobs.safetensors``
(safetensors: the float32 ``[S, V]`` tensor ``logprobs``; metadata ``key``, ``shape``,
``content_sha256`` = sha256 of the tensor's bytes), so a run interrupted after the ``full``
task resumes without running it again; the executor deletes the file once the last of those
tasks is stored. One that is damaged (unreadable, another key, a checksum that does not match)
is reported like a damaged task file, and the ``full`` task runs again for them.

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
    from torch import Tensor

    from kvlab.evaluation.plan import Task

__all__ = ["LOGPROBS_SUFFIX", "TaskStore", "result_problem"]


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


#: The suffix of a kept log-probabilities file (module docstring), and its format tag.
LOGPROBS_SUFFIX = ".logprobs.safetensors"
LOGPROBS_FORMAT = "kvlab-logprobs-1"


def _tensor_sha256(tensor: Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.contiguous().view(-1).numpy().data).hexdigest()


def _read_logprobs(path: Path, key: str) -> Tensor:
    """The tensor of a log-probabilities file, checked (module docstring).

    Raises:
        DamagedRunFile: unreadable, another format or key, or a checksum that does not match.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = list(handle.keys())
            tensor = handle.get_tensor("logprobs") if names == ["logprobs"] else None
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise DamagedRunFile(path, f"not a readable safetensors file ({exc})") from None
    if metadata.get("format") != LOGPROBS_FORMAT or tensor is None:
        raise DamagedRunFile(path, f"not a {LOGPROBS_FORMAT} file")
    if metadata.get("key") != key:
        held = str(metadata.get("key"))[:12]
        raise DamagedRunFile(path, f"it holds task {held}..., not {key[:12]}...")
    if tensor.dtype != torch.float32 or tensor.dim() != 2:
        raise DamagedRunFile(path, f"a {tensor.dtype} {tuple(tensor.shape)} tensor")
    if metadata.get("content_sha256") != _tensor_sha256(tensor):
        raise DamagedRunFile(path, "its content does not match its content_sha256")
    return tensor


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

    def logprobs_path(self, key: str) -> Path:
        """Where the log-probabilities of ``full`` task ``key`` are kept (module docstring)."""
        if self.folder is None:
            raise ValueError("this task store keeps nothing on disk")
        return self.folder / f"{key}{LOGPROBS_SUFFIX}"

    def has_logprobs(self, key: str) -> bool:
        """Whether a log-probabilities file of ``key`` is there (sound or not)."""
        return self.folder is not None and self.logprobs_path(key).is_file()

    def save_logprobs(self, key: str, logprobs: Tensor) -> None:
        """Keep ``logprobs`` (float32 ``[S, V]``) of ``full`` task ``key``, atomically (no-op
        without a folder)."""
        if self.folder is None:
            return
        import os
        import tempfile

        from safetensors.torch import save_file

        tensor = logprobs.detach().to("cpu", copy=False).contiguous()
        metadata = {
            "format": LOGPROBS_FORMAT,
            "key": key,
            "shape": ",".join(map(str, tensor.shape)),
            "content_sha256": _tensor_sha256(tensor),
        }
        path = self.logprobs_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file({"logprobs": tensor}, staging, metadata=metadata)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise

    def load_logprobs(self, key: str) -> Tensor | None:
        """The kept log-probabilities of ``full`` task ``key``, or ``None`` when there are none
        or their file is damaged (then a warning names it)."""
        if not self.has_logprobs(key):
            return None
        path = self.logprobs_path(key)
        try:
            return _read_logprobs(path, key)
        except DamagedRunFile as damaged:
            self.damaged.append(damaged)
            warn_damaged(damaged, "log-probabilities file", self.warn)
            return None

    def drop_logprobs(self, key: str) -> None:
        """Delete the log-probabilities file of ``key``, if any (its users are all stored)."""
        if self.folder is not None:
            self.logprobs_path(key).unlink(missing_ok=True)

    def save(self, task: Task, result: Mapping[str, Any]) -> None:
        """Write ``task``'s result, sealed, atomically (no-op without a folder)."""
        if self.folder is not None:
            document = {"key": task.key, "task": task.record(), "result": dict(result)}
            write_json_atomic(self.path(task.key), seal(document))
