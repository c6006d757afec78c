"""KVzip inside RelayModelCache: the reconstruction pass's scores against a float64 eager
reference, the eviction they drive, padded batches, and refusals that change nothing."""

from __future__ import annotations

import pytest
import torch
from pnmix_bytes import row_bytes
from transformers import DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention
from kvlab.integrations.composed_cache import ComposedModelCache
from kvlab.integrations.kvzip import compress
from kvlab.relay import KVzipScorer, ReconstructionPrompt

PROMPT = dict(first_ids=(5, 6, 7), next_ids=(8, 9), suffix_ids=(10,))


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(11, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _prefill(model, config: EvictionConfig, ids: torch.Tensor, **kwargs) -> RelayModelCache:
    cache = RelayModelCache(model.config, config)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache, **kwargs)
    return cache


def _reference_scores(
    model, ids: torch.Tensor, prompt: ReconstructionPrompt, sinks: int, observe: int = 0
):
    """float64 eager attention of the whole ``context + pass`` sequence per chunk: per layer,
    ``[H, n]`` KVzip scores (the pass's probabilities renormalized over the first sinks, the
    chunk and the pass's own tokens, max over the GQA group and the pass's queries; only the
    chunk's tokens scored), joined by a max with the prefill's last ``observe`` queries'
    probabilities (max over them and the group)."""
    model64 = type(model)(model.config).eval().double()
    model64.load_state_dict(model.state_dict())
    model64.set_attn_implementation("eager")
    n = ids.shape[1]
    heads = model.config.num_key_value_heads
    group = model.config.num_attention_heads // heads
    scores = [
        torch.zeros(heads, n, dtype=torch.float64) for _ in range(model.config.num_hidden_layers)
    ]
    for chunk in prompt.chunks(ids[0].tolist()):
        full = torch.cat([ids, torch.tensor([chunk.ids])], dim=1)
        with torch.no_grad():
            out = model64(full, output_attentions=True, cache=DynamicCache())
        scored = torch.zeros(n, dtype=torch.bool)
        scored[chunk.start : chunk.end] = True
        subset = scored.clone()
        subset[: min(sinks, chunk.start)] = True  # in the normalization, not scored
        keep = torch.cat([subset, torch.ones(len(chunk.ids), dtype=torch.bool)])
        for layer, probs in enumerate(out.attentions):
            p = probs[0, :, n:, :] * keep  # [H_q, Q, n + Q]; causal zeros stay zero
            p = p / p.sum(-1, keepdim=True)
            p = p[..., :n].masked_fill(~scored, 0.0)
            best = p.reshape(heads, group, -1, n).amax(dim=(1, 2))
            scores[layer] = torch.maximum(scores[layer], best)
    if observe:
        with torch.no_grad():
            out = model64(ids, output_attentions=True, cache=DynamicCache())
        for layer, probs in enumerate(out.attentions):
            seen = probs[0, :, n - observe :, :].reshape(heads, group, observe, n).amax((1, 2))
            scores[layer] = torch.maximum(scores[layer], seen)
    return scores


#: a chat template's prefix and suffix ids (ReconstructionPrompt.chat_prefix_ids / _suffix_ids)
CHAT = dict(chat_prefix_ids=(1, 2, 3, 4, 3, 2), chat_suffix_ids=(4, 3))


