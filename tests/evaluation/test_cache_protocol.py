"""The kvlab cache protocol (kvlab.integrations.cache_protocol.KVLabCache): every cache kvlab eval
runs satisfies it (kvlab's own, transformers' through evaluation.foreign_cache.describe), and
what evaluation reads through it is the byte model (docs/design.md, "Byte accounting"), pinned on
caches of known shape: tiny Llama, 2 layers, 2 kv heads, head_dim 16, float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import FAMILIES, tiny_llama_config
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import Cache, QuantizedLayer

from kvlab.evaluation.foreign_cache import ForeignCache, describe
from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.metrics import CacheStorage as MetricsCacheStorage
from kvlab.evaluation.metrics import cache_storage
from kvlab.evaluation.protocols import cache_details, position_kwargs, rope_position_of
from kvlab.integrations import use_attention
from kvlab.integrations.cache_protocol import CacheStorage, KVLabCache
from kvlab.pnmix.kernels import cpu as pnmix_cpu

LAYERS, KV_HEADS, HEAD_DIM, F32 = 2, 2, 16, 4
TOKEN_KV = 2 * HEAD_DIM  # key + value elements of one token in one kv head


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512)).eval()


def _ids(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _feed(model, cache, attention: str, chunks: list[int]) -> None:
    """Forward ``chunks`` of random tokens through ``cache`` as kvlab eval does (the cache's own
    positions where it keeps them)."""
    ids = _ids(sum(chunks))
    start = 0
    with torch.no_grad(), use_attention(model, attention):
        for size in chunks:
            piece = ids[start : start + size].view(1, -1)
            model(piece, cache=cache, use_cache=True, **position_kwargs(cache, size))
            start += size


def test_every_cache_kind_satisfies_the_protocol():
    config = tiny_llama_config()
    prepared = {"layer_fractions": [0.75, 1.25]}
    for spec, protocol, prep in [
        ("pn-mix", "prefill-score", None),
        ("relay@0.5", "prefill-score", prepared),
        ("streaming-llm@0.5", "stream", None),
        ("evict-no-relay:keynorm@0.25+kivi-2bit", "prefill-score", None),
    ]:
        cache = parse_method(spec, protocol=protocol, cache_slots=96).make_cache(config, prep)
        assert isinstance(cache, KVLabCache), spec
        assert describe(cache) is cache  # kvlab's caches answer for themselves
    full = parse_method("full").make_cache(config)
    assert not isinstance(full, KVLabCache)
    view = describe(full)
    assert isinstance(view, ForeignCache) and isinstance(view, KVLabCache)
    assert MetricsCacheStorage is CacheStorage  # its old import path still works


def used(storage: CacheStorage) -> CacheStorage:
    """``storage`` without its held bytes and per-layer-kind split (the used counts the byte
    model pins), after checking that the split adds up to the totals."""
    kinds = storage.layer_kinds
    assert kinds is not None
    assert sum(k["kv_bytes"] for k in kinds.values()) == storage.kv_bytes
    assert sum(k["kv_bytes_16bit"] for k in kinds.values()) == storage.kv_bytes_16bit
    return dataclasses.replace(storage, held_bytes=None, layer_kinds=None)


def test_dynamic_cache_of_known_shape():
    cache = DynamicCache(config=tiny_llama_config())
    assert used(cache_storage(cache)) == CacheStorage(0, 0, 0)
    k = torch.randn(1, KV_HEADS, 10, HEAD_DIM)
    for layer in range(LAYERS):
        cache.update(k, k.clone(), layer)
    # 2 (K, V) * layers * heads * tokens * head_dim * 4 bytes
    assert used(cache_storage(cache)) == CacheStorage(
        2 * 2 * 2 * 10 * 16 * 4, 2 * 2 * 2 * 10 * 16 * 2, 0
    )
    assert cache_details(cache) == {}
    assert position_kwargs(cache, 3) == {}
    assert rope_position_of(cache) == 10
    assert describe(cache).position_ids(3).tolist() == [[10, 11, 12]]


class _Int8Layer(QuantizedLayer):
    """The QuantizedCache layer kind with int8 rounding (quanto and hqq need not be installed)."""

    def _quantize(self, tensor, axis):
        return (tensor * 16).round().clamp(-127, 127).to(torch.int8)

    def _dequantize(self, q):
        return q.float() / 16


def test_quantized_layers_count_codes_and_the_exact_residual(llama):
    cache = Cache(layers=[_Int8Layer(residual_length=128) for _ in range(LAYERS)])
    _feed(llama, cache, "sdpa", [40])
    # the prefill is quantized (int8, 1 byte an element, counted as stored); no residual yet
    codes = LAYERS * KV_HEADS * 40 * TOKEN_KV
    assert used(cache_storage(cache)) == CacheStorage(codes, codes, 0)
    _feed(llama, cache, "sdpa", [1, 1])
    residual = LAYERS * KV_HEADS * 2 * TOKEN_KV  # 2 exact float32 tokens per layer and head
    assert used(cache_storage(cache)) == CacheStorage(
        codes + residual * F32, codes + residual * 2, 0
    )
    assert cache_details(cache) == {} and rope_position_of(cache) == 42


def test_a_foreign_layer_of_another_kind_is_refused():
    class Odd:
        layers = (object(),)

        def get_seq_length(self) -> int:
            return 5

    with pytest.raises(TypeError, match="cannot measure cache layer object"):
        cache_storage(Odd())
    assert cache_details(Odd()) == {} and rope_position_of(Odd()) == 5


def test_pnmix_cache_before_its_first_group(llama):
    cache = parse_method("pn-mix").make_cache(llama.config)
    assert used(cache_storage(cache)) == CacheStorage(0, 0, 0)
    _feed(llama, cache, "kvlab", [20, 1])
    # 21 tokens < 32 sinks: all exact, float16: tokens * (K + V) * head_dim * 2 bytes, in both
    exact = LAYERS * KV_HEADS * 21 * TOKEN_KV * 2
    assert cache.storage() == cache_storage(cache)
    assert used(cache.storage()) == CacheStorage(exact, exact, 0)
    assert exact == cache.nbytes()
    # the prefill attends exactly; the decode step reads the packed storage once per layer, on
    # the compiled CPU kernel where it is built
    ran = "cpu" if pnmix_cpu.load() is not None else "torch"
    assert cache_details(cache) == {
        "packed_attention_calls": LAYERS,
        "packed_attention_backends": {ran: LAYERS},
    }
    assert position_kwargs(cache, 1) == {}
    assert rope_position_of(cache) == 21
    assert cache.position_ids(2).tolist() == [[21, 22]]


def test_relay_cache_after_its_prefill_eviction(llama):
    # streaming-llm keeps by recency: half of the 94-token prefill per (layer, kv head), 47
    # tokens (the eviction's count, whatever the weights)
    cache = parse_method("streaming-llm@0.5").make_cache(llama.config)
    _feed(llama, cache, "kvlab", [94])
    stored = LAYERS * KV_HEADS * 47
    # used elements only (headroom excluded), index: two int64 positions and a float32
    # key_bias element per stored token
    expected = CacheStorage(stored * TOKEN_KV * F32, stored * TOKEN_KV * 2, stored * (16 + F32))
    assert cache_storage(cache) == cache.storage()
    assert used(cache.storage()) == expected == CacheStorage(24064, 12032, 3760)
    assert cache_details(cache) == {
        "evictions": 2,
        "next_position": 94,
        "stream_length": 94,
        "first_eviction_tokens_per_head": [[47, 47], [47, 47]],
        "prompt_forwards": [1],
    }
    assert list(cache_details(cache)) == [  # the artifact's key order
        "evictions",
        "next_position",
        "stream_length",
        "first_eviction_tokens_per_head",
        "prompt_forwards",
    ]
    kwargs = position_kwargs(cache, 2)
    assert list(kwargs) == ["position_ids"] and kwargs["position_ids"].tolist() == [[94, 95]]
    assert rope_position_of(cache) == 94


def test_relay_stream_positions_are_the_caches_own(llama):
    # capacity mode (stream protocol, 96 slots at R = 0.5: 48 tokens per kv head): RoPE-Relay
    # synchronizes the positions, so the next position is not the tokens seen
    cache = parse_method("streaming-llm@0.5", protocol="stream", cache_slots=96).make_cache(
        llama.config
    )
    _feed(llama, cache, "kvlab", [16] * 8 + [1] * 5)
    details = cache_details(cache)
    assert details["stream_length"] == 133 and details["next_position"] == rope_position_of(cache)
    assert rope_position_of(cache) < 133
    positions = position_kwargs(cache, 1)["position_ids"]
    assert positions.tolist() == [[rope_position_of(cache)]]
    stored = sum(sum(layer.tokens_per_head(0)) for layer in cache.layers)
    assert used(cache_storage(cache)) == CacheStorage(
        stored * TOKEN_KV * F32, stored * TOKEN_KV * 2, stored * (16 + F32)
    )


def test_details_name_the_torch_reference_when_it_attends(llama, monkeypatch):
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "torch")
    cache = parse_method("pn-mix").make_cache(llama.config)
    _feed(llama, cache, "kvlab", [20, 1, 1])
    assert cache_details(cache)["packed_attention_backends"] == {"torch": 2 * LAYERS}


def test_composed_cache_reports_eviction_and_packed_storage(llama):
    # 24-token prefill, half evicted: each kept stream is below pn-mix-lean's 4 sinks + 8
    # residual + one 32-token group, so every kept token is exact float16
    cache = parse_method("evict-no-relay:keynorm@0.5+pn-mix-lean").make_cache(llama.config)
    _feed(llama, cache, "kvlab", [24, 1])
    stored = sum(sum(layer.tokens_per_head(0)) for layer in cache.layers)
    assert 0 < stored < LAYERS * KV_HEADS * 25
    exact = stored * TOKEN_KV * 2
    assert cache_storage(cache) == cache.storage()
    assert used(cache.storage()) == CacheStorage(exact, exact, 0)
    details = cache_details(cache)
    assert list(details) == [
        "evictions",
        "next_position",
        "stream_length",
        "first_eviction_tokens_per_head",
        "prompt_forwards",
        "packed_attention_calls",
        "packed_attention_backends",
    ]
    assert details["evictions"] == LAYERS and details["packed_attention_calls"] == LAYERS
    assert sum(details["packed_attention_backends"].values()) == LAYERS
    assert details["next_position"] == details["stream_length"] == 25
    assert position_kwargs(cache, 1)["position_ids"].tolist() == [[25]]


def test_window_layers_count_as_held():
    # Gemma 3 (sliding, full, sliding; window 6): a window layer holds its last 5 tokens exactly
    # (float32), the full-attention layer evicts
    model = FAMILIES["gemma3"].build(seed=0)
    cache = parse_method("evict-no-relay:keynorm@0.25").make_cache(model.config)
    _feed(model, cache, "kvlab", [94])
    stored = sum(cache.layers[1].tokens_per_head(0))
    window = 2 * KV_HEADS * 5 * TOKEN_KV  # elements of the two window layers
    assert used(cache_storage(cache)) == CacheStorage(
        stored * TOKEN_KV * F32 + window * F32,
        stored * TOKEN_KV * 2 + window * 2,
        stored * (16 + F32),
    )
    pnmix = parse_method("pn-mix").make_cache(model.config)
    _feed(model, pnmix, "kvlab", [20])
    # the PN-Mix layer: 20 exact float16 tokens; the window layers as held (float32)
    exact = KV_HEADS * 20 * TOKEN_KV * 2
    assert used(cache_storage(pnmix)) == CacheStorage(exact + window * F32, exact + window * 2, 0)


def test_held_bytes_count_every_buffer_the_process_holds(llama):
    """``held_bytes``: a DynamicCache holds exactly its tensors; a relay cache every buffer of
    its stores (keys, values, positions, key_bias, headroom included), more than it uses; a
    PN-Mix cache its stores' allocation, spare slots included."""
    dynamic = DynamicCache(config=tiny_llama_config())
    k = torch.randn(1, KV_HEADS, 10, HEAD_DIM)
    for layer in range(LAYERS):
        dynamic.update(k, k.clone(), layer)
    assert cache_storage(dynamic).held_bytes == cache_storage(dynamic).kv_bytes
    relay = parse_method("streaming-llm@0.5").make_cache(llama.config)
    _feed(llama, relay, "kvlab", [94])
    buffers = [
        t
        for layer in relay.layers
        for t in (layer.store.keys, layer.store.values, layer.store.original_positions,
                  layer.store.rotary_positions, layer.store.key_bias)
    ]  # fmt: skip
    storage = relay.storage()
    assert storage.held_bytes == sum(t.numel() * t.element_size() for t in buffers)
    assert storage.held_bytes > storage.kv_bytes + storage.index_bytes
    pnmix = parse_method("pn-mix").make_cache(llama.config)
    _feed(llama, pnmix, "kvlab", [70, 1])
    reserved = sum(sum(layer.store.reserved_bytes().values()) for layer in pnmix.layers)
    assert pnmix.storage().held_bytes == reserved >= pnmix.storage().kv_bytes
