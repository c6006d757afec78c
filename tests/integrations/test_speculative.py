"""Speculative decoding with kvlab caches (docs/design.md, "Cache life cycle": crop).

``generate(assistant_model=...)`` and prompt-lookup decoding verify a draft in one multi-token
forward and ``crop`` the rejected tokens. A recording kvlab cache reads the prompt's end from
the ``generate`` call (or ``expect_prompt``), stores a forward's decode-phase tokens as
one-token decode steps would (the same bytes), attends them in one call with the decode steps'
numbers (PN-Mix storage) and crops them back byte for byte, so greedy tokens equal plain
generation's; the recording ends with the ``generate`` call.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import pytest
import torch
from tiny_models import FAMILIES

from kvlab.integrations import (
    ComposedModelCache,
    EvictionConfig,
    PNMixModelCache,
    RelayModelCache,
    decode_steps,
    enable_kvlab_attention,
)
from kvlab.integrations.pnmix_cache import PNMixLayer, PNMixView
from kvlab.integrations.relay_layer import RelayLayer
from kvlab.integrations.speculative import GenerateCall
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

# groups of 4 after 2 sinks and a 4-token residual: a group flushes every 4 tokens, in the
# prompt and inside every draft of more than 3 tokens
SMALL = PNMixConfig(sink_tokens=2, residual_tokens=4, group_tokens=4)
PROMPT = 30
NEW_TOKENS = 40
# llama: every layer full attention; qwen2: layer 0 full, layers 1-2 sliding (window layers
# recorded by transformers' own DynamicSlidingWindowLayer); gemma3: a window layer in front
FAMILY_NAMES = ("llama", "qwen2", "gemma3")


@functools.cache
def _model(name: str, seed: int = 7) -> Any:
    model = FAMILIES[name].build(seed=seed)
    enable_kvlab_attention(model)
    return model


def _prompt() -> torch.Tensor:
    """A prompt that repeats itself (prompt lookup finds drafts in it)."""
    ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, ids[:, :12]], 1)


def _generate(name: str, cache: Any, ids: torch.Tensor, **extra: Any) -> torch.Tensor:
    model = _model(name)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)
    return out[0, ids.shape[1] :]


class _Rollbacks:
    """Counts PNMixCache.rollback calls: all, and those that un-flushed a group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.unflushed = 0
        original = PNMixCache.rollback

        def spy(cache: PNMixCache, points: list[Any]) -> None:
            self.calls += 1
            before = int(cache.group_counts.sum())
            original(cache, points)
            self.unflushed += int(cache.group_counts.sum()) < before

        monkeypatch.setattr(PNMixCache, "rollback", spy)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_speculative_generate_equals_plain(name, mode, monkeypatch):
    ids = _prompt()
    plain = _generate(name, PNMixModelCache(_model(name).config, SMALL), ids)
    rollbacks = _Rollbacks(monkeypatch)
    cache = PNMixModelCache(_model(name).config, SMALL)
    cache.expect_prompt(ids.shape[1])
    if mode == "assistant":
        extra: dict[str, Any] = {"assistant_model": FAMILIES[name].build(seed=8)}
    else:
        extra = {"prompt_lookup_num_tokens": 5}
    got = _generate(name, cache, ids, **extra)
    assert got.tolist() == plain.tolist()
    # the mechanism ran: rejected draft tokens were cropped, some of them past a group flush
    assert rollbacks.calls > 0
    assert rollbacks.unflushed > 0
    assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1


