"""A split-K GQA decode kernel for packed PN-Mix caches (docs/benchmarks.md, "Decode bytes model
and the split-K kernel"; docs/design.md, "Kernels"): the ``"triton"`` backend's first entry in
the dispatch table (:data:`kvlab.pnmix.kernels.dispatch.KERNELS`), for the stores it covers.

Differences from :mod:`kvlab.pnmix.kernels.triton_decode` (the kernel timed in
docs/benchmarks.md), aimed at reading each stored byte once at full bandwidth:

* one program per (sequence, kv head, context split, block of query rows): the block covers
  every query head of the GQA group (and every query token), padded to at least 16 rows, so
  each K/V tile is loaded once and both products are ``tl.dot`` (``q·k`` and ``p·v``);
* codes are loaded as 32-bit little-endian words (an ``int32`` view of the store's uint8
  buffers: a token's codes start on a word when ``D · bits`` is a multiple of 32) and
  unpacked in registers with shifts and masks, ``32 / bits`` codes per word;
* the rotary pairs are decoded as two tiles ``[BLOCK_T, P]`` — every pair's first channel and
  every pair's second channel — so a Phase–Norm pair's norm and phase meet element for element
  (no partner gather) and ``q·k = q_A · k_A + q_B · k_B``; both RoPE layouts: ``half`` (pair
  ``p`` = channels ``p, p + D/2``: the low and high words of a token) and ``interleaved``
  (``2p, 2p + 1``: even and odd codes of a word);
* splits are ``BLOCK_T``-token tiles of the quantized region (a split may end inside a
  group); the exact sink and residual tokens are a separate small kernel; the merge (by
  log-sum-exp, learned sinks, Hadamard value transform) is
  :mod:`~kvlab.pnmix.kernels.triton_decode`'s merge kernel;
* the split count comes from the shape and the device's SM count (:func:`choose_splits`), and
  the launch function does nothing but launch (capturable in a CUDA graph).

The ``pn-mix`` coding's steps (docs/design.md, "Kernels"): per-pair code widths — each
channel's bit offset in a token of the width layout (widths descending, then channel
ascending) computed once per program, each code taken from its word (and the next, for a code
straddling two) selected in registers from the token's words; pre-RoPE keys rotated to their
positions with the CPU backend's float32 cos/sin table (the A and B tiles are the rotation's
two inputs); exact outliers as a sparse correction ``q · R(pos) (exact − decoded)`` of the
logits of the tile holding them (placed by a one-hot ``[K, BLOCK_T]`` product), not written
over the key tile.

Covered (:func:`~kvlab.pnmix.kernels.splits.splitk_unsupported` says why not otherwise):
per-channel keys — Cartesian, Phase–Norm, a mix of the two per (row, pair) (the seed coding),
KIVI keys — and per-pair widths (``bit_alloc``), rotated or pre-RoPE, with or without outliers
(not over Phase–Norm pairs), at 2 or 4 bits (the width layout: a mean of 2 or 4), rotary pairs
over the whole head (``rotary_dim = D``), ``D`` and ``Dv`` powers of two with ``D >= 32``,
``Dv >= 16``, groups a power of two ``>= 16``; per-token or Hadamard values; causal or not, any
query count, soft-cap, learned sinks. Not covered: per-token keys, 3-bit codes, partial rotary:
those run on :mod:`~kvlab.pnmix.kernels.triton_decode`, the table's next ``"triton"`` entry.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.kernels.spec import (
    KEYS_PER_CHANNEL,
    KEYS_WIDTHS,
    PAIR_PHASE_NORM,
    KernelKeyDecode,
)
from kvlab.pnmix.kernels.splits import choose_splits, rotary_pairs_kind, splitk_unsupported
from kvlab.pnmix.kernels.tables import extra_arguments  # the tables every backend reads
from kvlab.pnmix.kernels.triton_common import merge_kernel, merge_launch, pointer, pow2
from kvlab.pnmix.kernels.triton_splitk_kernels import exact_kernel, quantized_kernel
from kvlab.pnmix.store import PackedKV

__all__ = [
    "Launch",
    "choose_splits",
    "packed_attention_splitk",
    "splitk_launcher",
    "splitk_launches",
    "splitk_unsupported",
]


def _words(buf: Tensor) -> Tensor:
    """The int32 view of a uint8 code buffer (little-endian words)."""
    if buf.numel():
        return buf.view(torch.int32)
    return torch.zeros(1, dtype=torch.int32, device=buf.device)


def packed_attention_splitk(
    query: Tensor, kv: PackedKV, decode: KernelKeyDecode, mu: Tensor, **options: Any
) -> Tensor:
    """Packed attention by the split-K kernels: arguments and result as
    :func:`~kvlab.pnmix.kernels.triton_decode.packed_attention_triton` (float32
    ``[B, H_q, Q, Dv]``); ``options``: the keyword arguments of :func:`splitk_launcher`."""
    return splitk_launcher(query, kv, decode, mu, **options)()


def splitk_launches(
    query: Tensor,
    kv: PackedKV,
    decode: KernelKeyDecode,
    mu: Tensor,
    *,
    scale: float,
    causal: bool,
    logit_softcap: float | None,
    sink_logits: Tensor | None,
    splits: int | None = None,
    block_t: int | None = None,
    sm_count: int | None = None,
    precision: str = "ieee",
    dot: bool = True,
    num_warps: int | None = None,
) -> tuple[list[Launch], Tensor]:
    """The launches of one split-K attention call (prepared once: buffers, tables, grids) and
    the float32 ``[B, H_q, Q, Dv]`` output they write; :func:`splitk_launcher` runs them.

    Args:
        query: ``[B, H_q, Q, D]``; ``kv``, ``decode``, ``mu``: as the Triton backend's.
        scale, causal, logit_softcap, sink_logits: as :func:`~kvlab.pnmix.pnmix_attention`.
        splits: context splits per row (default :func:`choose_splits` of the longest row and
            ``sm_count``); the kernel uses ``ceil(tiles / ceil(tiles / splits))``.
        block_t: tokens per tile, a power of two >= 16 dividing ``group_tokens`` (default
            ``min(group_tokens, 64)`` for plain per-channel keys; with widths, outliers or
            pre-RoPE rotation 32, or 16 when ``D > 64``: the sm_90 builds' register budget,
            benchmarks/splitk_compile_check.py).
        sm_count: the device's SMs (default: queried on CUDA, 132 elsewhere).
        precision: ``tl.dot``'s ``input_precision``: ``"ieee"`` (float32 products, FMA
            units), ``"tf32x3"`` (three TF32 tensor-core products: about float32), ``"bf16x6"``
            (six bfloat16 products, CUDA only: about float32), ``"tf32"``
            (10-bit mantissas: outside the reference's tolerance; for timing).
        dot: ``tl.dot`` products (query rows padded to 16) or, ``False``, broadcast products
            reduced over an axis (rows padded to a power of two only; float32 FMAs).
        num_warps: Triton's (default 4, 8 when ``D > 64``).

    Raises:
        ValueError: a configuration :func:`splitk_unsupported` rejects, or a bad ``block_t``.
    """
    reason = splitk_unsupported(kv, decode)
    if reason is not None:
        raise ValueError(reason)
    b, hq, nq, d = query.shape
    hkv = kv.sink_keys.shape[1]
    rep = hq // hkv
    m_rows = rep * nq
    rows = b * hkv
    dev = kv.key_codes.device
    dv = kv.sink_values.shape[-1]
    t = kv.group_tokens
    plain = decode.kind == KEYS_PER_CHANNEL and not decode.payload_bytes
    plain = plain and not decode.rotate_to_position
    if block_t is None:  # registers without spills in sm_90 builds (splitk_compile_check.py)
        block_t = min(t, 64 if plain else (32 if d <= 64 else 16))
    if num_warps is None:
        num_warps = 4 if d <= 64 else 8
    bt = block_t
    if bt < 16 or bt & (bt - 1) or t % bt:
        raise ValueError(f"block_t must be a power of two >= 16 dividing {t}, got {bt}")
    q = (query.to(device=dev, dtype=torch.float32) * scale).reshape(rows, m_rows, d).contiguous()
    mu_rows = mu.to(torch.float32).reshape(rows, d).contiguous()
    counts_host = np.stack([kv.sink_lengths, kv.group_counts, kv.residual_lengths]).reshape(3, -1)
    counts = torch.from_numpy(np.ascontiguousarray(counts_host)).to(dev, non_blocking=True)
    block_m = min(max(pow2(m_rows), 16), 64) if dot else min(pow2(m_rows), 16)
    mblocks = math.ceil(m_rows / block_m)
    g_max = int(kv.group_counts.max(initial=0))
    tiles = g_max * (t // bt)
    if splits is None:
        if sm_count is None:
            sm_count = (
                torch.cuda.get_device_properties(dev).multi_processor_count
                if dev.type == "cuda"
                else 132
            )
        splits = choose_splits(b, hkv, g_max * t, sm_count)
    tiles_per_split = max(1, math.ceil(tiles / max(1, splits)))
    ns = math.ceil(tiles / tiles_per_split) if tiles else 0
    part_m = torch.empty((rows, ns + 1, m_rows), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((rows, ns + 1, m_rows, dv), dtype=torch.float32, device=dev)
    out = torch.empty((rows, m_rows, dv), dtype=torch.float32, device=dev)
    has_mask = kv.mask is not None and decode.mode_first != decode.mode_second
    mask = kv.mask.to(torch.uint8).contiguous() if has_mask else counts
    cap = 0.0 if logit_softcap is None else float(logit_softcap)
    extra: dict[str, object] = {} if dev.type == "cpu" else {"enable_fp_fusion": False}
    extra["num_warps"] = num_warps
    widths, payload, cos, sin, rope_base, offsets, sink_tokens, hadamard = extra_arguments(
        decode,
        mask=kv.mask,
        payload=kv.key_payload,
        rotary=kv.rotary,
        position_offsets=kv.position_offsets,
        group_counts=kv.group_counts,
        sink_tokens=kv.sink_tokens,
        group_tokens=t,
        value_head_dim=dv,
        device=dev,
    )
    e_bytes = payload.shape[-1] if payload.numel() else 0
    n_out = e_bytes // (kv.sink_keys.element_size() + 2)
    common = dict(CAUSAL=causal, SOFTCAP=logit_softcap is not None, PRECISION=precision, DOT=dot)
    quant_args = (
        q,
        mu_rows,
        _words(kv.key_codes),
        pointer(kv.key_scalars),
        _words(kv.value_codes),
        pointer(kv.value_scalars),
        counts,
        mask,
        pointer(widths, dev),
        pointer(payload.contiguous(), dev),
        pointer(cos, dev),
        pointer(sin, dev),
        pointer(offsets.to(dev, non_blocking=True), dev),
        part_m,
        part_l,
        part_acc,
        rows,
        m_rows,
        nq,
        kv.key_codes.shape[2],
        ns,
        tiles_per_split,
        cap,
        e_bytes,
        n_out,
        rope_base,
        sink_tokens,
    )
    quant_meta = dict(
        D=d,
        DV=dv,
        T=t,
        BITS=kv.bits,
        HALF=rotary_pairs_kind(kv.layout) == "half",
        KIND=2 if decode.kind == KEYS_WIDTHS else 0,
        ROTATE=bool(decode.rotate_to_position),
        HAS_PAYLOAD=n_out > 0,
        BF16=kv.sink_keys.dtype == torch.bfloat16,
        BLOCK_K=pow2(n_out, 16),
        MODE_FIRST=int(decode.mode_first == PAIR_PHASE_NORM),
        MODE_SECOND=int(decode.mode_second == PAIR_PHASE_NORM),
        HAS_MASK=has_mask,
        BLOCK_M=block_m,
        BLOCK_T=bt,
        VGROUPS=kv.value_scalars.shape[-1] // (2 * t),
        **common,
        **extra,
    )
    exact_args = (
        q,
        mu_rows,
        pointer(kv.sink_keys),
        pointer(kv.sink_values),
        pointer(kv.residual_keys),
        pointer(kv.residual_values),
        counts,
        part_m,
        part_l,
        part_acc,
        rows,
        m_rows,
        nq,
        kv.sink_keys.shape[2],
        kv.residual_keys.shape[2],
        ns,
        cap,
    )
    exact_meta = dict(D=d, DV=dv, T=t, BLOCK_M=block_m, BLOCK_E=16, **common, **extra)
    merge_args, merge_meta = merge_launch(
        (part_m, part_l, part_acc),
        q,
        mu_rows,
        sink_logits,
        hadamard,
        out,
        (m_rows, nq, hkv, rep, ns),
        d=d,
        dv=dv,
        block_m=block_m,
        block_d=d,
        block_dv=dv,
        softcap=logit_softcap is not None,
        value_hadamard=bool(decode.value_hadamard),
        extra=extra,
    )

    launches = [Launch(quantized_kernel, (rows, ns, mblocks), quant_args, quant_meta)] if ns else []
    launches.append(Launch(exact_kernel, (rows, mblocks), exact_args, exact_meta))
    launches.append(Launch(merge_kernel, (rows, mblocks), merge_args, merge_meta))
    return launches, out.reshape(b, hq, nq, dv)


class Launch(NamedTuple):
    """One kernel launch of :func:`splitk_launches`: ``kernel[grid](*args, **meta)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]


def splitk_launcher(
    query: Tensor, kv: PackedKV, decode: KernelKeyDecode, mu: Tensor, **options: Any
) -> Callable[[], Tensor]:
    """Everything before the launches, once (:func:`splitk_launches`, same arguments); returns
    a function that only launches the three kernels (quantized splits, exact tokens, merge:
    capturable in a CUDA graph) and returns float32 ``[B, H_q, Q, Dv]`` (the same buffer
    every call)."""
    launches, out = splitk_launches(query, kv, decode, mu, **options)

    def launch() -> Tensor:
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
        return out

    return launch
