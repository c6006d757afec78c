"""``kvlab eval``: plan, execute, report.

:func:`run_eval` checks everything it can before a model loads — options, the output folder
(:func:`~kvlab.evaluation.outputs.check_output_paths`), the methods, the text (UTF-8, long
enough for one window) — then plans the tasks (:mod:`~kvlab.evaluation.plan`), runs the ones
the output folder's task store does not hold yet with the chosen executor
(:mod:`~kvlab.evaluation.executors`), and writes the table, raw JSON, metric artifact and plot
(:mod:`~kvlab.evaluation.report`). The file names and contents are those of
:mod:`kvlab.evaluation.report`'s docstring; the task store is ``<output-dir>/tasks/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.evaluation.outputs import EvalPaths, check_output_paths, eval_paths, task_file_names
from kvlab.evaluation.plan import (
    DTYPES,
    PROTOCOLS,
    EvalConfig,
    ModelRef,
    Plan,
    TextRef,
    plan_eval,
    select_methods,
    window_starts,
)
from kvlab.evaluation.report import (
    EvalOutcome,
    summarize_prefill_score,
    summarize_stream,
    write_eval_report,
)
from kvlab.userinput import quote

__all__ = [
    "DTYPES",
    "PROTOCOLS",
    "EvalConfig",
    "EvalInputs",
    "EvalOutcome",
    "console_warning",
    "execution_context",
    "plan_line",
    "prepare_inputs",
    "run_eval",
    "stored_schedule",
    "summarize_prefill_score",
    "summarize_stream",
    "tokenize",
    "window_starts",
]


def tokenize(tokenizer: Any, data: bytes) -> list[int]:
    """Token ids of a UTF-8 text (no special tokens)."""
    decoded = data.decode("utf-8")
    return list(tokenizer(decoded, add_special_tokens=False, verbose=False)["input_ids"])


@dataclass(frozen=True)
class EvalInputs:
    """The checked inputs of one evaluation and its plan (see :func:`prepare_inputs`)."""

    config: EvalConfig
    paths: EvalPaths
    model: ModelRef
    text: TextRef
    text_tokens: int
    plan: Plan
    accelerator: str
    device_type: str


def prepare_inputs(config: EvalConfig, output_folder: Path) -> EvalInputs:
    """Every check that needs no model, in order: options, output paths, methods, text, model
    files, the methods against the model's config
    (:func:`kvlab.evaluation.support.check_methods`), tokenizer; then the plan.

    Raises:
        ValueError: invalid options, an output path that cannot be written, unknown methods,
            a text that is not UTF-8 or shorter than one window.
        FileNotFoundError: the text file does not exist.
        kvlab.models.ModelNotAvailableError: the model is not installed.
    """
    from kvlab.data import load_text
    from kvlab.device import accelerator_info, resolve_device
    from kvlab.models import checkpoint_label, checkpoint_sha256, load_tokenizer

    config.validate()
    device = resolve_device(config.device)
    paths = eval_paths(output_folder, config.protocol, device.type)
    task_files = [paths.tasks / name for name in task_file_names()]
    check_output_paths(paths.folder, [*paths.files(), *task_files])
    if paths.tasks.exists() and not paths.tasks.is_dir():
        raise ValueError(
            f"--output-dir {quote(paths.folder)}: {quote(paths.tasks)} is not a folder"
        )
    methods = select_methods(config)
    text = load_text(config.text)  # a bad text fails before the model loads
    model = ModelRef(
        spec=config.model,
        checkpoint=checkpoint_label(config.model),
        checkpoint_sha256=checkpoint_sha256(config.model),
        dtype=config.dtype,
        device=str(device),
    )
    from kvlab.evaluation.support import check_lengths, check_methods, read_model_config

    # every method runs on this model's layer kinds, or is refused now (not after the load)
    model_config = read_model_config(config.model)
    check_methods(methods, model_config, config.model)
    text_ref = TextRef(id=text.id, sha256=text.sha256, path=text.path, source_url=text.source_url)
    tokenizer = load_tokenizer(config.model)
    tokens = tokenize(tokenizer, text.data)
    plan = plan_eval(
        config, methods, model, text_ref, tokens, tokenizer, text_data=text.data.decode("utf-8")
    )
    # the prompt lengths the plan feeds, for caches that cannot take every length
    prompts = [int(t.unit.get("context_tokens", t.unit.get("prefill", 0))) for t in plan.tasks]
    check_lengths(methods, model_config, [n for n in prompts if n], config.model)
    return EvalInputs(
        config=config,
        paths=paths,
        model=model,
        text=text_ref,
        text_tokens=len(tokens),
        plan=plan,
        accelerator=accelerator_info(device).label,
        device_type=device.type,
    )


def run_eval(config: EvalConfig, console: Any = None) -> EvalOutcome:
    """Run ``kvlab eval`` (module docstring) and write its files.

    Raises:
        ValueError: invalid options, an unwritable output path, unknown methods, a text that
            is not UTF-8 or shorter than one window, or Ray missing for ``executor="ray"``.
        FileNotFoundError: the text file does not exist.
        kvlab.models.ModelNotAvailableError: the model is not installed.
        KeyboardInterrupt: interrupted; finished tasks are stored (rerun to resume).
    """
    from rich.console import Console

    from kvlab.evaluation.execute import TaskStore
    from kvlab.evaluation.executors import run_schedule

    console = console or Console(stderr=True)
    if not config.argv:
        import sys

        config.argv = ["kvlab", *sys.argv[1:]]
    inputs = prepare_inputs(config, Path(config.output_dir))
    store = TaskStore(inputs.paths.tasks, warn=console_warning(console))
    schedule = stored_schedule(inputs.plan, store, config.resume)
    console.print(plan_line(schedule, inputs.paths.tasks), highlight=False, soft_wrap=True)
    run_schedule(
        config.executor,
        schedule,
        store,
        execution_context(config),
        workers=config.workers,
        address=config.ray_address,
        progress=config.progress,
        announce=lambda line: console.print(line, highlight=False, soft_wrap=True),
    )
    return write_eval_report(
        config,
        inputs.plan,
        schedule.results,
        inputs.paths,
        model=inputs.model,
        text=inputs.text,
        text_tokens=inputs.text_tokens,
        accelerator=inputs.accelerator,
        device_type=inputs.device_type,
    )


def execution_context(config: EvalConfig) -> Any:
    """The :class:`~kvlab.evaluation.execute.ExecutionContext` of ``config``."""
    from kvlab.evaluation.calibration import default_calibration_dir
    from kvlab.evaluation.execute import ExecutionContext

    cache = None
    if config.use_calibration_cache:
        cache = str(config.calibration_cache or default_calibration_dir())
    return ExecutionContext(cpu_threads=config.cpu_threads, calibration_cache=cache)


def console_warning(console: Any) -> Any:
    """``warn(line)`` printing ``warning: line`` on ``console`` (rich markup not read)."""

    def warn(line: str) -> None:
        console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)

    return warn


def stored_schedule(plan: Any, store: Any, resume: bool) -> Any:
    """The :class:`~kvlab.evaluation.schedule.Schedule` of ``plan`` given the results the task
    store holds (none when ``resume`` is false) and the ``full`` tasks' log-probabilities it
    kept; deletes kept log-probabilities no pending task needs any more."""
    from kvlab.evaluation.schedule import Schedule

    stored = {}
    if resume:
        unique: dict[str, Any] = {}
        for task in plan.tasks:
            unique.setdefault(task.key, task)
        for key, task in unique.items():
            result = store.load(task)
            if result is not None:
                stored[key] = result
    references = {t.reference for t in plan.tasks if t.reference is not None}
    kept = {k for k in references if k in stored and store.has_logprobs(k)}
    schedule = Schedule(plan, stored, kept)
    for key in schedule.unneeded_logprobs():
        store.drop_logprobs(key)
    return schedule


def plan_line(schedule: Any, folder: Path) -> str:
    """``"N tasks: M to run, K already done in FOLDER ..."``, and, when stored ``full`` tasks
    run again for their log-probabilities, how many and why, and how many method preparations
    (calibrations) run first: everything the progress bar counts."""
    todo = schedule.total_tasks - schedule.skipped
    line = f"{schedule.total_tasks} tasks: {todo} to run"
    if schedule.skipped:
        line += f", {schedule.skipped} already done in {folder} (reused; --no-resume reruns them)"
    if schedule.reruns:
        line += (
            f"; {schedule.reruns} of the done ones (full) run again first, for the "
            "log-probabilities their windows' other tasks need (not kept by the run that "
            f"stored them): {todo + schedule.reruns} to run in all"
        )
    preparations = schedule.computing_jobs - todo - schedule.reruns
    if preparations > 0:
        line += (
            f"; before them {preparations} method preparation"
            f"{'s' if preparations > 1 else ''} (calibration, reused when cached), on the "
            "progress bar too"
        )
    return line