@pytest.mark.parametrize("templated", [False, True])
@pytest.mark.parametrize("observe", [0, 6])
@pytest.mark.parametrize("chunk_tokens", [2048, 16])
def test_reconstruction_scores_match_float64_eager_reference(
    make_llama, chunk_tokens, observe, templated
):
    model = make_llama(seed=41)
    ids = _ids(40, seed=42)
    prompt = ReconstructionPrompt(**PROMPT, **CHAT, chunk_tokens=chunk_tokens, overlap=3)
    if templated:  # the context starts with the chat prefix: rebuilt after it, chat suffix
        ids[0, :6] = torch.tensor(CHAT["chat_prefix_ids"])
        assert prompt.chunks(ids[0].tolist())[0].start == 6
    scorer = KVzipScorer(prompt=prompt, prefill_queries=observe)
    config = EvictionConfig(ratio=0.5, scorer=scorer, window_tokens=0)
    cache = _prefill(model, config, ids)
    assert cache.get_seq_length() == 40 and cache.awaiting_reconstruction() == [True]
    assert all(layer.tokens_per_head() == [40, 40] for layer in cache.layers)  # nothing evicted
    captured = []
    original = cache.evict_reconstructed

    def capture():
        captured.extend(layer.eviction_scores(0).clone() for layer in cache.layers)
        return original()

    cache.evict_reconstructed = capture
    compress(model, cache, ids)
    reference = _reference_scores(model, ids, prompt, sinks=config.sink_tokens, observe=observe)
    for got, want in zip(captured, reference, strict=True):
        torch.testing.assert_close(got[0].double(), want, atol=2e-6, rtol=1e-4)
    # the eviction keeps, per layer, its top scores over the kv heads (adaptive) + sinks
    for layer, want in zip(cache.layers, reference, strict=True):
        assert sum(layer.tokens_per_head()) == 40
        key = want.clone()
        key[:, : config.sink_tokens] = float("inf")
        top = torch.zeros_like(key, dtype=torch.bool).flatten()
        top[torch.topk(key.flatten(), 40).indices] = True
        for h in range(2):
            kept = layer.segment(0, h).original_positions.view(-1).sort().values
            assert torch.equal(kept, top.view(2, 40)[h].nonzero().view(-1))


@pytest.mark.parametrize("share", [1.0, 0.75, 0.3])
def test_scores_layer_budget_splits_by_the_global_top_scores(make_llama, share):
    model = make_llama(seed=43)
    ids = _ids(48, seed=44)
    prompt = ReconstructionPrompt(**PROMPT)
    config = EvictionConfig(
        ratio=0.5,
        scorer=KVzipScorer(prompt=prompt),
        window_tokens=0,
        relay=False,
        layer_budget="scores",
        scores_share=share,
    )
    cache = _prefill(model, config, ids)
    compress(model, cache, ids)
    reference = _reference_scores(model, ids, prompt, sinks=config.sink_tokens)
    keys = torch.stack(reference)  # [L, H, n]
    keys[..., : config.sink_tokens] = float("inf")
    budget = 2 * 2 * 24  # layers * kv heads * kept per head
    top = torch.zeros(keys.numel(), dtype=torch.bool)
    top[torch.topk(keys.flatten(), budget).indices] = True
    won = top.view_as(keys).sum((1, 2)).tolist()
    # share s of the budget by the scores, the rest uniform; largest remainder to integers
    want = [share * w + (1 - share) * budget / 2 for w in won]
    totals = [int(w) for w in want]
    for i in sorted(range(2), key=lambda i: want[i] - totals[i], reverse=True)[
        : budget - sum(totals)
    ]:
        totals[i] += 1
    for i, layer in enumerate(cache.layers):
        assert sum(layer.tokens_per_head()) == totals[i]
        mine = torch.zeros(2 * 48, dtype=torch.bool)
        mine[torch.topk(keys[i].flatten(), totals[i]).indices] = True
        for h in range(2):
            kept = layer.segment(0, h).original_positions.view(-1).sort().values
            assert torch.equal(kept, mine.view(2, 48)[h].nonzero().view(-1))
    assert sum(totals) == budget


@pytest.mark.parametrize("relay", [True, False])
def test_padded_batch_rows_evict_as_alone(make_llama, relay):
    model = make_llama(seed=45)
    prompt = ReconstructionPrompt(**PROMPT)
    config = EvictionConfig(
        ratio=0.5,
        scorer=KVzipScorer(prompt=prompt, prefill_queries=5),
        window_tokens=2,
        relay=relay,
    )
    long, short = _ids(36, seed=46), _ids(28, seed=47)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.int64), short], 1)])
    mask = torch.ones(2, 36, dtype=torch.int64)
    mask[1, :8] = 0
    cache = _prefill(model, config, batch, attention_mask=mask)
    compress(model, cache, batch)
    for row, ids in ((0, long), (1, short)):
        alone = _prefill(model, config, ids)
        compress(model, alone, ids)
        for got, want in zip(cache.layers, alone.layers, strict=True):
            for h in range(2):
                a, b = got.segment(row, h), want.segment(0, h)
                assert torch.equal(a.original_positions, b.original_positions)
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)


