"""Atomic failure on every model family with window layers, and on a full-attention family.

Each kvlab model cache (RelayModelCache, PNMixModelCache, ComposedModelCache) refuses a bad
forward with ONE ``ValueError`` and leaves every layer — window layers included, and state no
forward has touched yet — bit-identical to before the call: the whole cache is deep-copied
before the call and compared field by field afterwards (tensors byte for byte with
``torch.equal``). Families whose first layer is a sliding-window layer (Gemma 2/3, GPT-OSS,
Cohere 2, Llama 4's chunked layers) are the hard case: their window layers store the forward's
tokens before the first full-attention layer sees the attention mask it checks. Every refusal
is tried twice (a refused input is refused again), and the cache then continues exactly like
one that never saw the refusals.

The tiny configs are the model matrix's (``FAMILIES``, tests/fixtures/tiny_models.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES, prompt

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention
from kvlab.integrations.composed_cache import ComposedModelCache
from kvlab.integrations.model_support import plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.pnmix import PNMixConfig

KINDS = ("relay", "pnmix", "composed")
# the model matrix's compressing configurations
SMALL_PNMIX = PNMixConfig(sink_tokens=2, residual_tokens=4, group_tokens=4)
SMALL_RELAY = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=4)
# a ratio eviction no prompt of 2..46 tokens can meet (8 sinks + 16 recent tokens protected)
SHORT_RELAY = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=8, window_tokens=16)
LONGEST_REFUSED = 46  # tokens; 47 is accepted (checked in test_short_prompt_bounds)


def _plan(name: str) -> Any:
    return plan_model(FAMILIES[name].config())


# every family with window layers, and a plain full-attention family
NAMES = [name for name in FAMILIES if _plan(name).window_layers] + ["llama"]


@functools.cache
def _model(name: str) -> Any:
    return FAMILIES[name].build(seed=31)


def make_cache(name: str, kind: str, eviction: EvictionConfig = SMALL_RELAY) -> Any:
    model = _model(name)
    if kind == "pnmix":
        return PNMixModelCache(model.config, SMALL_PNMIX)
    if "relay" in FAMILIES[name].refused:  # NoPE full layers: eviction without relay
        eviction = EvictionConfig(**{**vars(eviction), "relay": False})
    if kind == "relay":
        return RelayModelCache(model.config, eviction)
    return ComposedModelCache(model.config, eviction, SMALL_PNMIX)


# ------------------------------------------------------------------ bit-identical state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same_state(
    before: Any,
    after: Any,
    path: str = "cache",
    seen: set | None = None,
    ignore: frozenset[str] = frozenset(),
) -> None:
    """``after`` equals ``before`` (its deep copy) in every reachable field: tensors by dtype,
    shape, device and bytes; numpy arrays by dtype, shape and bytes; containers and objects
    field by field (dataclasses: their compared fields), except attributes named in
    ``ignore``."""
    seen = set() if seen is None else seen
    if id(after) in seen:
        return
    seen.add(id(after))
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert (before.dtype, before.shape, before.device) == (
            after.dtype,
            after.shape,
            after.device,
        ), path
        assert torch.equal(_bits(before), _bits(after)), path
    elif isinstance(before, np.ndarray):
        assert isinstance(after, np.ndarray), path
        assert (before.dtype, before.shape) == (after.dtype, after.shape), path
        assert before.tobytes() == after.tobytes(), path
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), path
        for key in before:
            if key not in ignore:
                assert_same_state(before[key], after[key], f"{path}[{key!r}]", seen, ignore)
    elif isinstance(before, (list, tuple)):
        assert type(before) is type(after) and len(before) == len(after), path
        for i, (x, y) in enumerate(zip(before, after, strict=True)):
            assert_same_state(x, y, f"{path}[{i}]", seen, ignore)
    elif dataclasses.is_dataclass(before) and not isinstance(before, type):
        assert type(before) is type(after), path
        for f in dataclasses.fields(before):
            if f.compare:  # compare=False: a memo (e.g. RotaryConfig's per-device tables)
                name = f"{path}.{f.name}"
                assert_same_state(
                    getattr(before, f.name), getattr(after, f.name), name, seen, ignore
                )
    elif hasattr(before, "__dict__") and not callable(before):
        assert type(before) is type(after), path
        assert_same_state(vars(before), vars(after), path, seen, ignore)
    else:
        assert before == after, path


def refuse(model: Any, cache: Any, match: str, inputs: dict[str, Any], label: str = "") -> None:
    """``model(**inputs)`` raises one ValueError matching ``match``, twice, and changes no
    field of ``cache``."""
    before = copy.deepcopy(cache)
    for attempt in range(2):
        with pytest.raises(ValueError, match=match) as err:
            model(**inputs, cache=cache)
        assert "\n" not in str(err.value), label
        assert_same_state(before, cache, path=f"{label} (attempt {attempt}): cache")


# ------------------------------------------------------------------ the refused inputs


def _left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = prompt(len(lengths), width, seed)
    mask = torch.ones(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, : width - n] = 0
        mask[row, : width - n] = 0
    return ids, mask


def first_forward_refusals(kind: str) -> list[tuple[str, dict[str, Any], str]]:
    """(label, forward inputs, error match) refused in a cache's first forward."""
    ids, mask = _left_padded([24, 20], seed=1)
    right = mask.flip(1)  # row 1 padded on the right
    cases = [
        ("right padding", dict(input_ids=ids, attention_mask=right), "left padding only"),
        ("attention weights", dict(input_ids=ids, output_attentions=True), "attention weights"),
    ]
    if kind != "pnmix":
        holes = torch.arange(24).expand(2, 24) * 2
        cases.append(
            (
                "non-consecutive position_ids",
                dict(input_ids=ids, attention_mask=mask, position_ids=holes),
                "consecutive position_ids",
            )
        )
    if kind == "composed":
        empty = mask.clone()
        empty[1] = 0
        cases.append(
            (
                "a row of padding only",
                dict(input_ids=ids, attention_mask=empty),
                r"rows \[1\] have no real token",
            )
        )
    return cases


