"""AutoHadamardValueCodec ("hadamard_auto"): per kv head, min-max or squared-error value
ranges, chosen at the head's first flush by the attention-weighted output error (kvlab issue
19)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kernel_checks import require_cpu_kernel

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.pnmix.hadamard import hadamard_matrix
from kvlab.pnmix.values import (
    AutoHadamardValueCodec,
    HadamardValueCodec,
    MSEHadamardValueCodec,
    attention_weighted_value_error,
    value_codec_from_name,
)
from kvlab.rope import RotaryConfig, apply_rotary

D = 64
GROUP, RESIDUAL = 16, 8
T = RESIDUAL + 2 * GROUP  # one prefill that flushes two groups per row
F16 = torch.float16


@pytest.fixture(autouse=True)
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)


def _config(key_coding: str = "per_token", value_coding: str = "hadamard_auto") -> PNMixConfig:
    return PNMixConfig(
        bits=2,
        sink_tokens=0,
        residual_tokens=RESIDUAL,
        group_tokens=GROUP,
        key_coding=key_coding,  # type: ignore[arg-type]
        value_coding=value_coding,  # type: ignore[arg-type]
    )


def _values(gen: torch.Generator, tokens: int = T) -> torch.Tensor:
    """``[1, 2, tokens, D]``: head 0 i.i.d. Gaussian (each token's clipping error points its own
    way: squared-error ranges win); head 1 a common offset along one Hadamard row plus unit
    noise (every token's rotated extreme sits in the same channel, so clipping biases every
    token alike and the biases add up under attention: min-max wins)."""
    v = torch.randn(1, 2, tokens, D, generator=gen)
    offset = 4.0 * hadamard_matrix(D, torch.float32)[5]
    v[0, 1] = offset + torch.randn(tokens, D, generator=gen)
    return v


def _cache(key_coding: str = "per_token", value_coding: str = "hadamard_auto") -> PNMixCache:
    rotary = RotaryConfig(D, D, 10000.0, "half", None) if key_coding == "bit_alloc" else None
    return PNMixCache(
        _config(key_coding, value_coding),
        batch_size=1,
        num_key_value_heads=2,
        head_dim=D,
        rotary=rotary,
    )


def _keys(gen: torch.Generator, tokens: int = T) -> torch.Tensor:
    rotary = RotaryConfig(D, D, 10000.0, "half", None)
    return apply_rotary(torch.randn(1, 2, tokens, D, generator=gen), torch.arange(tokens), rotary)


def _reference_errors(keys, values, queries) -> torch.Tensor:
    """float64 ``[H, 2]``: the rule restated — softmax over the prefill (scale 1/sqrt(D)), the
    last ``RESIDUAL`` queries of each GQA group, errors over the two groups' tokens."""
    codec = AutoHadamardValueCodec(2)
    h, rep = keys.shape[1], queries.shape[1] // keys.shape[1]
    out = torch.zeros(h, 2, dtype=torch.float64)
    for head in range(h):
        k = keys[0, head].to(F16).double()
        q = queries[0, head * rep : (head + 1) * rep, T - RESIDUAL :].double()
        logits = q @ k.T / math.sqrt(D)  # [rep, W, T]
        pos = torch.arange(T - RESIDUAL, T)
        logits = logits.masked_fill(torch.arange(T)[None, :] > pos[:, None], -math.inf)
        p = torch.softmax(logits, -1)[..., : 2 * GROUP].reshape(1, -1, 2 * GROUP)
        v = values[0, head, : 2 * GROUP].reshape(2, GROUP, D).to(F16)
        frame = codec.frame(v, F16).double().reshape(1, -1, D)
        for j, cand in enumerate((codec.minmax, codec.mse)):
            dec = cand.decode(*cand.encode(v, F16)).double().reshape(1, -1, D)
            out[head, j] = float(torch.einsum("nqt,ntd->nqd", p, dec - frame).pow(2).sum())
    return out


