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

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (set before this module is first
imported: ``triton.jit`` reads it at decoration). Importing this module requires ``triton``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from kvlab.pnmix.kernels.spec import (
    KEYS_PER_TOKEN,
    KEYS_WIDTHS,
    PAIR_PHASE_NORM,
    KernelKeyDecode,
)
from kvlab.pnmix.kernels.tables import extra_arguments  # the tables both compiled backends read
from kvlab.pnmix.kernels.triton_common import (
    merge_kernel,
    merge_launch,
    online,
    pointer,
    pow2,
    softcap_tile,
)
from kvlab.pnmix.store import PackedKV

__all__ = ["packed_attention_triton", "triton_launcher"]


@triton.jit
def _codes(base, k_idx, valid, nbytes, BITS: tl.constexpr):
    """Float codes at code indices ``k_idx`` of the bitstream at ``base`` (``nbytes`` bytes)."""
    bit = k_idx * BITS
    byte = bit // 8
    shift = bit % 8
    v = tl.load(base + byte, mask=valid, other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may straddle two bytes
        nxt = tl.load(base + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
        v = v | (nxt << 8)
    return ((v >> shift) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _width_codes(base, t, off, width, valid, nbytes, STRIDE: tl.constexpr):
    """Float codes of tokens ``t [BT]`` at per-channel bit offsets ``off [BD]`` and widths
    ``width [BD]`` of the width layout (token stride ``STRIDE`` bits): two bytes per code."""
    bit = t[:, None] * STRIDE + off[None, :]
    byte = bit // 8
    shift = bit % 8
    lo = tl.load(base + byte, mask=valid, other=0).to(tl.int32)
    hi = tl.load(base + byte + 1, mask=valid & (byte + 1 < nbytes), other=0).to(tl.int32)
    v = (lo | (hi << 8)) >> shift
    return (v & ((1 << width[None, :]) - 1)).to(tl.float32)


@triton.jit
def _decode_tile(
    kbase,
    sbase,
    pbase,
    t,
    t_ok,
    chan,
    d_ok,
    off,
    width,
    pn,
    ch_f,
    ch_s,
    step,
    K,
    Kb,
    D: tl.constexpr,
    T: tl.constexpr,
    BITS: tl.constexpr,
    KIND: tl.constexpr,
    HAS_PN: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Keys ``[BT, BD]`` of tokens ``t`` at channels ``chan`` (float32, the codec's frame):
    steps (1) decode and (2) payload of the module docstring."""
    tile_ok = t_ok[:, None] & d_ok[None, :]
    if KIND == 1:
        c = _codes(kbase, t[:, None] * D + chan[None, :], tile_ok, Kb, BITS)
        t_scale = tl.load(sbase + t, mask=t_ok, other=0.0).to(tl.float32)
        t_zero = tl.load(sbase + T + t, mask=t_ok, other=0.0).to(tl.float32)
        k = t_zero[:, None] + c * t_scale[:, None]
    else:
        k_scale = tl.load(sbase + chan, mask=d_ok, other=0.0).to(tl.float32)
        k_zero = tl.load(sbase + D + chan, mask=d_ok, other=0.0).to(tl.float32)
        if KIND == 2:
            c = _width_codes(kbase, t, off, width, tile_ok, Kb, BITS * D)
        else:
            c = _codes(kbase, t[:, None] * D + chan[None, :], tile_ok, Kb, BITS)
        k = k_zero[None, :] + c * k_scale[None, :]
        if HAS_PN:
            sc_f = tl.load(sbase + ch_f, mask=d_ok, other=0.0).to(tl.float32)
            ze_f = tl.load(sbase + D + ch_f, mask=d_ok, other=0.0).to(tl.float32)
            offset = tl.load(sbase + D + ch_s, mask=d_ok, other=0.0).to(tl.float32)
            c_f = _codes(kbase, t[:, None] * D + ch_f[None, :], tile_ok, Kb, BITS)
            c_s = _codes(kbase, t[:, None] * D + ch_s[None, :], tile_ok, Kb, BITS)
            r = ze_f[None, :] + c_f * sc_f[None, :]
            level = offset[None, :] + c_s * step[None, :]
            first = (chan == ch_f)[None, :]
            polar = tl.where(first, r * tl.cos(level), r * tl.sin(level))
            k = tl.where(pn[None, :], polar, k)
    if HAS_PAYLOAD:
        # K storage-dtype values (little-endian bytes), then K int16 flat indices t * D + d;
        # written over the tile through one-hot products (one term per hit: exact)
        e = tl.arange(0, BLOCK_K)
        e_ok = e < K
        v_lo = tl.load(pbase + 2 * e, mask=e_ok, other=0).to(tl.int32)
        v_hi = tl.load(pbase + 2 * e + 1, mask=e_ok, other=0).to(tl.int32)
        bits16 = (v_lo | (v_hi << 8)).to(tl.int16)
        if BF16:  # noqa: SIM108 (a constexpr branch)
            vals = bits16.to(tl.bfloat16, bitcast=True)
        else:
            vals = bits16.to(tl.float16, bitcast=True)
        i_lo = tl.load(pbase + 2 * K + 2 * e, mask=e_ok, other=0).to(tl.int32)
        i_hi = tl.load(pbase + 2 * K + 2 * e + 1, mask=e_ok, other=0).to(tl.int32)
        idx = i_lo | (i_hi << 8)
        t_e = tl.where(e_ok, idx // D, -1)
        d_e = tl.where(e_ok, idx % D, -1)
        one_t = t[:, None] == t_e[None, :]  # [BT, BK]
        one_d = (d_e[:, None] == chan[None, :]).to(vals.dtype)  # [BK, BD]
        hit = tl.dot(one_t.to(vals.dtype), one_d, out_dtype=tl.float32)
        val = tl.dot(tl.where(one_t, vals[None, :], 0).to(vals.dtype), one_d, out_dtype=tl.float32)
        k = tl.where(hit > 0.5, val, k)
    return k


@triton.jit
def _split_kernel(
    q_ptr,
    mu_ptr,
    sink_k,
    sink_v,
    res_k,
    res_v,
    kcodes,
    kscal,
    vcodes,
    vscal,
    counts,
    mask_ptr,
    pair_first,
    pair_second,
    widths_ptr,
    payload_ptr,
    rope_cos,
    rope_sin,
    pos_off,
    part_m,
    part_l,
    part_acc,
    rows,
    M,
    Q,
    S_cap,
    R_cap,
    G_cap,
    Kb,
    Vb,
    Sk,
    P,
    NS,
    groups_per_split,
    softcap,
    E,
    K,
    rope_base,
    sink_tokens,
    D: tl.constexpr,
    DV: tl.constexpr,
    T: tl.constexpr,
    BITS: tl.constexpr,
    KIND: tl.constexpr,
    MODE_FIRST: tl.constexpr,
    MODE_SECOND: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    ROTATE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    s_len = tl.load(counts + row)
    g_cnt = tl.load(counts + rows + row)
    r_len = tl.load(counts + 2 * rows + row)
    n = s_len + g_cnt * T + r_len
    # a query row sees stream indices < limit: n, or causally n - Q + 1 + (its query index)
    limit = tl.zeros([BLOCK_M], dtype=tl.int64) + n
    if CAUSAL:
        limit = limit - (Q - 1 - offs_m % Q).to(tl.int64)
    q = tl.load(
        q_ptr + (row * M + offs_m[:, None]) * D + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    mu = tl.load(mu_ptr + row * D + offs_d, mask=d_ok, other=0.0)
    qmu = tl.sum(q * mu[None, :], axis=1)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    accz = tl.zeros([BLOCK_M], dtype=tl.float32)
    if split == NS:
        # the exact segment: combined index i < S_cap -> sink slot i, else residual slot
        for e0 in range(0, S_cap + R_cap, BLOCK_E):
            i = e0 + tl.arange(0, BLOCK_E)
            is_sink = i < S_cap
            j = i - S_cap
            ok_s = is_sink & (i < s_len)
            ok_r = (~is_sink) & (j < r_len)
            stream = tl.where(is_sink, i, s_len + g_cnt * T + j)
            ks = tl.load(
                sink_k + (row * S_cap + i[:, None]) * D + offs_d[None, :],
                mask=ok_s[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            kr = tl.load(
                res_k + (row * R_cap + j[:, None]) * D + offs_d[None, :],
                mask=ok_r[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            k = tl.where(is_sink[:, None], ks, kr) - mu[None, :]
            if DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            if SOFTCAP:
                s = softcap_tile(s, qmu[:, None], softcap)
            seen = (ok_s | ok_r)[None, :] & (stream[None, :] < limit[:, None]) & m_ok[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_run, l_run, acc, accz, p = online(s, m_run, l_run, acc, accz)
            vs_ = tl.load(
                sink_v + (row * S_cap + i[:, None]) * DV + offs_dv[None, :],
                mask=ok_s[:, None] & dv_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            vr = tl.load(
                res_v + (row * R_cap + j[:, None]) * DV + offs_dv[None, :],
                mask=ok_r[:, None] & dv_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            v = tl.where(is_sink[:, None], vs_, vr)
            if DOT:
                acc += tl.dot(p, v, input_precision="ieee")
            else:
                acc += tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    else:
        levels = (1 << BITS) - 1
        has_pn = (MODE_FIRST == 1) or (MODE_SECOND == 1)
        # per channel d: its rotary pair (-1: none) and the pair's two channels, found by
        # matching d against the pair indices (no host-side tables)
        offs_p = tl.arange(0, BLOCK_P)
        p_ok = offs_p < P
        pf = tl.load(pair_first + offs_p, mask=p_ok, other=-1).to(tl.int32)
        ps = tl.load(pair_second + offs_p, mask=p_ok, other=-1).to(tl.int32)
        hit = (pf[None, :] == offs_d[:, None]) | (ps[None, :] == offs_d[:, None])
        rotary = tl.sum(hit.to(tl.int32), axis=1) > 0
        pair = tl.where(rotary, tl.sum(tl.where(hit, offs_p[None, :], 0), axis=1), -1)
        ch_f = tl.where(rotary, tl.sum(tl.where(hit, pf[None, :], 0), axis=1), offs_d)
        ch_s = tl.where(rotary, tl.sum(tl.where(hit, ps[None, :], 0), axis=1), offs_d)
        is_first = offs_d == ch_f
        partner = tl.where(is_first, ch_s, ch_f)
        if HAS_MASK:
            bit = tl.load(mask_ptr + row * P + pair, mask=d_ok & (pair >= 0), other=0)
            mode = tl.where(bit != 0, MODE_SECOND, MODE_FIRST)
        else:
            mode = tl.zeros([BLOCK_D], dtype=tl.int32) + MODE_FIRST
        pn = (pair >= 0) & (mode == 1)
        # per-pair code widths (KIND 2): channel widths and bit offsets in a token (widths
        # descending, then channel index ascending); a pair's partner shares its width
        width = tl.zeros([BLOCK_D], dtype=tl.int32) + BITS
        off = tl.zeros([BLOCK_D], dtype=tl.int32)
        off_partner = off
        if KIND == 2:
            w_pair = tl.load(widths_ptr + row * P + pair, mask=d_ok & (pair >= 0), other=0)
            width = tl.where(pair >= 0, w_pair.to(tl.int32), BITS)
            width = tl.where(d_ok, width, 0)
            wj = width[None, :]
            wd = width[:, None]
            jj = offs_d[None, :]
            before = (wj > wd) | ((wj == wd) & (jj < offs_d[:, None]))
            off = tl.sum(tl.where(before, wj, 0), axis=1)
            before_p = (wj > wd) | ((wj == wd) & (jj < partner[:, None]))
            off_partner = tl.sum(tl.where(before_p, wj, 0), axis=1)
        g0 = split * groups_per_split
        g1 = tl.minimum(g0 + groups_per_split, g_cnt)
        for g in range(g0, g1):
            slot = row * G_cap + g
            kbase = kcodes + slot * Kb
            vbase = vcodes + slot * Vb
            sbase = kscal + slot * Sk
            pbase = payload_ptr + slot * E
            vsbase = vscal + slot * (2 * T)
            step = tl.zeros([BLOCK_D], dtype=tl.float32)
            if has_pn:
                span = tl.load(sbase + ch_s, mask=d_ok, other=0.0).to(tl.float32)
                step = span / levels
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                t_ok = t < T
                tile_ok = t_ok[:, None] & d_ok[None, :]
                # (1) the codec's decode, (2) the payload's exact entries
                k = _decode_tile(
                    kbase,
                    sbase,
                    pbase,
                    t,
                    t_ok,
                    offs_d,
                    d_ok,
                    off,
                    width,
                    pn,
                    ch_f,
                    ch_s,
                    step,
                    K,
                    Kb,
                    D,
                    T,
                    BITS,
                    KIND,
                    has_pn,
                    HAS_PAYLOAD,
                    BF16,
                    BLOCK_K,
                )
                if ROTATE:
                    # (3) rotate to positions offset + S + g * T + t (the partners' tile too)
                    kp = _decode_tile(
                        kbase,
                        sbase,
                        pbase,
                        t,
                        t_ok,
                        partner,
                        d_ok,
                        off_partner,
                        width,
                        pn,
                        ch_f,
                        ch_s,
                        step,
                        K,
                        Kb,
                        D,
                        T,
                        BITS,
                        KIND,
                        has_pn,
                        HAS_PAYLOAD,
                        BF16,
                        BLOCK_K,
                    )
                    pos = tl.load(pos_off + row) + sink_tokens + g * T + t - rope_base
                    rot_ok = t_ok[:, None] & (pair >= 0)[None, :]
                    at = pos[:, None] * P + pair[None, :]
                    cs = tl.load(rope_cos + at, mask=rot_ok, other=1.0)
                    sn = tl.load(rope_sin + at, mask=rot_ok, other=0.0)
                    a = k * cs
                    b = kp * sn
                    c2 = kp * sn
                    e2 = k * cs
                    first_val = a - b
                    second_val = c2 + e2
                    rotated = tl.where(is_first[None, :], first_val, second_val)
                    k = tl.where(rot_ok, rotated, k)
                k = tl.where(tile_ok, k - mu[None, :], 0.0)
                if DOT:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
                if SOFTCAP:
                    s = softcap_tile(s, qmu[:, None], softcap)
                stream = s_len + g * T + t
                seen = t_ok[None, :] & (stream[None, :] < limit[:, None]) & m_ok[:, None]
                s = tl.where(seen, s, float("-inf"))
                m_run, l_run, acc, accz, p = online(s, m_run, l_run, acc, accz)
                v_ok = t_ok[:, None] & dv_ok[None, :]
                vc = _codes(vbase, t[:, None] * DV + offs_dv[None, :], v_ok, Vb, BITS)
                v_scale = tl.load(vsbase + t, mask=t_ok, other=0.0).to(tl.float32)
                v_zero = tl.load(vsbase + T + t, mask=t_ok, other=0.0).to(tl.float32)
                w = p * v_scale[None, :]
                if DOT:
                    acc += tl.dot(w, vc, input_precision="ieee")
                else:
                    acc += tl.sum(w[:, :, None] * vc[None, :, :], axis=1)
                accz += tl.sum(p * v_zero[None, :], axis=1)
    base = (row * (NS + 1) + split) * M + offs_m
    tl.store(part_m + base, m_run, mask=m_ok)
    tl.store(part_l + base, l_run, mask=m_ok)
    tl.store(
        part_acc + base[:, None] * DV + offs_dv[None, :],
        acc + accz[:, None],
        mask=m_ok[:, None] & dv_ok[None, :],
    )


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
        _split_kernel[(rows, ns + 1, mblocks)](*split_args, **split_meta)
        merge_kernel[(rows, mblocks)](*merge_args, **merge_meta)
        return out.reshape(b, hq, nq, dv)

    return launch
