"""RelayModelCache inside transformers models: eviction, RoPE-Relay, positions, bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention

SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "rope_theta": 10000.0,
    },
}


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _capture_raw_kv(model):
    """Hooks that record each layer's raw (pre-RoPE) k_proj / v_proj outputs [B, H, S, D]."""
    records: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    heads = model.config.num_key_value_heads
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        dim = attn.head_dim

        def hook(name, index, dim=dim):
            def fn(module, args, output):
                b, s, _ = output.shape
                records.setdefault(index, {})[name] = (
                    output.view(b, s, heads, dim).transpose(1, 2).detach().clone()
                )

            return fn

        if hasattr(attn, "k_proj"):
            handles.append(attn.k_proj.register_forward_hook(hook("k", i)))
            handles.append(attn.v_proj.register_forward_hook(hook("v", i)))
        else:  # Phi-3: fused qkv_proj
            q_size = model.config.num_attention_heads * dim
            kv_size = heads * dim

            def fused(module, args, output, index=i, q_size=q_size, kv_size=kv_size, dim=dim):
                b, s, _ = output.shape
                k = output[..., q_size : q_size + kv_size]
                v = output[..., q_size + kv_size :]
                records.setdefault(index, {})["k"] = k.reshape(b, s, heads, dim).transpose(1, 2)
                records.setdefault(index, {})["v"] = v.reshape(b, s, heads, dim).transpose(1, 2)

            handles.append(attn.qkv_proj.register_forward_hook(fused))
    return records, handles


