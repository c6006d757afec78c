"""The compiled CPU backend and the dispatcher (docs/design.md, "Kernels").

The C++ kernel is checked against the torch reference (``backend="torch"``) to float32
rounding (:func:`kernel_checks.kernel_tolerance`) over shapes, lengths, padded rows, bits,
codecs, storage dtypes, large zero points, soft-caps and learned sinks; the fused decode step
stores exactly the bytes ``append`` stores.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import Case, attend, kernel_tolerance, require_cpu_kernel

from kvlab.pnmix import (
    CartesianCodec,
    MixCodec,
    PhaseNormCodec,
    PNMixCache,
    PNMixConfig,
    pnmix_attention,
    pnmix_decode_step,
)
from kvlab.pnmix.kernels import (
    KernelKeyDecode,
    cpu,
    dispatch,
    kernel_key_decode,
    register_pair_mode,
    select_backend,
)
from kvlab.pnmix.kernels.spec import KEYS_PER_CHANNEL, PAIR_CARTESIAN, PAIR_PHASE_NORM

CODINGS = ["mix", "cartesian", "phase_norm", "per_token"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)


def make_keys(b: int, h: int, t: int, d: int, offset: float, gen: torch.Generator) -> torch.Tensor:
    """Random keys; the first half-layout pair of every key has norm 3 and one of four phases
    (Phase–Norm codes it almost exactly, so mix masks mix); ``offset`` is added to every other
    channel (large zero points when it is -7e4)."""
    k = torch.randn(b, h, t, d, generator=gen)
    steps = torch.randint(0, 4, (b, h, t), generator=gen).float()
    theta = 0.5 * steps + 0.4 * torch.arange(b * h).reshape(b, h, 1)
    k[..., 0] = 3 * torch.cos(theta)
    k[..., d // 2] = 3 * torch.sin(theta)
    if offset:
        k[..., 1::2] = offset + 300 * torch.randn(b, h, t, len(range(1, d, 2)), generator=gen)
    return k


@st.composite
def cases(draw: st.DrawFn) -> Case:
    coding = draw(st.sampled_from(CODINGS))
    bits = draw(st.sampled_from([2, 3, 4]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    d, dv, rotary = draw(st.sampled_from([(8, 8, 8), (10, 6, 8), (16, 12, 16), (12, 8, 6)]))
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rep = draw(st.sampled_from([1, 2, 3]))
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=draw(st.sampled_from([0, 1, 3])),
        residual_tokens=draw(st.sampled_from([0, 2, 5])),
        group_tokens=draw(st.integers(2, 6)),
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_dim=rotary,
        rotary_layout=draw(st.sampled_from(["half", "interleaved"])),
        value_group_channels=draw(
            st.sampled_from([None, None, *(c for c in (2, 3, 4) if dv % c == 0)])
        ),
    )
    lengths = draw(st.lists(st.integers(1, 60), min_size=b, max_size=b))
    steps = draw(st.integers(0, 6))
    far = draw(st.booleans())
    offset = (-7e4 if dtype == torch.bfloat16 else -3e4) if far else 0.0
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    total = max(lengths) + steps
    keys = make_keys(b, hkv, total, d, offset, gen)
    values = torch.randn(b, hkv, total, dv, generator=gen)
    cache = PNMixCache(cfg, batch_size=b, num_key_value_heads=hkv, head_dim=d, value_head_dim=dv)
    first = max(lengths)
    cache.append(keys[:, :, :first], values[:, :, :first], lengths)
    for i in range(first, total):  # decode steps, flushes included
        cache.append(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    nq = draw(st.integers(1, min(5, int(cache.seq_lengths.max()))))
    query = torch.randn(b, hkv * rep, nq, d, generator=gen) * draw(st.sampled_from([0.05, 1.0]))
    sinks = torch.randn(hkv * rep, generator=gen) if draw(st.booleans()) else None
    return Case(cache, query, draw(st.booleans()), draw(st.sampled_from([None, 2.5])), sinks)


@settings(max_examples=80, deadline=None)
@given(case=cases())
def test_cpu_kernel_matches_the_reference(case: Case) -> None:
    require_cpu_kernel()
    ref = attend(case, "torch")
    out = attend(case, "cpu")
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool(torch.isfinite(out).all())
    tol = kernel_tolerance(case.query, case.cache, softcap=case.softcap)
    err = float((out - ref).abs().max())
    assert err <= tol, (err, tol)


def test_cpu_kernel_split_k_over_threads_matches_one_thread() -> None:
    """With several threads a row's groups are split across tasks and merged (FlashDecoding);
    the result equals the reference to float32 rounding."""
    require_cpu_kernel()
    gen = torch.Generator().manual_seed(3)
    cache = PNMixCache(
        PNMixConfig(sink_tokens=4, residual_tokens=4, group_tokens=8),
        batch_size=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    cache.append(make_keys(2, 2, 400, 16, 0.0, gen), torch.randn(2, 2, 400, 16), [400, 250])
    q = torch.randn(2, 6, 2, 16, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert cpu._splits(4, cache.store.group_counts) > 1
        out = pnmix_attention(q, cache, backend="cpu", sink_logits=torch.zeros(6))
    finally:
        torch.set_num_threads(threads)
    ref = pnmix_attention(q, cache, backend="torch", sink_logits=torch.zeros(6))
    assert float((out - ref).abs().max()) <= kernel_tolerance(q, cache)


# ---------------------------------------------------------------- the fused decode step
def _buffers(cache: PNMixCache) -> dict[str, torch.Tensor]:
    s = cache.store
    names = ("sink_keys", "sink_values", "key_codes", "key_scalars", "value_codes")
    names += ("value_scalars", "residual_keys", "residual_values")
    return {n: getattr(s, n) for n in names}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("coding", CODINGS)
def test_decode_step_stores_what_append_stores(
    coding: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pnmix_decode_step`` on the CPU backend equals ``append(checks="deferred")`` then
    ``pnmix_attention``: the same bytes in every buffer and the same counts after every step
    (flushes and padded rows included), the same output bit for bit; the fused call runs on
    every step that writes only a residual slot."""
    require_cpu_kernel()
    fused = []
    original = cpu.decode_step_cpu

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        fused.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu, "decode_step_cpu", spy)
    cfg = PNMixConfig(
        sink_tokens=2, residual_tokens=3, group_tokens=4, storage_dtype=dtype, key_coding=coding
    )  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(5)
    a, b = (PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8) for _ in range(2))
    k, v = make_keys(2, 2, 20, 8, 0.0, gen), torch.randn(2, 2, 20, 8, generator=gen)
    for cache in (a, b):
        cache.append(k, v, [20, 13])
    for step in range(14):
        k, v = make_keys(2, 2, 1, 8, 0.0, gen), torch.randn(2, 2, 1, 8, generator=gen)
        q = torch.randn(2, 4, 1, 8, generator=gen)
        sinks = torch.randn(4, generator=gen) if step % 3 == 0 else None
        cap = 4.0 if step % 2 else None
        a.append(k, v, checks="deferred")
        expected = pnmix_attention(q, a, backend="cpu", logit_softcap=cap, sink_logits=sinks)
        got = pnmix_decode_step(q, k, v, b, backend="cpu", logit_softcap=cap, sink_logits=sinks)
        assert torch.equal(got, expected)
        assert np.array_equal(a.store.counts, b.store.counts)
        for name, buf in _buffers(a).items():
            assert torch.equal(buf, _buffers(b)[name]), name
    assert len(fused) >= 6  # the steps in which no row flushes (rows flush at different steps)
    assert a.attention_calls == b.attention_calls == 14
    a.check_values()
    b.check_values()


