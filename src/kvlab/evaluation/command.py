"""The ``kvlab eval`` and ``kvlab sweep`` commands (registered by :mod:`kvlab.cli`).

Only light modules are imported here: ``kvlab --help`` must not load torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvlab.cli_support import err_console, fail, invocation_argv, user_errors
from kvlab.userinput import quote

__all__ = ["eval_command", "kept_tasks", "parse_counts", "sweep_command"]

_METHOD_HELP = (
    "KV-cache method, repeatable; `kvlab methods` lists every name with what it does (e.g. "
    "full, pn-mix, kivi-2bit, relay:snapkv@0.5, evict-no-relay:kvzip@0.5+pn-mix-lean). "
    "Default: prefill-score: full, PN-Mix (2/4-bit), kivi-2bit, int4, int2, relay and "
    "evict-no-relay per scorer, streaming-llm (+ transformers' QuantizedCache when "
    "installed); stream and needle: full, relay:snapkv@0.5, evict-no-relay:snapkv@0.5 "
    "(+ streaming-llm@0.5 in stream)."
)
_EXECUTOR_HELP = (
    "local (one process) or ray (Ray tasks: a local Ray instance, or the cluster at "
    "--ray-address). Both give the same numbers at the same --cpu-threads."
)

# The run options kvlab eval and kvlab sweep share (each command gives the default).
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
CpuThreadsOption = Annotated[
    int | None, typer.Option(help="torch CPU threads (per worker with --executor ray).")
]
ExecutorOption = Annotated[str, typer.Option(help=_EXECUTOR_HELP)]
WorkersOption = Annotated[int, typer.Option(help="ray: tasks run at once.")]
RayAddressOption = Annotated[
    str | None, typer.Option(help="ray: address of a running cluster (default: start one).")
]
CalibrationCacheOption = Annotated[
    str | None,
    typer.Option(
        help="Folder of cached calibrations (default: $KVLAB_CALIBRATION_CACHE or "
        "~/.cache/kvlab/calibration); 'none' disables it."
    ),
]
ResumeOption = Annotated[
    bool, typer.Option(help="Reuse results of finished tasks found in the output folder.")
]
ProgressOption = Annotated[bool, typer.Option(help="Show progress bars.")]


def parse_counts(text: str, option: str, *, allow_float: bool = False) -> list[float]:
    """Comma-separated numbers, ``K`` meaning 1024 (``"2K,4K"`` -> ``[2048, 4096]``).

    Raises:
        ValueError: an item that is not a number.
    """
    values: list[float] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        scale = 1024 if item[-1] in "kK" else 1
        number = item[:-1] if scale > 1 else item
        try:
            value = float(number) * scale if allow_float else int(number) * scale
        except ValueError as exc:
            raise ValueError(f"{option}: {quote(item)} is not a number") from exc
        values.append(value)
    if not values:
        raise ValueError(f"{option} is empty")
    return values


def kept_tasks(folder: Path) -> str:
    """What an interrupted run kept, said after the fact (only folders that exist are named):
    ``"3 finished tasks are kept in FOLDER; rerun the same command to resume"``, or that none
    had finished."""
    count = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    if not count:
        return "no task had finished, nothing was kept; rerun the same command to start again"
    tasks = "1 finished task is" if count == 1 else f"{count} finished tasks are"
    return f"{tasks} kept in {folder}; rerun the same command to resume"


def _chat(value: str) -> bool | None:
    choices = {"auto": None, "yes": True, "no": False}
    if value.lower() not in choices:
        raise ValueError(f"--ruler-chat must be auto, yes or no, got {quote(value)}")
    return choices[value.lower()]


def _calibration(value: str | None) -> tuple[Path | None, bool]:
    if value is None:
        return None, True
    if value.lower() == "none":
        return None, False
    return Path(value), True


def eval_command(
    model: Annotated[
        str,
        typer.Option(
            help="A registered name (kvlab models list: smollm2-135m, qwen2.5-coder-0.5b, "
            "qwen2.5-coder-1.5b, gemma3-270m; kvlab models install NAME), or a local "
            "transformers folder or .gguf file."
        ),
    ] = "smollm2-135m",
    text: Annotated[
        Path | None,
        typer.Option(
            help="UTF-8 text file to evaluate on (default: the package's public-domain text)."
        ),
    ] = None,
    method: Annotated[list[str] | None, typer.Option(help=_METHOD_HELP)] = None,
    protocol: Annotated[
        str,
        typer.Option(
            help="prefill-score (prefill P, score S one token at a time), stream (chunks "
            "through a bounded cache), needle (passkey retrieval at lengths x depths) or ruler "
            "(RULER's synthetic tasks: compress the context, answer the question)."
        ),
    ] = "prefill-score",
    windows: Annotated[int, typer.Option(help="prefill-score: number of token windows.")] = 4,
    prefill: Annotated[int, typer.Option(help="prefill-score: prefill tokens P.")] = 512,
    score: Annotated[int, typer.Option(help="prefill-score: scored tokens S.")] = 512,
    cache_slots: Annotated[
        int,
        typer.Option(
            help="stream, needle: cache window in tokens per kv head; an eviction "
            "method with R keeps (1 - R) * slots."
        ),
    ] = 2048,
    chunk_size: Annotated[int, typer.Option(help="stream, needle: tokens per forward.")] = 256,
    stream_length: Annotated[int, typer.Option(help="stream: tokens streamed.")] = 12288,
    segment: Annotated[int, typer.Option(help="stream: tokens per perplexity segment.")] = 1024,
    needle_lengths: Annotated[
        str, typer.Option(help="needle: prompt lengths in tokens (K = 1024).")
    ] = "2K,4K,8K,16K",
    needle_depths: Annotated[
        str, typer.Option(help="needle: needle depths, percent of the filler.")
    ] = "0,25,50,75,100",
    needle_trials: Annotated[int, typer.Option(help="needle: trials per cell.")] = 3,
    needle_seed: Annotated[int, typer.Option(help="needle: seed of passkeys and filler.")] = 0,
    ruler_tasks: Annotated[
        str, typer.Option(help="ruler: comma-separated RULER task names (default: all).")
    ] = "",
    ruler_lengths: Annotated[
        str, typer.Option(help="ruler: total token budgets per sample (K = 1024).")
    ] = "4K",
    ruler_samples: Annotated[int, typer.Option(help="ruler: samples per task and length.")] = 10,
    ruler_seed: Annotated[int, typer.Option(help="ruler: seed of the samples.")] = 0,
    ruler_chat: Annotated[
        str,
        typer.Option(help="ruler: auto (the chat template when the tokenizer has one), yes, no."),
    ] = "auto",
    ruler_shared_prefill: Annotated[
        bool,
        typer.Option(
            help="ruler: capture each context's prefill once and replay it into every method's "
            "cache (--no-ruler-shared-prefill: each method runs its own prefill)."
        ),
    ] = True,
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16 weights.")] = "float32",
    cpu_threads: CpuThreadsOption = None,
    executor: ExecutorOption = "local",
    workers: WorkersOption = 2,
    ray_address: RayAddressOption = None,
    calibration_cache: CalibrationCacheOption = None,
    output_dir: Annotated[
        Path, typer.Option(help="Folder for table, artifact, plot and the task store (tasks/).")
    ] = Path("runs/eval"),
    resume: ResumeOption = True,
    progress: ProgressOption = True,
) -> None:
    """Compare KV-cache methods on a pretrained model and a real text (perplexity, ΔPPL, KL to
    the full cache, KV bytes, time; needle: passkey accuracy); write a markdown table, a
    metric artifact (v2), the raw figures and a plot. Every finished task is kept in
    OUTPUT_DIR/tasks/, so an interrupted run resumes where it stopped."""
    from kvlab.evaluation.plan import EvalConfig

    console = err_console()
    with user_errors(lambda: kept_tasks(output_dir / "tasks")):
        from kvlab.backends import check_backend_variables

        check_backend_variables()  # KVLAB_*_BACKEND, before any model loads
        cache_dir, use_cache = _calibration(calibration_cache)
        config = EvalConfig(
            model=model,
            text=text,
            methods=list(method or []),
            protocol=protocol,
            windows=windows,
            prefill=prefill,
            score=score,
            device=device,
            dtype=dtype,
            output_dir=output_dir,
            cache_slots=cache_slots,
            chunk=chunk_size,
            stream_length=stream_length,
            segment=segment,
            argv=_argv(),
            progress=progress,
            needle_lengths=[int(v) for v in parse_counts(needle_lengths, "--needle-lengths")],
            needle_depths=parse_counts(needle_depths, "--needle-depths", allow_float=True),
            needle_trials=needle_trials,
            needle_seed=needle_seed,
            ruler_tasks=[t.strip() for t in ruler_tasks.split(",") if t.strip()],
            ruler_lengths=[int(v) for v in parse_counts(ruler_lengths, "--ruler-lengths")],
            ruler_samples=ruler_samples,
            ruler_seed=ruler_seed,
            ruler_chat=_chat(ruler_chat),
            ruler_shared_prefill=ruler_shared_prefill,
            executor=executor,
            workers=workers,
            ray_address=ray_address,
            cpu_threads=cpu_threads,
            calibration_cache=cache_dir,
            use_calibration_cache=use_cache,
            resume=resume,
        )
        config.needle_depths = [int(d) if d == int(d) else d for d in config.needle_depths]
        outcome = _run(config, console)
    sys.stdout.write(outcome.table)
    sys.stdout.flush()
    for name, path in (
        ("table", outcome.table_path),
        ("artifact", outcome.artifact_path),
        ("raw", outcome.raw_path),
        ("plot", outcome.plot_path),
    ):
        console.print(f"{name + ':':9s} {path}")


def _run(config: Any, console: Any) -> Any:
    from kvlab.device import set_cpu_threads
    from kvlab.evaluation.executors import TaskFailedError
    from kvlab.evaluation.harness import run_eval

    set_cpu_threads(config.cpu_threads)
    try:
        return run_eval(config, console)
    except TaskFailedError as exc:
        fail(str(exc))


def _argv() -> list[str]:
    return invocation_argv()


def sweep_command(
    file: Annotated[Path, typer.Argument(help="Sweep file (TOML; see examples/).")],
    output_dir: Annotated[
        Path | None,
        typer.Option(help="Output folder (default: runs/sweep/<file name without .toml>)."),
    ] = None,
    executor: ExecutorOption = "local",
    workers: WorkersOption = 2,
    ray_address: RayAddressOption = None,
    device: DeviceOption = "auto",
    cpu_threads: CpuThreadsOption = None,
    calibration_cache: CalibrationCacheOption = None,
    resume: ResumeOption = True,
    progress: ProgressOption = True,
) -> None:
    """Run a grid of evaluations — models x texts x methods (x ratios, bits) x protocols —
    from a TOML file, as one plan of tasks. Each finished task is stored in
    OUTPUT_DIR/tasks/ and skipped on rerun (Ctrl-C loses only the running tasks). Writes each
    group's table, artifact, raw JSON and plot, summary.md (every table, without wall times,
    comparable across executors) and a Pareto plot of KL against bytes per model and text."""
    from kvlab.evaluation.sweep import SweepOptions, run_sweep

    console = err_console()
    out = output_dir or Path("runs/sweep") / file.stem
    with user_errors(lambda: kept_tasks(out / "tasks")):
        from kvlab.backends import check_backend_variables

        check_backend_variables()  # KVLAB_*_BACKEND, before any model loads
        cache_dir, use_cache = _calibration(calibration_cache)
        options = SweepOptions(
            output_dir=out,
            executor=executor,
            workers=workers,
            ray_address=ray_address,
            device=device,
            cpu_threads=cpu_threads,
            calibration_cache=cache_dir,
            use_calibration_cache=use_cache,
            resume=resume,
            progress=progress,
            argv=_argv(),
        )
        from kvlab.evaluation.executors import TaskFailedError

        try:
            outcome = run_sweep(file, options, console)
        except TaskFailedError as exc:
            fail(str(exc))
    sys.stdout.write(outcome.summary)
    sys.stdout.flush()
    console.print(f"summary: {outcome.summary_path}")
    for path in outcome.pareto_paths:
        console.print(f"pareto:  {path}")