def later_refusals(
    kind: str, ids: torch.Tensor, mask: torch.Tensor
) -> list[tuple[str, dict[str, Any], str]]:
    """(label, forward inputs, error match) refused after a left-padded prefill ``ids``."""
    batch, seen = ids.shape
    step = prompt(batch, 3, seed=2)
    good = torch.cat([mask, torch.ones(batch, 3, dtype=mask.dtype)], 1)
    right, old = good.clone(), good.clone()
    right[0, -2] = 0
    old[1, 0] = 1 - old[1, 0]
    cases = [
        ("right padding", dict(input_ids=step, attention_mask=right), "left padding only"),
        (
            "old columns",
            dict(input_ids=step, attention_mask=old),
            "past tokens" if kind == "pnmix" else "differ from the padding",
        ),
        (
            "short mask",
            dict(input_ids=step, attention_mask=good[:, 1:]),
            "columns" if kind == "pnmix" else "2-D attention_mask",
        ),
        ("batch", dict(input_ids=prompt(batch + 1, 3, seed=3)), "new batch|do not fit"),
        (
            "attention weights",
            dict(input_ids=step, attention_mask=good, output_attentions=True),
            "attention weights",
        ),
        (
            "decode mask",
            dict(input_ids=step[:, :1], attention_mask=good[:, :-3]),
            "columns" if kind == "pnmix" else "2-D attention_mask",
        ),
    ]
    if kind != "pnmix":
        late = good.clone()
        late[1, -3] = 0
        holes = torch.arange(3).expand(batch, 3) * 2 + seen
        cases += [
            ("pad after tokens", dict(input_ids=step, attention_mask=late), "first token"),
            (
                "non-consecutive position_ids",
                dict(input_ids=step, attention_mask=good, position_ids=holes),
                "consecutive position_ids",
            ),
        ]
    return cases


# ------------------------------------------------------------------ the tests

# inputs a family legitimately accepts: Llama 4's attention never receives position_ids (its
# full layer is NoPE and, without relay, never rotates by them)
ACCEPTED = {("llama4", "non-consecutive position_ids")}
# refused by the kvlab attention itself, on plain tensors too (all-window models)
ATTENTION_REFUSALS = ("attention weights",)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_every_refused_forward_changes_no_layer(name, kind):
    model = _model(name)
    has_full = bool(_plan(name).full_layers)
    ids, mask = _left_padded([24, 20], seed=4)
    step = prompt(2, 3, seed=2)
    good = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        # all-window models: no kvlab layer; the kvlab attention's own refusals remain
        for label, inputs, match in first_forward_refusals(kind):
            if (name, label) in ACCEPTED or not (has_full or label in ATTENTION_REFUSALS):
                continue
            cache = make_cache(name, kind)
            refuse(model, cache, match, inputs, label)
            assert not any(layer.is_initialized for layer in cache.layers), label
        if has_full and kind != "pnmix":
            cache = make_cache(name, kind, SHORT_RELAY)
            short = dict(input_ids=ids[1:, 4:])
            refuse(model, cache, "cannot evict after the 20-token prefill", short, "short")
        cache = make_cache(name, kind)
        model(ids, attention_mask=mask, cache=cache)
        if kind == "composed":  # later multi-token forwards continue the conversation (a
            cache.end_prompt()  # composed cache refuses more of an open prompt)
        cases = later_refusals(kind, ids, mask)
        if not has_full:
            cases = [case for case in cases if case[0] in ("batch", *ATTENTION_REFUSALS)]
        cases = [case for case in cases if (name, case[0]) not in ACCEPTED]
        for label, inputs, match in cases:
            refuse(model, cache, match, inputs, label)
        # the cache continues exactly as one that never saw a refusal
        reference = make_cache(name, kind)
        model(ids, attention_mask=mask, cache=reference)
        if kind == "composed":
            reference.end_prompt()
        out = model(step, attention_mask=good, cache=cache).logits
        assert torch.equal(out, model(step, attention_mask=good, cache=reference).logits)
        # (PN-Mix's per-forward mask memo is keyed by the mask object's id)
        assert_same_state(reference, cache, ignore=frozenset({"_key", "_mask"}))


