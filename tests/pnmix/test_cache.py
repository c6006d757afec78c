"""PNMixCache: seed byte accounting, streaming invariance, exact buffers, mask, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import PNMixCache, PNMixConfig
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.quantizers import key_pair_errors, rotary_pair_indices

CODINGS = ["mix", "cartesian", "phase_norm", "per_token"]


def make_kv(
    b: int, h: int, t: int, d: int, dv: int | None = None, seed: int = 0, circle: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys [B,H,T,D] and values [B,H,T,Dv], except (``circle``) the first half-layout
    pair of every key: norm 3 and one of four evenly spaced phases, which Phase–Norm codes
    almost exactly (so the mix mask has both values)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=gen)
    if circle and d >= 4:
        steps = torch.randint(0, 4, (b, h, t), generator=gen).float()
        theta = 0.5 * steps + 0.3 * torch.arange(b * h).reshape(b, h, 1)
        k[..., 0] = 3 * torch.cos(theta)
        k[..., d // 2] = 3 * torch.sin(theta)
    v = torch.randn(b, h, t, dv or d, generator=gen)
    return k, v


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a stored tensor (so -0.0 != 0.0 and NaN payloads would differ)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.contiguous().view(torch.int16)
    return t


def storage(cache: PNMixCache) -> list[tuple[str, torch.Tensor]]:
    out = [
        ("sink_k", cache.sink_keys),
        ("sink_v", cache.sink_values),
        ("res_k", cache.residual_keys),
        ("res_v", cache.residual_values),
    ]
    for i, g in enumerate(cache.groups):
        out += [(f"g{i}.{name}", t) for name, t in g.tensors().items()]
    mask = cache.mix_mask
    if mask is not None:
        out.append(("mask", mask))
    return out


def assert_same_storage(a: PNMixCache, b: PNMixCache) -> None:
    sa, sb = storage(a), storage(b)
    assert [n for n, _ in sa] == [n for n, _ in sb]
    for (name, x), (_, y) in zip(sa, sb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(bits_of(x), bits_of(y)), name
    assert [g.start for g in a.groups] == [g.start for g in b.groups]
    assert a.nbytes() == b.nbytes()


# ---------------------------------------------------------------- the seed's configuration
SEED_BYTES = {
    "key_sink": 4096,
    "key_residual": 4096,
    "key_codes": 6144,
    "key_scales": 768,
    "key_mask": 4,
    "value_sink": 4096,
    "value_residual": 4096,
    "value_codes": 6144,
    "value_scales": 3072,
}


def _check_seed_numbers(cache: PNMixCache) -> None:
    assert cache.nbytes() == SEED_BYTES
    assert cache.key_bytes == 15108
    assert cache.value_bytes == 17408
    assert cache.persistent_bytes == 32516
    assert cache.key_bits_per_element == 4.215401785714286
    assert cache.key_bytes * 8 / (448 * 2 * 32) == 4.215401785714286
    assert cache.quantized_tokens == 384
    assert cache.residual_length == 32
    assert cache.sink_length == 32
    assert cache.seq_length == 448
    assert cache.num_groups == 3
    assert cache.saliency_computations == 1


@pytest.mark.parametrize("storage_dtype", [torch.float16, torch.bfloat16])
def test_seed_byte_accounting_one_shot(storage_dtype: torch.dtype) -> None:
    k, v = make_kv(1, 2, 448, 32, seed=42)
    cache = PNMixCache(
        PNMixConfig(storage_dtype=storage_dtype), batch_size=1, num_key_value_heads=2, head_dim=32
    )
    cache.append(k, v)
    _check_seed_numbers(cache)


def test_seed_byte_accounting_prefill_then_decode() -> None:
    k, v = make_kv(1, 2, 448, 32, seed=42)
    cache = PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=2, head_dim=32)
    cache.append(k[:, :, :384], v[:, :, :384])
    assert cache.quantized_tokens == 256 and cache.residual_length == 96
    mask = cache.mix_mask
    for i in range(384, 448):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    _check_seed_numbers(cache)
    assert torch.equal(cache.mix_mask, mask)


def test_equal_storage_baselines_bytes() -> None:
    k, v = make_kv(1, 2, 448, 32, seed=1)
    kwargs = {"batch_size": 1, "num_key_value_heads": 2, "head_dim": 32}
    nb = {}
    for coding in CODINGS:
        cache = PNMixCache(PNMixConfig(key_coding=coding), **kwargs)
        cache.append(k, v)
        nb[coding] = cache.nbytes()
        assert cache.value_bytes == 17408
    assert nb["cartesian"]["key_mask"] == nb["phase_norm"]["key_mask"] == 0
    assert sum(nb["cartesian"].values()) == 32516 - 4 == sum(nb["phase_norm"].values())
    assert nb["per_token"]["key_scales"] == 384 * 2 * 2 * 2  # per token: scale + zero


# ---------------------------------------------------------------- streaming invariance
@settings(max_examples=60, deadline=None)
@given(
    coding=st.sampled_from(CODINGS),
    sink=st.sampled_from([0, 1, 3]),
    residual=st.sampled_from([0, 2, 3]),
    group=st.sampled_from([2, 3, 4]),
    n=st.integers(0, 40),
    data=st.data(),
)
def test_streamed_equals_one_shot(
    coding: str, sink: int, residual: int, group: int, n: int, data: st.DataObject
) -> None:
    cfg = PNMixConfig(
        bits=data.draw(st.sampled_from([2, 3, 4])),
        sink_tokens=sink,
        residual_tokens=residual,
        group_tokens=group,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_dim=4,
    )
    k, v = make_kv(2, 2, n, 6, dv=5, seed=data.draw(st.integers(0, 1000)))

    def new() -> PNMixCache:
        return PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=6, value_head_dim=5)

    def chunks(lo: int, hi: int) -> list[tuple[int, int]]:
        cuts = sorted(data.draw(st.lists(st.integers(lo, hi), max_size=6)))
        edges = [lo, *cuts, hi]
        return list(itertools.pairwise(edges))

    n_sink = min(sink, n)
    streamed = chunks(0, n)
    one_shot = [(0, n)]
    a, b = new(), new()
    for lo, hi in one_shot:
        a.append(k[:, :, lo:hi], v[:, :, lo:hi])
    for lo, hi in streamed:
        b.append(k[:, :, lo:hi], v[:, :, lo:hi])
    assert a.seq_length == b.seq_length == n
    assert a.sink_length == n_sink
    non_sink = n - n_sink
    expected_groups = (non_sink - residual) // group if non_sink >= residual else 0
    assert a.num_groups == expected_groups
    assert a.residual_length == non_sink - expected_groups * group
    assert_same_storage(a, b)
    assert (
        a.saliency_computations
        == b.saliency_computations
        == int(coding == "mix" and expected_groups > 0)
    )


def test_token_by_token_from_scratch_equals_one_shot_for_every_coding() -> None:
    k, v = make_kv(1, 2, 300, 8, seed=3)
    for coding in CODINGS:
        cfg = PNMixConfig(key_coding=coding)  # type: ignore[arg-type]
        a = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
        b = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
        a.append(k, v)
        for i in range(300):
            b.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert_same_storage(a, b)


# ---------------------------------------------------------------- exact buffers, frozen codes
def test_sinks_and_residual_bit_exact_after_long_decode() -> None:
    cfg = PNMixConfig(sink_tokens=4, residual_tokens=3, group_tokens=5)
    k, v = make_kv(2, 2, 140, 8, seed=5)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    cache.append(k[:, :, :20], v[:, :, :20])
    for i in range(20, 140):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        r = cache.residual_length
        assert 3 <= r < 8
        assert torch.equal(bits_of(cache.residual_keys), bits_of(k[:, :, i + 1 - r : i + 1].half()))
        assert torch.equal(
            bits_of(cache.residual_values), bits_of(v[:, :, i + 1 - r : i + 1].half())
        )
    assert torch.equal(bits_of(cache.sink_keys), bits_of(k[:, :, :4].half()))
    assert torch.equal(bits_of(cache.sink_values), bits_of(v[:, :, :4].half()))
    dk, dv = cache.dequantize()
    assert float((dk[:, :, :4] - k[:, :, :4].half().float()).abs().max()) == 0.0  # sink error 0
    assert torch.equal(dk[:, :, -cache.residual_length :], cache.residual_keys.float())
    assert torch.equal(dv[:, :, :4], v[:, :, :4].half().float())


def test_flushed_codes_are_never_rewritten() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    k, v = make_kv(1, 2, 60, 8, seed=6)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    cache.append(k[:, :, :20], v[:, :, :20])
    before = [(g.start, {n: t.clone() for n, t in g.tensors().items()}) for g in cache.groups]
    assert len(before) == 4
    for i in range(20, 60, 3):
        cache.append(k[:, :, i : i + 3], v[:, :, i : i + 3])
    assert cache.num_groups > len(before)
    for g, (start, snap) in zip(cache.groups, before, strict=False):
        assert g.start == start
        for name, t in g.tensors().items():
            assert torch.equal(bits_of(t), bits_of(snap[name])), name
    # groups are views of the store's contiguous buffers (no per-group copies)
    store = cache.store
    for g in cache.groups:
        assert (
            g.key_codes.untyped_storage().data_ptr() == store.key_codes.untyped_storage().data_ptr()
        )
        assert (
            g.key_scale.untyped_storage().data_ptr()
            == store.key_scalars.untyped_storage().data_ptr()
        )
    assert [g.start for g in cache.groups] == [2 + 4 * i for i in range(cache.num_groups)]


# ---------------------------------------------------------------- the mix mask
def test_mask_computed_once_from_the_first_group_at_prefill() -> None:
    cfg = PNMixConfig(sink_tokens=3, residual_tokens=2, group_tokens=4, rotary_dim=6)
    k, v = make_kv(2, 3, 40, 8, seed=7)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=3, head_dim=8)
    cache.append(k[:, :, :2], v[:, :, :2])  # sinks only: no group yet
    assert cache.mix_mask is None and cache.saliency_computations == 0
    cache.append(k[:, :, 2:16], v[:, :, 2:16])  # prefill: flushes tokens 3..10 as 2 groups
    assert cache.saliency_computations == 1 and cache.num_groups == 2
    first, second = rotary_pair_indices(6)
    cart, pn = key_pair_errors(k.half()[:, :, 3:7], 2, first, second)
    expected = pn < cart
    mask = cache.mix_mask
    assert mask is not None and mask.shape == (2, 3, 3) and mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert bool(mask.any()) and not bool(mask.all())  # both codings occur in this data
    packed = cache.mask_packed  # stored packed: ceil(3 * 3 / 8) bytes per sequence
    assert packed is not None and packed.shape == (2, 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, 1, 9).reshape(2, 3, 3).bool(), mask)
    for i in range(16, 40):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert cache.saliency_computations == 1
    assert torch.equal(cache.mix_mask, mask)
    assert torch.equal(cache.phase_norm_pairs, mask)


def test_short_prefill_leaves_the_mask_to_the_first_flush() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=8, group_tokens=8)
    k, v = make_kv(1, 2, 30, 8, seed=8)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    cache.append(k[:, :, :9], v[:, :, :9])
    assert cache.num_groups == 0 and cache.saliency_computations == 0
    assert cache.mix_mask is None
    for i in range(9, 30):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert cache.num_groups == 2 and cache.saliency_computations == 1
    first, second = rotary_pair_indices(8)
    cart, pn = key_pair_errors(k[:, :, 2:10].half(), 2, first, second)
    assert torch.equal(cache.mix_mask, pn < cart)


def test_fixed_codings_compute_no_mask() -> None:
    k, v = make_kv(1, 2, 200, 8, seed=9)
    for coding in ("cartesian", "phase_norm", "per_token"):
        cache = PNMixCache(
            PNMixConfig(key_coding=coding),  # type: ignore[arg-type]
            batch_size=1,
            num_key_value_heads=2,
            head_dim=8,
        )
        cache.append(k, v)
        assert cache.saliency_computations == 0 and cache.mix_mask is None
        assert cache.nbytes()["key_mask"] == 0
    assert bool(cache.phase_norm_pairs is None)


def test_mix_mse_not_worse_than_pure_codings_on_the_saliency_group() -> None:
    torch.manual_seed(0)
    h, d, t = 2, 16, 200
    inv = 10000 ** (-torch.arange(d // 2) / (d // 2))
    ang = torch.arange(t)[:, None] * inv
    raw = torch.randn(1, h, 1, d) * 2 + 0.4 * torch.randn(1, h, t, d)
    a, b = raw[..., : d // 2], raw[..., d // 2 :]
    k = torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)
    v = torch.randn(1, h, t, d)
    cfg = {"sink_tokens": 4, "residual_tokens": 4, "group_tokens": 32}
    mse = {}
    for coding in ("mix", "cartesian", "phase_norm"):
        cache = PNMixCache(
            PNMixConfig(key_coding=coding, **cfg),  # type: ignore[arg-type]
            batch_size=1,
            num_key_value_heads=h,
            head_dim=d,
        )
        cache.append(k, v)
        assert cache.num_groups > 1  # later groups exist; the mask saw only the first
        dk, _ = cache.dequantize()
        err = dk[:, :, 4 : 4 + 32].double() - k[:, :, 4 : 4 + 32].half().double()
        mse[coding] = float((err**2).mean())
        if coding == "mix":
            mask = cache.mix_mask
    assert mask is not None and bool(mask.any()) and not bool(mask.all())
    assert mse["mix"] <= min(mse["cartesian"], mse["phase_norm"]) * (1 + 1e-9)
    assert mse["mix"] < max(mse["cartesian"], mse["phase_norm"])


# ---------------------------------------------------------------- exactness and ranges
@pytest.mark.parametrize("coding", CODINGS)
def test_constant_groups_reconstruct_exactly(coding: str) -> None:
    cfg = PNMixConfig(sink_tokens=1, residual_tokens=1, group_tokens=4, key_coding=coding)  # type: ignore[arg-type]
    t, d = 11, 8
    if coding == "per_token":
        k = torch.linspace(-3, 3, t).reshape(1, 1, t, 1).expand(2, 2, t, d)  # constant per token
    else:
        k = torch.linspace(-3, 3, d).reshape(1, 1, 1, d).expand(2, 2, t, d)  # constant per channel
    v = torch.linspace(-2, 5, t).reshape(1, 1, t, 1).expand(2, 2, t, d) * 1.37
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=d)
    cache.append(k, v)
    assert cache.num_groups == 2
    dk, dv = cache.dequantize()
    assert torch.equal(dv, v.half().float())
    for g in cache.groups:
        assert bool((g.value_scale == 0).all())
    if coding == "phase_norm":
        # the pair norms/phases are constant too (scale, span 0); only their storage rounding
        assert torch.allclose(dk, k.half().float(), atol=4e-3)
        for g in cache.groups:
            assert bool((g.key_scale == 0).all())
    else:
        assert torch.equal(dk, k.half().float())
        for g in cache.groups:
            assert bool((g.key_scale == 0).all())
        if coding == "mix":
            assert not bool(cache.mix_mask.any())  # Cartesian is exact: ties go to Cartesian


def test_values_near_float16_max_are_stored_finite() -> None:
    gen = torch.Generator().manual_seed(10)
    k = (torch.rand(1, 2, 40, 8, generator=gen) * 2 - 1) * 65504
    v = (torch.rand(1, 2, 40, 8, generator=gen) * 2 - 1) * 65504
    k[0, 0, 5, 0], v[0, 1, 6, 3] = 65519.0, -65519.0  # rounds to ±65504
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=8)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    cache.append(k, v)
    for _, t in storage(cache):
        if t.is_floating_point():
            assert bool(torch.isfinite(t).all())
    dk, dv = cache.dequantize()
    assert bool(torch.isfinite(dk).all() and torch.isfinite(dv).all())
    # 2-bit error bound: half a step of a range of at most 2 * 65504
    assert float((dk - k).abs().max()) <= 65504 / 3 * 1.01


def test_beyond_float16_names_bfloat16_and_bfloat16_works() -> None:
    k, v = make_kv(1, 2, 12, 8, seed=11)
    k[0, 1, 7, 2] = 70000.0
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    cache.append(k[:, :, :3], v[:, :, :3])
    before = cache.nbytes()
    with pytest.raises(ValueError, match="bfloat16"):
        cache.append(k[:, :, 3:], v[:, :, 3:])
    assert cache.seq_length == 3 and cache.nbytes() == before  # nothing stored
    with pytest.raises(ValueError, match="bfloat16"):
        cache.append(v[:, :, 3:4], k[:, :, 6:7] * 1e5)  # values too
    bf = PNMixCache(
        PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4, storage_dtype=torch.bfloat16),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=8,
    )
    bf.append(k, v)
    assert bf.sink_keys.dtype == torch.bfloat16 and bf.groups[0].key_scale.dtype == torch.bfloat16
    dk, _ = bf.dequantize()
    assert bool(torch.isfinite(dk).all())
    # channel 2 pairs with 6 (half layout); either coding keeps the outlier's pair norm
    assert float(torch.hypot(dk[0, 1, 7, 2], dk[0, 1, 7, 6])) == pytest.approx(70000.0, rel=0.02)


def test_phase_norm_pair_norm_overflow_is_a_clear_error() -> None:
    cfg = PNMixConfig(sink_tokens=0, residual_tokens=0, group_tokens=2, key_coding="phase_norm")
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=1, head_dim=2)
    k = torch.full((1, 1, 2, 2), 60000.0)
    with pytest.raises(ValueError, match="bfloat16"):
        cache.append(k, k)
    assert cache.seq_length == 0
    # mix: the saliency never picks a Phase–Norm pair that cannot be stored
    mix = PNMixCache(
        PNMixConfig(sink_tokens=0, residual_tokens=0, group_tokens=2),
        batch_size=1,
        num_key_value_heads=1,
        head_dim=2,
    )
    mix.append(k, k)
    assert not bool(mix.mix_mask.any())


def test_phase_straddling_pi_is_coded_on_the_short_arc() -> None:
    cfg = PNMixConfig(sink_tokens=0, residual_tokens=0, group_tokens=8, key_coding="phase_norm")
    phases = torch.linspace(math.pi - 0.15, math.pi + 0.15, 8)  # crosses +π -> -π
    k = torch.stack([2 * torch.cos(phases), 2 * torch.sin(phases)], dim=-1).reshape(1, 1, 8, 2)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=1, head_dim=2)
    cache.append(k, torch.zeros(1, 1, 8, 2))
    span = float(cache.groups[0].key_scale[0, 0, 1])  # second slot of a Phase–Norm pair
    assert span == pytest.approx(0.3, abs=2e-3)
    dk, _ = cache.dequantize()
    # half a phase step (0.3 / 3 / 2 rad) at norm 2; the long arc would allow ~2
    assert float((dk - k).abs().max()) <= 2 * 0.05 + 2e-3


# ---------------------------------------------------------------- batch independence, beams
def test_sequences_are_independent() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    k, v = make_kv(2, 2, 30, 8, seed=12)
    k2, v2 = k.clone(), v.clone()
    k2[1] = k2[1] * 5 + 1
    v2[1] = -v2[1]
    a = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    b = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    a.append(k, v)
    b.append(k2, v2)
    changed = False
    for (name, x), (_, y) in zip(storage(a), storage(b), strict=True):
        assert torch.equal(bits_of(x[0]), bits_of(y[0])), name
        changed |= not torch.equal(bits_of(x[1]), bits_of(y[1]))
    assert changed


def test_select_batch_permutes_bytes_exactly() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    k, v = make_kv(3, 2, 30, 8, seed=13)
    cache = PNMixCache(cfg, batch_size=3, num_key_value_heads=2, head_dim=8)
    cache.append(k, v)
    old = storage(cache)
    old_k, old_v = cache.dequantize()
    idx = torch.tensor([2, 0, 2, 1])
    cache.select_batch(idx)
    assert cache.batch_size == 4
    for (name, x), (_, y) in zip(old, storage(cache), strict=True):
        assert torch.equal(bits_of(x[idx]), bits_of(y)), name
    new_k, new_v = cache.dequantize()
    assert torch.equal(new_k, old_k[idx]) and torch.equal(new_v, old_v[idx])
    assert cache.saliency_computations == 1
    # decoding continues with the new batch size
    kk, vv = make_kv(4, 2, 5, 8, seed=14)
    cache.append(kk, vv)
    assert cache.seq_length == 35
    with pytest.raises(ValueError, match="index entries"):
        cache.select_batch(torch.tensor([4]))
    with pytest.raises(ValueError, match="integer"):
        cache.select_batch(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="1-D"):
        cache.select_batch(torch.tensor([], dtype=torch.long))


# ---------------------------------------------------------------- baselines and edge configs
def test_per_token_without_sinks_or_residual_quantizes_every_token() -> None:
    cfg = PNMixConfig(
        bits=4, sink_tokens=0, residual_tokens=0, group_tokens=1, key_coding="per_token"
    )
    k, v = make_kv(1, 2, 10, 8, seed=15)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    for i in range(10):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert cache.quantized_tokens == i + 1 and cache.residual_length == 0
    nb = cache.nbytes()
    assert nb["key_codes"] == nb["value_codes"] == 10 * 2 * 8 * 4 // 8
    assert nb["key_scales"] == nb["value_scales"] == 10 * 2 * 2 * 2
    assert nb["key_sink"] == nb["key_residual"] == nb["key_mask"] == 0


def test_lengths_shorter_than_sinks() -> None:
    k, v = make_kv(1, 2, 20, 8, seed=16)
    cache = PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=2, head_dim=8)
    cache.append(k[:, :, :0], v[:, :, :0])
    assert cache.seq_length == 0 and cache.persistent_bytes == 0
    assert math.isnan(cache.key_bits_per_element)
    for i in range(20):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert cache.sink_length == 20 and cache.residual_length == 0 and cache.mix_mask is None
    assert cache.key_bytes == 20 * 2 * 8 * 2
    dk, _ = cache.dequantize()
    assert torch.equal(dk, k.half().float())


def test_partial_rotary_and_interleaved_layout() -> None:
    cfg = PNMixConfig(
        sink_tokens=1,
        residual_tokens=1,
        group_tokens=4,
        rotary_dim=4,
        rotary_layout="interleaved",
        key_coding="phase_norm",
    )
    k, v = make_kv(1, 1, 9, 6, seed=17)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=1, head_dim=6)
    cache.append(k, v)
    assert cache.num_pairs == 2
    first, second = cache.pair_indices
    assert first.tolist() == [0, 2] and second.tolist() == [1, 3]
    g = cache.groups[0]
    codes = g.key_code_matrix()
    kh = k[:, :, 1:5].half().double()
    # non-rotary channels 4, 5 are Cartesian min-max: zero point is the channel minimum
    assert torch.equal(g.key_zero[..., 4:].double(), kh[..., 4:].amin(2))
    # rotary pair slots hold Phase–Norm: first slot zero = min norm (rounded)
    norm = torch.hypot(kh[..., 0], kh[..., 1]).amin(2)
    assert float((g.key_zero[..., 0].double() - norm).abs().max()) < 1e-2
    assert codes.shape == (1, 1, 4, 6)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 1}, "bits"),
        ({"bits": 5}, "bits"),
        ({"bits": True}, "bits"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"residual_tokens": -2}, "residual_tokens"),
        ({"group_tokens": 0}, "group_tokens"),
        ({"group_tokens": 1}, "group_tokens must be >= 2"),
        ({"group_tokens": 0, "key_coding": "per_token"}, "group_tokens"),
        ({"storage_dtype": torch.float32}, "storage_dtype"),
        ({"key_coding": "polar"}, "key_coding"),
        ({"rotary_dim": 3}, "even"),
        ({"rotary_dim": 0}, "rotary_dim"),
        ({"rotary_layout": "neox"}, "rotary_layout"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PNMixConfig(**kwargs)


def test_bad_cache_construction() -> None:
    with pytest.raises(ValueError, match="rotary_dim"):
        PNMixCache(PNMixConfig(rotary_dim=10), batch_size=1, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="odd"):
        PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=1, head_dim=7)
    with pytest.raises(ValueError, match="batch_size"):
        PNMixCache(PNMixConfig(), batch_size=0, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=0, head_dim=8)
    with pytest.raises(ValueError, match="PNMixConfig"):
        PNMixCache({}, batch_size=1, num_key_value_heads=1, head_dim=8)  # type: ignore[arg-type]


def test_bad_input() -> None:
    cache = PNMixCache(
        PNMixConfig(), batch_size=2, num_key_value_heads=2, head_dim=8, value_head_dim=4
    )
    k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 4)
    cases = [
        ((k[0], v), "4-D"),
        ((k.to(torch.int32), v), "floating"),
        ((k, v.to(torch.int64)), "floating"),
        ((k[:, :1], v[:, :1]), "num_key_value_heads"),
        ((k[:1], v[:1]), "batch size"),
        ((k[..., :6], v), "head_dim"),
        ((k, v[..., :3]), "value_head_dim"),
        ((k, v[:, :, :2]), "tokens"),
        ((k.numpy(), v), "torch.Tensor"),
    ]
    for (kk, vv), match in cases:
        with pytest.raises(ValueError, match=match):
            cache.append(kk, vv)
    for bad in (float("nan"), float("inf")):
        k2 = k.clone()
        k2[1, 0, 2, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            cache.append(k2, v)
    assert cache.seq_length == 0
