"""The compiled CPU backend on the issue-8 codecs (docs/design.md, "Kernels", "Capabilities").

Per-pair code widths (``"bit_alloc"``), exact sparse outliers (the key payload), pre-RoPE keys
rotated to their positions (partial rotary, both layouts, RoPE scaling, moved position offsets)
and Hadamard values, against the torch reference (``backend="torch"``) to float32 rounding
(:func:`kernel_checks.kernel_tolerance`, plus the Hadamard output transform's own rounding),
over shapes, GQA, padded rows, decode steps, query counts, soft-caps and learned sinks; the
fused decode step stores exactly what ``append`` stores; configurations without kernel
support run the torch reference exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import EPS, ROPE_SCALINGS, Case, attend, kernel_tolerance, require_cpu_kernel

from kvlab.pnmix import (
    BitAllocCodec,
    CartesianCodec,
    PNMixCache,
    PNMixConfig,
    ValueCodec,
    pnmix_attention,
    pnmix_decode_step,
)
from kvlab.pnmix.kernels import cpu, kernel_key_decode
from kvlab.pnmix.kernels.spec import KEYS_PER_CHANNEL, KEYS_WIDTHS, KernelKeyDecode
from kvlab.pnmix.values import HadamardValueCodec, PerTokenValueCodec
from kvlab.rope import RotaryConfig, apply_rotary

# (key_coding, key_outlier_fraction)
CODINGS = [
    ("bit_alloc", 0.0),
    ("bit_alloc", 0.05),
    ("prerope_cartesian", 0.0),
    ("prerope_cartesian", 0.05),
    ("cartesian", 0.05),
    ("prerope_mix", 0.0),
    ("prerope_qmix", 0.0),
    ("prerope_phase_norm", 0.0),
]


@pytest.fixture(autouse=True)
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)


def _random_widths(b: int, h: int, p: int, gen: torch.Generator) -> torch.Tensor:
    """Valid 2-bit width tables [B, H, P] in {0, 2, 3, 4} (each row's widths sum to 2 P):
    random moves (2, 2) -> (4, 0) and (2, 2, 2) -> (3, 3, 0)."""
    w = torch.full((b, h, p), 2, dtype=torch.uint8)
    for row in w.view(-1, p):
        for _ in range(p):
            twos = torch.nonzero(row == 2).flatten()
            if twos.numel() < 3:
                break
            pick = twos[torch.randperm(twos.numel(), generator=gen)[:3]]
            if torch.rand((), generator=gen) < 0.5:
                row[pick[0]], row[pick[1]] = 4, 0
            else:
                row[pick[0]], row[pick[1]], row[pick[2]] = 3, 3, 0
    return w


@st.composite
def cases(draw: st.DrawFn) -> Case:
    coding, outliers = draw(st.sampled_from(CODINGS))
    hadamard = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    d, dv, rotary_dim = draw(st.sampled_from([(8, 8, 8), (16, 16, 12), (12, 8, 12), (16, 4, 8)]))
    layout = draw(st.sampled_from(["half", "interleaved"]))
    scaling = draw(st.sampled_from(ROPE_SCALINGS))
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rep = draw(st.sampled_from([1, 2, 3]))
    cfg = PNMixConfig(
        bits=2,
        sink_tokens=draw(st.sampled_from([0, 1, 3])),
        residual_tokens=draw(st.sampled_from([0, 2, 5])),
        group_tokens=draw(st.sampled_from([4, 6, 8])),
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        key_outlier_fraction=outliers,
        value_coding="hadamard" if hadamard else "per_token",
        value_group_channels=draw(st.sampled_from([None, None, 2, 4])),  # divisors of every dv
        rotary_dim=rotary_dim,
        rotary_layout=layout,  # type: ignore[arg-type]
    )
    rotary = RotaryConfig(d, rotary_dim, 10000.0, layout, scaling)  # type: ignore[arg-type]
    cache = PNMixCache(
        cfg, batch_size=b, num_key_value_heads=hkv, head_dim=d, value_head_dim=dv, rotary=rotary
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if coding == "bit_alloc" and draw(st.booleans()):
        cache.set_pair_table(_random_widths(b, hkv, rotary_dim // 2, gen))
    lengths = draw(st.lists(st.integers(1, 60), min_size=b, max_size=b))
    steps = draw(st.integers(0, 6))
    far = draw(st.booleans())
    total = max(lengths) + steps
    raw = torch.randn(b, hkv, total, d, generator=gen)
    if far:  # large zero points on some channels
        raw[..., 1::3] += -3e3 if dtype == torch.float16 else -7e3
    keys = apply_rotary(raw, torch.arange(total), rotary)
    values = torch.randn(b, hkv, total, dv, generator=gen)
    queries = torch.randn(b, hkv * rep, total, d, generator=gen)
    first = max(lengths)
    cache.append(keys[:, :, :first], values[:, :, :first], lengths, queries=queries[:, :, :first])
    for i in range(first, total):  # decode steps, flushes included
        cache.append(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    if cache.codec.position_aware and draw(st.booleans()):  # a relay: new position offsets
        shift = draw(st.lists(st.integers(0, 90), min_size=b * hkv, max_size=b * hkv))
        cache.set_position_offsets(np.asarray(shift, dtype=np.int64).reshape(b, hkv))
    nq = draw(st.integers(1, min(4, int(cache.seq_lengths.max()))))
    query = torch.randn(b, hkv * rep, nq, d, generator=gen) * draw(st.sampled_from([0.05, 1.0]))
    sinks = torch.randn(hkv * rep, generator=gen) if draw(st.booleans()) else None
    return Case(cache, query, draw(st.booleans()), draw(st.sampled_from([None, 2.5])), sinks)


def tolerance(case: Case) -> float:
    """:func:`kernel_tolerance`, plus the Hadamard output transform's rounding: ``Dv``
    products of coded values (``|v H| <= sqrt(Dv) max|v|``) summed in another order."""
    tol = kernel_tolerance(case.query, case.cache, softcap=case.softcap)
    if case.cache.value_codec.transforms_output:
        _, values = case.cache.dequantize()
        dv = values.shape[-1]
        tol += 4 * dv * EPS * math.sqrt(dv) * float(values.abs().max())
    return tol


@settings(max_examples=120, deadline=None)
@given(case=cases())
def test_cpu_kernel_matches_the_reference_on_the_issue8_codecs(case: Case) -> None:
    require_cpu_kernel()
    assert not isinstance(case.cache.kernel_decode, str), case.cache.kernel_decode
    ref = attend(case, "torch")
    out = attend(case, "cpu")
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool(torch.isfinite(out).all())
    err = float((out - ref).abs().max())
    tol = tolerance(case)
    assert err <= tol, (err, tol)


def _pn_mix_cache(
    dtype: torch.dtype = torch.float16, value_group_channels: int | None = None
) -> PNMixCache:
    rotary = RotaryConfig(16, 12, 10000.0, "interleaved")
    cfg = PNMixConfig(
        sink_tokens=2,
        residual_tokens=3,
        group_tokens=8,
        storage_dtype=dtype,
        key_coding="bit_alloc",
        key_outlier_fraction=0.02,
        value_coding="hadamard",
        value_group_channels=value_group_channels,
        rotary_dim=12,
        rotary_layout="interleaved",
    )
    return PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=16, rotary=rotary)


@pytest.mark.parametrize("value_group_channels", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_step_stores_what_append_stores_with_the_pn_mix_codecs(
    dtype: torch.dtype, value_group_channels: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused decode step (one C++ call) on the ``pn-mix`` codecs, with one value scale and
    zero per token or per 4 channels: the same bytes in every buffer (payload included) and the
    same output bit for bit as ``append(checks="deferred")`` then the ``"cpu"`` backend, over
    flushes and padded rows."""
    require_cpu_kernel()
    fused = []
    original = cpu.decode_step_cpu

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        fused.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu, "decode_step_cpu", spy)
    gen = torch.Generator().manual_seed(7)
    a, b = (_pn_mix_cache(dtype, value_group_channels) for _ in range(2))
    k, v = torch.randn(2, 2, 30, 16, generator=gen), torch.randn(2, 2, 30, 16, generator=gen)
    q0 = torch.randn(2, 4, 30, 16, generator=gen)
    for cache in (a, b):
        cache.append(k, v, [30, 21], queries=q0)
    for step in range(20):
        k, v = torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen)
        q = torch.randn(2, 4, 1, 16, generator=gen)
        sinks = torch.randn(4, generator=gen) if step % 3 == 0 else None
        a.append(k, v, checks="deferred", queries=q)
        expected = pnmix_attention(q, a, backend="cpu", sink_logits=sinks)
        got = pnmix_decode_step(q, k, v, b, backend="cpu", sink_logits=sinks)
        assert torch.equal(got, expected)
        assert np.array_equal(a.store.counts, b.store.counts)
        for name in ("key_codes", "key_scalars", "key_payload", "value_codes", "value_scalars"):
            assert torch.equal(getattr(a.store, name), getattr(b.store, name)), name
        for name in ("sink_keys", "sink_values", "residual_keys", "residual_values"):
            assert torch.equal(getattr(a.store, name), getattr(b.store, name)), name
    assert len(fused) >= 10
    ref = pnmix_attention(q, b, backend="torch")
    got = pnmix_attention(q, b, backend="cpu")
    assert float((got - ref).abs().max()) <= kernel_tolerance(q, b) + 1e-5


