"""Teacher-forced scoring equals the decode path (issue 38, item 3; docs/design.md, "Cache life
cycle"): :func:`kvlab.evaluation.questions.answer_nll` scores an answer in one forward of the
question and the answer, whose answer tokens the cache stores and attends as
:func:`~kvlab.evaluation.questions.answer` feeds them — the question's forward, then one token at
a time. The reference here is that path itself: a copy of the compressed cache fed the question,
then each answer token alone."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from tiny_models import FAMILIES

from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.protocols import cache_keyword, position_kwargs
from kvlab.evaluation.questions import answer, answer_nll, compress_context
from kvlab.integrations.attention import use_attention
from kvlab.integrations.model_support import plan_model

# every method family: full attention, PN-Mix (two codings), RoPE-Relay eviction (with and
# without relay), eviction composed with PN-Mix
METHODS = (
    "full",
    "pn-mix-lean",
    "kivi-2bit",
    "relay:snapkv@0.5",
    "evict-no-relay:keynorm@0.5",
    "relay:snapkv@0.5+pn-mix-lean",
    "evict-no-relay:snapkv@0.5+pn-mix",
)


@functools.cache
def _model(name: str) -> Any:
    return FAMILIES[name].build(seed=3)


def _prepared(method: Any, model: Any) -> dict[str, Any] | None:
    if method.preparation is None:
        return None
    layers = len(plan_model(model.config).full_layers)  # calibrated per-layer budgets
    return {"layer_fractions": [0.7 if i % 2 else 0.3 for i in range(layers)]}


def _decode_path_nll(model: Any, compressed: Any, question: torch.Tensor, reply: list[int]) -> Any:
    """The answer's NLL as ``answer`` feeds it: the question's forward, then one token at a
    time (float64 log-softmax of the float32 logits)."""
    cache = copy.deepcopy(compressed.cache)
    key = cache_keyword(model)
    nll = []
    with torch.no_grad(), use_attention(model, compressed.method.attention):
        ids = question
        for token in reply:
            out = model(ids, use_cache=True, **{key: cache}, **position_kwargs(cache, ids.shape[1]))
            logits = out.logits[0, -1].double()
            nll.append(float(-torch.log_softmax(logits, -1)[token]))
            ids = torch.tensor([[token]])
    return nll


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("method_name", METHODS)
def test_answer_nll_is_the_decode_path(name, method_name):
    """``answer_nll`` equals the decode path's NLL to float32 rounding (1e-4 nats per token;
    the model's projections over ``A`` rows and over one round differently) for every method
    family; before, the PN-Mix family scored the question and answer stored, flushed, then
    attended, ~1e-2 nats per token away (``full`` and relay were already equal). Answers of
    40 tokens cross group flushes of every PN-Mix coding here."""
    model = _model(name)
    gen = torch.Generator().manual_seed(11)
    context = torch.randint(3, 96, (1, 120), generator=gen)
    question = torch.randint(3, 96, (1, 7), generator=gen)
    protocol = "prefill-score" if "+" in method_name else "ruler"
    method = parse_method(method_name, protocol=protocol)
    with torch.no_grad():
        compressed = compress_context(model, context, method, prepared=_prepared(method, model))
        reply = answer(model, compressed, question, max_new_tokens=40).tokens
        got = answer_nll(model, compressed, question, torch.tensor([reply]))
    want = _decode_path_nll(model, compressed, question, reply)
    assert len(got) == len(want) == 40
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