def _state(cache: RelayModelCache):
    relays = [getattr(layer, "relay_layer", layer) for layer in cache.layers]
    return [
        (
            layer.tokens_per_head(),
            list(layer.reconstruction_scores),
            list(layer.observation_scores),
            list(layer.evicted),
            layer.seen_tokens,
            list(layer.next_positions),
        )
        for layer in relays
    ]


def test_bad_input_fails_once_and_changes_nothing(make_llama):
    model = make_llama(seed=48)
    ids = _ids(24, seed=49)
    config = EvictionConfig(ratio=0.5, scorer=KVzipScorer(prefill_queries=4), window_tokens=0)
    cache = _prefill(model, config, ids)
    before = _state(cache)
    prompt = ReconstructionPrompt(**PROMPT)
    with pytest.raises(ValueError, match="repeat prompt"):
        compress(model, cache, ids)
    with pytest.raises(ValueError, match=r"\[B, seen\]"):
        compress(model, cache, ids[:, :-1], prompt=prompt)
    assert _state(cache) == before
    compress(model, cache, ids, prompt=prompt)
    with pytest.raises(ValueError, match="evicted already"):
        compress(model, cache, ids, prompt=prompt)
    plain = _prefill(model, EvictionConfig(ratio=0.5, window_tokens=4), ids)
    with pytest.raises(ValueError, match="needs a reconstruction"):
        compress(model, plain, ids, prompt=prompt)


def test_a_one_token_row_is_refused_in_words(make_llama):
    model = make_llama(seed=48)
    ids = _ids(1, seed=49)
    config = EvictionConfig(ratio=0.5, scorer=KVzipScorer(prefill_queries=4), window_tokens=0)
    cache = _prefill(model, config, ids)
    before = _state(cache)
    with pytest.raises(ValueError, match=r"^row 0 .* it holds 1 token; KVzip needs at least 2$"):
        compress(model, cache, ids, prompt=ReconstructionPrompt(**PROMPT))
    assert _state(cache) == before


def test_impossible_budget_fails_before_the_model_runs(make_llama):
    model = make_llama(seed=50)
    ids = _ids(12, seed=51)
    config = EvictionConfig(ratio=0.9, scorer=KVzipScorer(), sink_tokens=4, window_tokens=4)
    cache = _prefill(model, config, ids)
    before = _state(cache)
    with pytest.raises(ValueError, match="cannot evict"):
        compress(model, cache, ids, prompt=ReconstructionPrompt(**PROMPT))
    assert _state(cache) == before


def test_configurations_kvzip_cannot_run_are_refused_at_construction(make_llama):
    with pytest.raises(ValueError, match="needs ratio"):
        EvictionConfig(capacity=64, scorer="kvzip")
    with pytest.raises(ValueError, match="reconstruction pass"):
        EvictionConfig(ratio=0.5, scorer="snapkv", layer_budget="scores")
    with pytest.raises(ValueError, match="scores_share"):
        EvictionConfig(ratio=0.5, scorer="kvzip", scores_share=0.5)
    with pytest.raises(ValueError, match="scores_share"):
        EvictionConfig(ratio=0.5, scorer="kvzip", layer_budget="scores", scores_share=0.0)
    with pytest.raises(ValueError, match="prefill_queries"):
        KVzipScorer(prefill_queries=-1)


# ------------------------------------------------------------------ KVzip composed with PN-Mix

SMALL_PNMIX = dict(sink_tokens=4, residual_tokens=8, group_tokens=16)


def _composed(model, config: EvictionConfig, pnmix, ids: torch.Tensor) -> ComposedModelCache:
    cache = ComposedModelCache(model.config, config, pnmix, record_kept=True)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("relay", [True, False])