def test_kernel_description_of_the_issue8_codecs() -> None:
    ba = BitAllocCodec(2)
    described = kernel_key_decode(ba, HadamardValueCodec(2), 12)
    assert described == KernelKeyDecode(
        KEYS_WIDTHS, rotate_to_position=True, payload_bytes=12, value_hadamard=True
    )
    one_width = BitAllocCodec(2, widths=(2,), prerope=False, outlier_fraction=0.05)
    assert kernel_key_decode(one_width, PerTokenValueCodec(2), 8) == KernelKeyDecode(
        KEYS_PER_CHANNEL, payload_bytes=8
    )
    assert kernel_key_decode(CartesianCodec(2, prerope=True)) == KernelKeyDecode(
        KEYS_PER_CHANNEL, rotate_to_position=True
    )


@dataclass(frozen=True)
class _ScaledValues(PerTokenValueCodec):
    """A value codec no kernel knows (a subclass: kernels match exact classes)."""

    name = "scaled"
    transforms_output = True

    def output_transform(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x


@dataclass(frozen=True)
class _ShiftedWidths(BitAllocCodec):
    """A width codec subclass that decodes differently: kernels must not guess it."""

    def decode(self, codes, scalars, layout, table=None, active_pairs=None):  # type: ignore[override]
        return super().decode(codes, scalars, layout, table, active_pairs) + 0.5


@pytest.mark.parametrize(
    ("key_codec", "value_codec", "reason"),
    [
        (BitAllocCodec(2, outlier_fraction=0.05), _ScaledValues(2), "value coding"),
        (_ShiftedWidths(2), PerTokenValueCodec(2), "no kernel decode step"),
    ],
)
def test_configurations_without_kernel_support_run_the_reference_exactly(
    key_codec: BitAllocCodec, value_codec: ValueCodec, reason: str
) -> None:
    """The capability is decided once per cache; ``"auto"`` then gives the torch reference's
    result exactly (attention and the decode step) and an explicit ``"cpu"`` refuses with the
    reason."""
    require_cpu_kernel()
    rotary = RotaryConfig(8)
    cfg = PNMixConfig(
        sink_tokens=1,
        residual_tokens=2,
        group_tokens=4,
        key_coding=key_codec,
        value_coding=value_codec,
    )
    a, b = (
        PNMixCache(cfg, batch_size=2, num_key_value_heads=1, head_dim=8, rotary=rotary)
        for _ in range(2)
    )
    assert isinstance(a.kernel_decode, str) and reason in a.kernel_decode
    gen = torch.Generator().manual_seed(1)
    keys = apply_rotary(torch.randn(2, 1, 30, 8, generator=gen), torch.arange(30), rotary)
    values = torch.randn(2, 1, 30, 8, generator=gen)
    for cache in (a, b):
        cache.append(keys, values, [30, 22])
    q = torch.randn(2, 2, 2, 8, generator=gen)
    assert torch.equal(pnmix_attention(q, a), pnmix_attention(q, a, backend="torch"))
    with pytest.raises(ValueError, match=reason):
        pnmix_attention(q, a, backend="cpu")
    for _ in range(5):  # decode steps, a flush included
        k, v = torch.randn(2, 1, 1, 8, generator=gen), torch.randn(2, 1, 1, 8, generator=gen)
        q1 = torch.randn(2, 2, 1, 8, generator=gen)
        got = pnmix_decode_step(q1, k, v, a)
        b.append(k, v, checks="deferred")
        assert torch.equal(got, pnmix_attention(q1, b, backend="torch"))


def test_each_backend_runs_only_what_it_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both compiled kernels run the ``pn-mix`` codecs: on CUDA ``"auto"`` picks Triton for
    them; a configuration without kernel support runs the torch reference under ``"auto"``
    and is refused, with its reason, by an explicit compiled backend."""
    from kvlab.pnmix.kernels import dispatch

    pn_mix = kernel_key_decode(BitAllocCodec(2, outlier_fraction=0.01), HadamardValueCodec(2), 4)
    assert isinstance(pn_mix, KernelKeyDecode)
    for backend in ("cpu", "triton"):
        assert dispatch.unsupported(backend, pn_mix) is None
        assert dispatch.unsupported(backend, "why not") == "why not"
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    cuda = torch.device("cuda")
    assert dispatch.select_backend("auto", cuda, pn_mix) == "triton"
    assert dispatch.select_backend("auto", cuda, "no kernel step") == "torch"
    with pytest.raises(ValueError, match="cannot run this cache: no kernel step"):
        dispatch.select_backend("triton", cuda, "no kernel step")
