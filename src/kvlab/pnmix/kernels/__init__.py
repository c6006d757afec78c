"""Compiled backends of PN-Mix packed attention and their dispatch (docs/design.md, "Kernels").

* :mod:`~kvlab.pnmix.kernels.spec` — a key codec as compiled kernels decode it (and the
  extension points for later codecs);
* :mod:`~kvlab.pnmix.kernels.dispatch` — which backend runs (``"torch"``, ``"cpu"``,
  ``"triton"``; argument, ``KVLAB_PNMIX_BACKEND`` read by :mod:`kvlab.backends`, automatic
  rule) and the kernel table behind each compiled backend (:data:`~kvlab.pnmix.kernels.
  dispatch.KERNELS`: which kernel runs a store, looked up as data);
* :mod:`~kvlab.pnmix.kernels.tables` — the RoPE / Hadamard tables and extra arguments both
  compiled kernels read;
* :mod:`~kvlab.pnmix.kernels.cpu` — the C++ CPU kernel (``cpu_kernel.cpp``, and the group
  flush's encoder ``cpu_flush.cpp``; compiled once on first use);
* :mod:`~kvlab.pnmix.kernels.triton_splitk` (jit kernels in
  :mod:`~kvlab.pnmix.kernels.triton_splitk_kernels`, coverage and split count in
  :mod:`~kvlab.pnmix.kernels.splits`) — the split-K Triton kernel, the ``"triton"`` backend
  where it covers the store; :mod:`~kvlab.pnmix.kernels.triton_decode` (jit kernels in
  :mod:`~kvlab.pnmix.kernels.triton_decode_kernels`) — the older Triton kernel, for every other
  store; both imported only when used, with :mod:`~kvlab.pnmix.kernels.triton_common`;
* :mod:`~kvlab.pnmix.kernels.bytes_model` — the bytes a decode step moves.

Every backend takes a :class:`~kvlab.pnmix.store.PackedKV` — a store's buffers read in place,
its host counts and the codec description — and is tested against the torch reference
:func:`~kvlab.pnmix.reference.packed_attention_reference`. No kernel module imports the cache
or :mod:`kvlab.pnmix.attention`: the contract sits below them.
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
