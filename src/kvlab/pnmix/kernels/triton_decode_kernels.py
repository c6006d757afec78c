"""The ``@triton.jit`` kernels of the Triton backend of packed attention
(:mod:`kvlab.pnmix.kernels.triton_decode` launches them and owns their arguments; the algorithm
is described there): ``split_kernel`` — one program per (row, split, block of query rows), an
online softmax over a share of the row's quantized groups decoded in registers (``_codes``,
``_width_codes``, ``_decode_tile``: decode, payload, rotation), or over its exact tokens — whose
partials :func:`kvlab.pnmix.kernels.triton_common.merge_kernel` merges.

Importing this module requires ``triton``; under ``TRITON_INTERPRET=1`` (set before it is first
imported: ``triton.jit`` reads it at decoration) it runs on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.pnmix.kernels.triton_common import online, softcap_tile

__all__ = ["split_kernel"]


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
def split_kernel(
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
    VGROUPS: tl.constexpr = 1,
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
            vsbase = vscal + slot * (2 * T * VGROUPS)  # [scale(T, G) | zero(T, G)]
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
                if VGROUPS == 1:  # one scale and zero per token: p s @ codes + p . z
                    v_scale = tl.load(vsbase + t, mask=t_ok, other=0.0).to(tl.float32)
                    v_zero = tl.load(vsbase + T + t, mask=t_ok, other=0.0).to(tl.float32)
                    w = p * v_scale[None, :]
                    if DOT:
                        acc += tl.dot(w, vc, input_precision="ieee")
                    else:
                        acc += tl.sum(w[:, :, None] * vc[None, :, :], axis=1)
                    accz += tl.sum(p * v_zero[None, :], axis=1)
                else:  # per token and channel group: p @ (zero + codes * scale), decoded tile
                    at_g = t[:, None] * VGROUPS + (offs_dv // (DV // VGROUPS))[None, :]
                    v_scale = tl.load(vsbase + at_g, mask=v_ok, other=0.0).to(tl.float32)
                    v_zero = tl.load(vsbase + T * VGROUPS + at_g, mask=v_ok, other=0.0)
                    v = v_zero.to(tl.float32) + vc * v_scale
                    if DOT:
                        acc += tl.dot(p, v, input_precision="ieee")
                    else:
                        acc += tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    base = (row * (NS + 1) + split) * M + offs_m
    tl.store(part_m + base, m_run, mask=m_ok)
    tl.store(part_l + base, l_run, mask=m_ok)
    tl.store(
        part_acc + base[:, None] * DV + offs_dv[None, :],
        acc + accz[:, None],
        mask=m_ok[:, None] & dv_ok[None, :],
    )
