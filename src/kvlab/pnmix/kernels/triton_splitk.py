"""A split-K GQA decode kernel for packed PN-Mix caches (docs/benchmarks.md, "Split-K decode
kernel"; docs/design.md, "Kernels").

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

Covered (:func:`splitk_unsupported` says why not otherwise): per-channel keys — Cartesian,
Phase–Norm, a mix of the two per (row, pair) (the seed coding), KIVI keys — and per-pair
widths (``bit_alloc``), rotated or pre-RoPE, with or without outliers (not over Phase–Norm
pairs), at 2 or 4 bits (the width layout: a mean of 2 or 4), rotary pairs over the whole head
(``rotary_dim = D``), ``D`` and ``Dv`` powers of two with ``D >= 32``, ``Dv >= 16``, groups a
power of two ``>= 16``; per-token or Hadamard values; causal or not, any query count,
soft-cap, learned sinks. Not covered: per-token keys, 3-bit codes, partial rotary: those stay
on :mod:`~kvlab.pnmix.kernels.triton_decode`.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from kvlab.pnmix.kernels.spec import (
    KEYS_PER_CHANNEL,
    KEYS_WIDTHS,
    PAIR_PHASE_NORM,
    KernelKeyDecode,
)
from kvlab.pnmix.kernels.splits import choose_splits
from kvlab.pnmix.kernels.tables import extra_arguments  # the tables every backend reads
from kvlab.pnmix.kernels.triton_decode import _merge_kernel, _online, _pointer, _pow2, _softcap

if TYPE_CHECKING:
    from kvlab.pnmix.attention import PackedKV

__all__ = [
    "Launch",
    "choose_splits",
    "packed_attention_splitk",
    "splitk_launcher",
    "splitk_launches",
    "splitk_unsupported",
]


@triton.jit
def _unpack(words, SHIFT0: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """Float codes ``[BT, W * N]`` of int32 words ``[BT, W]``: code ``j`` of word ``w`` at bit
    ``SHIFT0 + j * STEP`` lands in column ``w * N + j``."""
    sh = SHIFT0 + tl.arange(0, N) * STEP
    c = (words[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(c, (words.shape[0], words.shape[1] * N)).to(tl.float32)


@triton.jit
def _qk(q, k, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """``q [M, C] @ k [N, C]^T``: ``tl.dot`` (blocks >= 16) or broadcast products reduced."""
    if DOT:
        return tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return tl.sum(q[:, None, :] * k[None, :, :], axis=2)


@triton.jit
def _pv(p, v, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """``p [M, N] @ v [N, C]``: ``tl.dot`` (blocks >= 16) or broadcast products reduced."""
    if DOT:
        return tl.dot(p, v, input_precision=PRECISION)
    return tl.sum(p[:, :, None] * v[None, :, :], axis=1)


@triton.jit
def _join(lo, hi, sh, width):
    """Float codes of ``width`` bits at bit ``sh`` of the 64-bit words ``hi:lo`` (int32
    tiles; a 3-bit code may straddle two words)."""
    v = ((lo.to(tl.int64) & 0xFFFFFFFF) >> sh.to(tl.int64)) | (hi.to(tl.int64) << (32 - sh))
    return (v & ((1 << width) - 1)).to(tl.float32)


@triton.jit
def _width_offsets(ch, w_ch, wd, offs_d):
    """Bit offsets in a token of the width layout (widths descending, then channel ascending)
    of channels ``ch`` of widths ``w_ch``; ``wd [D]``: every channel's width."""
    before = (wd[None, :] > w_ch[:, None]) | (
        (wd[None, :] == w_ch[:, None]) & (offs_d[None, :] < ch[:, None])
    )
    return tl.sum(tl.where(before, wd[None, :], 0), axis=1)


