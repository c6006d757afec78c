"""Where ``kvlab eval`` / ``kvlab sweep`` write, and the check that they can, made before any
model loads (a bad ``--output-dir`` must not cost the compute)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvlab.userinput import quote

__all__ = ["EvalPaths", "check_output_paths", "eval_paths", "task_file_names"]

#: Used when the file system does not say (POSIX's usual NAME_MAX and PATH_MAX).
_NAME_MAX, _PATH_MAX = 255, 4096

_PLOTS = {
    "prefill-score": "kl-vs-bytes.png",
    "stream": "stream-ppl.png",
    "needle": "needle-heatmap.png",
    "ruler": "ruler-heatmap.png",
}


@dataclass(frozen=True)
class EvalPaths:
    """The files of one evaluation (names as in ``kvlab eval --help``)."""

    folder: Path
    table: Path
    raw: Path
    artifact: Path
    plot: Path
    tasks: Path

    def files(self) -> list[Path]:
        return [self.table, self.raw, self.artifact, self.plot]


def eval_paths(folder: Path, protocol: str, device_type: str) -> EvalPaths:
    """``table-<protocol>.md``, ``raw-<protocol>-<device>.json``,
    ``metrics-<protocol>-<device>.json``, the plot, and the task store ``tasks/``."""
    folder = Path(folder)
    label = f"{protocol}-{device_type}"
    return EvalPaths(
        folder=folder,
        table=folder / f"table-{protocol}.md",
        raw=folder / f"raw-{label}.json",
        artifact=folder / f"metrics-{label}.json",
        plot=folder / _PLOTS[protocol],
        tasks=folder / "tasks",
    )


def task_file_names() -> list[str]:
    """The longest names of the task store's files (a sha256 key and its suffixes), which
    the length check of :func:`check_output_paths` stands for every task file by."""
    return [f"{'0' * 64}.json", f"{'0' * 64}.logprobs.safetensors"]


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return default


def _check_length(path: Path, existing: Path, option: str, folder: Path) -> None:
    """Refuse ``path`` when one of its names, or the whole, is longer (in bytes) than the
    file system under ``existing`` allows."""
    name_max = _limit(existing, "PC_NAME_MAX", _NAME_MAX)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise ValueError(
                f"{option} {quote(folder)}: the name {quote(part)} is {size} bytes long; "
                f"this file system allows {name_max}"
            )
    whole = len(os.fsencode(os.path.abspath(path)))
    path_max = _limit(existing, "PC_PATH_MAX", _PATH_MAX)
    if whole >= path_max:
        raise ValueError(
            f"{option} {quote(folder)}: {quote(path)} would be {whole} bytes long; this file "
            f"system allows {path_max - 1} (choose a shorter --output-dir)"
        )


def check_output_paths(
    folder: Path, files: Iterable[Path] = (), option: str = "--output-dir"
) -> None:
    """Check that ``folder`` can be created or written, that no file to write is a folder,
    and that no path (``folder`` and ``files``) is longer than the file system allows (a name
    over ``NAME_MAX`` bytes, a path of ``PATH_MAX`` bytes or more); creates nothing.

    Raises:
        ValueError: one line naming the path and the reason (a file where a folder is needed,
            a folder where a file is needed, no permission to write, or a name or path too
            long).
    """
    folder = Path(folder)
    files = [Path(file) for file in files]
    existing = Path(os.path.abspath(folder))
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    for path in (folder, *files):
        _check_length(path, existing if existing.is_dir() else existing.parent, option, folder)
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {quote(folder)}: {quote(existing)} exists and is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"{option} {quote(folder)}: cannot write in {quote(existing)} ({reason})"
        ) from exc
    for file in files:
        if file.is_dir():
            raise ValueError(
                f"{option} {quote(folder)}: {quote(file)} is a folder, where a file is written"
            )