def test_decode_step_defers_its_checks(no_host_sync_guard) -> None:
    """The fused step reads nothing back; a non-finite or out-of-range token is reported by
    ``check_values`` afterwards (it is stored, as with ``checks="deferred"``)."""
    require_cpu_kernel()
    cache = PNMixCache(
        PNMixConfig(sink_tokens=1, residual_tokens=4, group_tokens=4),
        batch_size=1,
        num_key_value_heads=1,
        head_dim=4,
    )
    cache.append(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    q = torch.randn(1, 2, 1, 4)
    good = torch.randn(1, 1, 1, 4)
    with no_host_sync_guard():
        pnmix_decode_step(q, good, good, cache, backend="cpu")
    cache.check_values()
    for bad in (torch.full((1, 1, 1, 4), math.inf), torch.full((1, 1, 1, 4), 1e5)):
        before = cache.seq_lengths
        with no_host_sync_guard():
            pnmix_decode_step(q, bad, good, cache, backend="cpu")
        assert (cache.seq_lengths == before + 1).all()
        with pytest.raises(ValueError, match="deferred checks"):
            cache.check_values()


@pytest.fixture
def no_host_sync_guard(monkeypatch: pytest.MonkeyPatch):
    """Inside ``with no_host_sync_guard():`` any read of a tensor value by Python raises."""

    def forbidden(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise AssertionError("host sync: a tensor value was read by Python")

    class Guard:
        def __enter__(self) -> None:
            for name in ("item", "__bool__", "tolist", "__int__", "__float__"):
                monkeypatch.setattr(torch.Tensor, name, forbidden)

        def __exit__(self, *exc: object) -> None:
            monkeypatch.undo()

    return Guard


def test_decode_step_bad_input_raises_like_append() -> None:
    cache = PNMixCache(
        PNMixConfig(sink_tokens=1, residual_tokens=4, group_tokens=4),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=4,
    )
    cache.append(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    before = cache.store.counts.copy()
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        pnmix_decode_step(q, torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), cache)
    with pytest.raises(ValueError, match="head_dim"):
        pnmix_decode_step(q, torch.randn(1, 2, 1, 5), torch.randn(1, 2, 1, 4), cache)
    assert np.array_equal(cache.store.counts, before)
    assert cache.attention_calls == 0


# ---------------------------------------------------------------- dispatch
def test_select_backend_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    require_cpu_kernel()
    ok = KernelKeyDecode(KEYS_PER_CHANNEL)
    cuda = torch.device("cuda")
    assert select_backend("auto", CPU, ok) == "cpu"
    assert select_backend("torch", CPU, ok) == "torch"
    assert select_backend("auto", CPU, "no kernel decodes it") == "torch"
    assert select_backend("auto", torch.device("meta"), ok) == "torch"
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert select_backend("auto", cuda, ok) == "triton"
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    assert select_backend("auto", cuda, ok) == "torch"
    with pytest.raises(RuntimeError, match="triton package"):
        select_backend("triton", cuda, ok)
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("triton", CPU, ok)
    with pytest.raises(ValueError, match="on the CPU"):
        select_backend("cpu", cuda, ok)
    with pytest.raises(ValueError, match="cannot run this cache: why not"):
        select_backend("cpu", CPU, "why not")
    with pytest.raises(ValueError, match="backend must be"):
        select_backend("gpu", CPU, ok)
    # the environment variable decides when the argument is "auto"; the argument wins
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "torch")
    assert select_backend("auto", CPU, ok) == "torch"
    assert select_backend("cpu", CPU, ok) == "cpu"
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "cpu")
    assert select_backend("auto", CPU, ok) == "cpu"
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "cuda")
    with pytest.raises(ValueError, match="KVLAB_PNMIX_BACKEND='cuda'"):
        select_backend("auto", CPU, ok)


