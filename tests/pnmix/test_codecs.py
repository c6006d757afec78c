"""Key codecs: float64 references, the mix and its saliency rule, codecs through the cache."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import (
    CartesianCodec,
    MixCodec,
    PerTokenCodec,
    PhaseNormCodec,
    PNMixCache,
    PNMixConfig,
    pnmix_attention,
)
from kvlab.pnmix.codecs import KeyLayout, key_codec_from_name
from kvlab.pnmix.quantizers import key_pair_errors, phase_levels


def _keys(n: int, t: int, d: int, seed: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, t, d, generator=gen) * 2
    theta = 0.5 * torch.randint(0, 4, (n, t), generator=gen).float()
    k[..., 0], k[..., d // 2] = 3 * theta.cos(), 3 * theta.sin()  # a pair Phase–Norm codes well
    return k.to(dtype).float()


def _minmax64(x: torch.Tensor, bits: int, dim: int, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Float64 reference of asymmetric min-max: stored scalars, codes, reconstruction."""
    levels = (1 << bits) - 1
    x = x.double()
    zero = x.amin(dim, keepdim=True).to(dt).double()
    scale = ((x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / levels).to(dt).double()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, ((x - zero) / safe).round().clamp(0, levels), 0 * x)
    return codes, scale, zero, zero + codes * scale


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_cartesian_and_per_token_against_float64(bits: int, dt: torch.dtype) -> None:
    keys = _keys(5, 8, 6, seed=bits, dtype=dt)
    layout = KeyLayout.for_rotary(6, 4)
    for codec, dim in ((CartesianCodec(bits), -2), (PerTokenCodec(bits), -1)):
        codes, scalars = codec.encode(keys, dt, layout)
        assert codes.dtype == torch.uint8 and codes.shape == keys.shape
        assert scalars.dtype == dt
        assert scalars.shape == (5, codec.scalar_count(8, 6))
        ref_codes, scale, zero, recon = _minmax64(keys, bits, dim, dt)
        assert torch.equal(codes.double(), ref_codes)
        half = scalars.shape[-1] // 2
        assert torch.equal(scalars[:, :half].double(), scale.squeeze(dim))
        assert torch.equal(scalars[:, half:].double(), zero.squeeze(dim))
        decoded = codec.decode(codes, scalars, layout)
        assert decoded.dtype == torch.float32
        torch.testing.assert_close(decoded.double(), recon, rtol=2**-23, atol=0)
        # float codes (what attention unpacks) decode to the same floats
        assert torch.equal(codec.decode(codes.float(), scalars, layout), decoded)


@pytest.mark.parametrize("layout_name", ["half", "interleaved"])
def test_phase_norm_pairs_against_float64(layout_name: str) -> None:
    """Phase–Norm on the rotary pairs (norm in the first slot, phase in the second), the
    non-rotary channels Cartesian; the reconstruction matches float64 polar math."""
    keys = _keys(4, 8, 10, seed=3)
    layout = KeyLayout.for_rotary(10, 8, layout_name)
    codec = PhaseNormCodec(2)
    codes, scalars = codec.encode(keys, torch.float16, layout)
    decoded = codec.decode(codes, scalars, layout).double()
    scale, zero = scalars[:, :10].double(), scalars[:, 10:].double()
    f, s = layout.first, layout.second
    norm = zero[:, f].unsqueeze(1) + codes[..., f].double() * scale[:, f].unsqueeze(1)
    levels = phase_levels(zero[:, s].float(), scale[:, s].float(), 2).double()  # [N, P, 4]
    phase = torch.gather(
        levels.unsqueeze(1).expand(-1, 8, -1, -1), -1, codes[..., s].long()[..., None]
    )
    phase = phase.squeeze(-1)
    torch.testing.assert_close(decoded[..., f], norm * phase.cos(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(decoded[..., s], norm * phase.sin(), rtol=1e-6, atol=1e-6)
    _, _, _, cart = _minmax64(keys[..., 8:], 2, -2, torch.float16)
    torch.testing.assert_close(decoded[..., 8:], cart, rtol=2**-23, atol=0)
    # error bound of a 2-bit polar code: half a norm step plus norm x half a phase step
    r = keys[..., f].double().hypot(keys[..., s].double())
    err = (decoded[..., f] - keys[..., f].double()).hypot(decoded[..., s] - keys[..., s].double())
    bound = scale[:, f].unsqueeze(1) / 2 + r * scale[:, s].unsqueeze(1) / 2 + 1e-2
    assert bool((err <= bound).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4]), big=st.booleans())
def test_default_saliency_equals_the_reference_rule(seed: int, bits: int, big: bool) -> None:
    """The mix's default rule gives exactly the masks of ``key_pair_errors`` (the rule of the
    list-of-groups cache): Phase–Norm where its float64 error is strictly smaller, ties and
    unstorable pairs Cartesian."""
    keys = _keys(6, 8, 8, seed=seed)
    if big:  # pair norms beyond float16: Phase–Norm cannot store them
        keys[:3, :, 1] = 60000.0
        keys[:3, :, 5] = 60000.0
    layout = KeyLayout.for_rotary(8, 8)
    codec = MixCodec(CartesianCodec(bits), PhaseNormCodec(bits))
    mask = codec.compute_mask(keys, torch.float16, layout)
    cart, pn = key_pair_errors(keys, bits, layout.first, layout.second, torch.float16)
    assert torch.equal(mask, pn < cart)
    if big:
        assert not bool(mask[:3, 1].any())


