"""Atomic JSON writing: a crash never leaves half a JSON file behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json_atomic"]


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically.

    The JSON goes to a temporary file in the same directory, is flushed and fsynced, then
    replaces ``path`` with :func:`os.replace` (atomic on POSIX and Windows). Parent
    directories are created. Non-finite floats are rejected (``allow_nan=False``), so no
    ``NaN``/``Infinity`` tokens ever reach an artifact. The file gets the mode a plain
    ``open(path, "w")`` would give (``0o666`` less the umask).

    Returns:
        The written path.

    Raises:
        ValueError: ``obj`` holds a non-finite float.
        TypeError: ``obj`` is not JSON-serializable.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give a normal file's mode
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file (UTF-8)."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
