"""A replayed prefill (kvlab.integrations.prefill_replay) builds the cache the method's own
prefill builds: layer 0 bit-identical, every later layer within the rounding of another
attention kernel, and the same greedy answer (kvlab.evaluation.questions)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import FAMILIES

from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.questions import answer, answer_nll, compress_context
from kvlab.integrations.prefill_replay import attention_modules, capture_prefill, replay_prefill

CONTEXT = 160
METHODS = (
    "full",
    "pn-mix",
    "kivi-2bit",
    "int2",
    "relay:snapkv@0.5",
    "evict-no-relay:snapkv@0.5",
    "relay:keynorm@0.5",
    "streaming-llm@0.5",
    "evict-no-relay:expected-attention@0.5",
    "evict-no-relay:kvzip@0.5",
    "evict-no-relay:snapkv@0.5+pn-mix-lean",
    "evict-no-relay:kvzip@0.5+pn-mix-lean",
)


def _prepared(method, layers: int):
    """Stand-ins for the preparations: uneven per-layer budgets, a short KVzip request."""
    if method.preparation is None:
        return None
    prepared = {}
    if method.params.get("calibrated"):
        prepared["layer_fractions"] = [0.7 if i % 2 else 0.3 for i in range(layers)]
    if method.params.get("reconstruction"):
        prepared["kvzip_prompt"] = {"first_ids": [5, 6, 7], "next_ids": [8, 9], "suffix_ids": [10]}
    return prepared


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(3, 96, (1, CONTEXT), generator=gen)
    question = torch.randint(3, 96, (1, 9), generator=gen)
    return context, question


def _tensors(root, max_depth: int = 4) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` within ``max_depth`` attribute/item steps, in a
    fixed order (any cache kind)."""
    out: list[torch.Tensor] = []

    def walk(obj, depth: int = 0) -> None:
        if depth > max_depth:
            return
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, depth + 1)

    walk(root)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, with NaN equal to NaN in the same places (a state may hold NaN
    placeholders, e.g. PN-Mix's ``value_choice_errors`` where no choice was made)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _layer0(cache) -> list[torch.Tensor]:
    """Every tensor of layer 0's state, flattened (any cache kind)."""
    return _tensors(cache.layers[0])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("name", METHODS)
def test_replay_matches_own_prefill(family: str, name: str) -> None:
    if family not in FAMILIES:
        pytest.skip(f"no {family} in the model matrix")
    model = FAMILIES[family].build(seed=5)
    method = parse_method(name)
    layers = len(attention_modules(model))
    prepared = _prepared(method, layers)
    context, question = _inputs(1)
    capture = capture_prefill(model, context)
    try:
        own = compress_context(model, context, method, prepared=prepared)
    except ValueError as error:  # a method refused on this family refuses the replay too
        with pytest.raises(
            ValueError, match=str(error)[:40].replace("(", r"\(").replace("[", r"\[")
        ):
            compress_context(model, context, method, prepared=prepared, capture=capture)
        return
    replayed = compress_context(model, context, method, prepared=prepared, capture=capture)
    assert replayed.replayed and not own.replayed
    assert replayed.storage == own.storage
    # layer 0 saw identical inputs: identical state
    for a, b in zip(_layer0(own.cache), _layer0(replayed.cache), strict=True):
        assert _same_bits(a, b)
    first_own = answer(model, own, question, max_new_tokens=1)
    first_replay = answer(model, replayed, question, max_new_tokens=1)
    assert first_own.tokens == first_replay.tokens
    a = answer(model, own, question, max_new_tokens=10)
    b = answer(model, replayed, question, max_new_tokens=10)
    assert a.tokens == b.tokens
    assert a.storage == b.storage


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_skipped_outputs_store_the_same_bits(family: str, name: str) -> None:
    """A replay that does not compute the prefill's attention outputs (the default) leaves
    every layer's state bit-identical to one that computes them."""
    if family not in FAMILIES:
        pytest.skip(f"no {family} in the model matrix")
    model = FAMILIES[family].build(seed=5)
    method = parse_method(name)
    prepared = _prepared(method, len(attention_modules(model)))
    context, _ = _inputs(2)
    capture = capture_prefill(model, context)
    caches = []
    for skip in (False, True):
        try:
            cache = method.make_cache(model.config, prepared)
            replay_prefill(model, capture, cache, attention=method.attention, skip_outputs=skip)
        except ValueError:  # refused on this family (test_replay_matches_own_prefill)
            return
        caches.append(cache)
    computed, skipped = (_tensors(c.layers, max_depth=6) for c in caches)
    assert computed and len(computed) == len(skipped)
    for a, b in zip(computed, skipped, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and _same_bits(a, b)


def test_skipped_outputs_run_no_prefill_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the default replay the prefill's own attention kernels are not called; with
    ``skip_outputs=False`` they are."""
    import kvlab.integrations.pnmix_layer as pnmix_layer
    import kvlab.integrations.relay_layer as relay_layer

    calls: list[str] = []

    def spy(name, real):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(relay_layer, "ragged_attention", spy("relay", relay_layer.ragged_attention))
    monkeypatch.setattr(
        pnmix_layer, "dense_causal_attention", spy("pnmix", pnmix_layer.dense_causal_attention)
    )
    model = FAMILIES["llama"].build(seed=5)
    context, _ = _inputs(3)
    capture = capture_prefill(model, context)
    for name, kind in (("evict-no-relay:keynorm@0.5", "relay"), ("pn-mix", "pnmix")):
        method = parse_method(name)
        cache = method.make_cache(model.config, None)
        replay_prefill(model, capture, cache, attention="kvlab")
        assert kind not in calls
        cache = method.make_cache(model.config, None)
        replay_prefill(model, capture, cache, attention="kvlab", skip_outputs=False)
        assert calls.count(kind) == len(attention_modules(model))


def test_full_replay_is_the_capture_and_answers_match_generate() -> None:
    """``full`` on a capture is the capture's DynamicCache; its greedy answer equals
    ``generate`` on context + question."""
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(4)
    capture = capture_prefill(model, context)
    compressed = compress_context(model, context, parse_method("full"), capture=capture)
    reply = answer(model, compressed, question, max_new_tokens=8)
    ids = torch.cat([context, question], dim=1)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert reply.tokens == reference[0, ids.shape[1] :].tolist()
    # the copy: a second answer sees the same compressed context
    assert answer(model, compressed, question, max_new_tokens=8).tokens == reply.tokens


def test_question_is_not_part_of_the_prompt() -> None:
    """After compression a question forward does not re-evict a ratio-mode relay cache: the
    stored tokens are the compressed context plus the question, every head."""
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(6)
    compressed = compress_context(model, context, parse_method("relay:keynorm@0.5"))
    kept = compressed.cache.layers[0].tokens_per_head()
    reply = answer(model, compressed, question, max_new_tokens=1, copy_cache=False)
    after = compressed.cache.layers[0].tokens_per_head()
    assert after == [k + question.shape[1] for k in kept]
    assert reply.tokens and compressed.cache.details()["evictions"] == layers_of(model)


def layers_of(model) -> int:
    return len(attention_modules(model))


def test_stop_tokens_and_bad_input() -> None:
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(7)
    compressed = compress_context(model, context, parse_method("full"))
    free = answer(model, compressed, question, max_new_tokens=6)
    stopped = answer(model, compressed, question, max_new_tokens=6, stop_token_ids=[free.tokens[2]])
    assert (
        stopped.stopped and stopped.tokens == free.tokens[: free.tokens.index(free.tokens[2]) + 1]
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        answer(model, compressed, question, max_new_tokens=0)
    with pytest.raises(ValueError, match="question_ids"):
        answer(model, compressed, question[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="context_ids"):
        compress_context(model, context.float(), parse_method("full"))
    other, _ = _inputs(8)
    with pytest.raises(ValueError, match="other tokens"):
        compress_context(
            model, other, parse_method("full"), capture=capture_prefill(model, context)
        )


def test_wrong_argument_types_are_one_type_error_each() -> None:
    """A method name, a LoadedModel, a list of ids or a bare cache in the place of what the
    functions take: a TypeError saying what to pass, and the compressed context unchanged."""
    from kvlab.models import LoadedModel

    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(7)
    loaded = LoadedModel(model, None, "tiny", "tiny", "", 0.0, torch.float32, torch.device("cpu"))
    full = parse_method("full")
    with pytest.raises(TypeError, match=r"got a str: call kvlab\.parse_method\('pn-mix'\) first"):
        compress_context(model, context, "pn-mix")
    with pytest.raises(TypeError, match=r"got dict"):
        compress_context(model, context, full.record())
    with pytest.raises(TypeError, match=r"got a LoadedModel: pass loaded\.model"):
        compress_context(loaded, context, full)
    with pytest.raises(TypeError, match=r"context_ids must be a torch int64 tensor .* got list"):
        compress_context(model, context.tolist(), full)
    with pytest.raises(TypeError, match=r"model must be a transformers causal LM .* got str"):
        compress_context("llama", context, full)
    compressed = compress_context(model, context, full)
    reply = answer(model, compressed, question, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"pass loaded\.model"):
        answer(loaded, compressed, question, max_new_tokens=4, copy_cache=False)
    with pytest.raises(TypeError, match=r"question_ids must be a torch int64 tensor .* got list"):
        answer(model, compressed, question.tolist(), max_new_tokens=4, copy_cache=False)
    with pytest.raises(TypeError, match=r"compressed must be what kvlab\.compress_context"):
        answer(model, compressed.cache, question, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"pass loaded\.model"):
        answer_nll(loaded, compressed, question, question)
    with pytest.raises(TypeError, match=r"answer_ids must be a torch int64 tensor"):
        answer_nll(model, compressed, question, [1, 2])
    assert compressed.cache.get_seq_length() == context.shape[1]  # nothing fed
    assert answer(model, compressed, question, max_new_tokens=4).tokens == reply.tokens


def test_replay_refuses_another_model_and_a_used_cache() -> None:
    """A capture replays only into the model it ran, and only into a fresh cache; both
    refusals change nothing."""
    model = FAMILIES["llama"].build(seed=2)
    other = FAMILIES["llama"].build(seed=3)  # same shapes, other weights
    context, _ = _inputs(9)
    capture = capture_prefill(model, context)
    method = parse_method("pn-mix")
    cache = method.make_cache(other.config, None)
    with pytest.raises(ValueError, match="another model"):
        replay_prefill(other, capture, cache, attention="kvlab")
    assert cache.get_seq_length() == 0
    for name in ("pn-mix", "full"):
        with pytest.raises(ValueError, match="another model"):
            compress_context(other, context, parse_method(name), capture=capture)
    cache = method.make_cache(model.config, None)
    replay_prefill(model, capture, cache, attention="kvlab")
    before = [t.clone() for t in _tensors(cache.layers, max_depth=6)]
    with pytest.raises(ValueError, match="fresh cache; this one holds 160 tokens"):
        replay_prefill(model, capture, cache, attention="kvlab")
    after = _tensors(cache.layers, max_depth=6)
    assert len(before) == len(after) and all(
        _same_bits(a, b) for a, b in zip(before, after, strict=True)
    )


def test_answer_on_a_cache_that_cannot_be_copied_says_how() -> None:
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(10)
    compressed = compress_context(model, context, parse_method("full"))

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise RuntimeError("The default implementation of __deepcopy__() fails here")

    compressed.cache = Uncopyable()
    with pytest.raises(ValueError, match="copy_cache=False"):
        answer(model, compressed, question, max_new_tokens=2)


def test_answer_nll_full_is_the_plain_forward_and_changes_nothing() -> None:
    """``full``: the answer's NLL is the log-softmax of one plain forward over context +
    question + answer (float64 of its logits); the compressed cache is not touched."""
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(9)
    reply = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    compressed = compress_context(model, context, parse_method("full"))
    before = compressed.cache.get_seq_length()
    got = answer_nll(model, compressed, question, reply)
    ids = torch.cat([context, question, reply], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    start = context.shape[1] + question.shape[1] - 1
    want = -torch.log_softmax(logits[start : start + 5], dim=-1)
    want = want.gather(1, reply[0].view(-1, 1)).view(-1)
    assert len(got) == 5
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-4)
    assert compressed.cache.get_seq_length() == before


@pytest.mark.parametrize("name", ["relay:snapkv@0.5", "evict-no-relay:kvzip@0.5", "pn-mix"])
def test_answer_nll_scores_what_the_greedy_decode_saw(name: str) -> None:
    """On a compressed cache (own RoPE positions, a reconstruction pass, packed codes), the
    one teacher-forced forward gives the distributions the decode steps saw: at every step
    the probabilities of all vocabulary tokens after the greedy prefix sum to 1 and the
    greedy token has the largest; a prefix's NLLs are the whole answer's first ones."""
    model = FAMILIES["llama"].build(seed=3)
    method = parse_method(name, protocol="ruler")
    context, question = _inputs(10)
    compressed = compress_context(model, context, method, prepared=_prepared(method, 2))
    reply = answer(model, compressed, question, max_new_tokens=3)
    ids = torch.tensor([reply.tokens], dtype=torch.int64)
    nll = answer_nll(model, compressed, question, ids)
    assert len(nll) == len(reply.tokens)
    vocab = model.config.vocab_size
    for step in range(len(reply.tokens)):
        prefix = ids[:, :step]
        last = [
            answer_nll(model, compressed, question, torch.cat([prefix, torch.tensor([[t]])], 1))
            for t in range(vocab)
        ]
        probs = torch.tensor([math.exp(-x[-1]) for x in last], dtype=torch.float64)
        assert abs(float(probs.sum()) - 1.0) < 1e-6
        assert int(probs.argmax()) == reply.tokens[step]
        assert last[reply.tokens[step]] == pytest.approx(nll[: step + 1], abs=1e-4)


def test_answer_nll_refuses_bad_ids() -> None:
    model = FAMILIES["llama"].build(seed=2)
    context, question = _inputs(11)
    compressed = compress_context(model, context, parse_method("full"))
    with pytest.raises(ValueError, match="answer_ids"):
        answer_nll(model, compressed, question, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="question_ids"):
        answer_nll(model, compressed, question.float(), torch.ones(1, 2, dtype=torch.int64))
