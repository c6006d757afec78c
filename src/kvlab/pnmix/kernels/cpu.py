"""The compiled CPU backend of packed attention (docs/design.md, "Kernels").

The C++ source (``cpu_kernel.cpp`` beside this module) is compiled once per machine on first
use with ``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native``, no fast-math,
OpenMP when the compiler has it) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``); compiling takes about a minute and logs one line. If it
cannot be compiled, :func:`load` logs the reason once and returns ``None``: the dispatcher then
uses the torch reference.

Entry points: :func:`packed_attention_cpu` (the attention of :class:`~kvlab.pnmix.store.
PackedKV` storage, what :func:`~kvlab.pnmix.reference.packed_attention_reference` computes),
:func:`append_residual_cpu` (one token per row into the residual, the decode step's append),
:func:`decode_step_cpu` (both in one call) and :func:`encode_groups_cpu` (the groups an append
flushes, coded bit for bit as the torch codecs code them; ``cpu_flush.cpp``).
"""

from __future__ import annotations

import logging
import math
from importlib import resources
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from kvlab.backends import PNMIX
from kvlab.native import CompiledModule, compile_module
from kvlab.pnmix.kernels.spec import KEYS_WIDTHS, KernelKeyDecode
from kvlab.pnmix.kernels.tables import extra_arguments, rope_table
from kvlab.pnmix.key_codec import KeyCodec, KeyLayout
from kvlab.pnmix.store import EncodedGroups, PackedKV
from kvlab.pnmix.values import HadamardValueCodec, PerTokenValueCodec, ValueCodec
from kvlab.pnmix.width_codec import BitAllocCodec
from kvlab.rope import RotaryConfig, rotation_tables

__all__ = [
    "append_residual_cpu",
    "cpu_kernel_status",
    "decode_step_cpu",
    "encode_groups_cpu",
    "flush_unsupported",
    "load",
    "packed_attention_cpu",
    "rope_table",
]

_LOG = logging.getLogger("kvlab")
_EMPTY = torch.empty(0)


_SOURCES = ("cpu_kernel.cpp", "cpu_flush.cpp", "cpu_tables.cpp")


def _source() -> str:
    files = resources.files("kvlab.pnmix.kernels")
    return "\n".join(files.joinpath(name).read_text("utf-8") for name in _SOURCES)


def _compile() -> ModuleType:
    return compile_module(
        "kvlab_pnmix_cpu",
        _source(),
        ["packed_attention", "append_residual", "decode_step", "encode_groups", "table_terms"],
        "kvlab: compiling the PN-Mix CPU attention kernel (once per machine, about a minute; "
        f"set {PNMIX.env_var}=torch to skip it)",
    )


_KERNEL = CompiledModule(
    lambda: _compile(),  # looked up at the first load: tests replace _compile
    "PN-Mix CPU attention kernel",
    f"packed attention uses the torch reference on the CPU ({PNMIX.env_var}=cpu refuses instead)",
)


def load() -> ModuleType | None:
    """The compiled module (compiled on the first call), or ``None`` when it cannot be built
    (the reason is logged once and kept in :func:`cpu_kernel_status`)."""
    return _KERNEL.load()


def loaded() -> ModuleType | None:
    """The module if it is already compiled and loaded (never compiles)."""
    return _KERNEL.loaded()


def cpu_kernel_status() -> str:
    """``"not loaded"``, ``"loaded"`` or ``"unavailable: <reason>"``."""
    return _KERNEL.status()


