"""Issue-8 key codecs on the store: pre-RoPE codes, per-pair widths, exact outliers, the
query-aware mix and Hadamard values — float64 references, attention from codes, exact bytes,
relay by positions, streaming, padded rows, host syncs, errors."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.pnmix.bitalloc import (
    allocate_pair_bits,
    greedy_pair_bits,
    mixed_bits_quantize,
    pair_logit_error,
    query_second_moment,
)
from kvlab.pnmix.codecs import (
    CartesianCodec,
    KeyLayout,
    MixCodec,
    PhaseNormCodec,
    TableStatistics,
    query_logit_saliency,
)
from kvlab.pnmix.hadamard import hadamard_matrix
from kvlab.pnmix.outliers import sparse_minmax_quantize
from kvlab.pnmix.packing import pack_codes
from kvlab.pnmix.prerope import to_prerope
from kvlab.pnmix.reference import apply_key_payload, decode_key_block
from kvlab.pnmix.values import HadamardValueCodec, PerTokenValueCodec
from kvlab.pnmix.width_codec import BitAllocCodec, channel_bit_offsets
from kvlab.rope import RotaryConfig, apply_rotary, rotate_by_delta

D = 16
ROPES = {
    "half": RotaryConfig(head_dim=D),
    "interleaved-partial-llama3": RotaryConfig(
        head_dim=D,
        rotary_dim=12,
        layout="interleaved",
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "half-partial-yarn": RotaryConfig(
        head_dim=D,
        rotary_dim=8,
        base=500.0,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
}
NEW_CODINGS = [
    ("prerope_cartesian", 0.0),
    ("prerope_phase_norm", 0.0),
    ("prerope_mix", 0.0),
    ("prerope_qmix", 0.0),
    ("qmix", 0.0),
    ("bit_alloc", 0.0),
    ("bit_alloc", 0.05),
    ("prerope_cartesian", 0.05),
]


def config(coding: str, rope: RotaryConfig, fraction: float = 0.0, **kw) -> PNMixConfig:
    base = dict(sink_tokens=3, residual_tokens=4, group_tokens=8)
    base.update(kw)
    return PNMixConfig(
        key_coding=coding,  # type: ignore[arg-type]
        key_outlier_fraction=fraction,
        rotary_dim=rope.rotary_dim,
        rotary_layout=rope.layout,
        **base,
    )


def make_cache(cfg: PNMixConfig, rope: RotaryConfig, b: int = 2, h: int = 2, dv: int = D):
    return PNMixCache(
        cfg, batch_size=b, num_key_value_heads=h, head_dim=D, value_head_dim=dv, rotary=rope
    )


def model_keys(b: int, h: int, t: int, rope: RotaryConfig, seed: int, start: int = 0):
    """Keys as a model hands them: raw keys with uneven channel scales, rotated at positions
    ``start .. start + t - 1``; values; queries (rotated) of 2 query heads per kv head."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.3, 4.0, D)
    raw = torch.randn(b, h, t, D, generator=gen) * scales + torch.linspace(-2, 2, D)
    pos = torch.arange(start, start + t)
    keys = apply_rotary(raw, pos, rope)
    values = torch.randn(b, h, t, D, generator=gen)
    queries = apply_rotary(torch.randn(b, 2 * h, t, D, generator=gen) * scales, pos, rope)
    return keys, values, queries


def reference_attention(query: torch.Tensor, cache: PNMixCache, causal: bool = True):
    keys, values = cache.dequantize()
    rep = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1).double()
    values = values.repeat_interleave(rep, dim=1).double()
    nq, seq = query.shape[2], keys.shape[2]
    mask = None
    if causal:
        mask = torch.arange(seq)[None, :] <= (seq - nq + torch.arange(nq))[:, None]
    return F.scaled_dot_product_attention(query.double(), keys, values, attn_mask=mask)


def digest(cache: PNMixCache) -> str:
    """sha256 over every used stored byte: group buffers (payload included), exact tokens,
    the packed per-pair table."""
    h = hashlib.sha256()
    s = cache.store
    n = int(s.group_counts.max(initial=0))
    for t in (
        s.key_codes[:, :, :n],
        s.key_scalars[:, :, :n],
        s.key_payload[:, :, :n],
        s.value_codes[:, :, :n],
        s.value_scalars[:, :, :n],
        cache.sink_keys,
        cache.sink_values,
        cache.residual_keys,
        cache.residual_values,
    ):
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.contiguous().view(torch.int16)
        h.update(t.contiguous().numpy().tobytes())
    if cache.mask_packed is not None:
        h.update(cache.mask_packed.numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- pre-RoPE codes
@settings(max_examples=12, deadline=None)
@given(
    rope=st.sampled_from(list(ROPES)),
    coding=st.sampled_from(["prerope_cartesian", "prerope_phase_norm"]),
    dt=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 10_000),
)
def test_prerope_codes_hold_keys_rotated_back_to_position_zero(rope, coding, dt, seed) -> None:
    """Every group's codes and scalars are the pair codec's of ``to_prerope`` of the group's
    storage-rounded keys at their stream positions; decoding rotates them forward again:
    equal to a float64 decode-and-rotate up to float32 rounding."""
    r = ROPES[rope]
    cfg = config(coding, r, storage_dtype=dt)
    k, v, _ = model_keys(2, 2, 45, r, seed)
    cache = make_cache(cfg, r)
    cache.append(k[:, :, :20], v[:, :, :20])
    for i in range(20, 45):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    codec, layout = cfg.key_codec, cache.layout
    plain = CartesianCodec(2) if coding == "prerope_cartesian" else PhaseNormCodec(2)
    keys, _ = cache.dequantize()
    for g in range(cache.num_groups):
        pos = torch.arange(3 + 8 * g, 3 + 8 * (g + 1))
        pre = to_prerope(k[:, :, pos].to(dt), pos, r, dt).reshape(4, 8, D)
        codes, scalars = plain.encode(pre, dt, layout)
        s = cache.store
        assert torch.equal(s.key_codes[:, :, g].reshape(4, -1), codec.pack(codes, layout))
        assert torch.equal(s.key_scalars[:, :, g].reshape(4, -1), scalars)
        decoded64 = plain.decode(codes, scalars, layout).double().reshape(2, 2, 8, D)
        expected = rotate_by_delta(decoded64, pos.double(), r)
        got = keys[:, :, 3 + 8 * g : 3 + 8 * (g + 1)].double()
        tol = 8 * 2**-24 * float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