@pytest.mark.parametrize("key_coding", ["per_token", "bit_alloc"])
def test_each_head_picks_the_coding_that_wins_on_its_values(key_coding: str) -> None:
    gen = torch.Generator().manual_seed(0)
    keys, values = _keys(gen), _values(gen)
    queries = torch.randn(1, 4, T, D, generator=gen)
    cache = _cache(key_coding)
    assert cache.value_mse_rows is not None and not cache.value_mse_rows.any()
    cache.append(keys, values, queries=queries)
    want = _reference_errors(keys, values, queries)
    got = cache.value_choice_errors[0]
    assert torch.allclose(got, want, rtol=1e-9, atol=0), (got, want)
    # both codings win somewhere: squared-error ranges on the Gaussian head, min-max on the
    # offset head, whose per-token squared error still favours clipping
    assert want[0, 1] < want[0, 0] and want[1, 0] < want[1, 1]
    assert cache.value_mse_rows.tolist() == [[True, False]]
    mse_plain = MSEHadamardValueCodec(2)
    minmax = HadamardValueCodec(2)
    v1 = values[0, 1, : 2 * GROUP].reshape(2, GROUP, D).to(F16)
    err = {
        c.name: (c.decode(*c.encode(v1, F16)) - c.frame(v1, F16).float()).pow(2).sum()
        for c in (minmax, mse_plain)
    }
    assert err["hadamard_mse"] < err["hadamard"]  # why squared error alone misleads here
    # the stored bytes: each head's groups decode as its chosen codec codes them
    _, decoded = cache.dequantize()
    for head, codec in ((0, mse_plain), (1, minmax)):
        v = values[0, head, : 2 * GROUP].reshape(2, GROUP, D).to(F16)  # as stored
        expect = codec.output_transform(codec.decode(*codec.encode(v, F16)))
        diff = float((decoded[0, head, : 2 * GROUP] - expect.reshape(-1, D)).abs().max())
        assert diff <= 1e-5, diff
    # the same keys as a cache that codes every value min-max
    plain = _cache(key_coding, "hadamard")
    plain.append(keys, values, queries=queries)
    plain_keys, plain_values = plain.dequantize()
    assert torch.equal(cache.dequantize()[0], plain_keys)
    assert torch.equal(decoded[0, 1], plain_values[0, 1])


def test_later_flushes_follow_the_choice_and_without_queries_min_max() -> None:
    gen = torch.Generator().manual_seed(1)
    total = T + GROUP
    keys, values = _keys(gen, total), _values(gen, total)
    queries = torch.randn(1, 2, T, D, generator=gen)
    cache = _cache()
    cache.append(keys[:, :, :T], values[:, :, :T], queries=queries)
    assert cache.value_mse_rows.tolist() == [[True, False]]
    for i in range(T, total):  # decode steps: the third group flushes without queries
        cache.append(keys[:, :, i : i + 1], values[:, :, i : i + 1], checks="deferred")
    cache.check_values()
    _, decoded = cache.dequantize()
    third = values[0, :, 2 * GROUP : 3 * GROUP].to(F16)
    for head, codec in ((0, MSEHadamardValueCodec(2)), (1, HadamardValueCodec(2))):
        expect = codec.output_transform(codec.decode(*codec.encode(third[head][None], F16)))[0]
        diff = float((decoded[0, head, 2 * GROUP : 3 * GROUP] - expect).abs().max())
        assert diff <= 1e-5, diff
    no_queries = _cache()
    no_queries.append(keys[:, :, :T], values[:, :, :T])
    assert no_queries.value_mse_rows.tolist() == [[False, False]]
    assert bool(no_queries.value_choice_errors.isnan().all())


