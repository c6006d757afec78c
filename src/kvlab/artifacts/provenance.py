"""Provenance: where an artifact came from, stated so that it can be checked later.

Source files are identified by POSIX paths relative to the *source root*: the repository root
when kvlab runs from a checkout (``<root>/src/kvlab``), else the folder that holds the
installed ``kvlab`` package. Their sha256 is over the raw bytes.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kvlab

__all__ = [
    "command_string",
    "file_sha256",
    "git_state",
    "manifest_digest",
    "provenance_block",
    "sha256_bytes",
    "source_hashes",
    "source_root",
]


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's raw bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkout_root() -> Path | None:
    """The repository root when kvlab runs from a source checkout (``<root>/src/kvlab``)."""
    parent = Path(kvlab.__file__).resolve().parent.parent
    if parent.name == "src" and (parent.parent / "pyproject.toml").is_file():
        return parent.parent
    return None


def source_root() -> Path:
    """The folder that recorded source paths are relative to (see module docstring)."""
    return _checkout_root() or Path(kvlab.__file__).resolve().parent.parent


def source_hashes(paths: Iterable[str], root: Path | None = None) -> dict[str, str]:
    """sha256 of each source file, keyed by its POSIX path relative to ``root``.

    Args:
        paths: POSIX paths relative to ``root`` (default :func:`source_root`).

    Raises:
        FileNotFoundError: a path does not exist under ``root``.
    """
    base = source_root() if root is None else root
    out: dict[str, str] = {}
    for rel in sorted(set(paths)):
        file = base / rel
        if not file.is_file():
            raise FileNotFoundError(f"source file {rel!r} not found under {base}")
        out[rel] = file_sha256(file)
    return out


def manifest_digest(hashes: Mapping[str, str]) -> str:
    """One sha256 standing for a set of files: sha256 over ``"<path>\\0<sha256>\\n"`` lines,
    sorted by path. Changing, adding or removing any file changes it."""
    lines = "".join(f"{path}\0{hashes[path]}\n" for path in sorted(hashes))
    return sha256_bytes(lines.encode("utf-8"))


def git_state(root: Path | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git work tree at ``root``; ``(None, None)`` outside git.

    By default ``root`` is kvlab's own checkout; an installed (non-checkout) kvlab reports
    ``(None, None)`` rather than the commit of whatever repository happens to contain its
    site-packages. ``dirty`` is true when ``git status --porcelain`` lists any change
    (untracked files included).
    """
    base = _checkout_root() if root is None else root
    if base is None:
        return None, None

    def _git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(base), *args],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git("status", "--porcelain")
    return commit.strip(), (None if status is None else bool(status.strip()))


def command_string(argv: Sequence[str]) -> str:
    """The argv list as one POSIX shell string (:func:`shlex.join`)."""
    return shlex.join(list(argv))


def provenance_block(
    *,
    artifact_path: str,
    raw_result_path: str,
    implementation_files: Sequence[str],
    runner_files: Sequence[str],
    argv: Sequence[str],
    accelerator: str,
    checkpoint: str | None,
    data_sha256: str,
) -> dict[str, Any]:
    """The ``provenance`` block of a metric artifact v2 (field order of reference record 000,
    then ``code_dirty``, ``command_argv`` and ``source_sha256``).

    Raises:
        FileNotFoundError: a listed source file is missing.
    """
    implementation = source_hashes(implementation_files)
    runner = source_hashes(runner_files)
    commit, dirty = git_state()
    return {
        "artifact_path": artifact_path,
        "raw_result": raw_result_path,
        "code_commit": commit,
        "implementation_sha256": manifest_digest(implementation),
        "runner_sha256": manifest_digest(runner),
        "command": command_string(argv),
        "accelerator": accelerator,
        "checkpoint": checkpoint,
        "dataset_fingerprint": f"sha256:{data_sha256}",
        "code_dirty": dirty,
        "command_argv": list(argv),
        "source_sha256": {"implementation": implementation, "runner": runner},
    }
