"""Packed-code attention equals dequantize-then-attend; counting; errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

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