def test_composed_kvzip_packs_relay_model_caches_kvzip_kept_set_byte_for_byte(make_llama, relay):
    """KVzip then PN-Mix: the composed cache keeps exactly the tokens RelayModelCache's KVzip
    keeps (reconstruction scores, cross-layer budget, relay or not), and each layer's store is
    a PNMixCache filled with those kept keys and values at the same position offsets, byte for
    byte (a position-aware codec without a per-pair table, so the queries do not enter)."""
    import numpy as np

    from kvlab.pnmix import PNMixCache, PNMixConfig

    model = make_llama(seed=80)
    ids = torch.cat([_ids(96, seed=81), _ids(96, seed=82)])
    prompt = ReconstructionPrompt(**PROMPT)
    config = EvictionConfig(
        ratio=0.5,
        scorer=KVzipScorer(prompt=prompt, prefill_queries=4),
        window_tokens=4,
        relay=relay,
        layer_budget="scores",
    )
    pnmix = PNMixConfig(
        key_coding="prerope_cartesian",
        key_outlier_fraction=0.02,
        value_coding="hadamard",
        **SMALL_PNMIX,
    )
    reference = _prefill(model, config, ids)
    compress(model, reference, ids)
    composed = _composed(model, config, pnmix, ids)
    assert composed.awaiting_reconstruction() == [True, True]
    assert all(layer.pnmix is None for layer in composed.layers)
    compress(model, composed, ids)
    assert composed.awaiting_reconstruction() == [False, False]
    for mine, theirs in zip(composed.layers, reference.layers, strict=True):
        assert mine.relay_layer.next_positions == theirs.next_positions
        counts = np.array([theirs.tokens_per_head(b) for b in range(2)])
        positions, kept = mine.kept_positions
        assert np.array_equal(kept, counts)
        width = int(counts.max())
        keys = torch.zeros(2, 2, width, 16)
        values = torch.zeros(2, 2, width, 16)
        for b in range(2):
            for h in range(2):
                seg = theirs.segment(b, h)
                n = len(seg.keys)
                assert torch.equal(positions[b, h, :n], seg.original_positions)
                keys[b, h, width - n :] = seg.keys
                values[b, h, width - n :] = seg.values
        alone = PNMixCache(
            mine.pnmix_config,
            batch_size=2,
            num_key_value_heads=2,
            head_dim=16,
            rotary=mine.relay_layer.rotary,
        )
        alone.set_position_offsets(np.asarray(theirs.next_positions)[:, None] - counts)
        alone.append(keys, values, counts)
        assert int(alone.group_counts.min()) > 0
        for b in range(2):
            for x, y in zip(row_bytes(mine.pnmix, b), row_bytes(alone, b), strict=True):
                assert torch.equal(x, y)
        assert mine.held_bytes() == sum(mine.pnmix.reserved_bytes().values())


def test_composed_kvzip_keeping_everything_equals_the_prefill_composed_cache(make_llama):
    """At ratio 0 KVzip keeps every token, so its deferred packing must store what a composed
    cache that packs at the prefill stores — with pn-mix's query-aware per-pair tables, which
    read the prefill's queries the deferred cache kept — bit for bit, and decode the same
    logits."""
    from kvlab.pnmix import PNMixConfig

    model = make_llama(seed=83)
    ids = _ids(80, seed=84)
    pnmix = PNMixConfig(
        key_coding="bit_alloc", key_outlier_fraction=0.02, value_coding="hadamard", **SMALL_PNMIX
    )
    prompt = ReconstructionPrompt(**PROMPT)
    deferred = _composed(
        model,
        EvictionConfig(ratio=0.0, scorer=KVzipScorer(prompt=prompt), window_tokens=4, relay=False),
        pnmix,
        ids,
    )
    assert deferred.layers[0].held_bytes() > deferred.layers[0].relay_layer.held_bytes()
    compress(model, deferred, ids)
    direct = _composed(model, EvictionConfig(ratio=0.0, window_tokens=4, relay=False), pnmix, ids)
    for a, b in zip(deferred.layers, direct.layers, strict=True):
        assert a.pnmix.mask_packed is not None  # the per-pair table was built
        assert torch.equal(a.pnmix.mask_packed, b.pnmix.mask_packed)
        for x, y in zip(row_bytes(a.pnmix, 0), row_bytes(b.pnmix, 0), strict=True):
            assert torch.equal(x, y)
    nxt = _ids(3, seed=85)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        for j in range(3):
            la = model(nxt[:, j : j + 1], cache=deferred).logits
            lb = model(nxt[:, j : j + 1], cache=direct).logits
            assert torch.equal(la, lb)