# ---------------------------------------------------------------- per-pair widths
def random_widths(n: int, p: int, gen: torch.Generator, bits: int = 2) -> torch.Tensor:
    """Random width tables ``[n, p]`` from (0, 2, 3, 4) within a budget of ``bits * p``."""
    out = torch.full((n, p), bits, dtype=torch.uint8)
    for i in range(n):
        for _ in range(3 * p):
            a, b = torch.randint(0, p, (2,), generator=gen).tolist()
            wa, wb = int(out[i, a]), int(out[i, b])
            # move bits from pair b to pair a, staying inside (0, 2, 3, 4)
            step = {0: 2, 2: 1, 3: 1}.get(wa)
            down = {2: 2, 3: 1, 4: 1}.get(wb)
            if a != b and step is not None and down is not None and step == down:
                out[i, a], out[i, b] = wa + step, wb - down
    return out


@settings(max_examples=30, deadline=None)
@given(
    rope=st.sampled_from(list(ROPES)),
    fraction=st.sampled_from([0.0, 0.03, 0.2]),
    dt=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 10_000),
)
def test_bit_alloc_codes_equal_the_reference_quantizers(rope, fraction, dt, seed) -> None:
    """Channels of width b >= 1 are coded exactly as the min-max (or dense-and-sparse) codes
    of b bits; 0-bit channels keep the group mean; the payload holds the exact outliers; the
    decode equals the float64 reconstruction and outliers come back bit-exactly."""
    r = ROPES[rope]
    layout = KeyLayout.for_rotary(D, r.rotary_dim, r.layout)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 8, D, generator=gen) * 3).to(dt)
    x[0, 2, 1] = 200.0
    table = random_widths(5, layout.num_pairs, gen)
    codec = BitAllocCodec(2, outlier_fraction=fraction)
    coded = codec.encode_groups(x, dt, layout, table)
    widths = codec.channel_widths(table, layout)
    scale, zero = coded.scalars[:, :D], coded.scalars[:, D:]
    k = codec.outlier_count(8, D)
    if k == 0:
        ref = mixed_bits_quantize(x, widths, -2, dt)
        assert torch.equal(coded.codes, ref.codes)
        assert torch.equal(scale, ref.scale) and torch.equal(zero, ref.zero)
        assert coded.payload.shape == (5, 0)
    else:
        for b in (2, 3, 4):
            sel = widths == b
            sp = sparse_minmax_quantize(x, b, k, dt)
            assert torch.equal(coded.codes.permute(0, 2, 1)[sel], sp.codes.permute(0, 2, 1)[sel])
            assert torch.equal(scale[sel], sp.scale[sel]) and torch.equal(zero[sel], sp.zero[sel])
        es = torch.finfo(dt).bits // 8
        assert coded.payload.shape == (5, k * (es + 2))
        assert torch.equal(coded.payload[:, : k * es].contiguous().view(dt), sp.outlier_values)
        assert torch.equal(
            coded.payload[:, k * es :].contiguous().view(torch.int16), sp.outlier_index
        )
    zero_sel = widths == 0
    assert torch.equal(scale[zero_sel], torch.zeros_like(scale[zero_sel]))
    kept = torch.ones_like(x, dtype=torch.float64)  # 0-bit: mean of the tokens not outliers
    if k:
        kept = kept.flatten(1).scatter(1, sp.outlier_index.long(), 0.0).view_as(x)
    mean = (x.double() * kept).sum(-2) / kept.sum(-2).clamp(min=1)
    assert torch.equal(zero[zero_sel], mean.to(dt)[zero_sel])
    assert bool((coded.codes.permute(0, 2, 1)[zero_sel] == 0).all())
    assert bool((coded.codes.long() < (1 << widths.long()).unsqueeze(1)).all())
    decoded = codec.apply_payload(
        codec.decode(coded.codes, coded.scalars, layout), coded.payload, dt
    )
    recon = zero.double().unsqueeze(1) + coded.codes.double() * scale.double().unsqueeze(1)
    if k:
        index = coded.payload[:, k * es :].contiguous().view(torch.int16).long()
        exact = torch.gather(x.flatten(1), 1, index)
        assert torch.equal(torch.gather(decoded.flatten(1), 1, index), exact.float())
        recon = recon.flatten(1).scatter(1, index, exact.double()).view_as(recon)
    torch.testing.assert_close(decoded.double(), recon, rtol=2**-23, atol=0)


