"""What every ``kvlab`` command shares, below :mod:`kvlab.cli` and the command modules it
mounts (:mod:`kvlab.evaluation.command`): one error style — ``error: <one line>`` on stderr,
exit code 2 (Ctrl-C: ``interrupted: ...``, exit code 130), no traceback for a user's mistake —
and the command line as it was typed (:func:`invocation_argv`, recorded in artifacts)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer

from kvlab.userinput import quote

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "err_console",
    "fail",
    "invocation_argv",
    "user_errors",
]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def err_console() -> Any:
    """A rich console on stderr that never wraps a message."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, highlight=False)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (``message`` is shown as it
    is: rich markup in it, e.g. a method name with ``[...]``, is not interpreted)."""
    from rich.markup import escape

    err_console().print(f"[red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(code)


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{quote(exc.filename)}: {exc.strerror}"
    return str(exc) or type(exc).__name__


@contextmanager
def user_errors(interrupted: str | Callable[[], str] | None = None) -> Iterator[None]:
    """Turn the errors a user can cause (bad values, missing files or models)
    into :func:`fail`; Ctrl-C prints ``interrupted: <interrupted>`` (what was kept, how to
    resume; a callable is asked at that moment, so it can say what is there then)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        sys.stderr.write("\n")
        said = interrupted() if callable(interrupted) else interrupted
        err_console().print(f"interrupted{': ' + said if said else ''}", markup=False)
        raise typer.Exit(EXIT_INTERRUPTED) from exc
    except (ValueError, OSError, KeyError) as exc:
        fail(_message(exc))


def invocation_argv() -> list[str]:
    """The command as it was typed: ``kvlab ...`` for the console script,
    ``python -m kvlab.cli ...`` for the module form."""
    program = Path(sys.argv[0]).name
    prefix = ["python", "-m", "kvlab.cli"] if program in ("cli.py", "__main__.py") else [program]
    return [*prefix, *sys.argv[1:]]
