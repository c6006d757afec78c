"""Min-max and Phase–Norm quantizers: error bounds, exact constants, shortest arc, saliency."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix.quantizers import (
    dequantize_keys_channelwise,
    key_pair_errors,
    minmax_dequantize,
    minmax_quantize,
    phase_norm_dequantize,
    phase_norm_quantize,
    quantize_keys_channelwise,
    rotary_pair_indices,
    round_to_storage,
    shortest_arc,
)

DTYPES = [torch.float16, torch.bfloat16]


def _angular_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    d = torch.remainder(x - y, 2 * math.pi)
    return torch.minimum(d, 2 * math.pi - d)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    tokens=st.integers(1, 20),
    amp=st.sampled_from([1e-3, 1.0, 300.0]),
    storage=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_minmax_error_bound(
    bits: int, tokens: int, amp: float, storage: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, tokens, 5, generator=gen, dtype=torch.float64) * amp).to(storage)
    codes, scale, zero = minmax_quantize(x, bits, -2, storage)
    levels = 2**bits - 1
    assert codes.dtype == torch.uint8 and int(codes.max()) <= levels
    assert scale.dtype == zero.dtype == storage and scale.shape == (3, 5)
    x64 = x.double()
    assert torch.equal(zero.double(), x64.amin(-2))  # zero point = min, exact
    exact_scale = (x64.amax(-2) - x64.amin(-2)) / levels
    bound = scale.double() / 2 + levels * (exact_scale - scale.double()).abs()
    err = (minmax_dequantize(codes, scale, zero, -2).double() - x64).abs()
    assert bool((err <= bound.unsqueeze(-2) * (1 + 1e-6) + 1e-6 * x64.abs() + 1e-30).all())


@pytest.mark.parametrize("storage", DTYPES)
def test_minmax_constant_stores_zero_scale_and_is_exact(storage: torch.dtype) -> None:
    x = torch.tensor([[1.3, 1.3, 1.3], [-7.0, -7.0, -7.0]]).to(storage)
    codes, scale, zero = minmax_quantize(x, 2, -1, storage)
    assert torch.equal(scale, torch.zeros(2, dtype=storage))
    assert torch.equal(codes, torch.zeros(2, 3, dtype=torch.uint8))
    assert torch.equal(minmax_dequantize(codes, scale, zero, -1), x.float())


def _brute_force_span(phases: list[float]) -> float:
    return min(max((p - s) % (2 * math.pi) for p in phases) for s in phases)


@settings(max_examples=80, deadline=None)
@given(phases=st.lists(st.floats(-math.pi, math.pi), min_size=1, max_size=12))
def test_shortest_arc_matches_brute_force(phases: list[float]) -> None:
    t = torch.tensor(phases, dtype=torch.float64)
    start, span = shortest_arc(t, 0)
    assert 0.0 <= float(span) < 2 * math.pi
    assert float(span) == pytest.approx(_brute_force_span(phases), abs=1e-12)
    assert any(float(start) == p for p in t.tolist())
    covered = torch.remainder(t - start, 2 * math.pi) <= span + 1e-12
    # a phase at distance ~2π from the start is the start itself (wrap-around)
    near_start = _angular_distance(t, start) <= 1e-12
    assert bool((covered | near_start).all())


def test_phase_norm_straddling_pi_uses_short_arc() -> None:
    phases = torch.tensor([math.pi - 0.1, math.pi - 0.02, -math.pi + 0.01, -math.pi + 0.1])
    a, b = 2.0 * torch.cos(phases), 2.0 * torch.sin(phases)
    a, b = a.half().unsqueeze(-1), b.half().unsqueeze(-1)
    pn = phase_norm_quantize(a, b, 2, 0, torch.float16)
    assert float(pn.phase_span) == pytest.approx(0.2, abs=2e-3)  # not ~2π - 0.2
    assert float(pn.phase_offset) == pytest.approx(math.pi - 0.1, abs=2e-3)
    a_hat, b_hat = phase_norm_dequantize(*pn, bits=2, dim=0)
    phi_hat = torch.atan2(b_hat, a_hat).squeeze(-1)
    assert float(_angular_distance(phi_hat.double(), phases.double()).max()) < 0.04


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    tokens=st.integers(1, 16),
    storage=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_phase_norm_error_bounds(bits: int, tokens: int, storage: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, tokens, 3, generator=gen).to(storage)
    b = torch.randn(4, tokens, 3, generator=gen).to(storage)
    pn = phase_norm_quantize(a, b, bits, -2, storage)
    levels = 2**bits - 1
    assert int(pn.norm_codes.max()) <= levels and int(pn.phase_codes.max()) <= levels
    assert all(s.dtype == storage for s in pn[2:])
    assert bool((pn.phase_span.float() >= 0).all())
    assert bool((pn.phase_span.float() < 2 * math.pi + 1e-2).all())
    a_hat, b_hat = phase_norm_dequantize(*pn, bits=bits, dim=-2)
    r = torch.hypot(a.double(), b.double())
    r_hat = torch.hypot(a_hat.double(), b_hat.double())
    rel = 2e-3 if storage == torch.float16 else 1.6e-2  # storage rounding of the scalars
    norm_bound = pn.norm_scale.double().unsqueeze(-2) / 2 + rel * r.amax(-2, keepdim=True)
    assert bool(((r_hat - r).abs() <= norm_bound + 1e-6).all())
    phi = torch.atan2(b.double(), a.double())
    phi_hat = torch.atan2(b_hat.double(), a_hat.double())
    phase_bound = pn.phase_span.double().unsqueeze(-2) / (2 * levels) + rel * math.pi
    ok = (_angular_distance(phi, phi_hat) <= phase_bound + 1e-6) | (r_hat < 1e-6) | (r < 1e-6)
    assert bool(ok.all())


def test_phase_norm_constant_pair_has_zero_norm_scale_and_span() -> None:
    a = torch.full((5, 1), 0.75).half()
    b = torch.full((5, 1), -0.5).half()
    pn = phase_norm_quantize(a, b, 2, 0, torch.float16)
    assert float(pn.norm_scale) == 0.0 and float(pn.phase_span) == 0.0
    a_hat, b_hat = phase_norm_dequantize(*pn, bits=2, dim=0)
    # only the storage rounding of the norm and phase offset remains
    assert torch.allclose(a_hat, a.float(), atol=2e-3)
    assert torch.allclose(b_hat, b.float(), atol=2e-3)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    layout=st.sampled_from(["half", "interleaved"]),
    tokens=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_mix_error_is_per_pair_minimum(bits: int, layout: str, tokens: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    first, second = rotary_pair_indices(6, layout)
    keys = torch.randn(2, 3, tokens, 8, generator=gen)
    # make some pairs circle-like (norm ~2, phase drifting) so both codings win somewhere
    theta = torch.linspace(0, 1.5, tokens)
    keys[:, 0, :, first[0]] = 2 * torch.cos(theta)
    keys[:, 0, :, second[0]] = 2 * torch.sin(theta)
    keys = keys.half()
    cart_err, pn_err = key_pair_errors(keys, bits, first, second)
    mask = pn_err < cart_err
    kc = quantize_keys_channelwise(keys, bits, first, second, mask)
    rec = dequantize_keys_channelwise(*kc, bits, first, second, mask).double()
    sq = (rec - keys.double()) ** 2
    mix_err = (sq[..., first] + sq[..., second]).sum(-2)
    torch.testing.assert_close(mix_err, torch.minimum(cart_err, pn_err), rtol=1e-9, atol=1e-12)
    # non-rotary channels are Cartesian whatever the mask says
    cart = quantize_keys_channelwise(keys, bits, first, second, torch.zeros_like(mask))
    assert torch.equal(kc.codes[..., 6:], cart.codes[..., 6:])
    assert torch.equal(kc.scale[..., 6:], cart.scale[..., 6:])


def test_phase_norm_norm_beyond_float16_names_bfloat16() -> None:
    first, second = rotary_pair_indices(2)
    keys = torch.full((1, 4, 2), 60000.0).half()  # finite, but the pair norm is ~84853
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_keys_channelwise(keys, 2, first, second, mask)
    cart_err, pn_err = key_pair_errors(keys, 2, first, second)
    assert float(cart_err) == 0.0 and math.isinf(float(pn_err))
    kb = keys.to(torch.bfloat16)
    kc = quantize_keys_channelwise(kb, 2, first, second, mask, torch.bfloat16)
    assert bool(torch.isfinite(kc.scale).all() and torch.isfinite(kc.zero).all())


def test_round_to_storage() -> None:
    ok = round_to_storage(torch.tensor([65519.0, -65000.0]), torch.float16)
    assert ok.tolist() == [65504.0, -64992.0]
    with pytest.raises(ValueError, match=r"bfloat16 storage"):
        round_to_storage(torch.tensor([70000.0]), torch.float16, name="keys")
    assert round_to_storage(torch.tensor([70000.0]), torch.bfloat16).item() == 70144.0
    with pytest.raises(ValueError, match="non-finite"):
        round_to_storage(torch.tensor([float("nan")]), torch.float16)
    with pytest.raises(ValueError, match="non-finite"):
        round_to_storage(torch.tensor([float("-inf")]), torch.bfloat16)
    with pytest.raises(ValueError, match="storage dtype"):
        round_to_storage(torch.tensor([1.0]), torch.float32)


def test_rotary_pair_indices() -> None:
    f, s = rotary_pair_indices(8, "half")
    assert f.tolist() == [0, 1, 2, 3] and s.tolist() == [4, 5, 6, 7]
    f, s = rotary_pair_indices(8, "interleaved")
    assert f.tolist() == [0, 2, 4, 6] and s.tolist() == [1, 3, 5, 7]
    for bad in (0, 3, -2, True):
        with pytest.raises(ValueError, match="rotary_dim"):
            rotary_pair_indices(bad)
    with pytest.raises(ValueError, match="layout"):
        rotary_pair_indices(4, "neox")
