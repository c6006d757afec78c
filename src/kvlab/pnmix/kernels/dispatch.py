"""Which backend computes packed attention (docs/design.md, "Kernels").

Backends: ``"torch"`` (the reference, :func:`~kvlab.pnmix.attention.packed_attention_reference`,
any device), ``"cpu"`` (the compiled C++ kernel, :mod:`kvlab.pnmix.kernels.cpu`) and
``"triton"`` (:mod:`kvlab.pnmix.kernels.triton_decode`; CUDA, or the CPU under
``TRITON_INTERPRET=1``).

Rule: an explicit ``backend=`` argument wins; else the environment variable
``KVLAB_PNMIX_BACKEND`` (same values; the ``"pnmix"`` entry of :mod:`kvlab.backends`); else
``"auto"``: on CUDA ``"triton"`` when the ``triton`` package is installed, else ``"torch"``; on
the CPU ``"cpu"`` (compiled on first use, about a minute, one log line; if it cannot be
compiled, one log line says why and ``"torch"`` is used); on other devices ``"torch"``.
``"auto"`` also uses ``"torch"`` for a cache that the chosen kernel does not support
(:func:`~kvlab.pnmix.kernels.spec.kernel_key_decode` describes the cache's codecs once;
:func:`unsupported` says what each backend lacks); an explicit compiled backend refuses it
with ``ValueError``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvlab import backends
from kvlab.pnmix.kernels import cpu
from kvlab.pnmix.kernels.spec import KernelKeyDecode

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "requested_backend",
    "select_backend",
    "select_flush_backend",
    "triton_installed",
    "unsupported",
]

BACKENDS: tuple[str, ...] = backends.PNMIX.choices  # ("torch", "cpu", "triton")
ENV_VAR = backends.PNMIX.env_var  # "KVLAB_PNMIX_BACKEND"


def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def unsupported(backend: str, decode: KernelKeyDecode | str) -> str | None:
    """Why compiled ``backend`` cannot run a cache whose codecs ``decode`` describes, or
    ``None`` when it can (docs/design.md, "Kernels", "Capabilities"). Both compiled kernels
    run every :class:`KernelKeyDecode` today; a backend that lags behind a new decode step
    says so here."""
    if isinstance(decode, str):
        return decode
    return None


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_backend(backend: str) -> str:
    """``backend`` unless it is ``"auto"``; then ``KVLAB_PNMIX_BACKEND`` if set, else
    ``"auto"``.

    Raises:
        ValueError: ``backend`` or the environment variable is not ``"auto"`` or a backend.
    """
    return backends.requested("pnmix", backend)


def select_backend(backend: str, device: torch.device, decode: KernelKeyDecode | str) -> str:
    """The backend that runs packed attention of a cache on ``device`` (module docstring).

    Args:
        backend: ``"auto"`` or one of :data:`BACKENDS`.
        device: where the cache's buffers live.
        decode: the codec's :class:`~kvlab.pnmix.kernels.spec.KernelKeyDecode`, or the reason
            compiled kernels cannot decode it.

    Raises:
        ValueError: an unknown backend; an explicit compiled backend for a codec it cannot
            decode or a device it does not run on.
        RuntimeError: an explicit backend that is not available here (not installed, not
            compiled).
    """
    choice = requested_backend(backend)
    if choice == "torch":
        return choice
    if choice == "auto":
        if isinstance(decode, str):
            return "torch"
        if device.type == "cuda":
            good = triton_installed() and unsupported("triton", decode) is None
            return "triton" if good else "torch"
        if device.type == "cpu":
            return "cpu" if cpu.load() is not None else "torch"
        return "torch"
    reason = unsupported(choice, decode)
    if reason is not None:
        raise ValueError(f"backend {choice!r} cannot run this cache: {reason}")
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs the cache on the CPU; it is on {device}")
        if cpu.load() is None:
            raise RuntimeError(f"backend 'cpu' is not available: {cpu.cpu_kernel_status()}")
        return choice
    if not triton_installed():
        raise RuntimeError("backend 'triton' needs the triton package: pip install 'kvlab[triton]'")
    if device.type == "cpu" and not _triton_interpret():
        raise ValueError(
            "backend 'triton' runs on CUDA; on the CPU only under TRITON_INTERPRET=1 (tests)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend 'triton' runs on CUDA; the cache is on {device}")
    return choice


def select_flush_backend(device: torch.device) -> str:
    """The backend that codes the groups an append flushes (docs/design.md, "Kernels",
    "Flush"): ``"cpu"`` (the compiled encoder, byte for byte the torch codecs' result) for a
    cache on the CPU when ``KVLAB_PNMIX_BACKEND`` is unset, ``"auto"`` or ``"cpu"`` and the
    kernel compiles (compiled on first use, as for attention); else ``"torch"`` (the codecs
    themselves). The caller also checks that the kernel codes the cache's codecs
    (:func:`~kvlab.pnmix.kernels.cpu.flush_unsupported`).

    Raises:
        ValueError: ``KVLAB_PNMIX_BACKEND`` is not ``"auto"`` or a backend.
    """
    if device.type != "cpu" or requested_backend("auto") not in ("auto", "cpu"):
        return "torch"
    return "cpu" if cpu.load() is not None else "torch"
