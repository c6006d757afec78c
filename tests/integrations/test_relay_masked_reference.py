"""Correctness reference for eviction (issue 9): eager attention over the FULL cache, with a
per-(layer, kv head) mask hiding exactly the tokens the eviction cache reports as evicted, at
their original positions, gives the logits of ``evict-no-relay`` (RelayModelCache with
``relay=False``) to float32 rounding.

The reference shares nothing with the cache but the kept-token sets it reports
(``layer.segment(0, h).original_positions`` after every forward): keys and values come from a
``transformers`` ``DynamicCache``, attention is a plain float32 softmax written here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention

REFERENCE = "kvlab_masked_reference"
#: layer index -> bool [H_kv, K]: which cached tokens each kv head may see in this forward
VISIBLE: dict[int, torch.Tensor] = {}


def masked_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """float32 softmax attention, causal, GQA, with the per-head visibility mask."""
    _, q_heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    visible = VISIBLE[module.layer_idx]  # [H_kv, K]
    allowed = visible.repeat_interleave(group, 0).view(1, q_heads, 1, k_len)
    rows = torch.arange(q_len).view(-1, 1) + (k_len - q_len)
    allowed = allowed & (torch.arange(k_len).view(1, -1) <= rows)
    k = key.repeat_interleave(group, 1).float()
    v = value.repeat_interleave(group, 1).float()
    logits = (query.float() @ k.transpose(-1, -2)) * scaling
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), None


def _kept_sets(cache: RelayModelCache) -> list[list[torch.Tensor]]:
    return [
        [layer.segment(0, h).original_positions.clone() for h in range(layer.store.heads)]
        for layer in cache.layers
    ]


def _forwards(mode: str, ids: torch.Tensor) -> list[torch.Tensor]:
    """The token chunks fed one forward each: a prefill then single tokens (ratio), or chunks
    of 16 then single tokens (capacity, streaming)."""
    if mode == "ratio":
        return [ids[:, :64]] + [ids[:, t : t + 1] for t in range(64, 84)]
    return [ids[:, s : s + 16] for s in range(0, 128, 16)] + [
        ids[:, t : t + 1] for t in range(128, 140)
    ]


@pytest.mark.parametrize("scorer", ["recency", "keynorm", "snapkv", "expected-attention", "tova"])
@pytest.mark.parametrize("mode", ["ratio", "capacity"])
def test_evict_no_relay_equals_full_attention_with_evicted_tokens_masked(make_llama, scorer, mode):
    AttentionInterface.register(REFERENCE, masked_eager_attention)
    model = make_llama(seed=61)  # 4 query heads on 2 kv heads: GQA
    ids = torch.randint(3, 96, (1, 140), generator=torch.Generator().manual_seed(62))
    if mode == "ratio":
        config = EvictionConfig(
            ratio=0.5, scorer=scorer, relay=False, sink_tokens=2, window_tokens=8
        )
    else:
        config = EvictionConfig(
            capacity=24, scorer=scorer, relay=False, sink_tokens=2, window_tokens=8
        )
    chunks = _forwards(mode, ids)
    cache = RelayModelCache(model.config, config)
    logits, kept_after = [], []
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        for chunk in chunks:
            logits.append(model(chunk, cache=cache).logits)
            kept_after.append(_kept_sets(cache))
    assert cache.events()  # it evicted

    reference = DynamicCache(config=model.config)
    full = DynamicCache(config=model.config)
    heads = model.config.num_key_value_heads
    seen = 0
    worst_unmasked = 0.0
    with torch.no_grad():
        for f, chunk in enumerate(chunks):
            total = seen + chunk.shape[1]
            for layer in range(model.config.num_hidden_layers):
                visible = torch.zeros(heads, total, dtype=torch.bool)
                visible[:, seen:] = True  # this forward's own tokens
                if f:
                    for h, kept in enumerate(kept_after[f - 1][layer]):
                        visible[h, kept] = True
                VISIBLE[layer] = visible
            with use_attention(model, REFERENCE):
                expected = model(chunk, cache=reference).logits
            with use_attention(model, "sdpa"):
                unmasked = model(chunk, cache=full).logits
            torch.testing.assert_close(logits[f], expected, atol=5e-6, rtol=0)
            worst_unmasked = max(worst_unmasked, float((unmasked - logits[f]).abs().max()))
            seen = total
    assert worst_unmasked > 1e-2  # the eviction matters: the test can fail