def _reference_pack(codes: torch.Tensor, widths: torch.Tensor, bits: int) -> list[int]:
    """Bytes of one group by the documented layout, built bit by bit: token t at bit
    t * bits * D; channels by width descending, then index; each code LSB first."""
    t, d = codes.shape
    order = sorted(range(d), key=lambda c: (-int(widths[c]), c))
    stream: list[int] = []
    for i in range(t):
        token: list[int] = []
        for c in order:
            token += [(int(codes[i, c]) >> k) & 1 for k in range(int(widths[c]))]
        token += [0] * (bits * d - len(token))
        stream += token
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[j + k] << k for k in range(8)) for j in range(0, len(stream), 8)]


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 6), seed=st.integers(0, 10_000), rope=st.sampled_from(list(ROPES)))
def test_width_layout_is_the_documented_bitstream(t, seed, rope) -> None:
    r = ROPES[rope]
    layout = KeyLayout.for_rotary(D, r.rotary_dim, r.layout)
    gen = torch.Generator().manual_seed(seed)
    codec = BitAllocCodec(2)
    table = random_widths(3, layout.num_pairs, gen)
    widths = codec.channel_widths(table, layout)
    codes = (torch.randint(0, 16, (3, t, D), generator=gen) % (1 << widths[:, None, :])).to(
        torch.uint8
    )
    packed = codec.pack(codes, layout, table)
    assert packed.shape == (3, codec.code_bytes(t, D)) == (3, math.ceil(t * D * 2 / 8))
    for n in range(3):
        assert packed[n].tolist() == _reference_pack(codes[n], widths[n], 2)
    assert torch.equal(codec.unpack(packed, t, layout, table), codes)
    # offsets: width descending, then channel index
    offsets = channel_bit_offsets(widths)
    for n in range(3):
        order = sorted(range(D), key=lambda c: (-int(widths[n, c]), c))
        acc = 0
        for c in order:
            assert int(offsets[n, c]) == acc
            acc += int(widths[n, c])
    # every width equal to the configured bits: exactly the fixed-width layout
    flat = torch.full_like(table, 2)
    two = codes % 4
    assert torch.equal(codec.pack(two, layout, flat), pack_codes(two.reshape(3, -1), 2))


def test_greedy_on_the_device_equals_the_per_row_loop() -> None:
    """``greedy_pair_bits`` (fixed vectorized steps, no host read) gives the allocation of the
    plain per-row greedy loop, on non-convex distortions and several width sets."""
    gen = torch.Generator().manual_seed(0)
    for widths, avg in [((0, 2, 3, 4), 2), ((0, 1, 2, 3, 4), 2), ((1, 2, 4), 3), ((0, 4), 2)]:
        dist = torch.rand(len(widths), 3, 2, 7, generator=gen, dtype=torch.float64)
        got = greedy_pair_bits(dist, widths, avg)
        w = torch.tensor(widths)
        for b in range(3):
            index = torch.zeros(14, dtype=torch.int64)
            d = dist[:, b].reshape(len(widths), 14)
            left = (avg - widths[0]) * 14
            while True:
                best, pick = -math.inf, None
                for j in range(14):
                    i = int(index[j])
                    if i + 1 < len(widths) and widths[i + 1] - widths[i] <= left:
                        gain = float(d[i, j] - d[i + 1, j]) / (widths[i + 1] - widths[i])
                        if gain > best:
                            best, pick = gain, j
                if pick is None:
                    break
                left -= widths[int(index[pick]) + 1] - widths[int(index[pick])]
                index[pick] += 1
            assert torch.equal(got[b].reshape(-1), w[index]), (widths, b)
        assert torch.equal(got, allocate_pair_bits(dist, widths, avg))


def _row_queries(q: torch.Tensor, b: int, h: int) -> torch.Tensor:
    rep = q.shape[1] // 2
    return q[b : b + 1, h * rep : (h + 1) * rep]


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 40),
    query_tokens=st.integers(1, 48),
    lengths=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    real=st.lists(st.integers(0, 48), min_size=2, max_size=2),
    seed=st.integers(0, 10_000),
)
def test_query_lengths_read_each_sequences_last_real_queries_only(
    tokens, query_tokens, lengths, real, seed
) -> None:
    """``append(..., queries=[B, H_q, T_q, D], query_lengths=[B])`` (a prefill's queries for
    the tokens an eviction kept: any ``T_q``): a table reads the last ``query_lengths[b]``
    queries of sequence ``b`` and nothing else — what the other queries hold (NaN here) does
    not change one stored byte; with ``T_q = T`` and ``query_lengths`` the rows' own lengths
    it stores what the aligned default stores."""
    r = ROPES["half"]
    cfg = config("bit_alloc", r, 0.05)
    k, v, _ = model_keys(2, 2, tokens, r, seed=seed)
    lens = np.minimum(np.array(lengths).reshape(2, 2), tokens)
    ql = np.minimum(np.array(real), query_tokens)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(2, 4, query_tokens, D, generator=gen)
    pads = torch.arange(query_tokens)[None, :] < torch.from_numpy(query_tokens - ql)[:, None]
    digests = []
    for fill in (float("nan"), 1e3):
        filled = torch.where(pads[:, None, :, None], torch.full_like(q, fill), q)
        cache = make_cache(cfg, r)
        cache.append(k, v, lens, queries=filled, query_lengths=ql)
        digests.append(digest(cache))
    assert digests[0] == digests[1]
    # aligned: the same as the default (query j real where token j is)
    q_aligned = torch.randn(2, 4, tokens, D, generator=gen)
    row = lens[:, :1].repeat(2, 1)
    aligned, default = make_cache(cfg, r), make_cache(cfg, r)
    aligned.append(k, v, row, queries=q_aligned, query_lengths=row[:, 0])
    default.append(k, v, row, queries=q_aligned)
    assert digest(aligned) == digest(default)


