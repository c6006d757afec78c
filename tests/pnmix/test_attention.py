"""Packed-code attention equals dequantize-then-attend; counting; errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import phase_norm_channels, require_cpu_kernel

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.pnmix.reference import packed_attention_reference

CODINGS = ["mix", "cartesian", "phase_norm", "per_token"]


def make_kv(
    b: int, h: int, t: int, d: int, dv: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values, except the first half-layout pair of every key: norm 3 and one of
    four evenly spaced phases, which Phase–Norm codes almost exactly (so mix masks mix)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=gen)
    steps = torch.randint(0, 4, (b, h, t), generator=gen).float()
    theta = 0.5 * steps + 0.4 * torch.arange(b * h).reshape(b, h, 1)
    k[..., 0] = 3 * torch.cos(theta)
    k[..., d // 2] = 3 * torch.sin(theta)
    return k, torch.randn(b, h, t, dv, generator=gen)


def reference(
    query: torch.Tensor, cache: PNMixCache, *, scale: float | None = None, causal: bool = True
) -> torch.Tensor:
    """Dequantize, expand GQA heads, SDPA in float64 with a bottom-right causal mask."""
    keys, values = cache.dequantize()
    rep = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1).double()
    values = values.repeat_interleave(rep, dim=1).double()
    nq, seq = query.shape[2], keys.shape[2]
    mask = None
    if causal:
        mask = torch.arange(seq)[None, :] <= (seq - nq + torch.arange(nq))[:, None]
    return F.scaled_dot_product_attention(query.double(), keys, values, attn_mask=mask, scale=scale)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    tol = 1e-5 * float(ref.abs().max())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("coding", CODINGS)
def test_packed_attention_matches_dequantized_reference(coding: str, bits: int) -> None:
    gen = torch.Generator().manual_seed(bits * 10 + CODINGS.index(coding))
    shapes = [(0, 0, 4), (2, 3, 4), (1, 0, 3), (0, 2, 5)]  # (sinks, residual, group)
    for case, (sink, residual, group) in enumerate(shapes):
        b = 1 + case % 2
        hkv, hq = 2, 2 * (1 + case % 3)  # GQA factors 1, 2, 3
        cfg = PNMixConfig(
            bits=bits,
            sink_tokens=sink,
            residual_tokens=residual,
            group_tokens=group,
            key_coding=coding,  # type: ignore[arg-type]
            rotary_dim=8 if case < 2 else 6,
            rotary_layout="half" if case % 2 == 0 else "interleaved",
        )
        d, dv, total = 10, 6, 23 + case
        k, v = make_kv(b, hkv, total, d, dv, seed=case)
        cache = PNMixCache(
            cfg, batch_size=b, num_key_value_heads=hkv, head_dim=d, value_head_dim=dv
        )
        cache.append(k[:, :, :15], v[:, :, :15])
        for i in range(15, total):
            cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert cache.num_groups >= 2
        for nq in range(1, 8):
            q = torch.randn(b, hq, nq, d, generator=gen)
            assert_matches(pnmix_attention(q, cache, block_groups=1 + nq % 3), reference(q, cache))
        q = torch.randn(b, hq, 3, d, generator=gen)
        assert_matches(
            pnmix_attention(q, cache, causal=False, scale=0.3),
            reference(q, cache, causal=False, scale=0.3),
        )
        assert cache.attention_calls == 8


def test_mix_mask_with_both_codings_is_exercised() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=6)
    k, v = make_kv(2, 2, 40, 8, 8, seed=3)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    cache.append(k, v)
    mask = cache.mix_mask
    assert mask is not None and bool(mask.any()) and not bool(mask.all())
    # some pair is Phase–Norm in one (sequence, head) and Cartesian in another: the packed
    # path evaluates the union of Phase–Norm pairs and must mask the rest
    rows = mask.flatten(0, 1).bool()
    assert bool((rows.any(0) & ~rows.all(0)).any())
    q = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(1))
    assert_matches(pnmix_attention(q, cache), reference(q, cache))


@settings(max_examples=25, deadline=None)
@given(
    coding=st.sampled_from(CODINGS),
    b=st.integers(1, 2),
    rep=st.sampled_from([1, 2, 4]),
    nq=st.integers(1, 7),
    total=st.integers(7, 60),
    sink=st.sampled_from([0, 1, 4]),
    residual=st.sampled_from([0, 3]),
    seed=st.integers(0, 10_000),
)
def test_packed_attention_random_configs(
    coding: str, b: int, rep: int, nq: int, total: int, sink: int, residual: int, seed: int
) -> None:
    cfg = PNMixConfig(
        sink_tokens=sink,
        residual_tokens=residual,
        group_tokens=4,
        key_coding=coding,  # type: ignore[arg-type]
    )
    k, v = make_kv(b, 2, total, 8, 8, seed=seed)
    cache = PNMixCache(cfg, batch_size=b, num_key_value_heads=2, head_dim=8)
    cache.append(k, v)
    q = torch.randn(b, 2 * rep, nq, 8, generator=torch.Generator().manual_seed(seed))
    assert_matches(pnmix_attention(q, cache), reference(q, cache))


@settings(max_examples=20, deadline=None)
@given(
    value_coding=st.sampled_from(["per_token", "hadamard", "hadamard_auto"]),
    channels=st.sampled_from([(8, 2), (16, 4), (16, 8), (32, 16)]),
    rep=st.sampled_from([1, 2]),
    nq=st.integers(1, 5),
    total=st.integers(9, 50),
    seed=st.integers(0, 10_000),
)
def test_packed_attention_with_grouped_value_scalars(
    value_coding: str, channels: tuple[int, int], rep: int, nq: int, total: int, seed: int
) -> None:
    """One scale and zero per token and ``c`` value channels (kvlab issue 40): the packed path
    (the torch reference: no kernel reads that layout) attends like dequantize-then-attend."""
    dv, c = channels
    cfg = PNMixConfig(
        sink_tokens=2,
        residual_tokens=3,
        group_tokens=4,
        value_coding=value_coding,  # type: ignore[arg-type]
        value_group_channels=c,
    )
    k, v = make_kv(2, 2, total, 8, dv, seed=seed)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8, value_head_dim=dv)
    cache.append(k[:, :, :7], v[:, :, :7])
    cache.append(k[:, :, 7:], v[:, :, 7:])
    assert cache.groups[0].value_scale.shape == (2, 2, 4 * dv // c)
    q = torch.randn(2, 2 * rep, nq, 8, generator=torch.Generator().manual_seed(seed))
    assert_matches(pnmix_attention(q, cache, block_groups=2), reference(q, cache))


def test_seed_configuration_prefill_and_decode_steps() -> None:
    k, v = make_kv(1, 2, 448, 32, 32, seed=42)
    gen = torch.Generator().manual_seed(0)
    cache = PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=2, head_dim=32)
    cache.append(k[:, :, :384], v[:, :, :384])
    q = torch.randn(1, 4, 384, 32, generator=gen)
    assert_matches(pnmix_attention(q, cache), reference(q, cache))
    for i in range(384, 448, 16):
        cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        q = torch.randn(1, 4, 1, 32, generator=gen)
        assert_matches(pnmix_attention(q, cache), reference(q, cache))
    assert cache.attention_calls == 5


def test_attention_reads_codes_not_the_dequantized_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    k, v = make_kv(1, 2, 30, 8, 8, seed=4)
    cache = PNMixCache(
        PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=8,
    )
    cache.append(k, v)
    q = torch.randn(1, 2, 2, 8)
    ref = reference(q, cache)

    def forbidden() -> None:
        raise AssertionError("attention must not dequantize the cache")

    monkeypatch.setattr(cache, "dequantize", forbidden)
    assert_matches(pnmix_attention(q, cache), ref)


def test_output_dtype_follows_query() -> None:
    k, v = make_kv(1, 2, 20, 8, 8, seed=5)
    cache = PNMixCache(
        PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=8,
    )
    cache.append(k, v)
    q = torch.randn(1, 2, 1, 8)
    out16 = pnmix_attention(q.half(), cache)
    assert out16.dtype == torch.float16
    torch.testing.assert_close(
        out16.float(), pnmix_attention(q.half().float(), cache), rtol=2e-3, atol=2e-3
    )


def test_attention_errors() -> None:
    cache = PNMixCache(PNMixConfig(), batch_size=1, num_key_value_heads=2, head_dim=8)
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="empty"):
        pnmix_attention(q, cache)
    k, v = make_kv(1, 2, 5, 8, 8, seed=6)
    cache.append(k, v)
    cases = [
        (torch.randn(1, 3, 1, 8), "multiple"),
        (torch.randn(1, 4, 1, 6), "head_dim"),
        (torch.randn(2, 4, 1, 8), "batch"),
        (torch.randn(1, 4, 6, 8), "query count"),
        (torch.randn(4, 1, 8), "4-D"),
        (torch.ones(1, 4, 1, 8, dtype=torch.int64), "floating"),
    ]
    for query, match in cases:
        with pytest.raises(ValueError, match=match):
            pnmix_attention(query, cache)
    with pytest.raises(ValueError, match="block_groups"):
        pnmix_attention(q, cache, block_groups=0)
    with pytest.raises(ValueError, match="PNMixCache"):
        pnmix_attention(q, object())  # type: ignore[arg-type]
    assert cache.attention_calls == 0


# ---------------------------------------------------------------- large zero points (bf16)
def _outlier_keys(variant: str, gen: torch.Generator) -> torch.Tensor:
    k = torch.randn(1, 2, 200, 16, generator=gen)
    far = -7e4 + 300 * torch.randn(1, 2, 200, 16, generator=gen)  # bf16 step there: 512
    if variant == "channel":
        k[..., 3] = far[..., 3]
    elif variant == "pair":  # half layout: channels 0 and 8 form pair 0
        k[..., 0], k[..., 8] = far[..., 0], far[..., 8]
    elif variant == "half":
        k[..., :8] = far[..., :8]
    else:
        k = far
    return k


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("variant", ["channel", "pair", "half", "all"])
@pytest.mark.parametrize("coding", CODINGS)
def test_large_zero_points_agree_with_dequantize_then_attend(
    coding: str, variant: str, backend: str
) -> None:
    """bfloat16 keys near -7e4 (issue 11): packed attention agrees with float64
    dequantize-then-attend to float32 rounding relative to the spread of the keys within a
    row (what softmax depends on), not their magnitude: error <= 2 eps * max_t |q| . |k_t - k_0|
    * max |v|. The folded ``q . zero + (q . scale) . codes`` form of the list-of-groups
    storage missed this bound by up to 9x here (cancellation of the -7e4 zero points). The
    compiled CPU kernel decodes Cartesian and per-token elements bit for bit as dequantize()
    does; its Phase–Norm cosines may differ by an ulp, which is rounding relative to the pair's
    norm: for Phase–Norm channels the bound adds 2 eps * |q| . r * max |v|."""
    if backend == "cpu":
        require_cpu_kernel()
    gen = torch.Generator().manual_seed(7)
    cfg = PNMixConfig(
        sink_tokens=4,
        residual_tokens=4,
        group_tokens=16,
        storage_dtype=torch.bfloat16,
        key_coding=coding,  # type: ignore[arg-type]
    )
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=16)
    cache.append(_outlier_keys(variant, gen), torch.randn(1, 2, 200, 16, generator=gen))
    eps = torch.finfo(torch.float32).eps
    keys, values = cache.dequantize()
    pn = phase_norm_channels(cache)[:, :, None, :] & (backend == "cpu")
    first, second = cache.pair_indices
    norm = torch.zeros_like(keys)
    norm[..., first] = norm[..., second] = torch.sqrt(
        keys[..., first] ** 2 + keys[..., second] ** 2
    )
    for scale in (1e-2, 1.0):
        q = torch.randn(1, 4, 3, 16, generator=gen) * scale
        out = pnmix_attention(q, cache, backend=backend)
        ref = reference(q, cache)
        spread = (keys - keys[:, :, :1]).abs() + torch.where(pn, norm, 0.0)
        spread = spread.double().repeat_interleave(2, dim=1)  # [B, Hq, T, D]
        logit_scale = (q.abs().double() @ spread.transpose(-1, -2)).max() / 4  # / sqrt(D)
        tol = 2 * eps * float(logit_scale) * float(values.abs().max()) + 4 * eps
        err = float((out.double() - ref).abs().max())
        assert err <= tol, (err, tol)


def test_large_value_zero_points_agree_to_the_values_scale() -> None:
    gen = torch.Generator().manual_seed(8)
    cfg = PNMixConfig(
        sink_tokens=2, residual_tokens=2, group_tokens=8, storage_dtype=torch.bfloat16
    )
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    values = -7e4 + 300 * torch.randn(1, 2, 100, 8, generator=gen)
    cache.append(torch.randn(1, 2, 100, 8, generator=gen), values)
    q = torch.randn(1, 2, 2, 8, generator=gen)
    err = float((pnmix_attention(q, cache).double() - reference(q, cache)).abs().max())
    assert err <= 16 * torch.finfo(torch.float32).eps * 7.1e4


# ---------------------------------------------------------------- padded rows, backends
def test_padded_rows_attend_like_each_row_alone() -> None:
    """A batch whose rows hold different lengths (left-padded appends): each row's output
    equals attention over that row's own cache; queries before a row's first token (padding
    queries) return zeros, never NaN."""
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=3, group_tokens=4)
    gen = torch.Generator().manual_seed(9)
    lengths = [30, 7, 19, 0]
    t = 30
    k = torch.randn(4, 2, t, 8, generator=gen)
    v = torch.randn(4, 2, t, 8, generator=gen)
    batch = PNMixCache(cfg, batch_size=4, num_key_value_heads=2, head_dim=8)
    batch.append(k, v, lengths)
    for nq in (1, 5, 12):
        q = torch.randn(4, 4, nq, 8, generator=gen)
        out = pnmix_attention(q, batch, block_groups=2)
        assert bool(torch.isfinite(out).all())
        for i, n in enumerate(lengths):
            if n == 0:
                assert bool((out[i] == 0).all())
                continue
            alone = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
            alone.append(k[i : i + 1, :, t - n :], v[i : i + 1, :, t - n :])
            real = min(nq, n)  # the row's last `real` queries are its own tokens
            expected = pnmix_attention(q[i : i + 1, :, nq - real :], alone)
            torch.testing.assert_close(
                out[i : i + 1, :, nq - real :], expected, rtol=1e-6, atol=1e-6
            )
            assert bool((out[i, :, : nq - real] == 0).all())


def test_backend_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="torch"`` is the reference; the environment variable selects when the
    argument is ``"auto"``; unknown names are refused (details: tests/pnmix/test_kernels.py)."""
    k, v = make_kv(1, 2, 40, 8, 8, seed=10)
    cache = PNMixCache(
        PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=8,
    )
    cache.append(k, v)
    q = torch.randn(1, 2, 3, 8)
    kv = cache.packed_kv()
    expected = packed_attention_reference(q, kv, scale=8**-0.5, block_groups=1024)
    assert torch.equal(pnmix_attention(q, cache, backend="torch"), expected)
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "torch")
    assert torch.equal(pnmix_attention(q, cache), expected)
    with pytest.raises(ValueError, match="backend"):
        pnmix_attention(q, cache, backend="triton-not-here")
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "fast")
    with pytest.raises(ValueError, match="KVLAB_PNMIX_BACKEND"):
        pnmix_attention(q, cache)
    assert cache.attention_calls == 2


def test_unknown_backend_environment_is_refused_at_cache_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One error naming the valid values when the cache is built, not at its first attention."""
    config = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "fast")
    valid = r"KVLAB_PNMIX_BACKEND='fast': must be 'auto' or one of \('torch', 'cpu', 'triton'\)"
    with pytest.raises(ValueError, match=valid):
        PNMixCache(config, batch_size=1, num_key_value_heads=2, head_dim=8)
    for name in ("auto", "torch", " cpu "):
        monkeypatch.setenv("KVLAB_PNMIX_BACKEND", name)
        PNMixCache(config, batch_size=1, num_key_value_heads=2, head_dim=8)
