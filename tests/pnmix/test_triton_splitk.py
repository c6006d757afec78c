"""The split-K GQA decode kernel (kvlab.pnmix.kernels.triton_splitk) against the torch
reference (docs/benchmarks.md, "Decode bytes model and the split-K kernel").

Runs where ``triton`` is installed: on CUDA when there is a GPU, else on the CPU under
``TRITON_INTERPRET=1`` (tests/conftest.py sets it; slow: tiny shapes). Marked ``triton``.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_checks import kernel_tolerance

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before triton is imported: it reads this when it loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = pytest.mark.triton


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """On the CPU, Triton's interpreter must have been on when the kernels were defined."""
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        from kvlab.pnmix.kernels import triton_splitk_kernels

        if not isinstance(triton_splitk_kernels.quantized_kernel, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    yield


def make_cache(
    coding: str,
    lengths: list[int],
    seed: int,
    *,
    kv_heads: int = 2,
    layout: str = "half",
    bits: int = 2,
    group: int = 16,
    dtype: torch.dtype = torch.float16,
    values: str = "per_token",
    head: tuple[int, int] = (32, 16),
    sinks: int = 2,
    residual: int = 3,
) -> PNMixCache:
    d, dv = head
    gen = torch.Generator().manual_seed(seed)
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=sinks,
        residual_tokens=residual,
        group_tokens=group,
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_layout=layout,  # type: ignore[arg-type]
        value_coding=values,  # type: ignore[arg-type]
    )
    b, t = len(lengths), max(lengths)
    keys = torch.randn(b, kv_heads, t + 2, d, generator=gen)
    # a few pairs with a strong norm and a few phases: the mix picks Phase-Norm for some
    first, second = (0, d // 2) if layout == "half" else (0, 1)  # pair 0 in either layout
    angle = 0.5 * torch.randint(0, 4, (b, kv_heads, t + 2), generator=gen)
    keys[..., first] = 3 * torch.cos(angle)
    keys[..., second] = 3 * torch.sin(angle)
    vals = torch.randn(b, kv_heads, t + 2, dv, generator=gen)
    cache = PNMixCache(
        cfg,
        batch_size=b,
        num_key_value_heads=kv_heads,
        head_dim=d,
        value_head_dim=dv,
        device=DEVICE,
    )
    cache.append(keys[:, :, :t].to(DEVICE), vals[:, :, :t].to(DEVICE), lengths)
    for i in range(t, t + 2):  # two decode appends (a flush may happen in them)
        cache.append(keys[:, :, i : i + 1].to(DEVICE), vals[:, :, i : i + 1].to(DEVICE))
    return cache


def splitk(cache: PNMixCache, query: torch.Tensor, **options: object) -> torch.Tensor:
    from kvlab.pnmix.kernels.triton_splitk import packed_attention_splitk
    from kvlab.pnmix.reference import reference_keys

    kv = cache.packed_kv()
    opts: dict[str, object] = dict(
        scale=query.shape[-1] ** -0.5, causal=True, logit_softcap=None, sink_logits=None
    )
    opts.update(options)
    return packed_attention_splitk(query, kv, cache.kernel_decode, reference_keys(kv), **opts)  # type: ignore[arg-type]


def check(cache: PNMixCache, query: torch.Tensor, **options: object) -> None:
    kwargs = {k: options[k] for k in ("causal", "logit_softcap", "sink_logits") if k in options}
    ref = pnmix_attention(query, cache, backend="torch", **kwargs)  # type: ignore[arg-type]
    out = splitk(cache, query, **options)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = kernel_tolerance(query, cache, softcap=options.get("logit_softcap"))  # type: ignore[arg-type]
    if cache.value_codec.transforms_output:  # the output transform's own rounding
        dv = cache.value_head_dim
        tol += 4 * dv * 1.2e-7 * dv**0.5 * float(cache.dequantize()[1].abs().max())
    err = float((out - ref).abs().max())
    assert err <= tol, (err, tol)


@pytest.mark.parametrize(
    ("coding", "layout"),
    [("mix", "half"), ("mix", "interleaved"), ("cartesian", "half"), ("phase_norm", "interleaved")],
)
def test_splitk_matches_the_reference(coding: str, layout: str) -> None:
    """The seed coding (mix), KIVI keys, all Phase-Norm; both RoPE layouts; padded rows of odd
    lengths (batch 2), GQA 3, decode (Q = 1) and causal Q = 2, splits of one tile."""
    cache = make_cache(coding, [53, 29], seed=len(coding), layout=layout)
    if coding == "mix":
        assert cache.phase_norm_pairs is not None and bool(cache.phase_norm_pairs.any())
    gen = torch.Generator().manual_seed(1)
    for nq in (1, 2):
        query = torch.randn(2, 6, nq, 32, generator=gen).to(DEVICE)
        check(cache, query, splits=100)


@pytest.mark.parametrize(("kv_heads", "rep"), [(2, 1), (1, 2), (1, 5), (1, 8)])
def test_splitk_gqa_groups(kv_heads: int, rep: int) -> None:
    """GQA groups of 1 to 8 query heads per kv head (one program covers the whole group)."""
    cache = make_cache("mix", [41], seed=rep, kv_heads=kv_heads)
    query = torch.randn(1, kv_heads * rep, 1, 32, generator=torch.Generator().manual_seed(rep))
    check(cache, query.to(DEVICE), splits=2)


def test_splitk_splits_ending_mid_group_agree() -> None:
    """Groups of 32 in tiles of 16: 1, 3 (tile 3 of 6 ends mid-group) and 100 splits, and the
    default (choose_splits) give the reference's output."""
    cache = make_cache("mix", [107, 60], seed=5, group=32)
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for splits in (None, 1, 3, 100):
        check(cache, query, splits=splits, block_t=16)


def test_splitk_softcap_sinks_bf16_hadamard_4bit() -> None:
    """Soft-cap, learned sink logits, bfloat16 storage, Hadamard values, 4-bit codes, a
    non-causal multi-query call."""
    cache = make_cache("mix", [45, 38], seed=9, bits=4, dtype=torch.bfloat16, values="hadamard")
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 4, 1, 32, generator=gen).to(DEVICE)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    check(cache, query, logit_softcap=2.5, sink_logits=sinks, splits=2)
    query = torch.randn(2, 4, 2, 32, generator=gen).to(DEVICE)
    check(cache, query, causal=False, splits=3)


