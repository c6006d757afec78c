"""Which backend computes packed attention, and the table of kernels behind each backend
(docs/design.md, "Kernels").

Backends: ``"torch"`` (the reference, :func:`~kvlab.pnmix.reference.packed_attention_reference`,
any device), ``"cpu"`` (the compiled C++ kernel, :mod:`kvlab.pnmix.kernels.cpu`) and
``"triton"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``).

Rule: an explicit ``backend=`` argument wins; else the environment variable
``KVLAB_PNMIX_BACKEND`` (same values; the ``"pnmix"`` entry of :mod:`kvlab.backends`); else
``"auto"``: on CUDA ``"triton"`` when the ``triton`` package is installed, else ``"torch"``; on
the CPU ``"cpu"`` (compiled on first use, about a minute, one log line; if it cannot be
compiled, one log line says why and ``"torch"`` is used); on other devices ``"torch"``.
``"auto"`` also uses ``"torch"`` for a cache that the chosen kernel does not support
(:func:`~kvlab.pnmix.kernels.spec.kernel_key_decode` describes the cache's codecs once;
:func:`unsupported` says what each backend lacks); an explicit compiled backend refuses it
with ``ValueError``.

The kernels are data (:data:`KERNELS`, as vLLM's attention backend registry): each
:class:`KernelEntry` names the backend it serves, the module and functions that implement it
(imported when first chosen: a Triton module needs ``triton``) and the check of what it covers.
A backend's first entry that covers a store runs it (:func:`attention_kernel`,
:func:`decode_step_kernel`): for ``"triton"`` the split-K kernel
(:mod:`~kvlab.pnmix.kernels.triton_splitk`), else the older
:mod:`~kvlab.pnmix.kernels.triton_decode`, which covers every decode description (per-token
keys, 3-bit codes and partial rotary need it). Every kernel has one signature — the contract at
the bottom: a :class:`~kvlab.pnmix.store.PackedKV` in, float32 attention out — and is tested
against the torch reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kvlab import backends
from kvlab.pnmix.kernels import cpu
from kvlab.pnmix.kernels.spec import KernelKeyDecode
from kvlab.pnmix.kernels.splits import splitk_unsupported
from kvlab.pnmix.store import PackedKV

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KERNELS",
    "AttentionKernel",
    "DecodeStepKernel",
    "KernelEntry",
    "attention_kernel",
    "decode_step_kernel",
    "has_decode_step",
    "kernel_entry",
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
    ``None`` when it can (docs/design.md, "Kernels", "Capabilities"). Each compiled backend
    has a kernel in :data:`KERNELS` that runs every :class:`KernelKeyDecode` today (``"cpu"``;
    ``"triton"``'s older kernel); a backend that lags behind a new decode step says so here.
    Which of a backend's kernels runs a given store is :func:`kernel_entry`'s."""
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


# ---------------------------------------------------------------------- the kernel table
class AttentionKernel(Protocol):
    """A compiled packed-attention kernel: what
    :func:`~kvlab.pnmix.reference.packed_attention_reference` computes for ``query`` ``[B, H_q,
    Q, D]`` over ``kv``, as float32 ``[B, H_q, Q, Dv]``; ``decode`` is the store's
    :class:`~kvlab.pnmix.kernels.spec.KernelKeyDecode` and ``mu`` float32 ``[B, H, 1, D]`` the
    rows' reference keys (:func:`~kvlab.pnmix.reference.reference_keys`)."""

    def __call__(
        self,
        query: Tensor,
        kv: PackedKV,
        decode: KernelKeyDecode,
        mu: Tensor,
        *,
        scale: float,
        causal: bool,
        logit_softcap: float | None,
        sink_logits: Tensor | None,
    ) -> Tensor: ...


