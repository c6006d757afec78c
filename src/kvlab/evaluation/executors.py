"""Executors: run a :class:`~kvlab.evaluation.execute.Schedule` in this process or on Ray.

* ``local`` (:func:`run_local`) — one process, jobs in plan order (today's behaviour): the
  model is loaded once, every result is stored as soon as it exists.
* ``ray`` (:func:`run_ray`) — jobs become Ray tasks (https://docs.ray.io): with an address
  it joins that cluster (``ray.init(address=...)``), without one it starts a local Ray
  instance of ``workers`` CPUs-worth of workers. At most ``workers`` jobs run at once, each
  with ``cpu_threads`` torch threads (default 1); each Ray worker process keeps its model
  loaded between tasks. A ``full`` task's log-probabilities go to dependents through Ray's
  object store and are dropped after the window's last dependent. The driver (this process)
  writes every result to the task store as it arrives, so the output folder only needs to
  exist here.

Both show finished / running / pending jobs (tqdm, on stderr): preparations, tasks to run, and
stored ``full`` tasks run again for their log-probabilities — not those whose log-probabilities
the task store kept, which are read, not computed (:mod:`kvlab.evaluation.schedule`). A ``full``
task's log-probabilities are kept in the task store while its window has tasks to run
(:mod:`kvlab.evaluation.store`), so an interrupted run resumes without running it again.

The same plan gives the same results bit for bit under both on CPU in float32 when the torch
thread count is the same (``--cpu-threads``; Ray workers default to 1): every task is computed
from its own data, in its own fresh cache, by the same code.

On Ctrl-C (``KeyboardInterrupt``) the running jobs are cancelled and lost; everything finished
is already in the task store, so rerunning the same command resumes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from kvlab.evaluation.execute import ExecutionContext, Runtime, Schedule, TaskStore
from kvlab.evaluation.plan import PrepTask, Task
from kvlab.userinput import quote

__all__ = ["EXECUTORS", "TaskFailedError", "run_local", "run_ray", "run_schedule"]

EXECUTORS = ("local", "ray")


class TaskFailedError(RuntimeError):
    """A task raised on a worker; the message names it and gives the worker's error."""


class _Display:
    """The job bar: finished / total, with running and pending counts (tqdm, stderr)."""

    def __init__(self, schedule: Schedule, enabled: bool) -> None:
        from tqdm import tqdm

        self.schedule = schedule
        self.enabled = enabled
        self.bar = tqdm(
            total=schedule.computing_jobs,
            desc="tasks",
            unit="task",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            position=0,
        )

    def show(self, running: list[str]) -> None:
        pending = self.bar.total - self.bar.n - len(running)
        now = f" · {running[0]}" if len(running) == 1 else ""
        self.bar.set_postfix_str(f"running {len(running)}, pending {pending}{now}", refresh=True)

    def advance(self) -> None:
        self.bar.update(1)

    def add_one(self) -> None:
        """A job the bar did not count (a load that became a rerun)."""
        self.bar.total += 1
        self.bar.refresh()

    def sub_bar(self, desc: str, total: int, unit: str) -> Any:
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            disable=not self.enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            position=1,
            leave=False,
        )

    def close(self) -> None:
        self.bar.close()


def _token_total(task: Task) -> int:
    if task.protocol == "prefill-score":
        return int(task.unit["score"])
    if task.protocol == "stream":
        return len(task.tokens) - 1
    return len(task.tokens)


def _release(store: TaskStore, key: str | None) -> None:
    """Delete the kept log-probabilities of ``key`` (its last pending user is stored)."""
    if key is not None:
        store.drop_logprobs(key)