def _splits(rows: int, group_counts: np.ndarray) -> int:
    """Group splits per row (split-K): 1 on one thread; else enough tasks for every thread."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    groups = int(group_counts.max(initial=0))
    if groups < 16:
        return 1
    return max(1, min(math.ceil(2 * threads / rows), groups // 8))


def packed_attention_cpu(
    query: Tensor,
    kv: PackedKV,
    decode: KernelKeyDecode,
    mu: Tensor,
    *,
    scale: float,
    causal: bool,
    logit_softcap: float | None,
    sink_logits: Tensor | None,
) -> Tensor:
    """Packed attention by the compiled CPU kernel; the arguments and result of
    :func:`~kvlab.pnmix.reference.packed_attention_reference` (float32 ``[B, H_q, Q, Dv]``),
    plus ``decode`` (the codec, :func:`~kvlab.pnmix.kernels.spec.kernel_key_decode`) and
    ``mu`` (float32 ``[B, H, 1, D]``, the rows' reference keys).

    Raises:
        RuntimeError: the kernel is not compiled (call :func:`load` first).
    """
    module = loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    b, hq, nq, d = query.shape
    hkv = kv.sink_keys.shape[1]
    rows = query.to(device="cpu", dtype=torch.float32) * scale
    rows = rows.reshape(b, hkv, (hq // hkv) * nq, d).contiguous()
    counts = kv.counts_tensor()
    empty = _EMPTY
    out = module.packed_attention(
        rows,
        mu.reshape(b, hkv, d).contiguous(),
        kv.sink_keys,
        kv.sink_values,
        kv.key_codes,
        kv.key_scalars,
        kv.value_codes,
        kv.value_scalars,
        kv.residual_keys,
        kv.residual_values,
        counts,
        empty if kv.mask is None or decode.kind == KEYS_WIDTHS else kv.mask.contiguous(),
        kv.layout.first,
        kv.layout.second,
        empty if sink_logits is None else sink_logits.detach().to(torch.float32).contiguous(),
        decode.kind,
        decode.mode_first,
        decode.mode_second,
        kv.bits,
        kv.group_tokens,
        nq,
        causal,
        0.0 if logit_softcap is None else float(logit_softcap),
        _splits(b * hkv, kv.group_counts),
        *extra_arguments(
            decode,
            mask=kv.mask,
            payload=kv.key_payload,
            rotary=kv.rotary,
            position_offsets=kv.position_offsets,
            group_counts=kv.group_counts,
            sink_tokens=kv.sink_tokens,
            group_tokens=kv.group_tokens,
            value_head_dim=kv.sink_values.shape[-1],
        ),
    )
    return out.reshape(b, hq, nq, -1)


def append_residual_cpu(
    keys: Tensor,
    values: Tensor,
    residual_keys: Tensor,
    residual_values: Tensor,
    positions: np.ndarray,
    ok: Tensor,
) -> None:
    """Write one token per row (``keys [B, H, 1, D]``, ``values [B, H, 1, Dv]``, any floating
    dtype, rounded to the storage dtype as ``Tensor.to`` rounds) at residual slot
    ``positions[b, h]`` (host int64 ``[B, H]``) and AND ``ok`` (bool 0-d) with "every rounded
    value is finite".

    Raises:
        RuntimeError: the kernel is not compiled, or a position is out of range.
    """
    module = loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    module.append_residual(
        keys, values, residual_keys, residual_values, torch.from_numpy(positions), ok
    )


def decode_step_cpu(
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
) -> Tensor:
    """One decode step in one call: ``keys [B, H, 1, D]`` / ``values [B, H, 1, Dv]`` written
    into every row's residual — at slot ``kv.residual_lengths`` of ``kv.residual_keys`` /
    ``kv.residual_values``, the store's own buffers, as :func:`append_residual_cpu` writes;
    ``ok`` AND-ed with their validity — then causal attention of ``query [B, H_q, 1, D]`` over
    the rows including them (as :func:`packed_attention_cpu`). ``kv`` holds the counts before
    the token: the caller has checked that every row's sinks are full and its residual has room
    (no flush) and counts the token in the store afterwards. Returns float32
    ``[B, H_q, 1, Dv]``.

    Raises:
        RuntimeError: the kernel is not compiled.
    """
    module = loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    mask = kv.mask
    layout = kv.layout
    return module.decode_step(
        query,
        keys,
        values,
        kv.sink_keys,
        kv.sink_values,
        kv.key_codes,
        kv.key_scalars,
        kv.value_codes,
        kv.value_scalars,
        kv.residual_keys,
        kv.residual_values,
        kv.counts_tensor(),
        _EMPTY if mask is None or decode.kind == KEYS_WIDTHS else mask,
        layout.first,
        layout.second,
        _EMPTY if sink_logits is None else sink_logits.detach().to(torch.float32).contiguous(),
        ok,
        decode.kind,
        decode.mode_first,
        decode.mode_second,
        kv.bits,
        kv.group_tokens,
        float(scale),
        0.0 if logit_softcap is None else float(logit_softcap),
        _splits(kv.sink_keys.shape[0] * kv.sink_keys.shape[1], kv.group_counts),
        *extra_arguments(
            decode,
            mask=mask,
            payload=kv.key_payload,
            rotary=kv.rotary,
            position_offsets=kv.position_offsets,
            group_counts=kv.group_counts,
            sink_tokens=kv.sink_tokens,
            group_tokens=kv.group_tokens,
            value_head_dim=kv.sink_values.shape[-1],
        ),
    )


# float64 sums of float16 values (multiples of 2**-24 below 65504) stay exact, hence independent
# of their order, for up to 8192 terms: a group's tokens, a value head's channels
_EXACT_SUM_TERMS = 8192


def flush_unsupported(
    codec: KeyCodec,
    value_codec: ValueCodec,
    storage_dtype: torch.dtype,
    group_tokens: int,
    value_head_dim: int,
) -> str | None:
    """Why :func:`encode_groups_cpu` cannot code a cache's flushes bit for bit as its torch
    codecs do, or ``None`` when it can (docs/design.md, "Kernels", "Flush"). Codec classes are
    recognised exactly (a subclass may code differently)."""
    if type(codec) is not BitAllocCodec:
        return f"key codec {codec} (the compiled flush codes BitAllocCodec keys)"
    if type(value_codec) not in (PerTokenValueCodec, HadamardValueCodec):
        return f"value codec {value_codec}"
    if storage_dtype != torch.float16:
        return (
            f"{storage_dtype} storage (float64 sums of its values are not exact, so their order, "
            "torch's, would matter)"
        )
    if group_tokens > _EXACT_SUM_TERMS or value_head_dim > _EXACT_SUM_TERMS:
        return f"groups or value heads beyond {_EXACT_SUM_TERMS} (inexact float64 sums)"
    return None


def encode_groups_cpu(
    keys: Tensor,
    values: Tensor,
    *,
    codec: BitAllocCodec,
    value_codec: ValueCodec,
    layout: KeyLayout,
    table: Tensor | None,
    positions: Tensor | None,
    rotary: RotaryConfig | None,
    frame_tables: tuple[Tensor, Tensor] | None = None,
    outlier_index: Tensor | None = None,
) -> EncodedGroups | None:
    """The groups one append flushes, coded by the compiled kernel exactly as the torch
    reference codes them (``PNMixCache`` without the compiled flush): the keys rotated back to
    position 0 when ``positions`` is given (``rotate_by_delta(keys, -positions, rotary)``,
    rounded to float16), ``codec.encode_groups`` and ``codec.pack`` (with ``table``), then
    ``value_codec.encode`` and :func:`~kvlab.pnmix.packing.pack_codes` — the same bytes.

    Args:
        keys: storage-rounded keys ``[N, T, D]`` (float16, CPU), as gathered (before the
            pre-RoPE rotation).
        values: storage-rounded values ``[N, T, Dv]`` (float16, CPU).
        codec: the key codec (:func:`flush_unsupported` is ``None`` for it).
        value_codec: the value codec.
        layout: the head's channel geometry.
        table: per-pair widths ``[N, P]`` (uint8) of each group's row, for a codec with a
            table (else ignored).
        positions: int64 ``[N, T]`` RoPE positions (tokens) of the keys for a position-aware
            codec, else ``None``.
        rotary: the layer's RoPE (with ``positions``).
        frame_tables: ``rotation_tables(-positions, rotary, torch.float32)`` when the caller
            has them (else computed here).
        outlier_index: int32 ``[N, K]``: the groups' outliers as the flush selects them (the
            table kernel's, :func:`kvlab.pnmix.kernels.cpu_tables.table_terms_cpu`), or
            ``None`` (selected here).

    Returns:
        :class:`~kvlab.pnmix.store.EncodedGroups` (``key_payload`` ``None`` without outliers),
        every stored value finite; or ``None`` when these groups must be coded by the torch
        reference (a negative zero or non-finite key or value, or a stored scalar that would
        not be finite: there torch's reduction order or NaN payloads could change a byte).

    Raises:
        RuntimeError: the kernel is not compiled.
    """
    module = loaded()
    if module is None:
        raise RuntimeError("the PN-Mix CPU kernel is not loaded")
    t, d = keys.shape[1:]
    cos = sin = _EMPTY
    if frame_tables is not None:
        cos, sin = frame_tables
    elif positions is not None:
        assert rotary is not None
        cos, sin = rotation_tables(-positions, rotary, torch.float32)
    widths = _EMPTY
    if codec.table_bits:
        assert table is not None
        widths = table.to(torch.uint8).contiguous()
    out = module.encode_groups(
        keys.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        layout.first,
        layout.second,
        widths,
        values.contiguous(),
        codec.bits,
        codec.outlier_count(t, d),
        isinstance(value_codec, HadamardValueCodec),
        _EMPTY if outlier_index is None else outlier_index.to(torch.int32).contiguous(),
        value_codec.channel_groups(values.shape[-1]),
    )
    if not out:
        return None
    key_codes, key_scalars, payload, value_codes, value_scalars = out
    return EncodedGroups(
        key_codes, key_scalars, value_codes, value_scalars, payload if payload.shape[-1] else None
    )
