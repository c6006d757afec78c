"""Where ``kvlab eval`` / ``kvlab sweep`` write, and the check that they can, made before any
model loads (a bad ``--output-dir`` must not cost the compute)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvlab.userinput import quote

__all__ = ["EvalPaths", "check_output_paths", "eval_paths"]

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


def check_output_paths(
    folder: Path, files: Iterable[Path] = (), option: str = "--output-dir"
) -> None:
    """Check that ``folder`` can be created or written and that no file to write is a folder;
    creates nothing.

    Raises:
        ValueError: one line naming the path and the reason (a file where a folder is needed,
            a folder where a file is needed, or no permission to write).
    """
    folder = Path(folder)
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
        if Path(file).is_dir():
            raise ValueError(
                f"{option} {quote(folder)}: {quote(file)} is a folder, where a file is written"
            )
