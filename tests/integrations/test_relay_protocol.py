"""RelayModelCache under transformers' Cache protocol: tokens seen, multi-turn generate,
continuing a cached prefix, copy.deepcopy prefix reuse."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention

COMPRESSING = {
    "capacity-relay": EvictionConfig(capacity=24, scorer="snapkv", sink_tokens=2, window_tokens=8),
    "ratio-norelay": EvictionConfig(
        ratio=0.5, scorer="keynorm", relay=False, sink_tokens=2, window_tokens=8
    ),
}
KEEP_ALL = EvictionConfig(ratio=0.0, scorer="recency", relay=False)


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, cache, first: torch.Tensor, steps: int) -> torch.Tensor:
    """Feed ``first`` (one forward), then ``steps - 1`` greedy tokens one at a time; returns the
    ``steps`` greedy tokens (what generate returns after its input)."""
    logits = model(first, cache=cache).logits[:, -1]
    tokens = []
    for i in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if i + 1 < steps:
            logits = model(token, cache=cache).logits[:, -1]
    return torch.cat(tokens, 1)


@pytest.fixture
def model(make_llama):
    m = make_llama(seed=51)
    m.generation_config.eos_token_id = None
    return m


@pytest.mark.parametrize("name", list(COMPRESSING))
def test_multi_turn_generate_feeds_every_token_once(model, name):
    config = COMPRESSING[name]
    turn1, turn2 = _ids(40, 1), _ids(10, 2)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = RelayModelCache(model.config, config)
        out1 = model.generate(turn1, max_new_tokens=8, do_sample=False, cache=cache)
        assert cache.get_seq_length() == 40 + 7  # generate never feeds its last token
        conversation = torch.cat([out1, turn2], 1)
        out2 = model.generate(conversation, max_new_tokens=8, do_sample=False, cache=cache)
        # the same forwards by hand: turn 1, 7 tokens, then (last token + turn 2), 7 tokens
        manual = RelayModelCache(model.config, config)
        first = _greedy(model, manual, turn1, 8)
        second = _greedy(model, manual, torch.cat([first[:, -1:], turn2], 1), 8)
    assert torch.equal(out1[:, 40:], first)
    assert torch.equal(out2[:, conversation.shape[1] :], second)
    seen = conversation.shape[1] + 7
    assert cache.get_seq_length() == manual.get_seq_length() == seen
    assert cache.stream_length == seen  # no token fed twice
    assert cache.next_position == manual.next_position
    if config.capacity is not None:
        assert cache.next_position < seen  # RoPE positions are a separate quantity


def test_multi_turn_generate_without_eviction_equals_dynamic_cache(model):
    turn1, turn2 = _ids(30, 3), _ids(9, 4)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        dynamic = DynamicCache(config=model.config)
        ref1 = model.generate(turn1, max_new_tokens=6, do_sample=False, cache=dynamic)
        ref2 = model.generate(
            torch.cat([ref1, turn2], 1), max_new_tokens=6, do_sample=False, cache=dynamic
        )
        with use_attention(model, KVLAB_ATTENTION):
            cache = RelayModelCache(model.config, KEEP_ALL)
            out1 = model.generate(turn1, max_new_tokens=6, do_sample=False, cache=cache)
            out2 = model.generate(
                torch.cat([out1, turn2], 1), max_new_tokens=6, do_sample=False, cache=cache
            )
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    assert cache.get_seq_length() == dynamic.get_seq_length()


@pytest.mark.parametrize("name", list(COMPRESSING))
def test_generate_continues_a_cached_prefix(model, name):
    """``continue_final_message``-style: the cache holds the start of the input; generate
    feeds only the rest."""
    config = COMPRESSING[name]
    prefix, rest = _ids(36, 5), _ids(12, 6)
    full = torch.cat([prefix, rest], 1)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = RelayModelCache(model.config, config)
        model(prefix, cache=cache)
        out = model.generate(full, max_new_tokens=8, do_sample=False, cache=cache)
        manual = RelayModelCache(model.config, config)
        model(prefix, cache=manual)
        expected = _greedy(model, manual, rest, 8)
    assert torch.equal(out[:, full.shape[1] :], expected)
    assert cache.get_seq_length() == full.shape[1] + 7 == cache.stream_length


@pytest.mark.parametrize("name", list(COMPRESSING))
def test_deepcopy_reuses_a_prefix_without_touching_it(model, name):
    config = COMPRESSING[name]
    prefix = _ids(44, 7)
    questions = [_ids(6, 8), _ids(11, 9)]
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        shared = RelayModelCache(model.config, config)
        model(prefix, cache=shared)
        snapshot = copy.deepcopy(shared)
        for question in questions:
            full = torch.cat([prefix, question], 1)
            out = model.generate(
                full, max_new_tokens=6, do_sample=False, cache=copy.deepcopy(shared)
            )
            fresh = RelayModelCache(model.config, config)
            model(prefix, cache=fresh)
            expected = _greedy(model, fresh, question, 6)
            assert torch.equal(out[:, full.shape[1] :], expected)
    # the shared prefix is untouched
    assert shared.get_seq_length() == 44 and shared.next_positions == snapshot.next_positions
    for a, b in zip(shared.layers, snapshot.layers, strict=True):
        assert a.store.lengths == b.store.lengths
        assert torch.equal(a.store.keys, b.store.keys)
        assert torch.equal(a.store.original_positions, b.store.original_positions)


def test_position_ids_are_the_rope_positions(model):
    config = COMPRESSING["capacity-relay"]
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = RelayModelCache(model.config, config)
        assert torch.equal(cache.position_ids(3), torch.tensor([[0, 1, 2]]))
        model(_ids(80, 10), cache=cache)
        assert cache.get_seq_length() == 80 and cache.stream_length == 80
        assert cache.next_position == 48  # relayed: E + 1 with E = 2 * capacity - 1
        assert torch.equal(cache.position_ids(2), torch.tensor([[48, 49]]))
        # passing them or not gives the same result up to the re-rotation's rounding
        twin = copy.deepcopy(cache)
        step = _ids(1, 11)
        a = model(step, cache=cache, position_ids=cache.position_ids(1)).logits
        b = model(step, cache=twin).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_beam_search_reorders_rows_like_dynamic_cache(model):
    prompt = _ids(24, 12)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model.generate(
            prompt,
            max_new_tokens=6,
            num_beams=3,
            do_sample=False,
            cache=DynamicCache(config=model.config),
        )
        with use_attention(model, KVLAB_ATTENTION):
            cache = RelayModelCache(model.config, KEEP_ALL)
            out = model.generate(
                prompt, max_new_tokens=6, num_beams=3, do_sample=False, cache=cache
            )
    assert torch.equal(out, expected)
    assert cache.layers[0].store.batch == 3  # one sequence per beam
