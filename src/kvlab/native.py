"""Building kvlab's compiled CPU kernels (C++ sources shipped in the package).

:func:`compile_module` compiles C++ source text with ``torch.utils.cpp_extension.load_inline``
(``-O3 -march=native``, no fast-math, OpenMP when the compiler has it) into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), under a name unique
to the source, the flags, the torch version and this processor, so a rebuilt source or another
machine never loads a stale binary. The shared headers of :mod:`kvlab.kernels_common`
(``kvlab_simd.h``) are on the include path of every build and part of that name.

A build interrupted (Ctrl-C, a killed process) leaves torch's build lock (its file ``lock`` in
the build folder) behind, and torch then waits on it forever. kvlab therefore builds under its
own lock first — ``fcntl.flock`` on ``kvlab.flock`` in the same folder, which the kernel
releases when its holder dies — and, holding it, removes a ``lock`` file left there: no other
kvlab process can be building that name then, so the file is stale by construction.

Used by :mod:`kvlab.pnmix.kernels.cpu` and :mod:`kvlab.relay.kernels.cpu`; each keeps its own
"compiled once, or the reason it could not be" state (:class:`CompiledModule`). This module
only compiles: which backend runs, and loading the kernels a method needs, is
:mod:`kvlab.backends`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock only
    fcntl = None  # type: ignore[assignment]

import torch

from kvlab.kernels_common import INCLUDE_DIR, header_sources

__all__ = [
    "FLAGS",
    "CompiledModule",
    "build_lock",
    "compile_module",
    "module_name",
]

_LOG = logging.getLogger("kvlab")

#: Compiler flags of every kvlab CPU kernel (``-ffp-contract=fast`` fuses multiply-adds; no
#: ``-ffast-math``: the kernels rely on IEEE ``inf`` and ordered reductions).
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math")


def module_name(prefix: str, source: str, flags: Sequence[str]) -> str:
    """``prefix`` + a digest of the source, flags, torch version and this CPU (``-march=native``
    binaries must not be shared between different processors)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    digest = hashlib.sha256(
        "\0".join([source, *flags, torch.__version__, cpu]).encode()
    ).hexdigest()
    return f"{prefix}_{digest[:16]}"


def _build_directory(name: str) -> str | None:
    """torch's build folder of extension ``name`` (created), or ``None`` if torch's private
    helper moved."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(name, False)
    except Exception:
        return None


def _built(name: str) -> bool:
    folder = _build_directory(name)
    # a private helper: if it moved, just announce the build
    return folder is not None and os.path.exists(os.path.join(folder, f"{name}.so"))


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold kvlab's lock of build ``name`` and clear a stale torch build lock (module
    docstring). Without ``fcntl`` (not POSIX) or a build folder, does nothing."""
    folder = _build_directory(name)
    if fcntl is None or folder is None:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kvlab.flock"), "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(folder, "lock")
            if os.path.exists(stale):
                _LOG.warning("kvlab: removing the build lock an interrupted build left: %s", stale)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_module(
    prefix: str, source: str, functions: Sequence[str], announcement: str
) -> ModuleType:
    """Compile (or load the cached build of) ``source`` exposing ``functions``; with OpenMP
    first, then without. ``announcement`` is logged once before an actual compilation. The
    source may ``#include`` the shared headers of :mod:`kvlab.kernels_common` (their text is
    part of the build's name, :func:`module_name`).

    Raises:
        RuntimeError: neither build worked (the last line of each error, joined).
    """
    from torch.utils.cpp_extension import load_inline

    errors = []
    announced = False
    # an edited header is another build, and so is another checkout: the include path is a
    # flag of the build, so two checkouts sharing TORCH_EXTENSIONS_DIR under one name would
    # rebuild each other's binary in turn (and wait on each other's build lock)
    hashed = "\0".join([source, *header_sources(), str(INCLUDE_DIR)])
    for openmp in (["-fopenmp"], []):
        flags = [*FLAGS, *openmp]
        name = module_name(prefix, hashed, flags)
        if not announced and not _built(name):
            _LOG.warning(announcement)  # once, also when the OpenMP build fails first
            announced = True
        try:
            with build_lock(name):
                return load_inline(
                    name,
                    cpp_sources=[source],
                    functions=list(functions),
                    extra_cflags=flags,
                    extra_ldflags=openmp,
                    extra_include_paths=[str(INCLUDE_DIR)],
                    verbose=False,
                )
        except Exception as err:  # compiler missing, flags refused, headers absent, ...
            lines = str(err).strip().splitlines() or [type(err).__name__]
            errors.append(f"{' '.join(flags)}: {lines[-1]}")
    raise RuntimeError("; ".join(errors))


class CompiledModule:
    """A kernel module compiled on first use, once per process — or the reason it could not be
    (logged once; callers then run their torch reference).

    Args:
        build: compiles and returns the module (e.g. a call of :func:`compile_module`).
        what: the kernel's name in the log line; fallback: what runs instead (same line).
    """

    def __init__(self, build: Callable[[], ModuleType], what: str, fallback: str) -> None:
        self._build = build
        self._what = what
        self._fallback = fallback
        self._lock = threading.Lock()
        self.state: dict[str, object] = {}

    def load(self) -> ModuleType | None:
        """The compiled module (compiled on the first call), or ``None`` when it cannot be
        built (the reason is logged once and kept in :meth:`status`)."""
        with self._lock:
            if "module" not in self.state:
                try:
                    self.state["module"] = self._build()
                except Exception as err:
                    self.state["module"] = None
                    self.state["error"] = str(err)
                    _LOG.warning(
                        "kvlab: the %s could not be compiled (%s); %s",
                        self._what,
                        err,
                        self._fallback,
                    )
            module = self.state["module"]
        return module if isinstance(module, ModuleType) else None

    def loaded(self) -> ModuleType | None:
        """The module if it is already compiled and loaded (never compiles)."""
        module = self.state.get("module")
        return module if isinstance(module, ModuleType) else None

    def status(self) -> str:
        """``"not loaded"``, ``"loaded"`` or ``"unavailable: <reason>"``."""
        if "module" not in self.state:
            return "not loaded"
        if self.state["module"] is not None:
            return "loaded"
        return f"unavailable: {self.state.get('error')}"