@triton.jit
def _outlier_logits(
    qrow,
    kw,
    sbase,
    pbase,
    wrow,
    rope_cos,
    rope_sin,
    pos0,
    g,
    t_first,
    m_ok,
    offs_d,
    wd,
    K,
    D: tl.constexpr,
    T: tl.constexpr,
    BITS: tl.constexpr,
    HALF: tl.constexpr,
    KIND: tl.constexpr,
    ROTATE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
):
    """Logit corrections ``[BLOCK_M, BLOCK_T]`` of a tile (tokens ``t_first ..`` of group
    ``g``) from the group's exact outliers (``K`` storage-dtype values, then ``K`` int16 flat
    indices ``t * D + d``): ``q · R(pos) (exact − decoded) e_d`` per outlier, placed in its
    token's column by a one-hot product (one nonzero term per entry: exact)."""
    P: tl.constexpr = D // 2
    KW: tl.constexpr = D * BITS // 32
    e = tl.arange(0, BLOCK_K)
    e_ok = e < K
    v_lo = tl.load(pbase + 2 * e, mask=e_ok, other=0).to(tl.int32)
    v_hi = tl.load(pbase + 2 * e + 1, mask=e_ok, other=0).to(tl.int32)
    bits16 = (v_lo | (v_hi << 8)).to(tl.int16)
    if BF16:
        exact = bits16.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        exact = bits16.to(tl.float16, bitcast=True).to(tl.float32)
    i_lo = tl.load(pbase + 2 * K + 2 * e, mask=e_ok, other=0).to(tl.int32)
    i_hi = tl.load(pbase + 2 * K + 2 * e + 1, mask=e_ok, other=0).to(tl.int32)
    idx = i_lo | (i_hi << 8)
    t_e = idx // D
    d_e = idx % D
    hit = e_ok & (t_e >= t_first) & (t_e < t_first + BLOCK_T)
    if HALF:
        pair_e = d_e % P
        first_e = d_e < P
        ch_a = pair_e
        ch_b = pair_e + P
    else:
        pair_e = d_e // 2
        first_e = d_e % 2 == 0
        ch_a = 2 * pair_e
        ch_b = 2 * pair_e + 1
    # the decoded element the outlier replaces
    if KIND == 2:
        w_e = tl.load(wrow + pair_e, mask=hit, other=0).to(tl.int32)
        off_e = _width_offsets(d_e, w_e, wd, offs_d)
    else:
        w_e = tl.zeros([BLOCK_K], dtype=tl.int32) + BITS
        off_e = d_e * BITS
    word = t_e * KW + (off_e >> 5)
    lo = tl.load(kw + word, mask=hit, other=0)
    hi = tl.load(kw + word + 1, mask=hit & (word + 1 < T * KW), other=0)
    code = _join(lo, hi, off_e & 31, w_e)
    scale = tl.load(sbase + d_e, mask=hit, other=0.0).to(tl.float32)
    zero = tl.load(sbase + D + d_e, mask=hit, other=0.0).to(tl.float32)
    delta = tl.where(hit, exact - (zero + code * scale), 0.0)
    if ROTATE:  # R(pos) delta e_d: (d cos, d sin) for a first channel, (-d sin, d cos) else
        at = (pos0 + g * T + t_e) * P + pair_e
        cs = tl.load(rope_cos + at, mask=hit, other=1.0)
        sn = tl.load(rope_sin + at, mask=hit, other=0.0)
        rot_a = tl.where(first_e, delta * cs, -(delta * sn))
        rot_b = tl.where(first_e, delta * sn, delta * cs)
    else:
        rot_a = tl.where(first_e, delta, 0.0)
        rot_b = tl.where(first_e, 0.0, delta)
    qa = tl.load(qrow + ch_a[None, :], mask=m_ok[:, None] & hit[None, :], other=0.0)
    qb = tl.load(qrow + ch_b[None, :], mask=m_ok[:, None] & hit[None, :], other=0.0)
    corr = qa * rot_a[None, :] + qb * rot_b[None, :]  # [BLOCK_M, BLOCK_K]
    col = tl.arange(0, BLOCK_T)
    onehot = ((t_e - t_first)[:, None] == col[None, :]) & hit[:, None]
    return _pv(corr, onehot.to(tl.float32), DOT, "ieee")