def run_local(
    schedule: Schedule,
    store: TaskStore,
    context: ExecutionContext,
    *,
    progress: bool = True,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Run every job of ``schedule`` in this process, in order (module docstring)."""
    runtime = Runtime(context, announce)
    display = _Display(schedule, progress)
    try:
        for index, job in enumerate(schedule.jobs):
            display.show([job.label])
            if isinstance(job.item, PrepTask):
                name = job.item.method.name
                # the layer bar opens at the calibration's first layer: none for a calibration
                # read from the cache, none during the model's load
                bars: list[Any] = []

                def layers(done: int, total: int, name: str = name, bars: list = bars) -> None:
                    if not bars:
                        bars.append(display.sub_bar(f"{name}: calibrating", total, "layer"))
                    bars[0].total = total
                    bars[0].n = done
                    bars[0].refresh()

                try:
                    runtime.loaded(job.item.model)  # the model load is not the calibration's
                    began = time.perf_counter()
                    prepared = runtime.prepare(job.item, layers)
                finally:
                    for bar in bars:
                        bar.close()
                schedule.finish(index, prepared)
                if announce is not None:
                    status = prepared.get("calibration_cache", {}).get("status", "done")
                    announce(
                        f"{name}: calibration {status} in {time.perf_counter() - began:.1f} s "
                        f"(cache key {job.key[:12]})"
                    )
            else:
                task = job.item
                if job.load_logprobs:
                    logprobs = store.load_logprobs(task.key)
                    if logprobs is not None:
                        schedule.finish(index, None, logprobs)
                        continue  # nothing computed: not on the bar
                    schedule.as_rerun(index)  # damaged or gone (a warning said which)
                    display.add_one()
                prepared, reference = schedule.inputs(job)
                with display.sub_bar(task.label, _token_total(task), "tok") as bar:
                    result, logprobs = runtime.run(
                        task,
                        prepared=prepared,
                        reference_logprobs=reference,
                        keep_logprobs=job.keep_logprobs,
                        on_tokens=bar.update,
                    )
                if job.store:
                    store.save(task, result)
                if job.keep_logprobs and logprobs is not None:
                    store.save_logprobs(task.key, logprobs)  # a resumed run reads them
                _release(store, schedule.finish(index, result, logprobs))
            display.advance()
    finally:
        display.close()


# --- Ray -----------------------------------------------------------------------------------

_WORKER_RUNTIME: Runtime | None = None


def _worker_runtime(context: ExecutionContext) -> Runtime:
    global _WORKER_RUNTIME
    if _WORKER_RUNTIME is None or _WORKER_RUNTIME.context != context:
        _WORKER_RUNTIME = Runtime(context)
    return _WORKER_RUNTIME


def _ray_prepare(prep: PrepTask, context: ExecutionContext) -> dict[str, Any]:
    """Ray task: a preparation, with per-layer progress through Ray's tqdm when available."""
    runtime = _worker_runtime(context)
    try:
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm
    except ImportError:  # pragma: no cover - older Ray
        return runtime.prepare(prep)
    bars: list[Any] = []

    def layers(done: int, total: int) -> None:
        if not bars:  # only when it computes (a cached calibration shows nothing)
            bars.append(
                ray_tqdm(desc=f"{prep.method.name}: calibrating", total=total, unit="layer")
            )
        bars[0].update(done - bars[0].n)

    try:
        return runtime.prepare(prep, layers)
    finally:
        for bar in bars:
            bar.close()


def _ray_task(
    task: Task,
    context: ExecutionContext,
    prepared: dict[str, Any] | None,
    reference_logprobs: Any,
    keep_logprobs: bool,
) -> tuple[dict[str, Any], Any]:
    """Ray task: one evaluation task (returns result and log-probabilities)."""
    return _worker_runtime(context).run(
        task,
        prepared=prepared,
        reference_logprobs=reference_logprobs,
        keep_logprobs=keep_logprobs,
    )


def run_ray(
    schedule: Schedule,
    store: TaskStore,
    context: ExecutionContext,
    *,
    workers: int = 2,
    address: str | None = None,
    progress: bool = True,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Run every job of ``schedule`` as Ray tasks (module docstring).

    Raises:
        ValueError: Ray is not installed (the message says how to install it).
        TaskFailedError: a task raised on a worker (finished results are stored).
    """
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "--executor ray needs Ray: pip install 'ray>=2.9' (or pip install -e '.[ray]')"
        ) from exc
    threads = context.cpu_threads or 1
    if context.cpu_threads is None:
        context = ExecutionContext(cpu_threads=threads, calibration_cache=context.calibration_cache)
    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": True,
            "logging_level": "WARNING",
        }
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=workers * threads, **options)
        if announce is not None:
            where = f"Ray cluster at {address}" if address else "a local Ray instance"
            announce(f"executor ray: {where}, {workers} workers x {threads} thread(s)")
    prepare = ray.remote(num_cpus=threads)(_ray_prepare)
    run = ray.remote(num_cpus=threads, num_returns=2)(_ray_task)
    display = _Display(schedule, progress)
    in_flight: dict[Any, int] = {}
    logprob_refs: dict[int, Any] = {}
    started: set[int] = set()
    try:
        while not schedule.done:
            while len(in_flight) < workers:
                index = schedule.next_ready(started)
                if index is None:
                    break
                job = schedule.jobs[index]
                started.add(index)
                if job.load_logprobs:  # read here, in the driver; shared via the object store
                    loaded = store.load_logprobs(job.key)
                    if loaded is not None:
                        schedule.finish(index, None, ray.put(loaded))
                        continue
                    schedule.as_rerun(index)
                    display.add_one()
                if isinstance(job.item, PrepTask):
                    in_flight[prepare.remote(job.item, context)] = index
                else:
                    prepared, reference = schedule.inputs(job)
                    result_ref, logprobs_ref = run.remote(
                        job.item, context, prepared, reference, job.keep_logprobs
                    )
                    in_flight[result_ref] = index
                    logprob_refs[index] = logprobs_ref
            display.show([schedule.jobs[i].label for i in in_flight.values()])
            if not in_flight:
                if schedule.done:  # the last jobs were loads, done here
                    break
                raise RuntimeError("no job is ready and none is running (a dependency cycle)")
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in ready:
                index = in_flight.pop(ref)
                job = schedule.jobs[index]
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    raise TaskFailedError(
                        f"task {job.label} failed on a Ray worker: {cause}"
                    ) from exc
                if isinstance(job.item, Task) and job.store:
                    store.save(job.item, value)
                logprobs = logprob_refs.pop(index, None) if job.keep_logprobs else None
                logprob_refs.pop(index, None)
                if logprobs is not None and store.folder is not None:
                    kept = ray.get(logprobs)  # a copy in the driver, for a resumed run
                    if kept is not None:
                        store.save_logprobs(job.key, kept)
                    del kept
                _release(store, schedule.finish(index, value, logprobs))
                display.advance()
    except BaseException:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        raise
    finally:
        display.close()
        if started_here:
            ray.shutdown()


def run_schedule(
    executor: str,
    schedule: Schedule,
    store: TaskStore,
    context: ExecutionContext,
    *,
    workers: int = 2,
    address: str | None = None,
    progress: bool = True,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Run ``schedule`` with executor ``"local"`` or ``"ray"``.

    Raises:
        ValueError: an unknown executor.
    """
    if executor == "local":
        run_local(schedule, store, context, progress=progress, announce=announce)
    elif executor == "ray":
        run_ray(
            schedule,
            store,
            context,
            workers=workers,
            address=address,
            progress=progress,
            announce=announce,
        )
    else:
        raise ValueError(
            f"unknown executor {quote(executor)}; choose one of {', '.join(EXECUTORS)}"
        )