HYBRID = [name for name in NAMES if _plan(name).window_layers and _plan(name).full_layers]


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from([name for name in HYBRID if _plan(name).layers[0].is_window]),
    kind=st.sampled_from(KINDS),
    refusal=st.sampled_from(["short prompt", "right padding", "batch"]),
    lengths=st.tuples(st.integers(2, LONGEST_REFUSED), st.integers(47, 60)),
    short_row=st.integers(0, 1),
    gap=st.integers(0, 100),
    batch=st.sampled_from([1, 3, 4]),
)
def test_refusals_with_a_window_layer_first(name, kind, refusal, lengths, short_row, gap, batch):
    """A window layer first (it stores before any check): prompt lengths, padded rows, the
    position of a right-padding hole and batch sizes vary."""
    short, long = lengths
    if refusal == "batch":
        short = max(short, 12)  # a prefill SMALL_RELAY can evict from
    rows = [long, long]
    rows[short_row] = short
    ids, mask = _left_padded(rows, seed=5)
    model = _model(name)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        if refusal == "short prompt":
            if kind == "pnmix":
                kind = "relay"  # PN-Mix has no length limit
            cache = make_cache(name, kind, SHORT_RELAY)
            match = f"cannot evict after the {short}-token prefill of row {short_row}"
            refuse(model, cache, match, dict(input_ids=ids, attention_mask=mask))
            return
        cache = make_cache(name, kind)
        if refusal == "right padding":
            hole = mask.clone()
            first_real = mask.shape[1] - rows[short_row]
            hole[short_row, first_real + 1 + gap % (rows[short_row] - 1)] = 0  # after a one
            refuse(model, cache, "left padding only", dict(input_ids=ids, attention_mask=hole))
            return
        model(ids, attention_mask=mask, cache=cache)
        refuse(model, cache, "new batch|do not fit", dict(input_ids=prompt(batch, 3, seed=6)))


def test_short_prompt_bounds():
    """The SHORT_RELAY bounds the tests rely on: 46 tokens refused, 47 accepted."""
    model = _model("gemma3")
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        with pytest.raises(ValueError, match="cannot evict"):
            model(prompt(1, LONGEST_REFUSED, 7), cache=make_cache("gemma3", "relay", SHORT_RELAY))
        model(prompt(1, LONGEST_REFUSED + 1, 7), cache=make_cache("gemma3", "relay", SHORT_RELAY))


@pytest.mark.parametrize("kind", ["pnmix", "composed"])
def test_unknown_backend_environment_is_refused_at_construction(kind, monkeypatch):
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"KVLAB_PNMIX_BACKEND='fast': must be 'auto' or one of"):
        make_cache("gemma3", kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [name for name in NAMES if _plan(name).full_layers])
def test_forgetting_the_kvlab_attention_changes_no_layer(name, kind):
    """A kvlab cache read by the model's own attention (``sdpa``/``eager``, the kvlab one not
    enabled) raises one TypeError naming the fix, and leaves every layer as it was: the
    forward after enabling it equals a fresh cache's."""
    model = _model(name)
    ids, mask = _left_padded([24, 20], seed=8)
    assert model.config._attn_implementation != KVLAB_ATTENTION
    cache = make_cache(name, kind)
    before = copy.deepcopy(cache)
    with torch.no_grad():
        for _ in range(2):
            with pytest.raises(TypeError, match="enable_kvlab_attention"):
                model(ids, attention_mask=mask, cache=cache)
            assert_same_state(before, cache)
        with use_attention(model, KVLAB_ATTENTION):
            out = model(ids, attention_mask=mask, cache=cache).logits
            fresh = make_cache(name, kind)
            assert torch.equal(out, model(ids, attention_mask=mask, cache=fresh).logits)
