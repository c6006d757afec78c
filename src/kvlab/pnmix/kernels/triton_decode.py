"""The Triton backend of packed attention (docs/design.md, "Kernels").

FlashDecoding-style: program ``(row, split, mblock)`` — row = (sequence, kv head), ``mblock``
a block of that kv head's ``rep · Q`` query rows — runs an online softmax over its slice of the
row's stream: splits ``0 .. NS - 1`` take consecutive shares of the quantized groups (decoded in
registers, ``BLOCK_T`` tokens at a time), split ``NS`` takes the exact tokens (sinks and
residual). Each writes ``(m, l, acc)``; a second kernel merges a row's splits (and the learned
sink logit, if any) and divides. Keys decode as :meth:`KeyCodec.decode` does (``zero + code ·
scale``, two roundings: launched with ``enable_fp_fusion=False``; Phase–Norm levels ``offset +
c · span / L`` and their cos/sin), centred by the row's reference key ``mu``; values are read
as ``Σ_t (p_t s_t) c_t + Σ_t p_t z_t`` (docs/design.md, "Attention").

Decoding one tile is three steps, as the reference's (docs/design.md, "Kernels"): the codec's
decode (pair modes per (row, pair), per-token scalars, or per-pair code widths read at
per-channel bit offsets of the width layout), then the exact sparse entries of the group's
payload written over it, then, for a position-aware (pre-RoPE) codec, the rotation of each key
to its position — a tile of the pair partners' channels is decoded alongside (registers cannot
be permuted), and the float32 cos/sin of the CPU backend's table are applied without fused
multiply-adds. A Hadamard value codec's quantized splits are mapped back (``@ H``, ``H``
symmetric) once per query row in the merge kernel, apart from the exact tokens' split.

In the dispatch table (:data:`kvlab.pnmix.kernels.dispatch.KERNELS`) this is the ``"triton"``
backend's kernel for the stores the split-K kernel (:mod:`~kvlab.pnmix.kernels.triton_splitk`)
does not cover — per-token keys, 3-bit codes, partial rotary, heads below 32 channels. The
``@triton.jit`` kernels are :mod:`~kvlab.pnmix.kernels.triton_decode_kernels`; this module
prepares their arguments and launches them.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (set before this module is first
imported: ``triton.jit`` reads it at decoration). Importing this module requires ``triton``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.kernels.spec import (
    KEYS_PER_TOKEN,
    KEYS_WIDTHS,
    PAIR_PHASE_NORM,
    KernelKeyDecode,
)
from kvlab.pnmix.kernels.tables import extra_arguments  # the tables both compiled backends read
from kvlab.pnmix.kernels.triton_common import merge_kernel, merge_launch, pointer, pow2
from kvlab.pnmix.kernels.triton_decode_kernels import split_kernel
from kvlab.pnmix.store import PackedKV

__all__ = ["packed_attention_triton", "triton_launcher"]


def packed_attention_triton(
    query: Tensor, kv: PackedKV, decode: KernelKeyDecode, mu: Tensor, **options: Any
) -> Tensor:
    """Packed attention by the Triton kernels; arguments and result as
    :func:`~kvlab.pnmix.kernels.cpu.packed_attention_cpu` (float32 ``[B, H_q, Q, Dv]``);
    ``options``: the keyword arguments of :func:`triton_launcher` (``scale``, ``causal``,
    ``logit_softcap``, ``sink_logits``, ``groups_per_split``, ``dot``, ``num_warps``)."""
    return triton_launcher(query, kv, decode, mu, **options)()


def triton_launcher(
    query: Tensor,
    kv: PackedKV,
    decode: KernelKeyDecode,
    mu: Tensor,
    *,
    scale: float,
    causal: bool,
    logit_softcap: float | None,
    sink_logits: Tensor | None,
    groups_per_split: int | None = None,
    dot: bool = False,
    num_warps: int | None = None,
) -> Callable[[], Tensor]:
    """Everything :func:`packed_attention_triton` does before its two kernel launches, once:
    returns a function that launches them (and nothing else: it can be captured in a CUDA
    graph) and returns the float32 ``[B, H_q, Q, Dv]`` output (the same buffer every call).

    ``groups_per_split``: quantized groups per split (default: enough splits to give the
    device about 1,024 programs). ``dot``: the products ``q·k`` and ``p·v`` as ``tl.dot`` in
    IEEE float32 (blocks of at least 16 rows, tokens and channels, padded and masked) rather
    than broadcast products reduced over an axis (the default, the path timed on an H200 in
    docs/benchmarks.md; ``dot=True`` is checked against the reference under
    ``TRITON_INTERPRET=1`` and waits for a CUDA timing: benchmarks/cuda_decode.py sweeps
    both). ``num_warps``: Triton's (default 4)."""
    b, hq, nq, d = query.shape
    hkv = kv.sink_keys.shape[1]
    rep = hq // hkv
    m_rows = rep * nq
    rows = b * hkv
    dev = kv.key_codes.device
    dv = kv.sink_values.shape[-1]
    t = kv.group_tokens
    q = (query.to(device=dev, dtype=torch.float32) * scale).reshape(rows, m_rows, d).contiguous()
    mu_rows = mu.reshape(rows, d).contiguous()
    counts_host = np.stack([kv.sink_lengths, kv.group_counts, kv.residual_lengths]).reshape(3, -1)
    counts = torch.from_numpy(np.ascontiguousarray(counts_host)).to(dev, non_blocking=True)
    block_m = min(pow2(m_rows), 16) if not dot else min(max(pow2(m_rows), 16), 64)
    mblocks = math.ceil(m_rows / block_m)
    g_max = int(kv.group_counts.max(initial=0))
    if groups_per_split is None:
        per_row = max(1, 1024 // (rows * mblocks))
        groups_per_split = max(1, math.ceil(g_max / per_row))
    ns = math.ceil(g_max / groups_per_split) if g_max else 0
    part_m = torch.empty((rows, ns + 1, m_rows), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((rows, ns + 1, m_rows, dv), dtype=torch.float32, device=dev)
    out = torch.empty((rows, m_rows, dv), dtype=torch.float32, device=dev)
    has_mask = kv.mask is not None and decode.mode_first != decode.mode_second
    mask = kv.mask.to(torch.uint8).contiguous() if has_mask else counts  # unused when no mask
    cap = 0.0 if logit_softcap is None else float(logit_softcap)
    extra: dict[str, object] = {} if dev.type == "cpu" else {"enable_fp_fusion": False}
    if num_warps is not None:
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
    kind = {KEYS_PER_TOKEN: 1, KEYS_WIDTHS: 2}.get(decode.kind, 0)
    # tl.dot's smallest block is 16: the products' blocks under dot=True; the tokens and
    # channels of a key tile whenever the payload is written over it by one-hot products
    floor = 16 if dot or n_out > 0 else 1
    block_d, block_dv = pow2(d, floor), pow2(dv, 16 if dot else 1)
    split_args = (
        q,
        mu_rows,
        pointer(kv.sink_keys),
        pointer(kv.sink_values),
        pointer(kv.residual_keys),
        pointer(kv.residual_values),
        pointer(kv.key_codes),
        pointer(kv.key_scalars),
        pointer(kv.value_codes),
        pointer(kv.value_scalars),
        counts,
        mask,
        pointer(kv.layout.first),
        pointer(kv.layout.second),
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
        kv.sink_keys.shape[2],
        kv.residual_keys.shape[2],
        kv.key_codes.shape[2],
        kv.key_codes.shape[3],
        kv.value_codes.shape[3],
        kv.key_scalars.shape[3],
        kv.layout.num_pairs,
        ns,
        groups_per_split,
        cap,
        e_bytes,
        n_out,
        rope_base,
        sink_tokens,
    )
    split_meta = dict(
        D=d,
        DV=dv,
        T=t,
        BITS=kv.bits,
        KIND=kind,
        MODE_FIRST=int(decode.mode_first == PAIR_PHASE_NORM),
        MODE_SECOND=int(decode.mode_second == PAIR_PHASE_NORM),
        HAS_MASK=has_mask,
        CAUSAL=causal,
        SOFTCAP=logit_softcap is not None,
        BLOCK_M=block_m,
        BLOCK_T=max(min(pow2(t), 32), floor),
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_E=32,
        BLOCK_P=pow2(kv.layout.num_pairs),
        HAS_PAYLOAD=n_out > 0,
        ROTATE=bool(decode.rotate_to_position),
        BF16=kv.sink_keys.dtype == torch.bfloat16,
        BLOCK_K=pow2(n_out, 16),
        VGROUPS=kv.value_scalars.shape[-1] // (2 * t),
        DOT=dot,
        **extra,
    )
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
        block_d=block_d,
        block_dv=block_dv,
        softcap=logit_softcap is not None,
        value_hadamard=bool(decode.value_hadamard),
        extra=extra,
    )

    def launch() -> Tensor:
        split_kernel[(rows, ns + 1, mblocks)](*split_args, **split_meta)
        merge_kernel[(rows, mblocks)](*merge_args, **merge_meta)
        return out.reshape(b, hq, nq, dv)

    return launch