def _hf_rotate(model, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Raw keys [B, S, D] rotated at positions [B, S] with the model's own HF rotary embedding
    (inverse frequencies and attention scaling from transformers) and rotary function."""
    module = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    cos, sin = model.model.rotary_emb(raw, position_ids=positions)
    x = raw.unsqueeze(1)
    rotated, _ = module.apply_rotary_pos_emb(x, x, cos, sin)
    return rotated.squeeze(1)


def _models(make_llama, make_phi3_partial):
    return {
        "phi3-partial": make_phi3_partial(seed=11),
        "llama3-scaling": make_llama(seed=12, rope_parameters=SCALINGS["llama3"]),
        "yarn-scaling": make_llama(seed=13, rope_parameters=SCALINGS["yarn"]),
    }


@pytest.mark.parametrize("which", ["phi3-partial", "llama3-scaling", "yarn-scaling"])
@pytest.mark.parametrize("scorer", ["recency", "keynorm", "snapkv"])
def test_relayed_keys_match_direct_rotation_and_logits_match_reference(
    make_llama, make_phi3_partial, which, scorer
):
    model = _models(make_llama, make_phi3_partial)[which]
    ids = _ids(2, 72, seed=21)
    prefill = 64
    cache = RelayModelCache(
        model.config,
        EvictionConfig(ratio=0.5, scorer=scorer, allocation="uniform", window_tokens=16),
    )
    records, handles = _capture_raw_kv(model)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids[:, :prefill], cache=cache)
    for handle in handles:
        handle.remove()
    endpoint = prefill - 1  # slots = tokens at eviction
    assert cache.next_position == endpoint + 1
    reference = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        raw_k, raw_v = records[i]["k"], records[i]["v"]
        keys, values = [], []
        for h in range(model.config.num_key_value_heads):
            segments = [layer.segment(b, h) for b in range(2)]
            orig = torch.stack([seg.original_positions for seg in segments])  # [B, k]
            assert torch.equal(orig, orig.sort(-1).values)  # stream order kept
            k = orig.shape[1]
            new_pos = torch.arange(endpoint - k + 1, endpoint + 1).expand_as(orig)
            assert torch.equal(torch.stack([seg.rotary_positions for seg in segments]), new_pos)
            stored_k = torch.stack([seg.keys for seg in segments])
            stored_v = torch.stack([seg.values for seg in segments])
            raw_kh = raw_k[:, h].gather(1, orig.unsqueeze(-1).expand(-1, -1, raw_k.shape[-1]))
            raw_vh = raw_v[:, h].gather(1, orig.unsqueeze(-1).expand(-1, -1, raw_v.shape[-1]))
            expected = _hf_rotate(model, raw_kh, new_pos)
            torch.testing.assert_close(stored_k, expected, atol=2e-5, rtol=1e-5)
            rotary = cache.rotary.rotary_dim
            assert torch.equal(stored_k[..., rotary:], raw_kh[..., rotary:])
            assert torch.equal(stored_v, raw_vh)
            keys.append(expected)
            values.append(raw_vh)
        reference.update(torch.stack(keys, 1), torch.stack(values, 1), i)
    # the next token at the synchronized position: relay cache vs a dense reference cache
    with torch.no_grad():
        position = torch.full((2, 1), endpoint + 1)
        expected_logits = model(
            ids[:, prefill : prefill + 1], cache=reference, position_ids=position
        ).logits
        with use_attention(model, KVLAB_ATTENTION):
            logits = model(ids[:, prefill : prefill + 1], cache=cache).logits
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    if which == "phi3-partial":
        assert cache.rotary.rotary_dim == 8 < cache.rotary.head_dim == 16


@pytest.mark.parametrize("scorer", ["recency", "keynorm", "snapkv"])
@pytest.mark.parametrize("relay", [True, False])
def test_keep_all_equals_the_full_cache(make_llama, scorer, relay):
    model = make_llama(seed=14)
    ids = _ids(1, 90, seed=22)
    with torch.no_grad():
        reference = model(ids).logits
        cache = RelayModelCache(model.config, EvictionConfig(ratio=0.0, scorer=scorer, relay=relay))
        with use_attention(model, KVLAB_ATTENTION):
            out = [model(ids[:, :70], cache=cache).logits]
            out += [model(ids[:, t : t + 1], cache=cache).logits for t in range(70, 90)]
    assert len(cache.events()) == model.config.num_hidden_layers  # eviction ran, kept all
    torch.testing.assert_close(torch.cat(out, 1), reference, atol=1e-5, rtol=1e-4)


@settings(max_examples=12, deadline=None)
@given(
    ratio=st.sampled_from([0.25, 0.5, 0.75]),
    prefill=st.sampled_from([48, 64, 80]),
    scorer=st.sampled_from(["recency", "keynorm", "snapkv"]),
)
def test_bytes_shrink_by_the_evicted_fraction(ratio, prefill, scorer):
    from tiny_models import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(15)
    config = tiny_llama_config(pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    ids = _ids(2, prefill, seed=23)
    full = DynamicCache(config=config)
    eviction = EvictionConfig(ratio=ratio, scorer=scorer, sink_tokens=2, window_tokens=8)
    cache = RelayModelCache(config, eviction)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        model(ids, cache=full)
        with use_attention(model, KVLAB_ATTENTION):
            model(ids, cache=cache)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    kept = round((1 - ratio) * prefill)
    assert kept * 4 == (1 - ratio) * prefill * 4  # these sizes evict an exact fraction
    assert cache.nbytes() * prefill == full_bytes * kept
    used = sum(sum(layer.tokens_per_head(row)) for layer in cache.layers for row in range(2))
    # stream index + rotary position, int64 each, and the float32 key_bias element
    assert cache.index_bytes() == used * (16 + 4)
    assert cache.nbytes() <= cache.reserved_bytes()  # headroom is reported, not counted
    for layer in cache.layers:
        for row in range(2):  # each sequence of the batch has its own per-head counts
            counts = layer.tokens_per_head(row)
            assert sum(counts) == kept * 2  # the layer budget, split over 2 kv heads
            assert all(10 <= k <= prefill for k in counts)  # sinks + window kept, cap respected
            for h in range(2):
                kept_positions = set(layer.segment(row, h).original_positions.tolist())
                assert {0, 1} <= kept_positions  # sinks
                assert set(range(prefill - 8, prefill)) <= kept_positions  # recent window
                assert len(kept_positions) == counts[h]


def test_generate_with_relay_equals_a_manual_loop(make_llama):
    model = make_llama(seed=16)
    model.generation_config.eos_token_id = None
    prompt = _ids(1, 80, seed=24)
    # 48 slots: the endpoint (47) is far below generate's positions (80, 81, ...)
    config = EvictionConfig(ratio=0.5, scorer="snapkv", max_head_tokens=48)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        generated = model.generate(
            prompt, max_new_tokens=12, do_sample=False, cache=RelayModelCache(model.config, config)
        )
        cache = RelayModelCache(model.config, config)
        logits = model(prompt, cache=cache).logits[:, -1]
        tokens = []
        for _ in range(12):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            logits = model(token, cache=cache).logits[:, -1]
    # generate feeds original positions (80, 81, ...); the cache re-rotates them to 48, 49, ...
    assert torch.equal(generated[:, 80:], torch.cat(tokens, 1))
    assert cache.next_position == 48 + 12 and cache.stream_length == 80 + 12


@pytest.mark.parametrize("relay", [True, False])
def test_streaming_positions_stay_inside_the_cache_only_with_relay(make_llama, relay):
    model = make_llama(seed=17)
    ids = _ids(1, 400, seed=25)
    capacity, chunk = 48, 32
    cache = RelayModelCache(
        model.config, EvictionConfig(capacity=capacity, scorer="snapkv", relay=relay)
    )
    highest = 0
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        for start in range(0, 400, chunk):
            model(ids[:, start : start + chunk], cache=cache)
            highest = max(highest, cache.next_position)
            for layer in cache.layers:
                assert sum(layer.tokens_per_head()) <= (capacity + chunk) * 2
    assert cache.stream_length == 400
    if relay:
        assert highest <= 2 * capacity + chunk  # slots + one chunk
    else:
        assert cache.next_position == 400
    assert all(len(layer.events) > 5 for layer in cache.layers)


def test_eviction_config_is_validated():
    with pytest.raises(ValueError, match="exactly one"):
        EvictionConfig()
    with pytest.raises(ValueError, match="ratio"):
        EvictionConfig(ratio=1.0)
    with pytest.raises(ValueError, match="sink_tokens"):
        EvictionConfig(capacity=10)
    with pytest.raises(ValueError, match="scorer"):
        EvictionConfig(ratio=0.5, scorer="oracle")