def test_the_choice_is_counted_one_byte_per_kv_head() -> None:
    gen = torch.Generator().manual_seed(2)
    keys, values = _keys(gen), _values(gen)
    queries = torch.randn(1, 2, T, D, generator=gen)
    auto, plain = _cache(), _cache(value_coding="hadamard")
    auto.append(keys[:, :, :RESIDUAL], values[:, :, :RESIDUAL], queries=queries[:, :, :RESIDUAL])
    assert auto.nbytes()["value_choice"] == 0  # nothing flushed yet
    auto.append(keys[:, :, RESIDUAL:], values[:, :, RESIDUAL:], queries=queries[:, :, RESIDUAL:])
    plain.append(keys, values)
    got, base = auto.nbytes(), plain.nbytes()
    assert "value_choice" not in base
    assert got.pop("value_choice") == 2 and got == base
    assert auto.value_bytes == plain.value_bytes + 2
    # beams: row selection carries the choice and its bytes
    auto.select_batch(torch.tensor([0, 0]))
    assert auto.nbytes()["value_choice"] == 4
    assert auto.value_mse_rows.shape == (2, 2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_packed_attention_equals_the_float64_reference_for_both_codings(backend: str) -> None:
    if backend == "cpu":
        require_cpu_kernel()
    gen = torch.Generator().manual_seed(3)
    keys, values = _keys(gen), _values(gen)
    cache = _cache("bit_alloc")
    cache.append(keys, values, queries=torch.randn(1, 4, T, D, generator=gen))
    assert cache.value_mse_rows.tolist() == [[True, False]]  # one head per coding
    query = torch.randn(1, 4, 3, D, generator=gen)
    out = pnmix_attention(query, cache, backend=backend)
    k, v = (x.double() for x in cache.dequantize())
    q = query.double().reshape(1, 2, 2, 3, D)
    logits = torch.einsum("bhrqd,bhtd->bhrqt", q, k) / math.sqrt(D)
    pos = torch.arange(T - 3, T)
    logits = logits.masked_fill(torch.arange(T) > pos[:, None], -math.inf)
    ref = torch.einsum("bhrqt,bhtd->bhrqd", torch.softmax(logits, -1), v).reshape(1, 4, 3, D)
    err = float((out.double() - ref).abs().max())
    assert err <= 1e-5 * float(v.abs().max()), err


def test_named_configured_and_the_error_formula() -> None:
    codec = value_codec_from_name("hadamard_auto", 2)
    assert isinstance(codec, AutoHadamardValueCodec) and codec.transforms_output
    assert PNMixConfig(bits=2, value_coding="hadamard_auto").value_codec == codec
    assert codec.minmax == HadamardValueCodec(2) and codec.mse == MSEHadamardValueCodec(2)
    with pytest.raises(ValueError, match="power-of-two"):
        _ = PNMixCache(_config(), batch_size=1, num_key_value_heads=1, head_dim=48)
    # Σ_q ||Σ_t p_qt e_t||² on a hand-sized case
    probs = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    values = torch.zeros(1, 2, 2)
    decoded = torch.tensor([[[1.0, 0.0], [-1.0, 2.0]]])
    got = attention_weighted_value_error(probs, values, decoded, F16)
    assert got.tolist() == [0.0**2 + 1.0**2 + 1.0**2 + 0.0**2]
    assert np.isclose(float(got), 2.0)


def test_a_padded_row_chooses_as_it_would_alone() -> None:
    """Left padding is neither a key of the softmax nor a query: each row's errors equal those
    of a batch of that row alone (and so does an eviction's longer query list, query_lengths)."""
    gen = torch.Generator().manual_seed(4)
    extra = 5
    keys = torch.cat([_keys(gen, T + extra), _keys(gen, T + extra)])
    values = torch.cat([_values(gen, T + extra), _values(gen, T + extra)])
    queries = torch.randn(2, 4, T + extra, D, generator=gen)
    batch = PNMixCache(_config(), batch_size=2, num_key_value_heads=2, head_dim=D)
    batch.append(keys, values, [T + extra, T], queries=queries)
    for row, length in ((0, T + extra), (1, T)):
        alone = _cache()
        first = T + extra - length
        alone.append(
            keys[row : row + 1, :, first:],
            values[row : row + 1, :, first:],
            queries=queries[row : row + 1, :, first:],
        )
        got, want = batch.value_choice_errors[row], alone.value_choice_errors[0]
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (got, want)  # float64 sums
        assert batch.value_mse_rows[row].tolist() == alone.value_mse_rows[0].tolist()
    # an eviction's case: more queries than kept tokens, the last query_lengths[b] real
    kept = _cache()
    kept.append(
        keys[:1, :, extra:], values[:1, :, extra:], queries=queries[:1], query_lengths=[T + extra]
    )
    assert bool(torch.isfinite(kept.value_choice_errors).all())
    assert kept.nbytes()["value_choice"] == 2