def test_bad_query_lengths_are_refused_and_store_nothing() -> None:
    r = ROPES["half"]
    k, v, q = model_keys(2, 2, 30, r, seed=3)
    cache = make_cache(config("bit_alloc", r), r)
    empty = digest(cache)
    for kwargs, match in [
        ({"query_lengths": [30, 30]}, "needs queries"),
        ({"queries": q, "query_lengths": [30]}, "one per sequence"),
        ({"queries": q, "query_lengths": [[30, 30], [30, 30]]}, "one per sequence"),
        ({"queries": q, "query_lengths": [31, 2]}, r"0\.\.30"),
        ({"queries": q, "query_lengths": [1.0, 2.0]}, "one per sequence"),
        ({"queries": q[:, :, :20]}, "T=30"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.append(k, v, **kwargs)
        assert digest(cache) == empty and int(cache.seq_lengths.max()) == 0
    cache.append(k, v, queries=q[:, :, :20], query_lengths=[20, 7])  # T_q may differ from T
    assert cache.pair_widths is not None


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("fraction", [0.0, 0.05])
def test_width_table_is_the_greedy_of_the_query_weighted_logit_error(rope, fraction) -> None:
    """The widths a prefill stores are ``allocate_pair_bits`` (one budget per row) of the
    distortion Σ_groups pair_logit_error(rotated coding error, prefill query moment) of every
    width, on the groups the prefill flushes; every row spends exactly bits * P."""
    r = ROPES[rope]
    cfg = config("bit_alloc", r, fraction)
    k, v, q = model_keys(2, 2, 40, r, seed=7)
    cache = make_cache(cfg, r)
    cache.append(k, v, queries=q)
    codec, layout = cfg.key_codec, cache.layout
    widths = cache.pair_widths
    assert widths is not None and cache.saliency_computations == 1
    p = layout.num_pairs
    assert widths.sum(-1).tolist() == [[2 * p] * 2] * 2
    groups = cache.num_groups
    for b, h in itertools.product(range(2), range(2)):
        moment = query_second_moment(_row_queries(q, b, h), 1)[0, 0]
        dist = torch.zeros(4, 1, 1, p, dtype=torch.float64)
        for g in range(groups):
            pos = torch.arange(3 + 8 * g, 3 + 8 * (g + 1))
            pre = to_prerope(k[b, h, pos], pos, r, torch.float16)[None]
            for i, w in enumerate(codec.widths):
                table = torch.full((1, p), w, dtype=torch.uint8)
                coded = codec.encode_groups(pre, torch.float16, layout, table)
                dec = codec.apply_payload(
                    codec.decode(coded.codes, coded.scalars, layout), coded.payload, torch.float16
                )
                err = rotate_by_delta(dec.double() - pre.double(), pos.double(), r)
                dist[i] += pair_logit_error(err[None], moment, layout.first, layout.second)[0]
        ref = allocate_pair_bits(dist, codec.widths, 2)[0, 0]
        assert torch.equal(widths[b, h], ref), (b, h)


def test_query_aware_mix_against_a_float64_query_loop() -> None:
    """The query-aware mix picks Phase–Norm exactly where its error Σ_groups Σ_t mean_q
    (q_pair · R(pos) e_pair)², computed query by query in float64, is strictly smaller."""
    r = ROPES["interleaved-partial-llama3"]
    layout = KeyLayout.for_rotary(D, r.rotary_dim, r.layout)
    gen = torch.Generator().manual_seed(3)
    g, t, n_q = 4, 6, 5
    keys = (torch.randn(g, t, D, generator=gen) * 2).half().float()
    theta = 0.7 * torch.randint(0, 4, (g, t), generator=gen).float()
    keys[..., 0], keys[..., 1] = 3 * theta.cos(), 3 * theta.sin()  # Phase–Norm codes it well
    keys = keys.half().float()
    owner = torch.tensor([0, 0, 1, 1])
    positions = torch.arange(g * t).reshape(g, t) + 10
    q = torch.randn(2, n_q, D, generator=gen, dtype=torch.float64) * torch.linspace(3, 0.2, D)
    moment = torch.einsum("nqd,nqe->nde", q, q) / n_q
    mix = MixCodec(
        CartesianCodec(2, prerope=True), PhaseNormCodec(2, prerope=True), query_aware=True
    )
    stats = TableStatistics(
        keys=keys,
        owner=owner,
        first=torch.tensor([0, 2]),
        storage_dtype=torch.float16,
        layout=layout,
        moment=moment,
        positions=positions,
        rotary=r,
    )
    mask = query_logit_saliency(mix, stats)
    assert torch.equal(mix.compute_table(stats), mask)
    errors = []
    for part in (mix.first, mix.second):
        codes, scalars = part.encode(keys, torch.float16, layout)
        e = part.decode(codes, scalars, layout).double() - keys.double()
        e = rotate_by_delta(e, positions.double(), r)
        total = torch.zeros(2, layout.num_pairs, dtype=torch.float64)
        for gi, row in enumerate(owner.tolist()):
            for p in range(layout.num_pairs):
                a, b = int(layout.first[p]), int(layout.second[p])
                for ti in range(t):
                    for j in range(n_q):
                        logit = q[row, j, a] * e[gi, ti, a] + q[row, j, b] * e[gi, ti, b]
                        total[row, p] += float(logit) ** 2 / n_q
        errors.append(total)
    assert torch.equal(mask, errors[1] < errors[0])
    assert bool(mask.any()) and not bool(mask.all())


# ---------------------------------------------------------------- attention from codes
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize(("coding", "fraction"), NEW_CODINGS)
def test_attention_from_codes_equals_attention_over_decoded_keys(rope, coding, fraction) -> None:
    """Packed attention (decode, payload, rotation to positions, value transform) equals
    float64 attention over ``dequantize()`` to float32 rounding: GQA 1-3, batch 1-2, query
    counts 1..7, block sizes, causal or not, per-token and Hadamard values."""
    r = ROPES[rope]
    gen = torch.Generator().manual_seed(len(coding) + int(100 * fraction))
    for case in range(3):
        b, rep = 1 + case % 2, 1 + case
        values = "hadamard" if case != 1 else "per_token"
        cfg = config(coding, r, fraction, value_coding=values)
        k, v, q = model_keys(b, 2, 47, r, seed=case)
        cache = make_cache(cfg, r, b=b)
        cache.append(k[:, :, :30], v[:, :, :30], queries=q[:, :, :30])
        for i in range(30, 47):
            cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert cache.num_groups >= 4
        for nq in range(1, 8):
            query = torch.randn(b, 2 * rep, nq, D, generator=gen)
            out = pnmix_attention(query, cache, block_groups=1 + nq % 3)
            ref = reference_attention(query, cache)
            assert out.dtype == torch.float32
            torch.testing.assert_close(
                out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())
            )
        query = torch.randn(b, 2 * rep, 3, D, generator=gen)
        torch.testing.assert_close(
            pnmix_attention(query, cache, causal=False).double(),
            reference_attention(query, cache, causal=False),
            rtol=1e-5,
            atol=1e-5,
        )


def test_attention_without_exact_tokens_rotates_the_reference_key() -> None:
    """No sinks, no residual: the logits' reference key is the first decoded group key, at
    its position."""
    r = ROPES["half-partial-yarn"]
    cfg = config("bit_alloc", r, 0.05, sink_tokens=0, residual_tokens=0, value_coding="hadamard")
    k, v, q = model_keys(1, 2, 32, r, seed=4, start=0)
    cache = make_cache(cfg, r, b=1)
    cache.append(k, v, queries=q)
    assert cache.num_groups == 4 and cache.residual_length == 0
    query = torch.randn(1, 4, 2, D)
    torch.testing.assert_close(
        pnmix_attention(query, cache).double(),
        reference_attention(query, cache),
        rtol=1e-5,
        atol=1e-6,
    )


# ---------------------------------------------------------------- bytes
def test_bytes_are_exact_and_the_research_count_is_reproduced() -> None:
    """Components of ``pn-mix``'s coding at SmolLM2-135M's shape (3 kv heads, head_dim 64,
    groups of 32) after 1,023 tokens: the research's simulated count, 202,440 bytes per layer
    (6,073,200 for 30 layers), reproduced from the stored buffers."""
    r = RotaryConfig(head_dim=64, base=100000.0)
    cfg = PNMixConfig(
        group_tokens=32, key_coding="bit_alloc", key_outlier_fraction=0.01, value_coding="hadamard"
    )
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=3, head_dim=64, rotary=r)
    gen = torch.Generator().manual_seed(0)
    k = apply_rotary(torch.randn(1, 3, 1023, 64, generator=gen), torch.arange(1023), r)
    cache.append(k[:, :, :512], torch.randn(1, 3, 512, 64, generator=gen))
    cache.append(k[:, :, 512:], torch.randn(1, 3, 511, 64, generator=gen))
    groups = cache.num_groups
    assert groups == 29 and cache.sink_length + cache.residual_length == 95
    k_out = round(0.01 * 32 * 64)
    assert cache.nbytes() == {
        "key_sink": 3 * 32 * 64 * 2,
        "key_residual": 3 * 63 * 64 * 2,
        "key_codes": groups * 3 * 32 * 64 * 2 // 8,
        "key_scales": groups * 3 * 2 * 64 * 2,
        "key_mask": math.ceil(3 * 32 * 2 / 8),  # 2-bit width index per (kv head, pair)
        "value_sink": 3 * 32 * 64 * 2,
        "value_residual": 3 * 63 * 64 * 2,
        "value_codes": groups * 3 * 32 * 64 * 2 // 8,
        "value_scales": groups * 3 * 2 * 32 * 2,
        "key_payload": groups * 3 * k_out * (2 + 2),
    }
    assert cache.persistent_bytes == 202_440 and 30 * cache.persistent_bytes == 6_073_200
    reserved = cache.reserved_bytes()
    assert reserved["key_payload"] == cache.store.group_capacity * 3 * k_out * 4
    assert reserved["key_codes"] >= cache.nbytes()["key_codes"]


