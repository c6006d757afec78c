"""The ``kvlab`` command line: ``reproduce``, ``validate``, ``papers``, ``methods``, ``eval``,
``sweep`` and ``models`` (``list``, ``install NAME``: :mod:`kvlab.cli_models`).

Heavy modules (torch, transformers, pydantic) are imported inside the commands, so
``kvlab --help`` and ``kvlab --version`` answer at once. Every command reports a user's mistake
the same way (:mod:`kvlab.cli_support`): ``error: <one line>`` on stderr, exit code 2.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvlab import __version__
from kvlab.cli_models import models_app
from kvlab.cli_support import err_console, fail, invocation_argv, user_errors
from kvlab.evaluation.command import eval_command, sweep_command
from kvlab.userinput import quote

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wrapped to any terminal width
    help="kvlab: KV-cache compression for RoPE transformers (RoPE-Relay, PN-Mix).",
)

_BUDGETS = ("smoke", "standard")


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvlab {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """kvlab: KV-cache compression for RoPE transformers (RoPE-Relay, PN-Mix)."""


def _console():
    from rich.console import Console

    return Console(soft_wrap=True)


def parse_seeds(seeds: str | None, seed: int | None) -> list[int]:
    """Seeds from ``--seeds 42,43,44`` or ``--seed N`` (default 42, 43, 44).

    Raises:
        ValueError: both given, an unparsable item, or a repeated seed.
    """
    if seeds is not None and seed is not None:
        raise ValueError("give either --seeds or --seed, not both")
    if seed is not None:
        if not 0 <= seed < 10**18:
            raise ValueError(f"--seed must lie in [0, 10^18), got {seed}")
        return [seed]
    if seeds is None:
        return [42, 43, 44]
    parts = [part.strip() for part in seeds.split(",") if part.strip()]
    if not parts:
        raise ValueError("--seeds is empty")
    if not all(re.fullmatch(r"\d{1,18}", part) for part in parts):
        raise ValueError(f"--seeds must be comma-separated integers in [0, 10^18): {quote(seeds)}")
    values = [int(part) for part in parts]
    if len(set(values)) != len(values):
        raise ValueError(f"--seeds repeats a seed: {quote(seeds)}")
    return values


@app.command()
def reproduce(
    paper: Annotated[str, typer.Option(help="Paper key, or 'all' for every registered one.")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    cpu_threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds.")] = None,
    seed: Annotated[int | None, typer.Option(help="A single seed.")] = None,
    budget: Annotated[
        str,
        typer.Option(
            help="smoke or standard. Recorded with the run; both L1 diagnostics are small "
            "enough to run their full protocol under either budget."
        ),
    ] = "standard",
    output_dir: Annotated[Path | None, typer.Option(help="Base folder (default: runs).")] = None,
    text: Annotated[
        Path | None, typer.Option(help="Input text for text-based diagnostics (pn-mix).")
    ] = None,
) -> None:
    """Run a mechanism diagnostic per seed; write its raw result and metric artifact (v2)."""
    with user_errors():
        if budget not in _BUDGETS:
            raise ValueError(f"--budget must be one of {', '.join(_BUDGETS)}")
        seed_list = parse_seeds(seeds, seed)
        from kvlab.backends import check_backend_variables

        check_backend_variables()  # KVLAB_*_BACKEND, before any model loads
        from kvlab.data import load_text
        from kvlab.device import resolve_device, set_cpu_threads
        from kvlab.diagnostics.paper import RunContext
        from kvlab.diagnostics.registry import get_paper, paper_keys
        from kvlab.diagnostics.runner import default_output_dir, run_paper

        entries = [get_paper(key) for key in (paper_keys() if paper == "all" else [paper])]
        torch_device = resolve_device(device)
        set_cpu_threads(cpu_threads)
        if text is not None and not any(e.uses_text for e in entries):
            raise ValueError(f"--text does not apply to {quote(paper)} (it reads no text)")
        source = load_text(text) if any(e.uses_text for e in entries) else None
        for entry in entries:
            if source is not None and len(source.data) < entry.min_text_bytes:
                raise ValueError(
                    f"{entry.key} reads the first {entry.min_text_bytes} bytes of its text; "
                    f"{source.path or source.id} has {len(source.data)}"
                )
    argv = invocation_argv()
    console = _console()
    for entry in entries:
        context = RunContext(
            device=torch_device,
            budget=budget,
            text=source if entry.uses_text else None,
            argv=argv,
            output_dir=default_output_dir(entry.key, output_dir),
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
    Lists the checks that could not be made and why (e.g. a record from another source tree).
    Exits 1, listing each problem, when anything does not match."""
    from kvlab.artifacts import validate_artifact

    console = _console()
    failed = False
    for path in paths:
        if not path.is_file():
            failed = True
            console.print(f"[red]FAILED[/] {path}: no such file")
            continue
        report = validate_artifact(path, root=root)
        if report.ok:
            console.print(f"[green]ok[/] {path}: {report.kind}, {report.summary()}")
            for note in report.unchecked:
                console.print(f"  not checked: {note}")
            continue
        failed = True
        console.print(f"[red]FAILED[/] {path}: {report.kind or 'unrecognized'}")
        for problem in report.problems:
            console.print(f"  - {problem}")
        for note in report.unchecked:
            console.print(f"  not checked: {note}")
    if failed:
        raise typer.Exit(1)