def test_a_kernel_that_cannot_compile_is_reported_once_and_torch_is_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(cpu._KERNEL, "state", {})
    monkeypatch.setattr(cpu, "_compile", broken)
    cache = PNMixCache(
        PNMixConfig(sink_tokens=1, residual_tokens=2, group_tokens=4),
        batch_size=1,
        num_key_value_heads=1,
        head_dim=4,
    )
    cache.append(torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4))
    q = torch.randn(1, 1, 1, 4)
    with caplog.at_level(logging.WARNING, logger="kvlab"):
        first = pnmix_attention(q, cache)
        second = pnmix_decode_step(q, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), cache)
    messages = [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(messages) == 1 and "no C++ compiler here" in messages[0]
    assert cpu.cpu_kernel_status().startswith("unavailable: no C++ compiler here")
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    with pytest.raises(RuntimeError, match="not available"):
        pnmix_attention(q, cache, backend="cpu")


# ---------------------------------------------------------------- the codec description
def test_kernel_key_decode_describes_the_codecs() -> None:
    assert kernel_key_decode(CartesianCodec(2)) == KernelKeyDecode(KEYS_PER_CHANNEL)
    pn = kernel_key_decode(PhaseNormCodec(3))
    assert pn == KernelKeyDecode(KEYS_PER_CHANNEL, PAIR_PHASE_NORM, PAIR_PHASE_NORM)
    mix = kernel_key_decode(MixCodec(CartesianCodec(2), PhaseNormCodec(2)))
    assert mix == KernelKeyDecode(KEYS_PER_CHANNEL, PAIR_CARTESIAN, PAIR_PHASE_NORM)
    with pytest.raises(ValueError, match="pair mode"):
        register_pair_mode(CartesianCodec, 7)


@dataclass(frozen=True)
class _ShiftedCartesian(CartesianCodec):
    """A Cartesian subclass that decodes differently: kernels must not guess it."""

    def decode(self, codes, scalars, layout, mask=None, active_pairs=None):  # type: ignore[override]
        return super().decode(codes, scalars, layout, mask, active_pairs) + 1.0


def test_codecs_no_kernel_decodes_use_the_reference() -> None:
    """A codec without a kernel decode step (an unregistered subclass, a mix with one) gets a
    reason; ``"auto"`` then uses the torch reference (the same numbers) and an explicit
    compiled backend refuses."""
    for codec, reason in (
        (_ShiftedCartesian(2), "no kernel decode step"),
        (MixCodec(_ShiftedCartesian(2), PhaseNormCodec(2)), "no kernel decodes"),
    ):
        described = kernel_key_decode(codec)
        assert isinstance(described, str) and reason in described
    cache = PNMixCache(
        PNMixConfig(
            sink_tokens=1, residual_tokens=2, group_tokens=4, key_coding=_ShiftedCartesian(2)
        ),
        batch_size=1,
        num_key_value_heads=1,
        head_dim=4,
    )
    cache.append(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
    q = torch.randn(1, 1, 2, 4)
    assert torch.equal(pnmix_attention(q, cache), pnmix_attention(q, cache, backend="torch"))
    with pytest.raises(ValueError, match="no kernel decode step"):
        pnmix_attention(q, cache, backend="cpu")
