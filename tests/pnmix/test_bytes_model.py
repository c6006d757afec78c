"""The decode bytes model (kvlab.pnmix.kernels.bytes_model) against what a filled PNMixCache
stores (docs/benchmarks.md, "Decode bytes model")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab.pnmix import PNMixCache, PNMixConfig
from kvlab.pnmix.kernels.bytes_model import (
    CODINGS,
    ModelStepBytes,
    decode_bytes,
    decode_weight_bytes,
    dense_cache_bytes,
    pnmix_table_bytes,
    sdpa_fp16_bytes,
    token_split,
)
from kvlab.rope import RotaryConfig, apply_rotary

# (coding name, PNMixConfig keyword arguments of the same coding)
CASES = [
    ("seed", dict()),
    (
        "pn-mix",
        dict(
            bits=2,
            key_coding="bit_alloc",
            key_outlier_fraction=0.01,
            value_coding="hadamard",
        ),
    ),
    ("kivi-2bit", dict(bits=2, key_coding="cartesian")),
]


def filled_cache(kwargs: dict[str, object], tokens: int, group: int) -> PNMixCache:
    b, h, hq, d = 2, 2, 4, 32
    rotary = RotaryConfig(d, d, 10000.0, "half")
    cfg = PNMixConfig(sink_tokens=3, residual_tokens=5, group_tokens=group, **kwargs)  # type: ignore[arg-type]
    cache = PNMixCache(
        cfg,
        batch_size=b,
        num_key_value_heads=h,
        head_dim=d,
        rotary=rotary if cfg.key_codec.position_aware else None,
    )
    gen = torch.Generator().manual_seed(tokens)
    keys = apply_rotary(torch.randn(b, h, tokens, d, generator=gen), torch.arange(tokens), rotary)
    values = torch.randn(b, h, tokens, d, generator=gen)
    queries = torch.randn(b, hq, tokens, d, generator=gen)
    cache.append(keys, values, queries=queries)
    return cache


@pytest.mark.parametrize(("name", "kwargs"), CASES)
@pytest.mark.parametrize(("tokens", "group"), [(70, 8), (37, 16), (6, 8)])
def test_bytes_model_equals_the_stored_bytes(
    name: str, kwargs: dict[str, object], tokens: int, group: int
) -> None:
    """Codes, scalars, table, outliers and exact tokens: the model's closed form equals the
    cache's own accounting (``nbytes()``) component for component."""
    cache = filled_cache(kwargs, tokens, group)
    coding = dataclasses.replace(
        CODINGS[name], group_tokens=group, sink_tokens=3, residual_tokens=5
    )
    model = decode_bytes(coding, batch=2, kv_heads=2, query_heads=4, head_dim=32, tokens=tokens)
    stored = cache.nbytes()
    assert model.key_codes == stored["key_codes"]
    assert model.value_codes == stored["value_codes"]
    assert model.key_scalars == stored["key_scales"]
    assert model.value_scalars == stored["value_scales"]
    assert model.tables == stored["key_mask"]
    assert model.outliers == stored.get("key_payload", 0)
    exact = sum(stored[k] for k in ("key_sink", "key_residual", "value_sink", "value_residual"))
    assert model.exact == exact
    assert model.cache == cache.persistent_bytes
    s, g, r = token_split(tokens, coding)
    assert (s, g, r) == (
        int(cache.store.sink_lengths[0, 0]),
        int(cache.store.group_counts[0, 0]),
        int(cache.store.residual_lengths[0, 0]),
    )


def test_bytes_model_at_64k() -> None:
    """The seed layout at 64K x batch 8 (SmolLM2 shape) reads ~1/6.8 of float16 SDPA's."""
    fp16 = sdpa_fp16_bytes(8, 3, 64, 65536)
    assert fp16 == 2 * 8 * 3 * 65536 * 64 * 2
    seed = decode_bytes("seed", batch=8, kv_heads=3, query_heads=9, head_dim=64, tokens=65536)
    assert seed.key_codes == 24 * 511 * 2048 and seed.value_codes == seed.key_codes
    assert 6 < fp16 / seed.cache < 7
    with pytest.raises(ValueError):
        decode_bytes("nope", batch=1, kv_heads=1, query_heads=1, head_dim=8, tokens=1)


def test_whole_model_step_bytes() -> None:
    """Weights (the input embedding by its rows unless tied), the exact cache, the kernel's
    tables, and the speed-up the totals allow."""
    params = [
        ("embed.weight", (100, 8), 4),
        ("layer.weight", (8, 8), 4),
        ("head.weight", (100, 8), 4),
    ]
    assert decode_weight_bytes(params, 3, "embed.weight") == (3 * 8 + 64 + 800) * 4
    tied = [params[0], params[1]]
    assert decode_weight_bytes(tied, 3, "embed.weight", tied=True) == (800 + 64) * 4
    with pytest.raises(ValueError, match="no parameter named"):
        decode_weight_bytes(params, 1, "wte.weight")
    assert dense_cache_bytes(24, 8, 2, 32768, 64) == 24 * 8 * 2 * 32768 * 128 * 4
    assert dense_cache_bytes(2, 1, 1, 10, 16, 8, element_size=2) == 2 * 10 * 24 * 2
    assert pnmix_table_bytes(24, 1000, 64, 64, prerope=True, hadamard_values=True) == 24 * (
        1000 * 32 * 2 * 4 + 64 * 64 * 4
    )
    assert pnmix_table_bytes(3, 1000, 64, 64, prerope=False, hadamard_values=False) == 0
    full = ModelStepBytes(weights=1000, cache=1000)
    packed = ModelStepBytes(weights=1000, cache=100, tables=100)
    assert full.total == 2000 and packed.total == 1200
    assert packed.limit_over(full) == pytest.approx(2000 / 1200)
