"""The ``kvlab`` command line: ``reproduce``, ``validate``, ``papers`` and ``eval``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvlab.artifacts import validate_artifact
from kvlab.data import load_text
from kvlab.device import resolve_device, set_cpu_threads
from kvlab.diagnostics.paper import RunContext
from kvlab.diagnostics.registry import get_paper, paper_keys
from kvlab.diagnostics.runner import default_output_dir, run_paper

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kvlab: KV-cache compression for RoPE transformers (RoPE-Relay, PN-Mix).",
)
console = Console()

_BUDGETS = ("smoke", "standard")


def parse_seeds(seeds: str | None, seed: int | None) -> list[int]:
    """Seeds from ``--seeds 42,43,44`` or ``--seed N`` (default 42, 43, 44).

    Raises:
        typer.BadParameter: both given, an unparsable item, or a repeated seed.
    """
    if seeds is not None and seed is not None:
        raise typer.BadParameter("give either --seeds or --seed, not both")
    if seed is not None:
        return [seed]
    if seeds is None:
        return [42, 43, 44]
    try:
        values = [int(part) for part in seeds.split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--seeds must be comma-separated integers: {seeds!r}") from exc
    if not values:
        raise typer.BadParameter("--seeds is empty")
    if len(set(values)) != len(values):
        raise typer.BadParameter(f"--seeds repeats a seed: {seeds!r}")
    return values


@app.command()
def reproduce(
    paper: Annotated[str, typer.Option(help="Paper key, or 'all' for every registered one.")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    cpu_threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds.")] = None,
    seed: Annotated[int | None, typer.Option(help="A single seed.")] = None,
    budget: Annotated[str, typer.Option(help="smoke or standard.")] = "standard",
    output_dir: Annotated[Path | None, typer.Option(help="Base folder (default: runs).")] = None,
    text: Annotated[
        Path | None, typer.Option(help="Input text for text-based diagnostics (pn-mix).")
    ] = None,
) -> None:
    """Run a mechanism diagnostic per seed; write its raw result and metric artifact (v2)."""
    if budget not in _BUDGETS:
        raise typer.BadParameter(f"--budget must be one of {', '.join(_BUDGETS)}")
    seed_list = parse_seeds(seeds, seed)
    try:
        keys = paper_keys() if paper == "all" else [get_paper(paper).key]
        torch_device = resolve_device(device)
        set_cpu_threads(cpu_threads)
    except (KeyError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc.args[0] if exc.args else exc}")
        raise typer.Exit(2) from exc
    argv = ["kvlab", *sys.argv[1:]]
    for key in keys:
        entry = get_paper(key)
        source = load_text(text) if entry.uses_text else None
        context = RunContext(
            device=torch_device,
            budget=budget,
            text=source,
            argv=argv,
            output_dir=default_output_dir(key, output_dir),
            seeds=seed_list,
        )
        run_paper(entry, context, console)


@app.command()
def validate(
    paths: Annotated[list[Path], typer.Argument(help="Artifact JSON files.")],
    root: Annotated[
        Path | None, typer.Option(help="Folder recorded source paths are relative to.")
    ] = None,
) -> None:
    """Check artifacts against their schema and recompute every recorded source sha256.
    Exits non-zero, listing each problem, when anything does not match."""
    failed = False
    for path in paths:
        report = validate_artifact(path, root=root)
        if report.ok:
            console.print(
                f"[green]ok[/] {path}: {report.kind}, {report.checked_files} source file(s) match"
            )
            continue
        failed = True
        console.print(f"[red]FAILED[/] {path}: {report.kind or 'unrecognized'}")
        for problem in report.problems:
            console.print(f"  - {problem}")
    if failed:
        raise typer.Exit(1)


@app.command()
def papers() -> None:
    """List the registered diagnostics."""
    for key in paper_keys():
        console.print(f"{key:12s} {get_paper(key).title}")


def _register_eval() -> None:
    try:
        from kvlab.evaluation.command import eval_command
    except ImportError:  # pragma: no cover - the evaluation package is optional at build time
        return
    app.command("eval")(eval_command)


_register_eval()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