def test_multi_token_forward_logits_equal_one_token_steps():
    """Model level: a recording cache's 10-token forward after a 30-token prefill gives the
    logits of 10 one-token forwards to float32 rounding (the model's own projections over 10
    rows vs 1: 1.49e-07 printed by experiments/speculative_logits.py, DynamicCache 1.79e-07);
    the plain multi-token path (store, then attend) differs by quantization (1.85e-02)."""
    model = _model("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        steps = PNMixModelCache(model.config, SMALL)
        want = [model(ids[:, :PROMPT], cache=steps).logits]
        want += [model(ids[:, j : j + 1], cache=steps).logits for j in range(PROMPT, 40)]
        want_t = torch.cat(want, 1)
        for split in (True, False):  # prompt and draft in one forward, or after a prefill
            rec = PNMixModelCache(model.config, SMALL)
            rec.activate_past_recording()
            rec.expect_prompt(PROMPT)
            if split:
                got = model(ids, cache=rec).logits
            else:
                first = model(ids[:, :PROMPT], cache=rec).logits
                got = torch.cat([first, model(ids[:, PROMPT:], cache=rec).logits], 1)
            torch.testing.assert_close(got, want_t, atol=1e-5, rtol=0)
        plain = PNMixModelCache(model.config, SMALL)
        first = model(ids[:, :PROMPT], cache=plain).logits
        old = torch.cat([first, model(ids[:, PROMPT:], cache=plain).logits], 1)
    assert (old - want_t).abs().max() > 1e-3  # the test can tell the two paths apart


# ---------------------------------------------------------------- layer level: bit identity


def _layer_cache() -> PNMixModelCache:
    return PNMixModelCache(_model("llama").config, SMALL)


def _tensors(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, tokens, 16, generator=gen)
    values = torch.randn(1, 2, tokens, 16, generator=gen)
    query = torch.randn(1, 4, tokens, 16, generator=gen)
    return keys, values, query


def _forward(layer: PNMixLayer, keys, values, query) -> torch.Tensor:
    view, _ = layer.update(keys, values)
    assert isinstance(view, PNMixView)
    return view.attend(None, query, scaling=0.25, attention_mask=None, kwargs={})


def _state(layer: PNMixLayer) -> tuple[Any, ...]:
    store = layer.store
    assert store is not None
    keys, values = store.dequantize()
    return (layer.columns, store._store.counts.tolist(), keys, values)


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[:2] == b[:2]
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


DRAFT = 11  # crosses two group flushes after the 13-token prefix


def _prefilled(prompt: int = 13) -> tuple[PNMixModelCache, PNMixLayer]:
    cache = _layer_cache()
    layer = cache.layers[0]
    _forward(layer, *_tensors(prompt, 0))
    return cache, layer


def test_a_recorded_forward_attends_in_one_call_as_one_token_forwards(monkeypatch):
    """Issue 38, item 2: a verification forward of DRAFT tokens stores the bytes of DRAFT
    one-token forwards (group flushes included) and attends with their numbers to float32
    rounding — token j sees the exact residual as it stood at step j and only the groups
    flushed by then (a one-call attention over the final storage would differ by quantization,
    checked) — in one packed-attention call per run between flushes and one fused decode step
    per flushing token: here 3 + 3 calls for 11 tokens (groups of 4 after a full residual)."""
    keys, values, query = _tensors(DRAFT, 1)
    cache, layer = _prefilled()
    cache.activate_past_recording()
    calls = {"steps": 0, "packed": 0}
    step, packed = decode_steps.pnmix_decode_step, decode_steps.pnmix_attention

    def counted_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["steps"] += 1
        return step(*args, **kwargs)

    def counted_packed(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["packed"] += 1
        return packed(*args, **kwargs)

    monkeypatch.setattr(decode_steps, "pnmix_decode_step", counted_step)
    monkeypatch.setattr(decode_steps, "pnmix_attention", counted_packed)
    groups = int(layer.store.group_counts.max())
    got = _forward(layer, keys, values, query)
    assert calls == {"steps": 3, "packed": 3}
    assert int(layer.store.group_counts.max()) - groups == 3  # one decode step per flush
    monkeypatch.undo()
    _, ref = _prefilled()
    want = torch.cat(
        [
            _forward(ref, keys[:, :, j : j + 1], values[:, :, j : j + 1], query[:, :, j : j + 1])
            for j in range(DRAFT)
        ],
        2,
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    _assert_same(_state(layer), _state(ref))
    final = pnmix_attention(query, layer.store, scale=0.25, causal=True)
    assert (final - want).abs().max() > 1e-3  # the test can tell the storage apart


def test_a_draft_that_flushes_nothing_is_one_append_and_one_packed_attention(monkeypatch):
    """The usual verification forward flushes no group: it is stored in one append and
    attended by one causal packed-attention call (the compiled kernel on the CPU backend) —
    the same bytes as one-token forwards and their outputs to float32 rounding."""
    cache, layer = _prefilled(10)  # the residual just flushed: 3 quiet steps
    store = layer.store
    assert store is not None
    quiet = decode_steps._quiet_run(store, DRAFT)
    assert quiet == 3  # a run to test; a fourth token would flush
    keys, values, query = _tensors(quiet, 2)
    cache.activate_past_recording()
    calls = {"packed": 0, "steps": 0}
    packed, steps = decode_steps.pnmix_attention, decode_steps.pnmix_decode_step

    def counted_packed(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["packed"] += 1
        return packed(*args, **kwargs)

    def counted_steps(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["steps"] += 1
        return steps(*args, **kwargs)

    monkeypatch.setattr(decode_steps, "pnmix_attention", counted_packed)
    monkeypatch.setattr(decode_steps, "pnmix_decode_step", counted_steps)
    got = _forward(layer, keys, values, query)
    assert calls == {"packed": 1, "steps": 0}
    monkeypatch.undo()
    _, ref = _prefilled(10)
    want = torch.cat(
        [
            _forward(ref, keys[:, :, j : j + 1], values[:, :, j : j + 1], query[:, :, j : j + 1])
            for j in range(quiet)
        ],
        2,
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    _assert_same(_state(layer), _state(ref))
    layer.crop(-quiet)  # its undo entries put the storage back (only layer 0 was fed)
    _, before = _prefilled(10)
    _assert_same(_state(layer), _state(before))


@pytest.mark.parametrize("remove", range(1, DRAFT + 1))
def test_crop_restores_the_state_before_the_removed_tokens(remove):
    keys, values, query = _tensors(DRAFT, 1)
    cache, layer = _prefilled()
    cache.activate_past_recording()
    _forward(layer, keys, values, query)
    layer.crop(-remove)  # only layer 0 was fed (the model cache crops every layer alike)
    _, ref = _prefilled()
    kept = DRAFT - remove
    for j in range(kept):
        _forward(ref, keys[:, :, j : j + 1], values[:, :, j : j + 1], query[:, :, j : j + 1])
    _assert_same(_state(layer), _state(ref))
    # and the next token sees the same cache
    nxt = _tensors(1, 2)
    assert torch.equal(_forward(layer, *nxt), _forward(ref, *nxt))
    assert cache.get_seq_length() == 13 + kept + 1


def test_crop_beyond_the_last_draft_is_refused_and_changes_nothing():
    cache, layer = _prefilled()
    cache.activate_past_recording()
    _forward(layer, *_tensors(DRAFT, 1))
    before = _state(layer)
    with pytest.raises(ValueError, match=f"only the {DRAFT} decode-phase tokens"):
        layer.crop(-(DRAFT + 1))  # a prompt token
    _assert_same(_state(layer), before)
    with pytest.raises(ValueError, match="minus the number of tokens"):
        layer.crop(3)
    # the model cache checks every layer first: layer 1 (never fed) can remove nothing
    with pytest.raises(ValueError, match="only the 0 decode-phase tokens"):
        cache.crop(-1)
    _assert_same(_state(layer), before)
    layer.crop(-2)
    with pytest.raises(ValueError, match=f"only the {DRAFT - 2} decode-phase"):
        layer.crop(-DRAFT)
    # a new forward accepts the last one: its tokens can no longer be removed
    _forward(layer, *_tensors(1, 3))
    with pytest.raises(ValueError, match="only the 1 decode-phase"):
        layer.crop(-2)


def test_crop_without_recording_is_refused():
    cache, layer = _prefilled()
    _forward(layer, *_tensors(3, 1))
    before = _state(layer)
    assert not cache.is_croppable
    cache.crop(0)
    with pytest.raises(NotImplementedError, match="only while it records"):
        cache.crop(-1)
    with pytest.raises(NotImplementedError, match="only while it records"):
        layer.crop(-1)
    _assert_same(_state(layer), before)


@pytest.mark.parametrize("kind", ["pnmix", "relay"])
def test_recording_by_hand_needs_the_prompt_end(kind):
    """Recording activated by hand (no generate call to read the prompt from): a multi-token
    first forward feeds prompt and draft together, so without expect_prompt the cache refuses
    it before storing anything."""
    name = "qwen2"  # window layers after the full layer: they are put back too
    model = _model(name)
    cache = PNMixModelCache(model.config, SMALL) if kind == "pnmix" else _relay(name)
    cache.activate_past_recording()
    with pytest.raises(ValueError, match="expect_prompt"), torch.no_grad():
        model(_prompt(), cache=cache)
    assert cache.get_seq_length() == 0
    assert all(not layer.is_initialized or layer.get_seq_length() == 0 for layer in cache.layers)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("kind", ["pnmix", "relay-ratio", "relay-capacity", "composed"])
def test_speculative_generate_needs_no_kvlab_call(kind, mode):
    """Issue 38, item 2: transformers' generate(assistant_model=...) and prompt lookup work
    with a kvlab cache as with DynamicCache — the cache reads the prompt's end from the
    generate call (before: a ValueError asking for cache.expect_prompt) — and give plain greedy
    decoding's tokens. (A second speculative turn on the same cache is not tested:
    transformers' assisted decoding feeds the whole conversation again in its first forward,
    with DynamicCache too.)"""
    model = _model("qwen2")
    config = model.config
    make = {
        "pnmix": lambda: PNMixModelCache(config, SMALL),
        "relay-ratio": lambda: RelayModelCache(config, RATIO),
        "relay-capacity": lambda: RelayModelCache(config, CAPACITY),
        "composed": lambda: ComposedModelCache(config, RATIO, SMALL),
    }[kind]
    if mode == "assistant":
        extra: dict[str, Any] = {"assistant_model": FAMILIES["qwen2"].build(seed=8)}
    else:
        extra = {"prompt_lookup_num_tokens": 5}
    ids = _prompt()
    plain_cache, cache = make(), make()
    plain = _generate("qwen2", plain_cache, ids)
    assert _generate("qwen2", cache, ids, **extra).tolist() == plain.tolist()
    assert cache.get_seq_length() == plain_cache.get_seq_length()


def test_reset_stops_recording():
    cache, layer = _prefilled()
    cache.activate_past_recording()
    cache.expect_prompt(13)
    assert cache.is_croppable
    cache.reset()
    assert not cache.is_croppable
    fresh = _layer_cache()
    out = _forward(layer, *_tensors(13, 0))
    assert torch.equal(out, _forward(fresh.layers[0], *_tensors(13, 0)))


RATIO = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=4)
CAPACITY = EvictionConfig(capacity=12, scorer="snapkv", sink_tokens=2, window_tokens=4)


def _relay(name: str, eviction: EvictionConfig = RATIO) -> RelayModelCache:
    return RelayModelCache(_model(name).config, eviction)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("kind", ["ratio", "capacity"])
@pytest.mark.parametrize("name", ("llama", "qwen2"))
def test_relay_speculative_generate_equals_plain(name, kind, mode, monkeypatch):
    """Ratio mode: the prompt evicts once at its end (not with the first draft), drafts are
    appended after it and cropped off the segments' ends. Capacity mode: every decode step
    evicts (12 tokens per head), a crop goes back past evictions."""
    eviction = RATIO if kind == "ratio" else CAPACITY
    ids = _prompt()
    plain_cache = _relay(name, eviction)
    plain = _generate(name, plain_cache, ids)
    crops: list[int] = []
    uneviction = []
    original = RelayLayer.crop

    def spy(layer: RelayLayer, tokens: int) -> None:
        crops.append(-tokens)
        events = len(layer.events)
        original(layer, tokens)
        uneviction.append(len(layer.events) < events)

    monkeypatch.setattr(RelayLayer, "crop", spy)
    cache = _relay(name, eviction)
    cache.expect_prompt(ids.shape[1])
    if mode == "assistant":
        extra: dict[str, Any] = {"assistant_model": FAMILIES[name].build(seed=8)}
    else:
        extra = {"prompt_lookup_num_tokens": 5}
    got = _generate(name, cache, ids, **extra)
    assert got.tolist() == plain.tolist()
    assert max(crops) > 0  # rejected draft tokens were cropped
    assert any(uneviction) == (kind == "capacity")  # capacity: crops went past evictions
    # the same eviction schedule: one prompt eviction per layer, the same tokens kept
    assert len(cache.events()) == len(plain_cache.events())
    for a, b in zip(cache._relay_layers(), plain_cache._relay_layers(), strict=True):
        assert a.tokens_per_head() == b.tokens_per_head()
        assert a.next_positions == b.next_positions


@pytest.mark.parametrize("kind", ["ratio", "capacity", "composed"])
def test_relay_multi_token_forward_logits_equal_one_token_steps(kind):
    """A recording relay (or composed) cache's 10-token forward after the prompt gives the
    logits of 10 one-token forwards to float32 rounding, with the same evictions (ratio mode:
    none during decoding; capacity mode: one per step); the prompt and the draft in one
    forward too (the prompt evicts at its end first)."""

    def new_cache() -> Any:
        if kind == "composed":
            return _composed("llama")
        return _relay("llama", RATIO if kind == "ratio" else CAPACITY)

    model = _model("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        steps = new_cache()
        want = [model(ids[:, :PROMPT], cache=steps).logits]
        want += [model(ids[:, j : j + 1], cache=steps).logits for j in range(PROMPT, 40)]
        want_t = torch.cat(want, 1)
        for split in (True, False):
            rec = new_cache()
            rec.activate_past_recording()
            rec.expect_prompt(PROMPT)
            if split:
                got = model(ids, cache=rec).logits
            else:
                first = model(ids[:, :PROMPT], cache=rec).logits
                got = torch.cat([first, model(ids[:, PROMPT:], cache=rec).logits], 1)
            torch.testing.assert_close(got, want_t, atol=1e-5, rtol=0)
            assert len(rec.events()) == len(steps.events())
            for a, b in zip(rec.layers, steps.layers, strict=True):
                if hasattr(a, "tokens_per_head"):
                    assert a.tokens_per_head() == b.tokens_per_head()


@pytest.mark.parametrize("kind", ["ratio", "capacity"])
def test_relay_crop_beyond_the_draft_is_refused_and_changes_nothing(kind):
    model = _model("llama")
    ids = _prompt()
    cache = _relay("llama", RATIO if kind == "ratio" else CAPACITY)
    cache.activate_past_recording()
    cache.expect_prompt(PROMPT)
    with torch.no_grad():
        model(ids[:, : PROMPT + 5], cache=cache)
    layers = cache._relay_layers()
    before = [
        (layer.tokens_per_head(), layer.seen_tokens, layer.next_positions) for layer in layers
    ]
    with pytest.raises(ValueError, match="only the 5 decode-phase tokens"):
        cache.crop(-6)
    with pytest.raises(ValueError, match="minus the number of tokens"):
        cache.crop(2)
    after = [(layer.tokens_per_head(), layer.seen_tokens, layer.next_positions) for layer in layers]
    assert after == before
    cache.crop(-5)
    assert cache.get_seq_length() == PROMPT
    with pytest.raises(ValueError, match="only the 0 decode-phase"):
        cache.crop(-1)


def test_relay_crop_without_recording_is_refused():
    cache = _relay("llama")
    with torch.no_grad():
        _model("llama")(_prompt(), cache=cache)
    assert not cache.is_croppable
    with pytest.raises(NotImplementedError, match="only while it records"):
        cache.crop(-1)


def _composed(name: str) -> ComposedModelCache:
    return ComposedModelCache(_model(name).config, RATIO, SMALL)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("name", ("llama", "qwen2"))
def test_composed_speculative_generate_equals_plain(name, mode, monkeypatch):
    """The prompt evicts and packs at its end; each later token is a PN-Mix decode step,
    cropped back byte for byte (groups un-flushed)."""
    ids = _prompt()
    plain_cache = _composed(name)
    plain = _generate(name, plain_cache, ids)
    rollbacks = _Rollbacks(monkeypatch)
    cache = _composed(name)
    cache.expect_prompt(ids.shape[1])
    if mode == "assistant":
        extra: dict[str, Any] = {"assistant_model": FAMILIES[name].build(seed=8)}
    else:
        extra = {"prompt_lookup_num_tokens": 5}
    got = _generate(name, cache, ids, **extra)
    assert got.tolist() == plain.tolist()
    assert rollbacks.calls > 0 and rollbacks.unflushed > 0
    assert len(cache.events()) == len(plain_cache.events())
    for a, b in zip(cache.kvlab_layers(), plain_cache.kvlab_layers(), strict=True):
        assert a.tokens_per_head() == b.tokens_per_head()
        assert a.relay_layer.next_positions == b.relay_layer.next_positions


def test_composed_crop_beyond_the_draft_is_refused_and_changes_nothing():
    model = _model("llama")
    cache = _composed("llama")
    cache.activate_past_recording()
    cache.expect_prompt(PROMPT)
    with torch.no_grad():
        model(_prompt()[:, : PROMPT + 5], cache=cache)
    layers = cache.kvlab_layers()
    before = [(layer.tokens_per_head(), layer.relay_layer.next_positions) for layer in layers]
    with pytest.raises(ValueError, match="only the 5 decode-phase tokens"):
        cache.crop(-6)
    assert [(layer.tokens_per_head(), layer.relay_layer.next_positions) for layer in layers] == (
        before
    )
    cache.crop(-5)
    assert cache.get_seq_length() == PROMPT
    fresh = _composed("llama")
    with torch.no_grad():
        model(_prompt()[:, :PROMPT], cache=fresh)
    assert [layer.tokens_per_head() for layer in layers] == [
        layer.tokens_per_head() for layer in fresh.kvlab_layers()
    ]
    with pytest.raises(NotImplementedError, match="only while it records"):
        fresh.crop(-1)


@pytest.mark.parametrize("remove", [1, 4, 9])
@pytest.mark.parametrize("kind", ["ratio", "capacity"])
def test_relay_crop_restores_the_state_before_the_removed_tokens(kind, remove):
    """After a 10-token recorded forward and crop(-remove): what a cache fed the prompt and
    the kept tokens one at a time holds (tokens per head, positions, evictions), and the next
    token's logits to float32 rounding."""
    eviction = RATIO if kind == "ratio" else CAPACITY
    model = _model("llama")
    ids = torch.randint(3, 96, (1, 41), generator=torch.Generator().manual_seed(2))
    kept = 10 - remove
    with torch.no_grad():
        rec = _relay("llama", eviction)
        rec.activate_past_recording()
        rec.expect_prompt(PROMPT)
        model(ids[:, : PROMPT + 10], cache=rec)
        rec.crop(-remove)
        ref = _relay("llama", eviction)
        model(ids[:, :PROMPT], cache=ref)
        for j in range(PROMPT, PROMPT + kept):
            model(ids[:, j : j + 1], cache=ref)
        assert rec.get_seq_length() == ref.get_seq_length() == PROMPT + kept
        assert len(rec.events()) == len(ref.events())
        for a, b in zip(rec._relay_layers(), ref._relay_layers(), strict=True):
            assert a.tokens_per_head() == b.tokens_per_head()
            assert (a.next_positions, a.stream_lengths) == (b.next_positions, b.stream_lengths)
        nxt = ids[:, PROMPT + kept : PROMPT + kept + 1]
        torch.testing.assert_close(
            model(nxt, cache=rec).logits, model(nxt, cache=ref).logits, atol=1e-5, rtol=0
        )


def test_reconstruction_scorers_refuse_speculative_decoding_up_front():
    eviction = EvictionConfig(ratio=0.5, scorer="kvzip", sink_tokens=2, window_tokens=4)
    cache = RelayModelCache(_model("llama").config, eviction)
    cache.expect_prompt(PROMPT + 12)
    with pytest.raises(NotImplementedError, match="reconstruction pass"):
        _generate("llama", cache, _prompt(), prompt_lookup_num_tokens=5)
    assert cache.get_seq_length() == 0
    assert not cache.is_croppable


@pytest.mark.parametrize("kind", ["pnmix", "relay"])
def test_expect_prompt_refuses_a_count_that_is_no_prompt(kind):
    """expect_prompt takes the prompt's total length: 0, or not more than the tokens already
    seen, is refused with kvlab's message (expect_prompt(0) crashed inside the relay layer)."""
    cache = _relay("qwen2") if kind == "relay" else PNMixModelCache(_model("qwen2").config, SMALL)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="expect_prompt"):
            cache.expect_prompt(bad)
    cache.expect_prompt(PROMPT)  # accepted


# ---------------------------------------------------------------- after a speculative generate


def _speculative_kinds(kind: str) -> Any:
    config = _model("llama").config
    if kind == "pnmix":
        return PNMixModelCache(config, SMALL)
    if kind == "relay-capacity":
        return RelayModelCache(config, CAPACITY)
    return ComposedModelCache(config, RATIO, SMALL)


@pytest.mark.parametrize("kind", ["pnmix", "relay-capacity", "composed"])
def test_a_speculative_generate_leaves_no_speculative_mode_behind(kind):
    """Issue 38, item 1: ``transformers`` never undoes ``activate_past_recording``; the cache
    stops recording when the speculative ``generate`` returns, so the next, plain turn on the
    same conversation (a multi-token forward, then decode steps) gives the logits of a twin
    whose first turn was plain, to float32 rounding (before: up to 0.69 apart with a
    capacity-mode relay cache, 1.4e-3 composed; the turn ran as speculative decode steps)."""
    model = _model("llama")
    ids = _prompt()
    twin, cache = _speculative_kinds(kind), _speculative_kinds(kind)
    plain = _generate("llama", twin, ids)
    cache.expect_prompt(ids.shape[1])
    assert _generate("llama", cache, ids, prompt_lookup_num_tokens=5).tolist() == plain.tolist()
    assert not cache.is_croppable  # the generate call is over
    with pytest.raises(NotImplementedError, match="only while it records"):
        cache.crop(-1)
    turn = torch.cat(
        [plain[-1:], torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(5))]
    )
    turn = turn.view(1, -1)
    with torch.no_grad():
        got, want = [model(turn, cache=cache).logits], [model(turn, cache=twin).logits]
        token = want[0][:, -1:].argmax(-1)
        for _ in range(3):
            got.append(model(token, cache=cache).logits)
            want.append(model(token, cache=twin).logits)
            token = want[-1][:, -1:].argmax(-1)
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-4, rtol=0)


def test_a_generate_call_runs_until_it_returns_in_any_thread():
    """The scope of a generate call's recording: running while its frame executes — on this
    thread's stack or in another thread (a streamer runs generate in a worker) — and over once
    it returned (its finished frame is then cleared, letting go of its locals)."""
    started, release, frames = threading.Event(), threading.Event(), []

    def generate() -> None:
        held = torch.zeros(3)  # a local the finished frame lets go of
        frames.append(sys._getframe())
        started.set()
        release.wait()
        assert held.numel() == 3

    worker = threading.Thread(target=generate)
    worker.start()
    started.wait()
    call = GenerateCall(frames[0])
    assert call.running() and call.scoped
    assert "held" in frames[0].f_locals
    release.set()
    worker.join()
    assert not call.running()
    assert frames[0].f_locals == {}
    assert GenerateCall().running() and not GenerateCall().scoped  # recording by hand