def test_mix_selects_pairs_slot_by_slot_between_any_two_pair_codecs() -> None:
    keys = _keys(4, 8, 8, seed=5)
    layout = KeyLayout.for_rotary(8, 6, "interleaved")  # 3 pairs, channels 6, 7 not rotary
    mask = torch.tensor([[1, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    cart, pn = CartesianCodec(2), PhaseNormCodec(2)
    cc, cs = cart.encode(keys, torch.float16, layout)
    pc, ps = pn.encode(keys, torch.float16, layout)
    for mix, second_is_pn in ((MixCodec(cart, pn), True), (MixCodec(pn, cart), False)):
        codes, scalars = mix.encode(keys, torch.float16, layout, mask)
        use_pn = mask if second_is_pn else ~mask
        for p in range(3):
            for ch in (layout.first[p], layout.second[p]):
                for n in range(4):
                    src_c, src_s = (pc, ps) if use_pn[n, p] else (cc, cs)
                    assert torch.equal(codes[n, :, ch], src_c[n, :, ch])
                    assert torch.equal(scalars[n, ch], src_s[n, ch])
                    assert torch.equal(scalars[n, 8 + ch], src_s[n, 8 + ch])
        assert torch.equal(codes[..., 6:], cc[..., 6:])  # non-rotary: Cartesian in both
        decoded = mix.decode(codes, scalars, layout, mask)
        expected = torch.where(
            use_pn.repeat_interleave(2, dim=1)[:, None, :],
            pn.decode(pc, ps, layout)[..., :6],
            cart.decode(cc, cs, layout)[..., :6],
        )
        assert torch.equal(decoded[..., :6], expected)
        # decoding the second codec on a superset of the set pairs changes nothing
        used = torch.nonzero(mask.any(0)).squeeze(1)
        assert torch.equal(mix.decode(codes, scalars, layout, mask, used), decoded)
    with pytest.raises(ValueError, match="mask"):
        MixCodec().encode(keys, torch.float16, layout)


def test_a_custom_saliency_rule_is_used_and_stored_bytes_follow_it() -> None:
    """A rule choosing the second codec everywhere stores exactly Phase–Norm's bytes (plus a
    mask of ones); attention still equals dequantize-then-attend."""

    def everywhere(codec, keys, storage_dtype, layout):
        return torch.ones(keys.shape[0], layout.num_pairs, dtype=torch.bool)

    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 2, 40, 8, generator=gen), torch.randn(2, 2, 40, 8, generator=gen)
    base = {"sink_tokens": 2, "residual_tokens": 2, "group_tokens": 4}
    custom = PNMixCache(
        PNMixConfig(key_coding=MixCodec(saliency=everywhere), **base),
        batch_size=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    pn = PNMixCache(
        PNMixConfig(key_coding="phase_norm", **base),
        batch_size=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    custom.append(k, v)
    pn.append(k, v)
    for a, b in zip(custom.groups, pn.groups, strict=True):
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), name
    assert bool(custom.mix_mask.all()) and custom.saliency_computations == 1
    assert custom.key_bytes == pn.key_bytes + 2  # the mask: ceil(2 * 4 / 8) bytes per sequence
    assert torch.equal(custom.phase_norm_pairs, pn.phase_norm_pairs)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    torch.testing.assert_close(pnmix_attention(q, custom), pnmix_attention(q, pn), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mix", "cartesian", "phase_norm", "per_token"])
def test_codec_objects_and_names_store_the_same_bytes(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(1, 2, 50, 8, generator=gen), torch.randn(1, 2, 50, 8, generator=gen)
    base = {"bits": 3, "sink_tokens": 2, "residual_tokens": 2, "group_tokens": 4}
    named = PNMixCache(
        PNMixConfig(key_coding=name, **base), batch_size=1, num_key_value_heads=2, head_dim=8
    )  # type: ignore[arg-type]
    codec = key_codec_from_name(name, 3)
    obj = PNMixCache(
        PNMixConfig(key_coding=codec, **base), batch_size=1, num_key_value_heads=2, head_dim=8
    )
    named.append(k, v)
    obj.append(k, v)
    assert named.nbytes() == obj.nbytes()
    for a, b in zip(named.groups, obj.groups, strict=True):
        assert all(torch.equal(t, b.tensors()[n]) for n, t in a.tensors().items())
    assert str(codec).startswith(name)


def test_config_checks_codec_objects() -> None:
    with pytest.raises(ValueError, match="bits"):
        PNMixConfig(bits=2, key_coding=CartesianCodec(3))
    with pytest.raises(ValueError, match="key_coding"):
        PNMixConfig(key_coding="polar")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_tokens must be >= 2"):
        PNMixConfig(group_tokens=1, key_coding=MixCodec())
    assert PNMixConfig(group_tokens=1, key_coding=PerTokenCodec(2)).group_tokens == 1
    with pytest.raises(ValueError, match="share bits"):
        MixCodec(CartesianCodec(2), PhaseNormCodec(3))
    with pytest.raises(ValueError, match="pair codecs"):
        MixCodec(PerTokenCodec(2), PhaseNormCodec(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits"):
        CartesianCodec(0)
    with pytest.raises(ValueError, match="head_dim"):
        KeyLayout.for_rotary(4, 6)
    assert PNMixConfig().key_codec == MixCodec(CartesianCodec(2), PhaseNormCodec(2))
    assert math.isclose(PNMixConfig().key_codec.bits, 2)