# ---------------------------------------------------------------- outliers, relay
@pytest.mark.parametrize("coding", ["bit_alloc", "prerope_cartesian"])
def test_outliers_come_back_bit_exactly_through_the_store(coding) -> None:
    r = ROPES["interleaved-partial-llama3"]
    cfg = config(coding, r, 0.1)
    k, v, q = model_keys(2, 2, 40, r, seed=9)
    k[0, 1, 13, 5] = 900.0
    cache = make_cache(cfg, r)
    cache.append(k, v, queries=q)
    kv = cache.packed_kv()
    n = cache.num_groups
    pre = apply_key_payload(decode_key_block(kv, 0, n), kv, 0, n).reshape(2, 2, n, 8, D)
    es, count = 2, cfg.key_codec.outlier_count(8, D)
    payload = cache.store.key_payload[:, :, :n]
    index = payload[..., count * es :].contiguous().view(torch.int16).long()
    for g in range(n):
        pos = torch.arange(3 + 8 * g, 3 + 8 * (g + 1))
        exact = to_prerope(k[:, :, pos].half(), pos, r, torch.float16).flatten(-2)
        idx = index[:, :, g]
        got = torch.gather(pre[:, :, g].flatten(-2), -1, idx)
        assert torch.equal(got, torch.gather(exact, -1, idx).float())
    flat = (13 - 3) % 8 * D + 5  # the planted outlier: stream token 13 = group 1, token 2
    assert bool((index[0, 1, (13 - 3) // 8] == flat).any())


@pytest.mark.parametrize(
    ("coding", "fraction"),
    [("prerope_qmix", 0.0), ("prerope_cartesian", 0.0), ("bit_alloc", 0.0), ("bit_alloc", 0.05)],
)
def test_a_relay_changes_positions_only(coding, fraction) -> None:
    """``set_position_offsets``: codes, scalars, payload and table untouched; decoded keys are
    the old ones rotated by the shift; exact tokens rotated likewise; attention equals
    dequantize-then-attend; and (without outliers) the result equals re-encoding the relayed
    keys' decoded values to one quantization step. With outliers re-encoding is no reference:
    it selects its outliers again, among decoded values."""
    r = ROPES["half"]
    cfg = config(coding, r, fraction, value_coding="hadamard")
    k, v, q = model_keys(2, 2, 45, r, seed=11)
    cache = make_cache(cfg, r)
    cache.append(k, v, queries=q)
    before_keys, before_values = cache.dequantize()
    s = cache.store
    frozen = [t.clone() for t in (s.key_codes, s.key_scalars, s.key_payload, s.value_codes)]
    table = None if cache.mask_packed is None else cache.mask_packed.clone()
    delta = np.array([[5, -3], [100, 0]])
    cache.set_position_offsets(delta)
    assert cache.position_offsets.tolist() == delta.tolist()
    now = (s.key_codes, s.key_scalars, s.key_payload, s.value_codes)
    for old, new in zip(frozen, now, strict=True):
        assert torch.equal(old, new)
    assert table is None or torch.equal(table, cache.mask_packed)
    keys, values = cache.dequantize()
    assert torch.equal(values, before_values)
    shift = torch.from_numpy(delta)[..., None].double()
    relayed = rotate_by_delta(before_keys.double(), shift, r)
    # exact tokens: one more rounding to the storage dtype; codes: float32 rotation
    torch.testing.assert_close(keys.double(), relayed, rtol=2**-10, atol=1e-5)
    query = torch.randn(2, 4, 3, D)
    torch.testing.assert_close(
        pnmix_attention(query, cache).double(),
        reference_attention(query, cache),
        rtol=1e-5,
        atol=1e-5,
    )
    if fraction:
        return
    # a fresh cache at the new positions coding the relayed decoded keys: within one step
    fresh = make_cache(cfg, r)
    fresh.set_position_offsets(delta)
    if table is not None:
        fresh.set_pair_table(cache.pair_table)
    fresh.append(relayed.float(), before_values)
    again, _ = fresh.dequantize()
    scale = s.key_scalars[:, :, : cache.num_groups, :D].float()  # per group and channel
    step = scale.repeat_interleave(8, dim=2)
    grouped = slice(3, 3 + 8 * cache.num_groups)
    err = (again[:, :, grouped] - keys[:, :, grouped]).abs()
    # a 0-bit channel's step is its spread: use the channel's own range there
    spread = before_keys[:, :, grouped].amax(2, keepdim=True) - before_keys[:, :, grouped].amin(
        2, keepdim=True
    )
    bound = torch.where(step > 0, step, spread) + 1e-2
    if cfg.key_codec.name == "mix":
        bound = bound + 0.05 * keys[:, :, grouped].abs()  # a phase step moves both channels
    assert bool((err <= bound).all()), float((err - bound).max())
    exact = torch.cat([cache.sink_keys, cache.residual_keys], 2)
    assert torch.equal(exact, torch.cat([fresh.sink_keys, fresh.residual_keys], 2))
    if table is not None:
        assert torch.equal(fresh.pair_table, cache.pair_table)


def test_relay_of_rotated_codes_is_refused_and_changes_nothing() -> None:
    cache = PNMixCache(
        PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=8,
    )
    cache.append(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))
    before = digest(cache)
    with pytest.raises(ValueError, match="re-quantize"):
        cache.set_position_offsets([3])
    assert digest(cache) == before


# ---------------------------------------------------------------- streaming, padding
@pytest.mark.parametrize(
    ("coding", "fraction", "values"),
    [
        ("bit_alloc", 0.05, "hadamard"),
        ("prerope_qmix", 0.0, "per_token"),
        ("qmix", 0.0, "hadamard"),
    ],
)
def test_streamed_arrival_equals_one_prefill_given_the_same_table(coding, fraction, values) -> None:
    """The table is computed once, at the append that flushes a row's first group, from that
    append's queries and every group it flushes; with that table given, any chunking of the
    same tokens stores the same bytes, byte for byte."""
    r = ROPES["interleaved-partial-llama3"]
    cfg = config(coding, r, fraction, value_coding=values)
    k, v, q = model_keys(2, 2, 60, r, seed=13)
    one = make_cache(cfg, r)
    one.append(k, v, queries=q)
    assert one.saliency_computations == 1
    gen = torch.Generator().manual_seed(1)
    for trial in range(3):
        streamed = make_cache(cfg, r)
        streamed.set_pair_table(one.pair_table)
        cuts = sorted(set(torch.randint(1, 60, (trial * 4,), generator=gen).tolist()) | {0, 60})
        for lo, hi in itertools.pairwise(cuts):
            streamed.append(k[:, :, lo:hi], v[:, :, lo:hi], queries=q[:, :, lo:hi])
        assert streamed.saliency_computations == 0  # the given table was used
        assert digest(streamed) == digest(one)
    # without the table, one token at a time computes it at the first flush, from one query
    alone = make_cache(cfg, r)
    for i in range(60):
        alone.append(k[:, :, i : i + 1], v[:, :, i : i + 1], queries=q[:, :, i : i + 1])
    assert alone.saliency_computations == 1 and alone.pair_table is not None


@settings(max_examples=20, deadline=None)
@given(
    coding=st.sampled_from(NEW_CODINGS),
    values=st.sampled_from(["per_token", "hadamard"]),
    data=st.data(),
)
def test_padded_rows_store_and_attend_like_each_row_alone(coding, values, data) -> None:
    """Left-padded appends (pads NaN in keys, values and queries): each row's bytes, table
    and attention equal a batch-1 cache fed that row's real tokens and queries."""
    r = ROPES["half-partial-yarn"]
    cfg = config(coding[0], r, coding[1], value_coding=values, group_tokens=4)
    b, h = 3, 2
    batch = make_cache(cfg, r, b=b)
    alone = [make_cache(cfg, r, b=1) for _ in range(b)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    for _ in range(data.draw(st.integers(1, 4))):
        t = data.draw(st.integers(1, 14))
        lengths = [data.draw(st.integers(0, t)) for _ in range(b)]
        k = torch.randn(b, h, t, D, generator=gen) * torch.linspace(0.3, 3, D)
        v = torch.randn(b, h, t, D, generator=gen)
        q = torch.randn(b, 2 * h, t, D, generator=gen)
        for i, n in enumerate(lengths):
            k[i, :, : t - n] = float("nan")
            v[i, :, : t - n] = float("inf")
            q[i, :, : t - n] = float("nan")
            if n:
                alone[i].append(
                    k[i : i + 1, :, t - n :],
                    v[i : i + 1, :, t - n :],
                    queries=q[i : i + 1, :, t - n :],
                )
        batch.append(k, v, lengths, queries=q)
    for i in range(b):
        x, y = alone[i], batch
        n = x.seq_length
        assert y.seq_lengths[i].tolist() == [n] * h
        ng = x.num_groups
        for name in ("key_codes", "key_scalars", "key_payload", "value_codes", "value_scalars"):
            assert torch.equal(
                getattr(y.store, name)[i, :, :ng], getattr(x.store, name)[0, :, :ng]
            ), name
        if x.pair_table is not None:
            assert torch.equal(y.pair_table[i], x.pair_table[0])
        if n:
            query = torch.randn(1, 4, 1, D, generator=gen)
            full = torch.zeros(b, 4, 1, D)
            full[i] = query[0]
            torch.testing.assert_close(
                pnmix_attention(full, y)[i], pnmix_attention(query, x)[0], rtol=1e-6, atol=1e-6
            )


# ---------------------------------------------------------------- host syncs
SYNCS = ("item", "__bool__", "tolist", "__int__", "__float__")


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch):
    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync: a tensor value was read by Python")

    class Guard:
        def __enter__(self) -> None:
            for name in SYNCS:
                monkeypatch.setattr(torch.Tensor, name, forbidden)

        def __exit__(self, *exc: object) -> None:
            monkeypatch.undo()

    return Guard


@pytest.mark.parametrize(("coding", "fraction"), NEW_CODINGS)
def test_decode_steps_read_nothing_back_from_the_device(coding, fraction, no_host_sync) -> None:
    """Deferred one-token appends (with their queries) and attention, including the append
    that flushes the first group and computes the table: no device value is read."""
    r = ROPES["interleaved-partial-llama3"]
    cfg = config(coding, r, fraction, value_coding="hadamard", group_tokens=4)
    for lengths in (None, [9, 6]):
        k, v, q = model_keys(2, 2, 30, r, seed=3)
        cache = make_cache(cfg, r)
        cache.append(k[:, :, :9], v[:, :, :9], lengths)  # no group flushed yet
        assert int(cache.group_counts.max()) == 0
        with no_host_sync():
            for i in range(9, 30):
                one = slice(i, i + 1)
                cache.append(k[:, :, one], v[:, :, one], checks="deferred", queries=q[:, :, one])
                pnmix_attention(q[:, :, one], cache)
        assert int(cache.group_counts.min()) >= 3
        cache.check_values()
        # padded rows reach their first flush in different appends: one table call each
        calls = 1 if lengths is None else 2
        assert cache.saliency_computations == (calls if cache.has_table else 0)


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_hadamard_values_against_float64(dt) -> None:
    """Codes and scalars are the per-token min-max of ``round(v H)`` (float64 H); decoding
    maps back by ``H^T``: within a quantization step of the values."""
    gen = torch.Generator().manual_seed(2)
    v = (torch.randn(4, 8, 16, generator=gen) * 3).to(dt)
    v[0, 0, 3] = 40.0  # an outlier channel, spread by the rotation
    codec = HadamardValueCodec(2)
    ref = (v.double() @ hadamard_matrix(16, torch.float64)).to(dt)
    assert torch.equal(codec.frame(v, dt), ref)
    codes, scalars = codec.encode(v, dt)
    plain_codes, plain_scalars = PerTokenValueCodec(2).encode(ref, dt)
    assert torch.equal(codes, plain_codes) and torch.equal(scalars, plain_scalars)
    decoded = codec.output_transform(codec.decode(codes, scalars))
    step = scalars[..., :8].float().unsqueeze(-1)
    bound = step / 2 * 4 + 1e-3 * v.float().abs().amax(-1, keepdim=True)  # |H| row norm 1
    assert bool(((decoded - v.float()).abs() <= bound).all())
    with pytest.raises(ValueError, match="power-of-two"):
        codec.check_head_dim(12)


# ---------------------------------------------------------------- errors
def test_bad_configurations_and_calls_are_refused_and_change_nothing() -> None:
    r = ROPES["half"]
    with pytest.raises(ValueError, match="RotaryConfig"):
        PNMixCache(config("bit_alloc", r), batch_size=1, num_key_value_heads=1, head_dim=D)
    with pytest.raises(ValueError, match="does not match"):
        PNMixCache(
            config("prerope_cartesian", r),
            batch_size=1,
            num_key_value_heads=1,
            head_dim=D,
            rotary=ROPES["half-partial-yarn"],
        )
    with pytest.raises(ValueError, match="keeps no sparse outliers"):
        config("mix", r, 0.01)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        config("bit_alloc", r, 1.5)
    with pytest.raises(ValueError, match="power-of-two"):
        make_cache(config("bit_alloc", r, value_coding="hadamard"), r, dv=12)
    with pytest.raises(ValueError, match="value_coding"):
        config("bit_alloc", r, value_coding="walsh")
    with pytest.raises(ValueError, match="widths"):
        BitAllocCodec(2, widths=(0, 3, 2))
    with pytest.raises(ValueError, match="outside the widths"):
        BitAllocCodec(5)
    with pytest.raises(ValueError, match="same frame"):
        MixCodec(CartesianCodec(2, prerope=True), PhaseNormCodec(2))
    cache = make_cache(config("bit_alloc", r, 0.05), r)
    k, v, q = model_keys(2, 2, 30, r, seed=1)
    p = cache.num_pairs
    for bad, match in [
        (torch.full((2, 2, p), 4, dtype=torch.uint8), "budget"),
        (torch.full((2, 2, p), 1, dtype=torch.uint8), "widths must be in"),
        (torch.full((2, 2, p + 1), 2, dtype=torch.uint8), "fit"),
        (torch.full((2, 2, p), 2.0), "integers"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.set_pair_table(bad)
    with pytest.raises(ValueError, match="query heads"):
        cache.append(k, v, queries=q[:, :3])
    with pytest.raises(ValueError, match="queries"):
        cache.append(k, v, queries=q[:, :, :5])
    assert cache.seq_lengths.tolist() == [[0, 0], [0, 0]] and cache.mask_packed is None
    cache.append(k, v, queries=q)
    before = digest(cache)
    with pytest.raises(ValueError, match="already hold"):
        cache.set_pair_table(torch.full((2, 2, p), 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        cache.set_position_offsets([[1, 2, 3]])
    with pytest.raises(ValueError, match="integers"):
        cache.set_position_offsets([1.5, 2.0])
    assert digest(cache) == before
    with pytest.raises(ValueError, match="no per-pair table"):
        make_cache(config("prerope_cartesian", r), r).set_pair_table(torch.zeros(2, 2, p))


@pytest.mark.parametrize("fraction", [0.0, 0.01])
@pytest.mark.parametrize("seed", [0, 1])
def test_shared_table_independent_coding_gives_the_same_codes(fraction, seed) -> None:
    """compute_table reuses one set of outliers and min-max codes for every candidate table:
    encode_groups with them equals encode_groups computing them, byte for byte."""
    gen = torch.Generator().manual_seed(seed)
    codec = BitAllocCodec(2, outlier_fraction=fraction)
    layout = KeyLayout.for_rotary(16, 12)
    keys = (torch.randn(6, 32, 16, generator=gen) * 3).to(torch.float16).float()
    shared = codec._shared(keys, torch.float16)
    tables = [torch.full((6, 6), w, dtype=torch.uint8) for w in codec.widths]
    tables.append(
        torch.tensor(codec.widths, dtype=torch.uint8)[torch.randint(0, 4, (6, 6), generator=gen)]
    )
    for table in tables:
        a = codec.encode_groups(keys, torch.float16, layout, table)
        b = codec.encode_groups(keys, torch.float16, layout, table, shared=shared)
        assert torch.equal(a.codes, b.codes)
        assert torch.equal(a.scalars.view(torch.int16), b.scalars.view(torch.int16))
        assert torch.equal(a.payload, b.payload)