@app.command()
def papers() -> None:
    """List the registered diagnostics."""
    from kvlab.diagnostics.registry import get_paper, paper_keys

    console = _console()
    for key in paper_keys():
        console.print(f"{key:12s} {get_paper(key).title}")


@app.command()
def methods(
    markdown: Annotated[
        bool, typer.Option(help="Print the Markdown table the README and docs/methods.md use.")
    ] = False,
    measure: Annotated[
        bool,
        typer.Option(
            "--bytes",
            help="Measure each method's bytes vs a 16-bit cache on a 4,096-token reference "
            "prompt (about a minute of CPU).",
        ),
    ] = False,
    headline: Annotated[
        bool, typer.Option(help="Only the README's main methods, not every variant.")
    ] = False,
) -> None:
    """List the KV-cache methods --method takes: name, what it does, source (paper)."""
    from kvlab.evaluation.methods.catalog import CATALOG, markdown_table, measure_fractions

    docs = [doc for doc in CATALOG if doc.headline or not headline]
    fractions = None
    if measure:
        import torch

        torch.set_num_threads(1)  # the same figures on every machine (one thread)
        fractions = measure_fractions(doc.example for doc in docs)
    if markdown:
        sys.stdout.write(markdown_table(docs, fractions))
        return
    import shutil
    import textwrap

    width = min(100, shutil.get_terminal_size().columns)
    out = []
    for doc in docs:
        head = doc.shown_as
        if fractions is not None and doc.example in fractions:
            head += f"   ({fractions[doc.example]:.3f} of a 16-bit cache's bytes as {doc.example})"
        out += textwrap.wrap(head, width, subsequent_indent="  ", break_on_hyphens=False)
        for part in (doc.summary + ".", doc.source):
            out += textwrap.wrap(part, width, initial_indent="    ", subsequent_indent="    ")
    out.append("")
    out += textwrap.wrap(
        "R = evicted fraction in [0, 1); SCORER = snapkv (default), keynorm, recency, "
        "expected-attention, tova, combined, kvzip; PNMIX = a PN-Mix name without calibration "
        "(pn-mix, pn-mix-lean, kivi-2bit, ...). The grammar and every option: docs/methods.md.",
        width,
    )
    sys.stdout.write("\n".join(out) + "\n")


app.command("eval")(eval_command)
app.command("sweep")(sweep_command)
app.add_typer(models_app, name="models")

__all__ = ["app", "err_console", "fail", "invocation_argv", "main", "parse_seeds"]


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
