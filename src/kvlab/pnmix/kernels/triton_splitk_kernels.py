"""The ``@triton.jit`` kernels of the split-K GQA decode (:mod:`kvlab.pnmix.kernels.
triton_splitk` launches them and owns their arguments): ``quantized_kernel`` — one program per
(sequence, kv head, context split, query block) over the quantized groups, codes read as 32-bit
words and unpacked in registers, ``tl.dot`` for q·k and p·v, outliers as a sparse correction to
the logits — and ``exact_kernel`` — the sink and residual tokens, merged by log-sum-exp
(:func:`kvlab.pnmix.kernels.triton_common.merge_kernel`).

Importing this module requires ``triton``; under ``TRITON_INTERPRET=1`` it runs on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.pnmix.kernels.triton_common import online, softcap_tile


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
def quantized_kernel(
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
    VGROUPS: tl.constexpr = 1,
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
            s = softcap_tile(s, qmu[:, None], softcap)
        stream = s_len + g * T + t
        seen = (stream[None, :] < limit[:, None]) & m_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_run, l_run, acc, accz, p = online(s, m_run, l_run, acc, accz)
        vw = tl.load(vwords + slot * (T * VW) + t[:, None] * VW + tl.arange(0, VW)[None, :])
        vc = _unpack(vw, 0, BITS, CPW, BITS)
        vsbase = vscal + slot * (2 * T * VGROUPS)  # [scale(T, G) | zero(T, G)]
        if VGROUPS == 1:  # one scale and zero per token: p s @ codes + p . z
            v_scale = tl.load(vsbase + t).to(tl.float32)
            v_zero = tl.load(vsbase + T + t).to(tl.float32)
            acc += _pv(p * v_scale[None, :], vc, DOT, PRECISION)
            accz += tl.sum(p * v_zero[None, :], axis=1)
        else:  # per token and channel group: p @ (zero + codes * scale), decoded tile
            at_g = t[:, None] * VGROUPS + (offs_dv // (DV // VGROUPS))[None, :]
            v_scale = tl.load(vsbase + at_g).to(tl.float32)
            v_zero = tl.load(vsbase + T * VGROUPS + at_g).to(tl.float32)
            acc += _pv(p, v_zero + vc * v_scale, DOT, PRECISION)
    base = (row * (NS + 1) + split) * M + offs_m
    tl.store(part_m + base, m_run, mask=m_ok)
    tl.store(part_l + base, l_run, mask=m_ok)
    tl.store(
        part_acc + base[:, None] * DV + offs_dv[None, :], acc + accz[:, None], mask=m_ok[:, None]
    )


@triton.jit
def exact_kernel(
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
            s = softcap_tile(s, qmu[:, None], softcap)
        seen = (ok_s | ok_r)[None, :] & (stream[None, :] < limit[:, None]) & m_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_run, l_run, acc, accz, p = online(s, m_run, l_run, acc, accz)
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
