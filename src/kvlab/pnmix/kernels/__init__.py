"""Compiled backends of PN-Mix packed attention and their dispatch (docs/design.md, "Kernels").

* :mod:`~kvlab.pnmix.kernels.spec` — a key codec as compiled kernels decode it (and the
  extension points for later codecs);
* :mod:`~kvlab.pnmix.kernels.dispatch` — which backend runs (``"torch"``, ``"cpu"``,
  ``"triton"``; argument, ``KVLAB_PNMIX_BACKEND`` read by :mod:`kvlab.backends`, automatic
  rule);
* :mod:`~kvlab.pnmix.kernels.tables` — the RoPE / Hadamard tables and extra arguments both
  compiled kernels read;
* :mod:`~kvlab.pnmix.kernels.cpu` — the C++ CPU kernel (``cpu_kernel.cpp``, and the group
  flush's encoder ``cpu_flush.cpp``; compiled once on first use);
* :mod:`~kvlab.pnmix.kernels.triton_decode` — the Triton kernel (imported only when used).

Every backend reads a :class:`~kvlab.pnmix.store.PackedStore`'s buffers in place and is tested
against the torch reference :func:`~kvlab.pnmix.attention.packed_attention_reference`.
"""

from __future__ import annotations

from kvlab.pnmix.kernels import cpu, dispatch  # submodules, for tests and tools
from kvlab.pnmix.kernels.dispatch import (
    BACKENDS,
    ENV_VAR,
    requested_backend,
    select_backend,
    select_flush_backend,
    triton_installed,
)
from kvlab.pnmix.kernels.spec import KernelKeyDecode, kernel_key_decode, register_pair_mode

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KernelKeyDecode",
    "cpu",
    "dispatch",
    "kernel_key_decode",
    "register_pair_mode",
    "requested_backend",
    "select_backend",
    "select_flush_backend",
    "triton_installed",
]
