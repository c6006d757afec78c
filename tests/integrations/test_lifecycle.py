"""A cache through a conversation's whole life (docs/design.md, "Cache life cycle"): reset and
reuse, masks with holes, a fault in one row, a prompt split over several forwards, inference
mode, each cache kind on every family of the model matrix where it applies, against an
independent reference (a fresh cache of the same kind, a row run alone, transformers'
``DynamicCache`` with the family's own attention)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from tiny_models import FAMILIES
from transformers import DynamicCache

from kvlab.integrations import (
    ComposedModelCache,
    EvictionConfig,
    PNMixModelCache,
    RelayModelCache,
    enable_kvlab_attention,
    plan_model,
)
from kvlab.pnmix import PNMixConfig

SMALL_PNMIX = PNMixConfig(sink_tokens=2, residual_tokens=4, group_tokens=4)
RATIO = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=4)
CAPACITY = EvictionConfig(capacity=12, scorer="snapkv", sink_tokens=2, window_tokens=4)
KINDS = ("pnmix", "ratio", "capacity", "composed")
PROMPT = 30


def _compresses(name: str) -> bool:
    return bool(plan_model(FAMILIES[name].config()).full_layers)


NAMES = [name for name in FAMILIES if _compresses(name)]


@functools.cache
def _model(name: str) -> Any:
    model = FAMILIES[name].build(seed=7)
    enable_kvlab_attention(model)
    return model


def make_cache(name: str, kind: str) -> Any:
    model = _model(name)
    if kind == "pnmix":
        return PNMixModelCache(model.config, SMALL_PNMIX)
    eviction = CAPACITY if kind == "capacity" else RATIO
    if "relay" in FAMILIES[name].refused:  # NoPE full layers: eviction without relay
        eviction = EvictionConfig(**{**vars(eviction), "relay": False})
    if kind == "composed":
        return ComposedModelCache(model.config, eviction, SMALL_PNMIX)
    return RelayModelCache(model.config, eviction)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model: Any, cache: Any, chunks: list[torch.Tensor], mask: torch.Tensor | None = None):
    """Logits of each forward of ``chunks`` (each ``[B, T_i]``) through ``cache``."""
    out, seen = [], 0
    with torch.no_grad():
        for chunk in chunks:
            seen += chunk.shape[1]
            m = None if mask is None else mask[:, :seen]
            out.append(model(chunk, attention_mask=m, cache=cache).logits)
    return torch.cat(out, 1)


def _stored(cache: Any) -> list[Any]:
    """What each layer holds: tokens per head for evicting layers, tokens seen otherwise."""
    rows = []
    for layer in cache.layers:
        if hasattr(layer, "tokens_per_head"):
            rows.append([layer.tokens_per_head(b) for b in range(layer.batch_rows())])
        else:
            rows.append(layer.get_seq_length())
    return rows


def _decode(ids: torch.Tensor) -> list[torch.Tensor]:
    return [ids[:, :PROMPT]] + [ids[:, t : t + 1] for t in range(PROMPT, ids.shape[1])]


# ------------------------------------------------------------------ reset and reuse


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_reset_gives_a_cache_that_behaves_as_a_new_one(name, kind):
    """A left-padded conversation, ``reset()``, then an unpadded batch of the same shape: the
    logits and the stored tokens equal a new cache's, bit for bit (a relay cache kept the first
    conversation's forward plan: rows stored fewer tokens, logits 0.4 off)."""
    model = _model(name)
    ids = _ids(2, PROMPT + 4, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    cache = make_cache(name, kind)
    _run(model, cache, [ids[:, :PROMPT]], mask)  # one forward: the plan of forward 0 stays
    cache.reset()
    fresh = make_cache(name, kind)
    assert torch.equal(_run(model, cache, _decode(ids)), _run(model, fresh, _decode(ids)))
    assert _stored(cache) == _stored(fresh)


@pytest.mark.parametrize("kind", KINDS)
def test_reset_after_a_refused_forward(kind):
    """A conversation that ended with a refused decode step: after ``reset()`` the next one
    runs as on a new cache (it was refused with the first conversation's error)."""
    name = "llama"
    model = _model(name)
    ids = _ids(1, PROMPT + 3, seed=4)
    cache = make_cache(name, kind)
    _run(model, cache, [ids[:, :PROMPT]])
    with pytest.raises(ValueError), torch.no_grad():
        bad = torch.ones(1, PROMPT + 2, dtype=torch.long)  # two new columns for one token
        model(ids[:, PROMPT : PROMPT + 1], attention_mask=bad, cache=cache)
    cache.reset()
    fresh = make_cache(name, kind)
    assert torch.equal(_run(model, cache, _decode(ids)), _run(model, fresh, _decode(ids)))


# ------------------------------------------------------------------ masks with holes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen2"])
def test_a_mask_with_a_hole_in_a_past_position_is_refused_and_changes_nothing(name, kind):
    """A one-token decode whose mask hides a past real token: transformers' own attention
    honours it (its logits change); a kvlab cache, which stores no per-token mask, refuses it
    with one ValueError, and the cache then decodes exactly as one that never saw it (PN-Mix
    read only the mask's last column and returned the no-hole logits)."""
    model = _model(name)
    ids = _ids(2, PROMPT + 2, seed=5)
    hole = torch.ones(2, PROMPT + 1, dtype=torch.long)
    hole[0, PROMPT // 2] = 0
    with torch.no_grad():  # the independent reference: the hole matters
        ref = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa" if type(model)._supports_sdpa else "eager")
        model(ids[:, :PROMPT], cache=ref)
        holed = model(ids[:, PROMPT : PROMPT + 1], attention_mask=hole, cache=ref).logits
        enable_kvlab_attention(model)
    ref_plain = DynamicCache(config=model.config)
    plain = _run(model, ref_plain, [ids[:, :PROMPT], ids[:, PROMPT : PROMPT + 1]])
    assert not torch.allclose(holed[0], plain[0, -1:], atol=1e-4)

    cache, twin = make_cache(name, kind), make_cache(name, kind)
    _run(model, cache, [ids[:, :PROMPT]])
    _run(model, twin, [ids[:, :PROMPT]])
    with pytest.raises(ValueError, match="mask"), torch.no_grad():
        model(ids[:, PROMPT : PROMPT + 1], attention_mask=hole, cache=cache)
    rest = [ids[:, t : t + 1] for t in range(PROMPT, PROMPT + 2)]
    assert torch.equal(_run(model, cache, rest), _run(model, twin, rest))
    assert _stored(cache) == _stored(twin)


# ------------------------------------------------------------------ a fault in one row


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_value_in_one_row_leaves_the_other_rows_intact(kind):
    """Row 0's decode token embeds to NaN (as a DynamicCache, that row's outputs turn NaN):
    the other row's logits equal that row run alone, every layer saw every token, and the
    cache goes on decoding (a capacity-mode relay cache raised after layer 0 stored the token,
    then refused every later forward)."""
    name = "llama"
    model = _model(name)
    ids = _ids(2, PROMPT + 12, seed=6)
    emb = model.model.embed_tokens.weight
    poisoned = 5
    ids[:, PROMPT:] = torch.where(ids[:, PROMPT:] == poisoned, 6, ids[:, PROMPT:])
    ids[0, PROMPT] = poisoned
    cache, alone = make_cache(name, kind), make_cache(name, kind)
    saved = emb.data[poisoned].clone()
    try:
        emb.data[poisoned] = float("nan")
        both = _run(model, cache, _decode(ids))
    finally:
        emb.data[poisoned] = saved
    single = _run(model, alone, _decode(ids[1:]))
    assert not torch.isfinite(both[0, PROMPT:]).all()
    torch.testing.assert_close(both[1], single[0], atol=1e-5, rtol=1e-4)
    assert len({layer.get_seq_length() for layer in cache.layers}) == 1


# ------------------------------------------------------------------ inference mode


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_cache_filled_in_inference_mode_continues_outside_it(name, kind):
    """Generate under ``torch.inference_mode()``, continue under ``no_grad`` (a serving
    pattern that works with ``DynamicCache``): the logits equal a run entirely under
    ``no_grad`` (PyTorch's "Inplace update to inference tensor" came out of the stores)."""
    model = _model(name)
    ids = _ids(1, PROMPT + 24, seed=8)
    chunks = _decode(ids)
    cache, reference = make_cache(name, kind), make_cache(name, kind)
    with torch.inference_mode():
        first = [model(c, cache=cache).logits for c in chunks[:6]]
    later = _run(model, cache, chunks[6:])
    expected = _run(model, reference, chunks)
    assert torch.equal(torch.cat([*first, later], 1), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_masked_forward_inside_inference_mode(kind):
    """A forward with an attention mask made inside ``torch.inference_mode()`` (inference
    tensors carry no version counter: the PN-Mix mask check read it and raised), then decode
    outside it, equals a run under ``no_grad``."""
    model = _model("llama")
    ids = _ids(2, PROMPT + 3, seed=12)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, :5] = 0
    cache, reference = make_cache("llama", kind), make_cache("llama", kind)
    with torch.inference_mode():
        first = model(ids[:, :PROMPT], attention_mask=mask.clone(), cache=cache).logits
    steps = [ids[:, t : t + 1] for t in range(PROMPT, PROMPT + 3)]
    full = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    with torch.no_grad():
        expected = model(ids[:, :PROMPT], attention_mask=mask, cache=reference).logits
        outs, refs = [], []
        for t, step in enumerate(steps):
            m = full[:, : PROMPT + t + 1]
            outs.append(model(step, attention_mask=m, cache=cache).logits)
            refs.append(model(step, attention_mask=m, cache=reference).logits)
    assert torch.equal(first, expected) and torch.equal(torch.cat(outs, 1), torch.cat(refs, 1))


# ------------------------------------------------------------------ split prompts


@pytest.mark.parametrize("split", [[1, 79], [40, 40], [20, 20, 40], [1, 1, 78]])
def test_a_ratio_budget_holds_however_the_prompt_arrives(split):
    """A prompt fed in several forwards (chunked prefill, a first token then the rest) keeps
    what the same prompt fed in one forward keeps per layer (``round((1 - ratio) * n)`` tokens
    per kv head on average) and reaches the same next RoPE position; ``details()`` counts the
    forwards it arrived in (it kept 80 of 80 tokens for [1, 79], 61 for [40, 41]). The budget
    holds per layer; which tokens each head keeps depends on what each eviction saw."""
    name = "llama"
    model = _model(name)
    ids = _ids(1, 81, seed=9)
    whole = make_cache(name, "ratio")
    _run(model, whole, [ids[:, :80], ids[:, 80:]])
    cache, chunks, start = make_cache(name, "ratio"), [], 0
    for n in split:
        chunks.append(ids[:, start : start + n])
        start += n
    _run(model, cache, [*chunks, ids[:, 80:]])
    for mine, theirs in zip(cache.layers, whole.layers, strict=True):
        assert sum(mine.tokens_per_head(0)) == sum(theirs.tokens_per_head(0))
    assert sum(whole.layers[0].tokens_per_head(0)) == 2 * 40 + 2  # 2 kv heads, + the decode
    assert cache.next_positions == whole.next_positions
    assert cache.details()["prompt_forwards"] == [len(split)]
    assert whole.details()["prompt_forwards"] == [1]


@pytest.mark.parametrize("split", [[1, 80], [40, 41], [1, 1, 79]])
def test_a_composed_cache_refuses_a_split_prompt_before_storing(split):
    """Issue 38, item 6: a composed cache evicts and packs a prompt at its first forward, so it
    cannot honour the ratio's budget for a prompt that keeps arriving (before, a prompt of 81
    split 1 + 80 kept 81 tokens per head and 40 + 41 kept 61, with a UserWarning; the relay
    cache evicts every chunk, test_a_ratio_budget_holds_however_the_prompt_arrives): a
    multi-token forward while the prompt is open — no decode step after its eviction yet — is
    refused before anything is stored. After ``end_prompt()`` the same tokens are a
    continuation; a decode step after the eviction closes the prompt too."""
    model = _model("llama")
    ids = _ids(1, 83, seed=9)
    chunks, start = [], 0
    for n in split:
        chunks.append(ids[:, start : start + n])
        start += n
    cache = make_cache("llama", "composed")
    _run(model, cache, chunks[:-1])
    before = (_stored(cache), cache.get_seq_length(), cache.details()["prompt_forwards"])
    with pytest.raises(ValueError, match="split prompt"):
        _run(model, cache, chunks[-1:])
    assert (_stored(cache), cache.get_seq_length(), cache.details()["prompt_forwards"]) == before
    cache.end_prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _run(model, cache, chunks[-1:])
    assert cache.get_seq_length() == 81
    # the prompt in one forward, a decode step, then more tokens: a continuation
    whole = make_cache("llama", "composed")
    _run(model, whole, [ids[:, :80], ids[:, 80:81], ids[:, 81:]])
    assert whole.get_seq_length() == 83 and whole.details()["prompt_forwards"] == [1]
