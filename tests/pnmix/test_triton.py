"""The Triton backend against the torch reference (docs/design.md, "Kernels").

Runs where ``triton`` is installed (the ``triton`` extra): on CUDA when there is a GPU, else
on the CPU under ``TRITON_INTERPRET=1`` (slow: small shapes only). Marked ``triton``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import kernel_tolerance

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.rope import RotaryConfig, apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before triton is imported: it reads this when it loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = pytest.mark.triton
CODINGS = ["mix", "cartesian", "phase_norm", "per_token"]


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """On the CPU, run Triton's interpreter (it must be set before the kernels are defined)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVLAB_PNMIX_BACKEND", raising=False)
        if DEVICE.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
            from kvlab.pnmix.kernels import triton_decode_kernels

            if not isinstance(triton_decode_kernels.split_kernel, _interpreted_type()):
                pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        yield


def _interpreted_type() -> type:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def make_cache(
    coding: str,
    bits: int,
    dtype: torch.dtype,
    lengths: list[int],
    seed: int,
    *,
    offset: float = 0.0,
    group: int = 4,
    head: tuple[int, int, int] = (10, 6, 8),
    sinks: int = 2,
    residual: int = 3,
) -> PNMixCache:
    d, dv, rotary = head
    gen = torch.Generator().manual_seed(seed)
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=sinks,
        residual_tokens=residual,
        group_tokens=group,
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_dim=rotary,
    )
    b, t = len(lengths), max(lengths)
    keys = torch.randn(b, 2, t + 3, d, generator=gen)
    keys[..., 0] = 3 * torch.cos(0.5 * torch.randint(0, 4, (b, 2, t + 3), generator=gen))
    keys[..., rotary // 2] = 3 * torch.sin(0.5 * torch.randint(0, 4, (b, 2, t + 3), generator=gen))
    keys[..., 1::2] += offset
    values = torch.randn(b, 2, t + 3, dv, generator=gen)
    cache = PNMixCache(
        cfg, batch_size=b, num_key_value_heads=2, head_dim=d, value_head_dim=dv, device=DEVICE
    )
    cache.append(keys[:, :, :t].to(DEVICE), values[:, :, :t].to(DEVICE), lengths)
    for i in range(t, t + 3):
        cache.append(keys[:, :, i : i + 1].to(DEVICE), values[:, :, i : i + 1].to(DEVICE))
    return cache


def check(cache: PNMixCache, query: torch.Tensor, **kwargs: object) -> None:
    ref = pnmix_attention(query, cache, backend="torch", **kwargs)  # type: ignore[arg-type]
    out = pnmix_attention(query, cache, backend="triton", **kwargs)  # type: ignore[arg-type]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    softcap = kwargs.get("logit_softcap")
    tol = kernel_tolerance(query, cache, softcap=softcap)  # type: ignore[arg-type]
    err = float((out - ref).abs().max())
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("coding", CODINGS)
def test_triton_matches_the_reference_for_every_codec(coding: str) -> None:
    """Padded rows, GQA 3, decode (Q = 1) and multi-query causal (Q = 3) and non-causal."""
    cache = make_cache(coding, 2, torch.float16, [23, 14], seed=CODINGS.index(coding))
    gen = torch.Generator().manual_seed(1)
    for nq, causal in ((1, True), (3, True), (3, False)):
        query = torch.randn(2, 6, nq, 10, generator=gen).to(DEVICE)
        check(cache, query, causal=causal)


def test_triton_without_sinks_or_residual_slots() -> None:
    """Zero-size sink and residual buffers (per-token keys in groups of 1, nothing exact)."""
    cache = make_cache("per_token", 4, torch.float16, [9, 5], seed=3, group=1, sinks=0, residual=0)
    assert cache.store.sink_keys.numel() == 0 and cache.store.residual_keys.numel() == 0
    query = torch.randn(2, 4, 2, 10, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    check(cache, query)


@settings(max_examples=8, deadline=None)
@given(
    coding=st.sampled_from(CODINGS),
    bits=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=2),
    group=st.integers(2, 5),
    head=st.sampled_from([(8, 8, 8), (10, 6, 8), (12, 8, 6)]),
    far=st.booleans(),
    softcap=st.sampled_from([None, 2.5]),
    sinks=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_triton_matches_the_reference(
    coding: str,
    bits: int,
    dtype: torch.dtype,
    lengths: list[int],
    group: int,
    head: tuple[int, int, int],
    far: bool,
    softcap: float | None,
    sinks: bool,
    seed: int,
) -> None:
    """Bits, storage dtypes, large zero points (bfloat16 -7e4), soft-cap, learned sinks."""
    offset = (-7e4 if dtype == torch.bfloat16 else -3e4) if far else 0.0
    cache = make_cache(coding, bits, dtype, lengths, seed, offset=offset, group=group, head=head)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(len(lengths), 4, 1, head[0], generator=gen).to(DEVICE)
    sink_logits = torch.randn(4, generator=gen).to(DEVICE) if sinks else None
    check(cache, query, logit_softcap=softcap, sink_logits=sink_logits)


def test_triton_splits_merge_like_one_split() -> None:
    """Many splits of one group each (FlashDecoding reduction) and the exact segment."""
    from kvlab.pnmix.kernels.triton_decode import packed_attention_triton
    from kvlab.pnmix.reference import reference_keys

    cache = make_cache("mix", 2, torch.float16, [40], seed=7)
    query = torch.randn(1, 4, 2, 10, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    kv = cache.packed_kv()
    mu = reference_keys(kv)
    outs = [
        packed_attention_triton(
            query,
            kv,
            cache.kernel_decode,  # type: ignore[arg-type]
            mu,
            scale=10**-0.5,
            causal=True,
            logit_softcap=None,
            sink_logits=None,
            groups_per_split=g,
        )
        for g in (1, 3, 100)
    ]
    ref = pnmix_attention(query, cache, backend="torch")
    for out in outs:
        assert float((out - ref).abs().max()) <= kernel_tolerance(query, cache)


# (key_coding, key_outlier_fraction, value_coding, rotary layout, storage dtype, relayed,
#  value_group_channels of the 8 value channels)
ISSUE8 = [
    ("bit_alloc", 0.05, "hadamard", "half", torch.float16, False, None),
    ("bit_alloc", 0.0, "per_token", "interleaved", torch.bfloat16, True, None),
    ("prerope_cartesian", 0.05, "hadamard", "interleaved", torch.float16, True, None),
    ("prerope_mix", 0.0, "hadamard", "half", torch.bfloat16, False, None),
    ("cartesian", 0.05, "per_token", "half", torch.float16, False, None),
    ("bit_alloc", 0.05, "hadamard", "half", torch.float16, False, 4),  # pn-mix-values64's shape
    ("bit_alloc", 0.0, "per_token", "interleaved", torch.bfloat16, True, 2),
]


def issue8_cache(case: int) -> tuple[PNMixCache, torch.Generator]:
    """The cache of ISSUE8 row ``case`` (rows of 40 and 27 tokens) and the generator after it."""
    coding, outliers, values_coding, layout, dtype, relayed, value_groups = ISSUE8[case]
    d, dv, rotary_dim = 16, 8, 12
    rotary = RotaryConfig(d, rotary_dim, 10000.0, layout)  # type: ignore[arg-type]
    cfg = PNMixConfig(
        sink_tokens=2,
        residual_tokens=3,
        group_tokens=8,
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        key_outlier_fraction=outliers,
        value_coding=values_coding,  # type: ignore[arg-type]
        value_group_channels=value_groups,
        rotary_dim=rotary_dim,
        rotary_layout=layout,  # type: ignore[arg-type]
    )
    cache = PNMixCache(
        cfg,
        batch_size=2,
        num_key_value_heads=2,
        head_dim=d,
        value_head_dim=dv,
        device=DEVICE,
        rotary=rotary if cfg.key_codec.position_aware else None,
    )
    gen = torch.Generator().manual_seed(case)
    n = 40
    keys = apply_rotary(torch.randn(2, 2, n, d, generator=gen), torch.arange(n), rotary)
    queries = torch.randn(2, 6, n, d, generator=gen)
    values = torch.randn(2, 2, n, dv, generator=gen)
    cache.append(keys.to(DEVICE), values.to(DEVICE), [n, 27], queries=queries.to(DEVICE))
    if relayed:
        cache.set_position_offsets([[5, 0], [17, 3]])
    assert not isinstance(cache.kernel_decode, str)
    return cache, gen


def issue8_tolerance(query: torch.Tensor, cache: PNMixCache) -> float:
    tol = kernel_tolerance(query, cache)
    if cache.value_codec.transforms_output:  # the output transform's own rounding
        dv = cache.value_head_dim
        tol += 4 * dv * 1.2e-7 * dv**0.5 * float(cache.dequantize()[1].abs().max())
    return tol


@pytest.mark.parametrize("case", range(len(ISSUE8)))
def test_triton_matches_the_reference_on_the_issue8_codecs(case: int) -> None:
    """Per-pair widths, exact outliers, pre-RoPE keys (partial rotary, both layouts, moved
    position offsets), Hadamard values; padded rows, GQA 3, Q = 1 and Q = 3 causal."""
    cache, gen = issue8_cache(case)
    for nq in (1, 3):
        query = torch.randn(2, 6, nq, cache.head_dim, generator=gen).to(DEVICE)
        ref = pnmix_attention(query, cache, backend="torch")
        out = pnmix_attention(query, cache, backend="triton")
        tol = issue8_tolerance(query, cache)
        err = float((out - ref).abs().max())
        assert err <= tol, (err, tol)


@pytest.mark.parametrize("case", range(len(ISSUE8)))
def test_triton_products_by_dot_or_by_reduction_agree(case: int) -> None:
    """``dot=True`` (``tl.dot``, blocks padded to 16) and ``dot=False`` (broadcast products
    reduced over an axis) both stay within the reference's tolerance; a launcher replays the
    same result into the same buffer."""
    from kvlab.pnmix.kernels.triton_decode import triton_launcher
    from kvlab.pnmix.reference import reference_keys

    cache, gen = issue8_cache(case)
    query = torch.randn(2, 6, 3, cache.head_dim, generator=gen).to(DEVICE)
    kv = cache.packed_kv()
    mu = reference_keys(kv)
    ref = pnmix_attention(query, cache, backend="torch")
    tol = issue8_tolerance(query, cache)
    for dot in (False, True):
        launch = triton_launcher(
            query,
            kv,
            cache.kernel_decode,  # type: ignore[arg-type]
            mu,
            scale=query.shape[-1] ** -0.5,
            causal=True,
            logit_softcap=None,
            sink_logits=None,
            groups_per_split=2,
            dot=dot,
        )
        first = launch().clone()
        again = launch()
        assert torch.equal(first, again)
        assert float((first - ref).abs().max()) <= tol, dot
