"""Executing a plan's tasks: the per-process runtime, the task store, and the schedule.

* :class:`Runtime` — what one process (the driver, or a Ray worker) keeps between tasks: the
  loaded model (one at a time) and the prepared states. :meth:`Runtime.run` runs one
  :class:`~kvlab.evaluation.plan.Task` through its protocol and returns a JSON-ready result.
* :class:`~kvlab.evaluation.store.TaskStore` (:mod:`kvlab.evaluation.store`, re-exported
  here) — one sealed JSON file per finished task, written as soon as the task finishes; a
  rerun skips every task whose file is sound.
* :class:`~kvlab.evaluation.schedule.Schedule` (:mod:`kvlab.evaluation.schedule`,
  re-exported here) — which jobs still have to run and when each is ready.

Executors (:mod:`kvlab.evaluation.executors`) drive a schedule in one process or on Ray.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.evaluation.plan import ModelRef, PrepTask, Task
from kvlab.evaluation.schedule import Job, Schedule
from kvlab.evaluation.store import TaskStore
from kvlab.userinput import quote

__all__ = ["ExecutionContext", "Job", "Runtime", "Schedule", "TaskStore"]


@dataclass(frozen=True)
class ExecutionContext:
    """How workers run tasks (picklable).

    Attributes:
        cpu_threads: torch CPU threads per worker (``None``: leave torch's default).
        calibration_cache: the calibration cache folder, or ``None`` for none.
    """

    cpu_threads: int | None = None
    calibration_cache: str | None = None


class Runtime:
    """Per-process state of an executor (module docstring).

    Args:
        context: the execution context.
        announce: called with a line to show (model loads), or ``None``.
    """

    def __init__(
        self, context: ExecutionContext, announce: Callable[[str], None] | None = None
    ) -> None:
        self.context = context
        self.announce = announce
        self._model_key: tuple[str, str, str] | None = None
        self._loaded: Any = None
        self.load_seconds: float | None = None
        self._prepared: dict[str, dict[str, Any]] = {}
        self._capture: tuple[tuple[Any, ...], Any] | None = None
        if context.cpu_threads is not None:
            import torch

            torch.set_num_threads(context.cpu_threads)

    def loaded(self, ref: ModelRef) -> Any:
        """The :class:`~kvlab.models.LoadedModel` of ``ref`` (loaded once; one at a time)."""
        key = (ref.spec, ref.dtype, ref.device)
        if self._model_key != key:
            import torch

            from kvlab.models import load_model, load_tokenizer

            self._loaded = None
            loaded = load_model(
                ref.spec,
                device=ref.device,
                dtype=getattr(torch, ref.dtype),
                tokenizer=load_tokenizer(ref.spec),
            )
            if loaded.checkpoint != ref.checkpoint:
                raise RuntimeError(
                    f"model {quote(ref.spec)} changed since the plan was made: "
                    f"{loaded.checkpoint} != {ref.checkpoint}"
                )
            self._loaded, self._model_key = loaded, key
            self.load_seconds = loaded.load_seconds
            if self.announce is not None:
                self.announce(
                    f"model {ref.spec}: {loaded.checkpoint} loaded in {loaded.load_seconds:.1f} s"
                )
        return self._loaded

    def prepare(
        self, prep: PrepTask, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Run (or reuse: in memory, then the calibration cache) a preparation."""
        from kvlab.evaluation.calibration import prepare_method

        if prep.key not in self._prepared:
            loaded = self.loaded(prep.model)
            cache = self.context.calibration_cache
            self._prepared[prep.key] = prepare_method(
                prep.method,
                loaded.model,
                loaded.tokenizer,
                checkpoint_sha256=prep.model.checkpoint_sha256,
                dtype=prep.model.dtype,
                cache_dir=Path(cache) if cache is not None else None,
                progress=progress,
                warn=self._warn,
            )
        return self._prepared[prep.key]

    def _warn(self, line: str) -> None:
        """A warning: shown through ``announce`` when there is one, else
        :func:`warnings.warn` (a Ray worker's stderr reaches the driver's)."""
        if self.announce is not None:
            self.announce(f"warning: {line}")
            return
        import warnings

        from kvlab.evaluation.runfiles import DamagedRunFileWarning

        warnings.warn(line, DamagedRunFileWarning, stacklevel=2)

    def capture(self, ref: ModelRef, context: Any) -> tuple[Any, float]:
        """The prefill capture of ``context`` (int64 ``[1, T]``) on ``ref``'s model, and the
        seconds it took now (0 when reused): one capture is kept, the last one, so the
        methods of one sample (consecutive in a plan) share it
        (:func:`kvlab.integrations.prefill_replay.capture_prefill`)."""
        import time

        from kvlab.evaluation.ruler_protocol import CAPTURE_ATTENTION
        from kvlab.integrations.prefill_replay import capture_prefill

        key = (ref.spec, ref.dtype, ref.device, tuple(context.view(-1).tolist()))
        if self._capture is not None and self._capture[0] == key:
            return self._capture[1], 0.0
        self._capture = None  # free the previous one first
        model = self.loaded(ref).model
        start = time.perf_counter()
        captured = capture_prefill(model, context, attention=CAPTURE_ATTENTION)
        self._capture = (key, captured)
        return captured, time.perf_counter() - start

    def run(
        self,
        task: Task,
        *,
        prepared: Mapping[str, Any] | None = None,
        reference_logprobs: Any = None,
        keep_logprobs: bool = False,
        on_tokens: Callable[[int], None] | None = None,
    ) -> tuple[dict[str, Any], Any]:
        """Run ``task``; returns its JSON-ready result and, with ``keep_logprobs``, the
        float32 ``[S, V]`` log-softmax of a prefill-score run (else ``None``).

        Raises:
            ValueError: a prefill-score method task without its reference log-probabilities.
        """
        import torch

        from kvlab.evaluation.metrics import storage_record
        from kvlab.evaluation.needle import run_needle
        from kvlab.evaluation.protocols import score_window, stream_tokens

        loaded = self.loaded(task.model)
        model = loaded.model
        device = next(model.parameters()).device
        tokens = torch.tensor(task.tokens, dtype=torch.int64, device=device)
        common = {
            "context": int(getattr(model.config, "max_position_embeddings", 0) or 0),
            "model_load_seconds": self.load_seconds,
            "worker_pid": os.getpid(),
            "prepared": dict(prepared) if prepared is not None else None,
        }
        logprobs = None
        if task.protocol == "prefill-score":
            if task.reference is not None and reference_logprobs is None:
                raise ValueError(f"task {task.label} needs its window's full-cache reference")
            score = score_window(
                model,
                tokens,
                task.method,
                prefill=task.unit["prefill"],
                score=task.unit["score"],
                reference_logprobs=reference_logprobs,
                keep_logprobs=keep_logprobs,
                on_token=on_tokens,
                prepared=prepared,
            )
            kl = score.kl if score.kl is not None else torch.zeros_like(score.nll)
            logprobs = score.reference_logprobs
            result = {
                "nll": score.nll.tolist(),
                "kl": kl.tolist(),
                "storage_prefill": storage_record(score.storage_prefill),
                "storage_final": storage_record(score.storage_final),
                "model_seconds": score.model_seconds,
                "details": score.details,
            }
        elif task.protocol == "stream":
            stream = stream_tokens(
                model,
                tokens,
                task.method,
                chunk=task.unit["chunk"],
                on_chunk=on_tokens,
                prepared=prepared,
            )
            result = {
                "nll": stream.nll.tolist(),
                "peak_storage": storage_record(stream.peak_storage),
                "final_storage": storage_record(stream.final_storage),
                "final_position": stream.final_position,
                "model_seconds": stream.model_seconds,
                "details": stream.details,
            }
        elif task.protocol == "ruler":
            from kvlab.evaluation.ruler_protocol import run_ruler_task

            capture, capture_seconds = None, 0.0
            if task.unit["shared_prefill"]:
                context = tokens[: task.unit["context_tokens"]].view(1, -1)
                capture, capture_seconds = self.capture(task.model, context)
            result = run_ruler_task(
                model,
                loaded.tokenizer,
                tokens,
                task.method,
                task.unit,
                prepared=prepared,
                capture=capture,
            )
            result["capture_seconds"] = capture_seconds
            if on_tokens is not None:
                on_tokens(len(task.tokens))
        elif task.protocol == "needle":
            result = run_needle(
                model,
                loaded.tokenizer,
                task.tokens,
                task.method,
                passkey=task.unit["passkey"],
                chunk=task.unit["chunk"],
                max_new_tokens=task.unit["max_new_tokens"],
                prepared=prepared,
                on_tokens=on_tokens,
            )
        else:
            raise ValueError(f"unknown protocol {task.protocol!r}")
        return {**result, **common}, logprobs