def test_composed_kvzip_refuses_other_forwards_until_compressed(make_llama):
    from kvlab.pnmix import PNMixConfig

    model = make_llama(seed=86)
    ids = _ids(64, seed=87)
    prompt = ReconstructionPrompt(**PROMPT)
    config = EvictionConfig(ratio=0.5, scorer=KVzipScorer(prompt=prompt), window_tokens=4)
    cache = _composed(model, config, PNMixConfig(**SMALL_PNMIX), ids)
    before = _state(cache)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        with pytest.raises(ValueError, match="compress"):
            model(_ids(1, seed=88), cache=cache)
        with pytest.raises(ValueError, match="compress"):
            model(_ids(5, seed=89), cache=cache)
    assert _state(cache) == before
    assert cache.get_seq_length() == 64
    compress(model, cache, ids)
    assert all(layer.pnmix is not None for layer in cache.layers)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model(_ids(1, seed=88), cache=cache)
    assert torch.isfinite(out.logits).all()
    with pytest.raises(ValueError, match="evicted already"):
        compress(model, cache, torch.cat([ids, _ids(1, seed=88)], 1))


@pytest.mark.parametrize("relay", [True, False])
def test_kvzip_caches_of_one_prefill_share_its_reconstruction_scores(make_llama, relay):
    """A scores memo: the first compress runs the pass and keeps its scores; another cache of
    the same prefill (another ratio; the cache composed with PN-Mix) evicts from them with no
    model forward, exactly as after its own pass; another context runs its own pass."""
    from kvlab.pnmix import PNMixConfig

    model = make_llama(seed=90)
    ids = _ids(96, seed=91)
    prompt = ReconstructionPrompt(**PROMPT)

    def config(ratio: float) -> EvictionConfig:
        return EvictionConfig(
            ratio=ratio,
            scorer=KVzipScorer(prompt=prompt, prefill_queries=4),
            window_tokens=4,
            relay=relay,
            layer_budget="scores",
        )

    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        memo: dict = {}
        compress(model, _prefill(model, config(0.5), ids), ids, scores=memo)
        assert len(memo) == 1
        own = _prefill(model, config(0.75), ids)
        compress(model, own, ids)
        shared = _prefill(model, config(0.75), ids)
        forwards.clear()
        compress(model, shared, ids, scores=memo)
        assert forwards == []  # no reconstruction pass
        for a, b in zip(shared.layers, own.layers, strict=True):
            assert a.tokens_per_head() == b.tokens_per_head()
            for h in range(2):
                x, y = a.segment(0, h), b.segment(0, h)
                assert torch.equal(x.original_positions, y.original_positions)
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        pnmix = PNMixConfig(
            key_coding="prerope_cartesian",
            key_outlier_fraction=0.02,
            value_coding="hadamard",
            **SMALL_PNMIX,
        )
        composed_own = _composed(model, config(0.5), pnmix, ids)
        compress(model, composed_own, ids)
        composed = _composed(model, config(0.5), pnmix, ids)
        forwards.clear()
        compress(model, composed, ids, scores=memo)
        assert forwards == []
        for a, b in zip(composed.layers, composed_own.layers, strict=True):
            for x, y in zip(row_bytes(a.pnmix, 0), row_bytes(b.pnmix, 0), strict=True):
                assert torch.equal(x, y)
        other = _ids(96, seed=92)
        forwards.clear()
        compress(model, _prefill(model, config(0.5), other), other, scores=memo)
        assert forwards and len(memo) == 2  # another context: its own pass
    finally:
        handle.remove()
    # another model with the same context: its own pass, its own eviction
    twin = make_llama(seed=93)
    mine = _prefill(twin, config(0.75), ids)
    passes = []
    handle = twin.register_forward_pre_hook(lambda module, args: passes.append(1))
    compress(twin, mine, ids, scores=memo)
    handle.remove()
    assert passes  # a miss: the memo's scores are another model's
    fresh = _prefill(twin, config(0.75), ids)
    compress(twin, fresh, ids)
    for a, b in zip(mine.layers, fresh.layers, strict=True):
        for h in range(2):
            x, y = a.segment(0, h), b.segment(0, h)
            assert torch.equal(x.original_positions, y.original_positions)