def test_splitk_without_groups_or_exact_tokens() -> None:
    """Rows still all exact (no quantized group: no split launched), and a cache without sink
    or residual slots."""
    cache = make_cache("mix", [3, 1], seed=2)
    assert int(cache.store.group_counts.max()) == 0
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    check(cache, query)
    cache = make_cache("cartesian", [34, 16], seed=3, sinks=0, residual=0)
    check(cache, query, splits=2)


def test_splitk_launcher_replays_into_one_buffer() -> None:
    from kvlab.pnmix.kernels.triton_splitk import splitk_launcher
    from kvlab.pnmix.reference import reference_keys

    cache = make_cache("mix", [40], seed=8)
    query = torch.randn(1, 6, 1, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    kv = cache.packed_kv()
    launch = splitk_launcher(
        query,
        kv,
        cache.kernel_decode,  # type: ignore[arg-type]
        reference_keys(kv),
        scale=32**-0.5,
        causal=True,
        logit_softcap=None,
        sink_logits=None,
        splits=2,
    )
    first = launch().clone()
    again = launch()
    assert torch.equal(first, again)


def test_choose_splits_and_unsupported_reasons() -> None:
    from kvlab.pnmix.kernels.splits import choose_splits, splitk_unsupported

    assert choose_splits(8, 3, 65536, 132) == 22  # 4 * 132 / 24 programs
    assert choose_splits(8, 2, 65536, 132) == 33
    assert choose_splits(1, 1, 1000, 132) == 1  # at most one split per 512 tokens
    assert choose_splits(1, 1, 10, 132) == 1
    with pytest.raises(ValueError):
        choose_splits(0, 1, 10, 132)
    cache = make_cache("per_token", [20], seed=1)
    assert "per-channel" in str(splitk_unsupported(cache.packed_kv(), cache.kernel_decode))
    cache = make_cache("mix", [20], seed=1, head=(16, 16))
    assert "head_dim" in str(splitk_unsupported(cache.packed_kv(), cache.kernel_decode))
    cache = make_cache("mix", [20], seed=1, bits=3)
    assert "bit" in str(splitk_unsupported(cache.packed_kv(), cache.kernel_decode))


# (key_coding, key_outlier_fraction, value_coding, rotary layout, storage dtype, relayed,
#  group tokens, value_group_channels of the 16 value channels, block_t)
PNMIX_CASES = [
    ("bit_alloc", 0.05, "hadamard", "half", torch.float16, True, 16, None, None),  # pn-mix's
    ("bit_alloc", 0.02, "hadamard", "interleaved", torch.float16, False, 32, None, 16),
    ("bit_alloc", 0.0, "per_token", "interleaved", torch.bfloat16, True, 16, None, None),
    ("prerope_cartesian", 0.05, "hadamard", "interleaved", torch.bfloat16, True, 16, None, None),
    ("prerope_mix", 0.0, "hadamard", "half", torch.float16, False, 16, None, None),
    ("cartesian", 0.05, "per_token", "half", torch.float16, False, 32, None, 16),
    ("bit_alloc", 0.05, "hadamard", "half", torch.float16, True, 16, 4, None),  # 4 value groups
    ("bit_alloc", 0.0, "per_token", "interleaved", torch.bfloat16, False, 32, 8, 16),
]


def pnmix_cache(case: int) -> tuple[PNMixCache, torch.Generator]:
    """The cache of PNMIX_CASES row ``case``: rows of 45 and 30 tokens, 2 kv heads, D = 32,
    Dv = 16, full rotary; tables from prefill queries; optionally moved position offsets."""
    from kvlab.rope import RotaryConfig, apply_rotary

    coding, outliers, values, layout, dtype, relayed, group, value_groups, _ = PNMIX_CASES[case]
    d, dv = 32, 16
    rotary = RotaryConfig(d, d, 10000.0, layout)  # type: ignore[arg-type]
    cfg = PNMixConfig(
        sink_tokens=2,
        residual_tokens=3,
        group_tokens=group,
        storage_dtype=dtype,
        key_coding=coding,  # type: ignore[arg-type]
        key_outlier_fraction=outliers,
        value_coding=values,  # type: ignore[arg-type]
        value_group_channels=value_groups,
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
    gen = torch.Generator().manual_seed(100 + case)
    if coding == "bit_alloc" and case < 2:  # widths 4/3/2/0 in every row: 3-bit codes straddle
        widths = torch.tensor([4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0], dtype=torch.uint8)
        table = torch.stack([widths[torch.randperm(16, generator=gen)] for _ in range(4)])
        cache.set_pair_table(table.reshape(2, 2, 16))
    n = 45
    keys = apply_rotary(torch.randn(2, 2, n, d, generator=gen), torch.arange(n), rotary)
    keys[..., 3] += 6 * (torch.rand(2, 2, n, generator=gen) < 0.05)  # a few real outliers
    queries = torch.randn(2, 6, n, d, generator=gen)
    vals = torch.randn(2, 2, n, dv, generator=gen)
    cache.append(keys.to(DEVICE), vals.to(DEVICE), [n, 30], queries=queries.to(DEVICE))
    if relayed:
        cache.set_position_offsets([[5, 0], [17, 3]])
    return cache, gen


@pytest.mark.parametrize("case", range(len(PNMIX_CASES)))
def test_splitk_matches_the_reference_on_the_pnmix_codings(case: int) -> None:
    """Per-pair widths (3-bit codes straddling words), exact outliers as a sparse logit
    correction (rotated for pre-RoPE keys; tiles ending mid-group), pre-RoPE keys at moved
    position offsets, Hadamard values; padded rows, GQA 3, Q = 1 and causal Q = 3."""
    from kvlab.pnmix.kernels.splits import splitk_unsupported

    cache, gen = pnmix_cache(case)
    assert splitk_unsupported(cache.packed_kv(), cache.kernel_decode) is None
    block_t = PNMIX_CASES[case][-1]
    for nq in (1, 3):
        query = torch.randn(2, 6, nq, 32, generator=gen).to(DEVICE)
        check(cache, query, splits=3, block_t=block_t)


@pytest.mark.parametrize("case", [None, 0, 1])
def test_splitk_reduced_products(case: int | None) -> None:
    """``dot=False`` (broadcast products reduced over an axis, query rows padded to a power
    of two: 3 -> 4) on the seed coding and two pn-mix configurations (outliers, widths)."""
    if case is None:
        cache = make_cache("mix", [37, 50], seed=11)
        gen = torch.Generator().manual_seed(12)
    else:
        cache, gen = pnmix_cache(case)
    query = torch.randn(2, 6, 1, 32, generator=gen).to(DEVICE)
    check(cache, query, splits=2, dot=False)


def test_the_triton_backend_runs_the_splitk_kernel_where_it_covers_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pnmix_attention(backend="triton")`` takes its kernel from the dispatch table: the
    split-K kernel for a store it covers (the seed coding here), the older kernel otherwise
    (per-token keys); both agree with the reference."""
    from kvlab.pnmix.kernels import triton_decode, triton_splitk

    used: list[str] = []
    for module, name in (
        (triton_splitk, "packed_attention_splitk"),
        (triton_decode, "packed_attention_triton"),
    ):
        original = getattr(module, name)

        def spy(*args: object, _fn: object = original, _name: str = name, **kw: object) -> object:
            used.append(_name)
            return _fn(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(module, name, spy)
    gen = torch.Generator().manual_seed(6)
    for coding, expected in (
        ("mix", "packed_attention_splitk"),
        ("per_token", "packed_attention_triton"),
    ):
        cache = make_cache(coding, [37, 50], seed=21)
        query = torch.randn(2, 6, 1, 32, generator=gen).to(DEVICE)
        used.clear()
        out = pnmix_attention(query, cache, backend="triton")
        assert used == [expected]
        ref = pnmix_attention(query, cache, backend="torch")
        assert float((out - ref).abs().max()) <= kernel_tolerance(query, cache)