@triton.jit
def _quantized_kernel(
    q_ptr,
    mu_ptr,
    kwords,
    kscal,
    vwords,
    vscal,
    counts,
    mask_ptr,
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
    G_cap,
    NS,
    tiles_per_split,
    softcap,
    E,
    K,
    rope_base,
    sink_tokens,
    D: tl.constexpr,
    DV: tl.constexpr,
    T: tl.constexpr,
    BITS: tl.constexpr,
    HALF: tl.constexpr,
    KIND: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE_FIRST: tl.constexpr,
    MODE_SECOND: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    P: tl.constexpr = D // 2
    CPW: tl.constexpr = 32 // BITS  # codes per word
    KW: tl.constexpr = D // CPW  # words per token of keys
    VW: tl.constexpr = DV // CPW
    TPG: tl.constexpr = T // BLOCK_T  # tiles per group
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_p = tl.arange(0, P)
    offs_dv = tl.arange(0, DV)
    # the pairs' first and second channels (module docstring: half or interleaved)
    if HALF:
        ch_a = offs_p
        ch_b = offs_p + P
    else:
        ch_a = 2 * offs_p
        ch_b = 2 * offs_p + 1
    s_len = tl.load(counts + row)
    g_cnt = tl.load(counts + rows + row)
    r_len = tl.load(counts + 2 * rows + row)
    n = s_len + g_cnt * T + r_len
    limit = tl.zeros([BLOCK_M], dtype=tl.int64) + n
    if CAUSAL:
        limit = limit - (Q - 1 - offs_m % Q).to(tl.int64)
    qrow = q_ptr + (row * M + offs_m[:, None]) * D
    qa = tl.load(qrow + ch_a[None, :], mask=m_ok[:, None], other=0.0)
    qb = tl.load(qrow + ch_b[None, :], mask=m_ok[:, None], other=0.0)
    mua = tl.load(mu_ptr + row * D + ch_a)
    mub = tl.load(mu_ptr + row * D + ch_b)
    qmu = tl.sum(qa * mua[None, :], axis=1) + tl.sum(qb * mub[None, :], axis=1)
    if HAS_MASK:
        bit = tl.load(mask_ptr + row * P + offs_p)
        pn = tl.where(bit != 0, MODE_SECOND, MODE_FIRST) == 1
    else:
        pn = (tl.zeros([P], dtype=tl.int32) + MODE_FIRST) == 1
    levels = (1 << BITS) - 1
    offs_d = tl.arange(0, D)
    if HALF:  # noqa: SIM108 (a constexpr branch)
        pair_d = offs_d % P
    else:
        pair_d = offs_d // 2
    wd = tl.zeros([D], dtype=tl.int32) + BITS
    pos0 = tl.zeros([1], dtype=tl.int64)
    if KIND == 2:  # per-pair widths: every channel's width and the pairs' bit offsets
        wp = tl.load(widths_ptr + row * P + offs_p).to(tl.int32)
        wd = tl.load(widths_ptr + row * P + pair_d).to(tl.int32)
        off_a = _width_offsets(ch_a, wp, wd, offs_d)
        off_b = _width_offsets(ch_b, wp, wd, offs_d)
    if ROTATE:
        pos0 = tl.load(pos_off + row + tl.zeros([1], dtype=tl.int64)) + sink_tokens - rope_base
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    accz = tl.zeros([BLOCK_M], dtype=tl.float32)
    tt = tl.arange(0, BLOCK_T)
    i0 = split * tiles_per_split
    i1 = tl.minimum(i0 + tiles_per_split, g_cnt * TPG)
    for it in range(i0, i1):
        g = it // TPG
        t = (it % TPG) * BLOCK_T + tt  # tokens of the tile within group g
        slot = row * G_cap + g
        sbase = kscal + slot * (2 * D)
        kw = kwords + slot * (T * KW) + t[:, None] * KW
        if KIND == 2:  # per-pair widths: each code's word(s) selected in registers
            wi_a = (off_a >> 5)[None, :]
            wi_b = (off_b >> 5)[None, :]
            lo_a = tl.zeros([BLOCK_T, P], dtype=tl.int32)
            hi_a = lo_a
            lo_b = lo_a
            hi_b = lo_a
            for w in tl.static_range(KW):
                col = tl.load(kw + w)
                lo_a = tl.where(wi_a == w, col, lo_a)
                hi_a = tl.where(wi_a + 1 == w, col, hi_a)
                lo_b = tl.where(wi_b == w, col, lo_b)
                hi_b = tl.where(wi_b + 1 == w, col, hi_b)
            ca = _join(lo_a, hi_a, (off_a & 31)[None, :], wp[None, :])
            cb = _join(lo_b, hi_b, (off_b & 31)[None, :], wp[None, :])
        elif HALF:  # low words: first channels; high words: second channels
            wa = tl.load(kw + tl.arange(0, KW // 2)[None, :])
            wb = tl.load(kw + KW // 2 + tl.arange(0, KW // 2)[None, :])
            ca = _unpack(wa, 0, BITS, CPW, BITS)
            cb = _unpack(wb, 0, BITS, CPW, BITS)
        else:  # even codes: first channels; odd codes: second channels
            w = tl.load(kw + tl.arange(0, KW)[None, :])
            ca = _unpack(w, 0, 2 * BITS, CPW // 2, BITS)
            cb = _unpack(w, BITS, 2 * BITS, CPW // 2, BITS)
        sc_a = tl.load(sbase + ch_a).to(tl.float32)
        ze_a = tl.load(sbase + D + ch_a).to(tl.float32)
        sc_b = tl.load(sbase + ch_b).to(tl.float32)
        ze_b = tl.load(sbase + D + ch_b).to(tl.float32)
        ka = ze_a[None, :] + ca * sc_a[None, :]
        kb = ze_b[None, :] + cb * sc_b[None, :]
        if MODE_FIRST + MODE_SECOND > 0:  # Phase-Norm: norm first, level offset + c·span/L
            level = ze_b[None, :] + cb * (sc_b / levels)[None, :]
            ka2 = ka * tl.cos(level)
            kb2 = ka * tl.sin(level)
            ka = tl.where(pn[None, :], ka2, ka)
            kb = tl.where(pn[None, :], kb2, kb)
        if ROTATE:  # pre-RoPE keys to positions offset + S + g * T + t (no fused mul-adds)
            at = (pos0 + g * T + t)[:, None] * P + offs_p[None, :]
            cs = tl.load(rope_cos + at)
            sn = tl.load(rope_sin + at)
            a = ka * cs
            b = kb * sn
            c2 = ka * sn
            e2 = kb * cs
            ka = a - b
            kb = c2 + e2
        ka = ka - mua[None, :]
        kb = kb - mub[None, :]
        s = _qk(qa, ka, DOT, PRECISION) + _qk(qb, kb, DOT, PRECISION)
        if HAS_PAYLOAD:  # exact outliers: a sparse correction q . (exact - decoded) to logits
            t_first = (it % TPG) * BLOCK_T
            s += _outlier_logits(
                qrow,
                kwords + slot * (T * KW),
                kscal + slot * (2 * D),
                payload_ptr + slot * E,
                widths_ptr + row * P,
                rope_cos,
                rope_sin,
                pos0,
                g,
                t_first,
                m_ok,
                offs_d,
                wd,
                K,
                D,
                T,
                BITS,
                HALF,
                KIND,
                ROTATE,
                BF16,
                BLOCK_T,
                BLOCK_K,
                DOT,
            )
        if SOFTCAP:
            s = _softcap(s, qmu[:, None], softcap)
        stream = s_len + g * T + t
        seen = (stream[None, :] < limit[:, None]) & m_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_run, l_run, acc, accz, p = _online(s, m_run, l_run, acc, accz)
        vw = tl.load(vwords + slot * (T * VW) + t[:, None] * VW + tl.arange(0, VW)[None, :])
        vc = _unpack(vw, 0, BITS, CPW, BITS)
        vsbase = vscal + slot * (2 * T)
        v_scale = tl.load(vsbase + t).to(tl.float32)
        v_zero = tl.load(vsbase + T + t).to(tl.float32)
        acc += _pv(p * v_scale[None, :], vc, DOT, PRECISION)
        accz += tl.sum(p * v_zero[None, :], axis=1)
    base = (row * (NS + 1) + split) * M + offs_m
    tl.store(part_m + base, m_run, mask=m_ok)
    tl.store(part_l + base, l_run, mask=m_ok)
    tl.store(
        part_acc + base[:, None] * DV + offs_dv[None, :], acc + accz[:, None], mask=m_ok[:, None]
    )


@triton.jit
def _exact_kernel(
    q_ptr,
    mu_ptr,
    sink_k,
    sink_v,
    res_k,
    res_v,
    counts,
    part_m,
    part_l,
    part_acc,
    rows,
    M,
    Q,
    S_cap,
    R_cap,
    NS,
    softcap,
    D: tl.constexpr,
    DV: tl.constexpr,
    T: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    """The exact tokens (sinks, then residual) of a row into partial slot ``NS``."""
    row = tl.program_id(0).to(tl.int64)
    mblk = tl.program_id(1)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    m_ok = offs_m < M
    s_len = tl.load(counts + row)
    g_cnt = tl.load(counts + rows + row)
    r_len = tl.load(counts + 2 * rows + row)
    n = s_len + g_cnt * T + r_len
    limit = tl.zeros([BLOCK_M], dtype=tl.int64) + n
    if CAUSAL:
        limit = limit - (Q - 1 - offs_m % Q).to(tl.int64)
    q = tl.load(
        q_ptr + (row * M + offs_m[:, None]) * D + offs_d[None, :], mask=m_ok[:, None], other=0.0
    )
    mu = tl.load(mu_ptr + row * D + offs_d)
    qmu = tl.sum(q * mu[None, :], axis=1)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    accz = tl.zeros([BLOCK_M], dtype=tl.float32)
    for e0 in range(0, s_len + r_len, BLOCK_E):
        i = e0 + tl.arange(0, BLOCK_E)  # i < s_len: sink slot i, else residual slot i - s_len
        is_sink = i < s_len
        j = i - s_len
        ok_s = is_sink
        ok_r = (~is_sink) & (j < r_len)
        stream = tl.where(is_sink, i, s_len + g_cnt * T + j)
        ks = tl.load(
            sink_k + (row * S_cap + i[:, None]) * D + offs_d[None, :], mask=ok_s[:, None], other=0.0
        ).to(tl.float32)
        kr = tl.load(
            res_k + (row * R_cap + j[:, None]) * D + offs_d[None, :], mask=ok_r[:, None], other=0.0
        ).to(tl.float32)
        k = tl.where(is_sink[:, None], ks, kr) - mu[None, :]
        s = _qk(q, k, DOT, PRECISION)
        if SOFTCAP:
            s = _softcap(s, qmu[:, None], softcap)
        seen = (ok_s | ok_r)[None, :] & (stream[None, :] < limit[:, None]) & m_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_run, l_run, acc, accz, p = _online(s, m_run, l_run, acc, accz)
        vs_ = tl.load(
            sink_v + (row * S_cap + i[:, None]) * DV + offs_dv[None, :],
            mask=ok_s[:, None],
            other=0.0,
        ).to(tl.float32)
        vr = tl.load(
            res_v + (row * R_cap + j[:, None]) * DV + offs_dv[None, :],
            mask=ok_r[:, None],
            other=0.0,
        ).to(tl.float32)
        acc += _pv(p, tl.where(is_sink[:, None], vs_, vr), DOT, PRECISION)
    base = (row * (NS + 1) + NS) * M + offs_m
    tl.store(part_m + base, m_run, mask=m_ok)
    tl.store(part_l + base, l_run, mask=m_ok)
    tl.store(part_acc + base[:, None] * DV + offs_dv[None, :], acc, mask=m_ok[:, None])


def _layout_kind(kv: PackedKV) -> str | None:
    """``"half"``, ``"interleaved"`` or ``None`` (rotary pairs not covering the head in one of
    the two layouts). Reads the layout's index tensors (a copy to the host when on a GPU:
    launcher build time, not launch time)."""
    d = kv.layout.head_dim
    p = kv.layout.num_pairs
    if 2 * p != d:
        return None
    first = kv.layout.first.cpu().tolist()
    second = kv.layout.second.cpu().tolist()
    if first == list(range(p)) and second == list(range(p, d)):
        return "half"
    if first == list(range(0, d, 2)) and second == list(range(1, d, 2)):
        return "interleaved"
    return None


def splitk_unsupported(kv: PackedKV, decode: KernelKeyDecode | str) -> str | None:
    """``None`` when :func:`splitk_launcher` runs this cache, else why not (module docstring:
    what is covered)."""
    if isinstance(decode, str):
        return decode
    if decode.kind not in (KEYS_PER_CHANNEL, KEYS_WIDTHS):
        return "split-K kernel: per-channel keys or per-pair widths only (no per-token keys)"
    pn = PAIR_PHASE_NORM in (decode.mode_first, decode.mode_second)
    if decode.payload_bytes and pn:
        return "split-K kernel: outliers over Phase-Norm pairs are not decoded"
    if decode.kind == KEYS_WIDTHS and kv.mask is None:
        return "split-K kernel: per-pair widths without a width table"
    if kv.bits not in (2, 4):
        return f"split-K kernel: 2- or 4-bit codes only, got {kv.bits}"
    d, dv = kv.layout.head_dim, kv.sink_values.shape[-1]
    cpw = 32 // kv.bits
    for name, x, lo in (("head_dim", d, 32), ("value head_dim", dv, 16)):
        if x < lo or x & (x - 1) or x % cpw:
            return f"split-K kernel: {name} must be a power of two >= {lo}, got {x}"
    if (d // cpw) % 2:
        return "split-K kernel: a token's key codes must fill an even number of words"
    t = kv.group_tokens
    if t < 16 or t & (t - 1):
        return f"split-K kernel: group_tokens must be a power of two >= 16, got {t}"
    if _layout_kind(kv) is None:
        return "split-K kernel: rotary pairs must cover the head (rotary_dim = head_dim)"
    for buf in (kv.key_codes, kv.value_codes):
        if not buf.is_contiguous() or buf.storage_offset() % 4:
            return "split-K kernel: code buffers must be contiguous and 4-byte aligned"
    return None


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
    block_m = min(max(_pow2(m_rows), 16), 64) if dot else min(_pow2(m_rows), 16)
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
        _pointer(kv.key_scalars),
        _words(kv.value_codes),
        _pointer(kv.value_scalars),
        counts,
        mask,
        _pointer(widths, dev),
        _pointer(payload.contiguous(), dev),
        _pointer(cos, dev),
        _pointer(sin, dev),
        _pointer(offsets.to(dev, non_blocking=True), dev),
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
        HALF=_layout_kind(kv) == "half",
        KIND=2 if decode.kind == KEYS_WIDTHS else 0,
        ROTATE=bool(decode.rotate_to_position),
        HAS_PAYLOAD=n_out > 0,
        BF16=kv.sink_keys.dtype == torch.bfloat16,
        BLOCK_K=_pow2(n_out, 16),
        MODE_FIRST=int(decode.mode_first == PAIR_PHASE_NORM),
        MODE_SECOND=int(decode.mode_second == PAIR_PHASE_NORM),
        HAS_MASK=has_mask,
        BLOCK_M=block_m,
        BLOCK_T=bt,
        **common,
        **extra,
    )
    exact_args = (
        q,
        mu_rows,
        _pointer(kv.sink_keys),
        _pointer(kv.sink_values),
        _pointer(kv.residual_keys),
        _pointer(kv.residual_values),
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
    sinks = (
        sink_logits.detach().to(device=dev, dtype=torch.float32).contiguous()
        if sink_logits is not None
        else out
    )
    merge_args = (
        part_m,
        part_l,
        part_acc,
        q,
        mu_rows,
        sinks,
        _pointer(hadamard, dev),
        out,
        m_rows,
        nq,
        hkv,
        rep,
        ns,
    )
    merge_meta = dict(
        D=d,
        DV=dv,
        HAS_SINKS=sink_logits is not None,
        SOFTCAP=logit_softcap is not None,
        HADAMARD=bool(decode.value_hadamard),
        BLOCK_M=block_m,
        BLOCK_D=d,
        BLOCK_DV=dv,
        **extra,
    )

    launches = (
        [Launch(_quantized_kernel, (rows, ns, mblocks), quant_args, quant_meta)] if ns else []
    )
    launches.append(Launch(_exact_kernel, (rows, mblocks), exact_args, exact_meta))
    launches.append(Launch(_merge_kernel, (rows, mblocks), merge_args, merge_meta))
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
