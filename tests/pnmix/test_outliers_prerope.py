"""Dense-and-sparse outliers and the pre-RoPE frame: float64 references, exact outliers,
exact bytes, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix.outliers import (
    outlier_count,
    select_outliers,
    sparse_minmax_dequantize,
    sparse_minmax_quantize,
    sparse_outlier_bytes,
)
from kvlab.pnmix.prerope import from_prerope, to_prerope
from kvlab.pnmix.quantizers import minmax_quantize
from kvlab.rope import RotaryConfig, apply_rotary

DTYPES = [torch.float16, torch.bfloat16]


def _reference_outliers(x: torch.Tensor, count: int) -> list[int]:
    """Float64 reference for one [T, D] group: distance from the lower median of each channel,
    largest first, ties by flat index."""
    t, d = x.shape
    x64 = x.double()
    items = []
    for j in range(d):
        col = sorted(x64[:, j].tolist())
        med = col[(t - 1) // 2]
        for i in range(t):
            items.append((-abs(float(x64[i, j]) - med), i * d + j))
    items.sort()
    return sorted(idx for _, idx in items[:count])


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(2, 10),
    d=st.integers(1, 6),
    frac=st.sampled_from([0.0, 0.05, 0.2]),
    bits=st.sampled_from([2, 3, 4]),
    storage=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_minmax_against_float64_reference(t, d, frac, bits, storage, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, t, d, generator=gen) * 4).to(storage)
    x[0, 0, 0, 0] = 300.0  # a real outlier
    count = outlier_count(frac, t, d)
    out = sparse_minmax_quantize(x, bits, count, storage)
    assert out.outlier_index.dtype == torch.int16 and out.outlier_index.shape == (2, 3, count)
    assert out.outlier_values.dtype == storage and out.scale.dtype == storage
    dec = sparse_minmax_dequantize(out)
    levels = 2**bits - 1
    for b in range(2):
        for h in range(3):
            g = x[b, h]
            idx = _reference_outliers(g, count)
            assert out.outlier_index[b, h].long().tolist() == idx
            mask = torch.zeros(t * d, dtype=torch.bool)
            mask[idx] = True
            mask = mask.view(t, d)
            # outliers reconstruct bit-exactly
            assert torch.equal(dec[b, h][mask], g.float()[mask])
            for j in range(d):
                rest = g[:, j][~mask[:, j]].double()
                if rest.numel() == 0:
                    assert float(out.scale[b, h, j]) == 0.0
                    continue
                lo, hi = float(rest.min()), float(rest.max())
                assert float(out.zero[b, h, j]) == float(torch.tensor(lo).to(storage))
                s = float(torch.tensor((hi - lo) / levels, dtype=torch.float64).to(storage))
                assert float(out.scale[b, h, j]) == s
                # dense elements: the nearest level of the stored grid, clamped
                for i in range(t):
                    if mask[i, j]:
                        assert int(out.codes[b, h, i, j]) == 0  # an outlier's code is unused
                        continue
                    z = float(out.zero[b, h, j])
                    code = 0 if s == 0 else min(max(round((float(g[i, j]) - z) / s), 0), levels)
                    assert int(out.codes[b, h, i, j]) == code


def test_no_outliers_equals_minmax() -> None:
    x = (torch.randn(3, 8, 5) * 2).half()
    out = sparse_minmax_quantize(x, 2, 0)
    ref = minmax_quantize(x, 2, -2)
    assert torch.equal(out.codes, ref.codes)
    assert torch.equal(out.scale, ref.scale) and torch.equal(out.zero, ref.zero)
    assert out.outlier_values.shape == (3, 0)


def test_outlier_shrinks_the_range() -> None:
    x = torch.zeros(1, 8, 2)
    x[0, :, 0] = torch.arange(8.0) / 8
    x[0, 3, 0] = 1000.0
    x = x.half()
    without = minmax_quantize(x, 2, -2)
    with_one = sparse_minmax_quantize(x, 2, 1)
    assert with_one.outlier_index.tolist() == [[3 * 2 + 0]]
    assert float(with_one.scale[0, 0]) < float(without.scale[0, 0]) / 100


def test_bytes_and_count() -> None:
    assert outlier_count(0.01, 32, 64) == 20
    assert sparse_outlier_bytes(20) == 80
    assert sparse_outlier_bytes(20, torch.bfloat16) == 80
    out = sparse_minmax_quantize(torch.randn(3, 32, 64).half(), 2, 20)
    stored = out.outlier_values.numel() * 2 + out.outlier_index.numel() * 2
    assert stored == 3 * sparse_outlier_bytes(20)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 0, "count": 1}, "bits"),
        ({"bits": 2, "count": 40}, "count"),
        ({"bits": 2, "count": -1}, "count"),
        ({"bits": 2, "count": 1, "storage_dtype": torch.float32}, "storage dtype"),
    ],
)
def test_sparse_rejects_bad_input_and_leaves_input_unchanged(kwargs, match) -> None:
    x = torch.randn(2, 5, 8).half()
    before = x.clone()
    with pytest.raises(ValueError, match=match):
        sparse_minmax_quantize(x, **kwargs)
    assert torch.equal(x, before)


def test_select_and_count_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="fraction"):
        outlier_count(1.0, 4, 4)
    with pytest.raises(ValueError, match="floating"):
        select_outliers(torch.zeros(4, 4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="int16"):
        select_outliers(torch.zeros(1024, 64), 1)


ROPES = [
    RotaryConfig(head_dim=8, base=10000.0),
    RotaryConfig(head_dim=8, rotary_dim=4, base=500.0, layout="interleaved"),
    RotaryConfig(
        head_dim=8,
        base=10000.0,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    RotaryConfig(
        head_dim=8,
        base=10000.0,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
]


@settings(max_examples=30, deadline=None)
@given(
    rope=st.sampled_from(ROPES),
    start=st.integers(0, 5000),
    t=st.integers(1, 9),
    storage=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_prerope_recovers_the_unrotated_keys(rope, start, t, storage, seed) -> None:
    """to_prerope(apply_rotary(k0, p)) == round(k0) to float32 rotation accuracy, and
    from_prerope inverts it; non-rotary channels are untouched."""
    gen = torch.Generator().manual_seed(seed)
    k0 = torch.randn(2, 3, t, 8, generator=gen, dtype=torch.float64) * 2
    pos = torch.arange(start, start + t)
    rotated = apply_rotary(k0.float(), pos, rope)
    pre = to_prerope(rotated, pos, rope, storage)
    assert pre.dtype == storage
    tol = 4e-3 if storage == torch.float16 else 3e-2
    torch.testing.assert_close(pre.double(), k0, rtol=tol, atol=tol * 4)
    r = rope.rotary_dim
    assert torch.equal(pre[..., r:], rotated[..., r:].to(storage))
    back = from_prerope(pre, pos, rope)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, apply_rotary(pre.float(), pos, rope), rtol=1e-5, atol=1e-5)


def test_prerope_rejects_bad_input() -> None:
    rope = RotaryConfig(head_dim=8)
    with pytest.raises(ValueError, match="positions"):
        to_prerope(torch.randn(1, 2, 8), torch.tensor([True, False]), rope)
    with pytest.raises(ValueError):
        to_prerope(torch.randn(1, 2, 6), torch.arange(2), rope)
    with pytest.raises(ValueError, match="float16"):
        to_prerope(torch.full((1, 2, 8), 1e6), torch.arange(2), rope)
