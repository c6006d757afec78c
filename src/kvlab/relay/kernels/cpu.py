"""The compiled CPU decode attention of RoPE-Relay (docs/design.md, "RoPE-Relay: Attention"),
and of the dense exact cache (:func:`dense_decode_cpu`).

``cpu_decode.cpp`` beside this module is compiled once per machine on first use
(:func:`kvlab.native.compile_module`: about half a minute, one log line). If it cannot be
compiled, :func:`load` logs the reason once and returns ``None``, and
:func:`~kvlab.relay.attention.ragged_attention` uses SDPA (the torch reference).

Backend rule (:func:`decode_backend`, the ``"relay"`` entry of :mod:`kvlab.backends`):
``KVLAB_RELAY_BACKEND`` = ``auto`` (default), ``torch`` or ``cpu``. ``auto`` runs the compiled
kernel for what it covers — a decode step (one query per sequence, none of them padding) over
a float32 store on the CPU, without Gemma 2 soft-capping or GPT-OSS sinks — and SDPA for
everything else; ``cpu`` is the same but fails when the kernel cannot be compiled; ``torch``
always uses SDPA.
"""

from __future__ import annotations

from importlib import resources
from types import ModuleType
from typing import TYPE_CHECKING

from torch import Tensor

from kvlab import backends
from kvlab.native import CompiledModule, compile_module

if TYPE_CHECKING:
    from kvlab.relay.storage import RelayStore

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "cpu_kernel_status",
    "decode_backend",
    "dense_decode_cpu",
    "load",
    "ragged_decode_cpu",
]

BACKENDS: tuple[str, ...] = backends.RELAY.choices  # ("torch", "cpu")
ENV_VAR = backends.RELAY.env_var  # "KVLAB_RELAY_BACKEND"


def decode_backend() -> str:
    """``"auto"``, ``"torch"`` or ``"cpu"`` from ``KVLAB_RELAY_BACKEND`` (unset: ``"auto"``).

    Raises:
        ValueError: any other value.
    """
    return backends.env_backend("relay")


def _compile() -> ModuleType:
    source = resources.files("kvlab.relay.kernels").joinpath("cpu_decode.cpp").read_text("utf-8")
    return compile_module(
        "kvlab_relay_cpu",
        source,
        ["ragged_decode", "dense_decode"],
        "kvlab: compiling the RoPE-Relay CPU decode kernel (once per machine, about half a "
        f"minute; set {ENV_VAR}=torch to skip it)",
    )


_KERNEL = CompiledModule(
    lambda: _compile(),
    "RoPE-Relay CPU decode kernel",
    f"relay attention uses SDPA ({ENV_VAR}=cpu refuses instead)",
)


def load() -> ModuleType | None:
    """The compiled module (compiled on the first call), or ``None`` when it cannot be built
    (the reason is logged once and kept in :func:`cpu_kernel_status`)."""
    return _KERNEL.load()


def cpu_kernel_status() -> str:
    """``"not loaded"``, ``"loaded"`` or ``"unavailable: <reason>"``."""
    return _KERNEL.status()


def ragged_decode_cpu(module: ModuleType, query: Tensor, store: RelayStore, scale: float) -> Tensor:
    """One decode step's attention over every segment of ``store`` with the compiled kernel.

    Args:
        module: from :func:`load`.
        query: float32 ``[B, H_q, 1, D]`` on the CPU (``B == store.batch``, ``H_q`` a multiple
            of ``store.heads``); store: float32, every segment holding at least one token.
        scale: softmax scale of the logits.

    Returns:
        float32 ``[B, H_q, 1, Dv]``: softmax attention of each query head over the stored
        tokens of its kv head (GQA), equal to the SDPA reference to float32 rounding.
    """
    batch, q_heads, _, dim = query.shape
    segments = store.num_segments
    q = query.reshape(segments, q_heads // store.heads, dim).contiguous()
    out = module.ragged_decode(q, store.keys, store.values, store.stride, store.lengths, scale)
    return out.view(batch, q_heads, 1, store.value_dim)


def dense_decode_cpu(
    module: ModuleType, query: Tensor, keys: Tensor, values: Tensor, length: int, scale: float
) -> Tensor:
    """One decode step's exact attention over the first ``length`` tokens of dense buffers with
    the compiled kernel (every kv head's keys and values read once for its query heads).

    Args:
        module: from :func:`load`.
        query: float32 ``[B, H_q, 1, D]`` on the CPU, ``H_q`` a multiple of ``H_kv``.
        keys, values: float32 ``[B, H_kv, S, D]`` / ``[B, H_kv, S, Dv]`` on the CPU whose token
            rows are contiguous (a view of a larger buffer is fine: no copy).
        length: tokens attended per (sequence, kv head), ``1 <= length <= S``.
        scale: softmax scale of the logits.

    Returns:
        float32 ``[B, H_q, 1, Dv]``: softmax attention of each query head over its kv head's
        first ``length`` tokens (GQA), equal to SDPA to float32 rounding (its exponential is
        :file:`kvlab_simd.h`'s ``exp_approx``, relative error about 2e-7).

    Raises:
        RuntimeError: buffers the kernel cannot read in place (see ``cpu_decode.cpp``).
    """
    batch, q_heads, _, dim = query.shape
    heads = keys.shape[1]
    q = query.reshape(batch * heads, q_heads // heads, dim).contiguous()
    out = module.dense_decode(q, _segments(keys), _segments(values), length, scale)
    return out.view(batch, q_heads, 1, values.shape[-1])


def _segments(t: Tensor) -> Tensor:
    """``[B, H, S, D]`` as ``[B * H, S, D]``, without a copy when the (B, H) axes collapse to
    one stride (a view of a ``[B, H, capacity, D]`` buffer does)."""
    b, h, s, d = t.shape
    if t.stride(0) == h * t.stride(1) or b == 1:
        return t.as_strided((b * h, s, d), (t.stride(1), t.stride(2), t.stride(3)))
    return t.reshape(b * h, s, d)
