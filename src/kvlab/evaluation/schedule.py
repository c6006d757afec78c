"""The schedule of a run: which jobs still have to run, in plan order, and when each is ready.

Preparations come first; a prefill-score method task is ready once the ``full`` task of its
window has produced its log-probabilities (its reference, kept in memory only until the
window's last pending task finished). A ``full`` task that a previous run stored, whose
window still has pending tasks, gives its log-probabilities one of two ways:

* *load* — the task store kept them (``<key>.logprobs.safetensors``,
  :mod:`kvlab.evaluation.store`): the executor reads the file; nothing is computed, and the
  job is not counted as one to run;
* *rerun* — no sound file (a run from before the store kept them, or a damaged file): the
  ``full`` task runs again for them, its stored result kept; the plan line says so, and the
  progress bar counts it.

Not listed in :data:`kvlab.evaluation.plan.RESULT_MODULES` (scheduling does not decide a
result): editing it keeps every task key.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.evaluation.plan import Plan, PrepTask, Task

__all__ = ["Job", "Schedule"]


@dataclass
class Job:
    """One unit of work of a :class:`Schedule`.

    Attributes:
        item: the :class:`PrepTask` or :class:`Task`.
        store: write the result to the store (``False`` for a stored ``full`` task whose
            log-probabilities are loaded or recomputed).
        keep_logprobs: keep its log-probabilities for dependents.
        load_logprobs: read its log-probabilities from the task store instead of running it
            (module docstring); when that fails, the executor runs it (a rerun).
    """

    item: PrepTask | Task
    store: bool = True
    keep_logprobs: bool = False
    load_logprobs: bool = False

    @property
    def key(self) -> str:
        return self.item.key

    @property
    def label(self) -> str:
        return self.item.label

    @property
    def computes(self) -> bool:
        """Whether the job runs a model (all but a load)."""
        return not self.load_logprobs


@dataclass
class Schedule:
    """The jobs a plan still needs, in order, and their readiness (module docstring).

    Args:
        plan: the plan.
        stored: results already available, by task key (a previous run's).
        kept_logprobs: keys of stored ``full`` tasks whose log-probabilities the task store
            has a file of.
    """

    plan: Plan
    stored: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    kept_logprobs: Collection[str] = ()

    def __post_init__(self) -> None:
        unique: dict[str, Task] = {}
        for task in self.plan.tasks:
            unique.setdefault(task.key, task)
        self.results: dict[str, dict[str, Any]] = dict(self.stored)
        pending = [t for t in unique.values() if t.key not in self.results]
        references = {t.reference for t in pending if t.reference is not None}
        preparations = {t.preparation for t in pending if t.preparation is not None}
        self.jobs: list[Job] = [Job(p) for p in self.plan.preparations if p.key in preparations]
        for task in unique.values():
            if task.key not in self.results:
                self.jobs.append(Job(task, store=True, keep_logprobs=task.key in references))
            elif task.key in references:
                load = task.key in self.kept_logprobs
                self.jobs.append(Job(task, store=False, keep_logprobs=True, load_logprobs=load))
        self.users: dict[str, int] = {}
        for task in pending:
            if task.reference is not None:
                self.users[task.reference] = self.users.get(task.reference, 0) + 1
        self.prepared: dict[str, dict[str, Any]] = {}
        self.logprobs: dict[str, Any] = {}
        self.finished: set[int] = set()
        self.skipped = len(unique) - len(pending)

    @property
    def total_tasks(self) -> int:
        return len({t.key for t in self.plan.tasks})

    @property
    def reruns(self) -> int:
        """Stored ``full`` tasks run again for their log-probabilities (no file kept)."""
        return sum(1 for j in self.jobs if isinstance(j.item, Task) and not j.store and j.computes)

    @property
    def loads(self) -> int:
        """Stored ``full`` tasks whose log-probabilities are read from the task store."""
        return sum(1 for j in self.jobs if j.load_logprobs)

    @property
    def computing_jobs(self) -> int:
        """Jobs that run a model: preparations, tasks to run, reruns (the progress bar's
        total)."""
        return sum(1 for j in self.jobs if j.computes)

    def unneeded_logprobs(self) -> list[str]:
        """Keys of the plan's ``full`` tasks no pending task needs (their kept
        log-probabilities, if any, can go)."""
        references = {t.reference for t in self.plan.tasks if t.reference is not None}
        return sorted(k for k in references if self.users.get(k, 0) == 0)

    def as_rerun(self, index: int) -> None:
        """Turn load job ``index`` into a rerun (its file could not be read)."""
        self.jobs[index].load_logprobs = False

    def ready(self, job: Job) -> bool:
        """Whether everything ``job`` depends on is available."""
        if isinstance(job.item, PrepTask):
            return True
        task = job.item
        if task.preparation is not None and task.preparation not in self.prepared:
            return False
        return task.reference is None or task.reference in self.logprobs

    def next_ready(self, started: set[int]) -> int | None:
        """Index of the first job neither started nor finished whose dependencies are met."""
        for index, job in enumerate(self.jobs):
            if index not in started and index not in self.finished and self.ready(job):
                return index
        return None

    def inputs(self, job: Job) -> tuple[dict[str, Any] | None, Any]:
        """``(prepared, reference_logprobs)`` for a task job."""
        task = job.item
        assert isinstance(task, Task)
        prepared = self.prepared.get(task.preparation) if task.preparation else None
        return prepared, self.logprobs.get(task.reference) if task.reference else None

    def still_needed(self, key: str) -> bool:
        """Whether a pending task still needs the log-probabilities of task ``key``."""
        return self.users.get(key, 0) > 0

    def finish(self, index: int, value: Any, logprobs: Any = None) -> str | None:
        """Record job ``index``'s outcome: a prepared state, or a task result (and its
        log-probabilities); releases a reference's log-probabilities after its last user.

        Returns:
            the key of the reference whose last user this job was (its kept log-probabilities
            file can go), else ``None``.
        """
        job = self.jobs[index]
        self.finished.add(index)
        if isinstance(job.item, PrepTask):
            self.prepared[job.key] = value
            return None
        task = job.item
        if job.store:
            self.results[task.key] = value
        if job.keep_logprobs and logprobs is not None:
            self.logprobs[task.key] = logprobs
        if task.reference is not None:
            self.users[task.reference] -= 1
            if self.users[task.reference] == 0:
                self.logprobs.pop(task.reference, None)
                return task.reference
        return None

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.jobs)