class DecodeStepKernel(Protocol):
    """A fused decode step (one token per row into the residual of ``kv``'s buffers, then
    attention over the rows including it; :func:`~kvlab.pnmix.kernels.cpu.decode_step_cpu`):
    float32 ``[B, H_q, 1, Dv]``; ``ok`` (bool 0-d) is AND-ed with the token's validity."""

    def __call__(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        kv: PackedKV,
        decode: KernelKeyDecode,
        ok: Tensor,
        *,
        scale: float,
        logit_softcap: float | None,
        sink_logits: Tensor | None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel of :data:`KERNELS`.

    Attributes:
        backend: the backend it serves (``"cpu"``, ``"triton"``).
        name: the kernel's name (logs, tests).
        module: the module holding its functions, imported when the entry is first chosen.
        attention: the name of that module's :class:`AttentionKernel`.
        decode_step: the name of that module's :class:`DecodeStepKernel`, or ``None`` (no
            fused step).
        unsupported: why it cannot run a store (``(kv, decode) -> reason | None``; host
            metadata only, asked on every call), or ``None``: it runs every
            :class:`~kvlab.pnmix.kernels.spec.KernelKeyDecode` on any store.
    """

    backend: str
    name: str
    module: str
    attention: str
    decode_step: str | None = None
    unsupported: Callable[[PackedKV, KernelKeyDecode], str | None] | None = None

    def why_not(self, kv: PackedKV, decode: KernelKeyDecode) -> str | None:
        """``None`` when this kernel runs ``kv``, else why not."""
        return None if self.unsupported is None else self.unsupported(kv, decode)

    def function(self, name: str) -> Callable[..., Tensor]:
        """Function ``name`` of :attr:`module` (looked up on every call: a test may replace
        it)."""
        fn: Callable[..., Tensor] = getattr(importlib.import_module(self.module), name)
        return fn


#: The compiled kernels, in order of preference within a backend.
KERNELS: tuple[KernelEntry, ...] = (
    KernelEntry(
        backend="cpu",
        name="cpu",
        module="kvlab.pnmix.kernels.cpu",
        attention="packed_attention_cpu",
        decode_step="decode_step_cpu",
    ),
    KernelEntry(
        backend="triton",
        name="triton-splitk",
        module="kvlab.pnmix.kernels.triton_splitk",
        attention="packed_attention_splitk",
        unsupported=splitk_unsupported,
    ),
    KernelEntry(
        backend="triton",
        name="triton-decode",
        module="kvlab.pnmix.kernels.triton_decode",
        attention="packed_attention_triton",
    ),
)


def kernel_entry(backend: str, kv: PackedKV, decode: KernelKeyDecode) -> KernelEntry:
    """The first entry of :data:`KERNELS` for ``backend`` that runs ``kv`` (no device read).

    Raises:
        ValueError: no kernel of ``backend`` runs it (each one's reason in the message).
    """
    reasons = []
    for entry in KERNELS:
        if entry.backend != backend:
            continue
        reason = entry.why_not(kv, decode)
        if reason is None:
            return entry
        reasons.append(f"{entry.name}: {reason}")
    raise ValueError(f"no {backend!r} kernel runs this cache ({'; '.join(reasons) or 'none'})")


def attention_kernel(backend: str, kv: PackedKV, decode: KernelKeyDecode) -> AttentionKernel:
    """The attention function of :func:`kernel_entry` (``backend`` a compiled backend that
    :func:`select_backend` chose)."""
    entry = kernel_entry(backend, kv, decode)
    fn: AttentionKernel = entry.function(entry.attention)
    return fn


def has_decode_step(backend: str) -> bool:
    """Whether some kernel of ``backend`` has a fused decode step (before building a
    :class:`~kvlab.pnmix.store.PackedKV` for :func:`decode_step_kernel`)."""
    return any(e.backend == backend and e.decode_step is not None for e in KERNELS)


def decode_step_kernel(
    backend: str, kv: PackedKV, decode: KernelKeyDecode
) -> DecodeStepKernel | None:
    """The fused decode step of :func:`kernel_entry`, or ``None`` when that kernel has none."""
    entry = kernel_entry(backend, kv, decode)
    if entry.decode_step is None:
        return None
    fn: DecodeStepKernel = entry.function(entry.decode_step)
    return fn
