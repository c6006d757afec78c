"""KVzip's model-free parts: the reconstruction attention (the reference against float64
loops, the CPU flash path against the reference in float64), the prompt's chunks, the scorer's
refusals."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab.relay.kvzip_attention as kvzip_attention
from kvlab.relay import KVzipScorer, ReconstructionPrompt
from kvlab.relay.kvzip import chat_template_parts
from kvlab.relay.kvzip_attention import (
    reconstruction_attention,
    reconstruction_attention_reference,
)
from kvlab.relay.scorers import ScoreInputs


def _reference(query, keys, values, valid, own_keys, own_values, scale, columns):
    """float64 loops: per query head and query, softmax over the valid cached slots and the
    causal own tokens (scores: over ``columns`` and the causal own tokens)."""
    _, hq, q_len, _ = query.shape
    heads, slots = keys.shape[1], keys.shape[2]
    group = hq // heads
    out = torch.zeros(hq, q_len, values.shape[-1], dtype=torch.float64)
    scores = torch.zeros(heads, slots, dtype=torch.float64)
    for g in range(hq):
        h = g // group
        k = torch.cat([keys[0, h], own_keys[0, h]]).double()
        v = torch.cat([values[0, h], own_values[0, h]]).double()
        for j in range(q_len):
            logits = (k @ query[0, g, j].double()) * scale
            allowed = torch.cat([valid[0, h], torch.arange(q_len) <= j])
            p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), 0)
            out[g, j] = p @ v
            subset = valid[0, h] if columns is None else valid[0, h] & columns[0, h]
            keep = torch.cat([subset, torch.arange(q_len) <= j])
            ps = torch.softmax(logits.masked_fill(~keep, float("-inf")), 0)[:slots]
            scores[h] = torch.maximum(scores[h], ps.masked_fill(~subset, 0.0))
    return out, scores


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    slots=st.integers(1, 12),
    q_len=st.integers(1, 9),
    subset=st.booleans(),
    block=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    fast=st.booleans(),
)
def test_reconstruction_attention_matches_float64_reference(
    heads, group, slots, q_len, subset, block, seed, fast
):
    """Both paths against the float64 loops: the CPU flash path (``Dv == D``) and the
    reference (``Dv != D`` falls back to it)."""
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    dv = dim if fast else 5
    query = torch.randn(1, heads * group, q_len, dim, generator=gen)
    keys = torch.randn(1, heads, slots, dim, generator=gen)
    values = torch.randn(1, heads, slots, dv, generator=gen)
    own_keys = torch.randn(1, heads, q_len, dim, generator=gen)
    own_values = torch.randn(1, heads, q_len, dv, generator=gen)
    valid = torch.rand(1, heads, slots, generator=gen) < 0.8
    columns = (torch.rand(1, heads, slots, generator=gen) < 0.6) if subset else None
    out, scores = reconstruction_attention(
        query,
        keys,
        values,
        valid,
        own_keys,
        own_values,
        scale=0.3,
        score_columns=columns,
        block_queries=block,
    )
    ref_out, ref_scores = _reference(query, keys, values, valid, own_keys, own_values, 0.3, columns)
    assert out.dtype == query.dtype and scores.dtype == torch.float32
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[0].double(), ref_scores, atol=1e-6, rtol=1e-5)
    assert bool((scores[~valid] == 0).all())


def _inputs(gen, heads, group, slots, q_len, dim, spread):
    """Random float32 inputs of :func:`reconstruction_attention`; logits grow with ``spread``."""
    query = torch.randn(1, heads * group, q_len, dim, generator=gen) * spread
    keys = torch.randn(1, heads, slots, dim, generator=gen)
    values = torch.randn(1, heads, slots, dim, generator=gen)
    own_keys = torch.randn(1, heads, q_len, dim, generator=gen)
    own_values = torch.randn(1, heads, q_len, dim, generator=gen)
    return query, keys, values, own_keys, own_values


class _ReferenceCalled(Exception):
    pass


def _no_reference(*args, **kwargs):
    raise _ReferenceCalled


@settings(max_examples=60, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3, 7]),
    slots=st.integers(0, 23),
    q_len=st.integers(1, 13),
    valid_kind=st.sampled_from(["all", "random", "padded", "empty-head"]),
    columns_kind=st.sampled_from(["none", "random", "chunk", "empty-head"]),
    sinks=st.booleans(),
    spread=st.sampled_from([0.3, 1.0, 4.0]),
    block=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_flash_path_matches_reference_in_float64(
    heads, group, slots, q_len, valid_kind, columns_kind, sinks, spread, block, seed
):
    """The CPU flash path (it must not fall back: the reference is patched to raise) against
    the reference computed in float64: padded views (invalid slots, a head without any),
    score columns (a chunk of the slots with two sinks, random, a head without any) or none,
    GPT-OSS sinks, small and odd shapes; tolerances of float32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    query, keys, values, own_keys, own_values = _inputs(
        gen, heads, group, slots, q_len, dim, spread
    )
    valid = torch.ones(1, heads, slots, dtype=torch.bool)
    if valid_kind == "random":
        valid = torch.rand(1, heads, slots, generator=gen) < 0.7
    elif valid_kind == "padded":  # left-aligned segments of different lengths
        lengths = torch.randint(0, slots + 1, (heads,), generator=gen)
        valid = (torch.arange(slots).view(1, -1) < lengths.view(-1, 1)).unsqueeze(0)
    elif valid_kind == "empty-head":
        valid[0, 0] = False
    columns = None
    if columns_kind == "random":
        columns = torch.rand(1, heads, slots, generator=gen) < 0.5
    elif columns_kind == "chunk":
        start = int(torch.randint(0, slots + 1, (1,), generator=gen))
        index = torch.arange(slots)
        columns = ((index >= start) & (index < start + 5)) | (index < 2)
        columns = columns.expand(1, heads, slots).clone()
    elif columns_kind == "empty-head":
        columns = torch.ones(1, heads, slots, dtype=torch.bool)
        columns[0, -1] = False
    s_aux = torch.randn(heads * group, generator=gen) if sinks else None
    with patch.object(kvzip_attention, "reconstruction_attention_reference", _no_reference):
        out, scores = reconstruction_attention(
            query,
            keys,
            values,
            valid,
            own_keys,
            own_values,
            scale=0.35,
            score_columns=columns,
            s_aux=s_aux,
            block_queries=block,
        )
    ref_out, ref_scores = reconstruction_attention_reference(
        query.double(),
        keys.double(),
        values.double(),
        valid,
        own_keys.double(),
        own_values.double(),
        scale=0.35,
        score_columns=columns,
        s_aux=None if s_aux is None else s_aux.double(),
        compute_dtype=torch.float64,
    )
    assert out.shape == query.shape and out.dtype == torch.float32
    assert scores.shape == (1, heads, slots) and scores.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6 * spread, rtol=1e-5)
    torch.testing.assert_close(scores.double(), ref_scores, atol=1e-6, rtol=2e-5)
    scored = valid if columns is None else valid & columns
    assert bool((scores[~scored] == 0).all())


def test_flash_path_falls_back_for_softcap_and_other_value_sizes():
    """softcap (Gemma 2), ``Dv != D`` and an empty pass take the reference; plain CPU input
    never does."""
    gen = torch.Generator().manual_seed(5)
    query, keys, values, own_keys, own_values = _inputs(gen, 2, 2, 6, 3, 8, 1.0)
    valid = torch.ones(1, 2, 6, dtype=torch.bool)
    args = (query, keys, values, valid, own_keys, own_values)
    with patch.object(kvzip_attention, "reconstruction_attention_reference", _no_reference):
        reconstruction_attention(*args, scale=0.3)
        with pytest.raises(_ReferenceCalled):
            reconstruction_attention(*args, scale=0.3, softcap=20.0)
        with pytest.raises(_ReferenceCalled):
            reconstruction_attention(
                *args[:2], values[..., :5], valid, own_keys, own_values[..., :5], scale=0.3
            )
    out, scores = reconstruction_attention(*args, scale=0.3, softcap=20.0)
    ref = reconstruction_attention_reference(*args, scale=0.3, softcap=20.0)
    assert torch.equal(out, ref[0]) and torch.equal(scores, ref[1])
    # no query: nothing attended, nothing scored (the flash kernel would crash on it)
    out, scores = reconstruction_attention(
        query[:, :, :0], keys, values, valid, own_keys[:, :, :0], own_values[:, :, :0], scale=0.3
    )
    assert out.shape == (1, 4, 0, 8) and torch.equal(scores, torch.zeros(1, 2, 6))


def test_flash_path_keeps_a_low_precision_query_dtype():
    """bfloat16 inputs: computed in float32, ``out`` back in bfloat16, scores float32."""
    gen = torch.Generator().manual_seed(9)
    query, keys, values, own_keys, own_values = _inputs(gen, 2, 3, 9, 4, 8, 1.0)
    valid = torch.ones(1, 2, 9, dtype=torch.bool)
    bf = [t.bfloat16() for t in (query, keys, values)]
    own = [t.bfloat16() for t in (own_keys, own_values)]
    out, scores = reconstruction_attention(*bf, valid, *own, scale=0.3)
    ref_out, ref_scores = reconstruction_attention_reference(*bf, valid, *own, scale=0.3)
    assert out.dtype == torch.bfloat16 and scores.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(scores, ref_scores, atol=1e-6, rtol=1e-5)


def test_reconstruction_attention_refuses_shapes_that_do_not_fit():
    q = torch.randn(1, 3, 4, 8)  # 3 query heads over 2 kv heads
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="do not fit"):
        reconstruction_attention(
            q, k, v, torch.ones(1, 2, 5, dtype=torch.bool), k[:, :, :4], v[:, :, :4], scale=1.0
        )


def test_prompt_chunks_follow_kvpress_layout():
    prompt = ReconstructionPrompt((7, 8), (9,), (5,), chunk_tokens=4, overlap=2)
    chunks = prompt.chunks(range(100, 110))
    assert [(c.start, c.end) for c in chunks] == [(0, 4), (4, 8), (8, 10)]
    assert chunks[0].ids == (7, 8, 5, 100, 101, 102, 103)
    assert chunks[1].ids == (9, 102, 103, 5, 104, 105, 106, 107)
    assert chunks[2].ids == (9, 106, 107, 5, 108, 109)
    assert ReconstructionPrompt(**prompt.settings()) == prompt


def test_prompt_chunks_of_a_templated_context_start_after_the_chat_prefix():
    prompt = ReconstructionPrompt(
        (7, 8), (9,), (5,), chunk_tokens=4, overlap=2, chat_prefix_ids=(1, 2), chat_suffix_ids=(3,)
    )
    chunks = prompt.chunks([1, 2, *range(100, 106)])
    assert [(c.start, c.end) for c in chunks] == [(2, 6), (6, 8)]
    assert chunks[0].ids == (7, 8, 3, 100, 101, 102, 103)
    assert chunks[1].ids == (9, 102, 103, 3, 104, 105)
    # a context without the prefix (raw text), or the prefix alone, is rebuilt whole as before
    assert prompt.chunks([1, 9, 100])[0].ids == (7, 8, 5, 1, 9, 100)
    assert prompt.chunks([1, 2])[0].ids == (7, 8, 5, 1, 2)
    assert ReconstructionPrompt(**prompt.settings()) == prompt


def _kvpress_layout(ctx, prompt, prefix_length, chunk_size):
    """kvpress 0.5.5 ``KVzipPress.prepare`` on plain lists (an independent re-statement):
    ``[(start, end, ids)]`` in context indices, the chunks of ``ctx[prefix_length:]``."""
    body = ctx[prefix_length:]
    pieces = [body[i : i + chunk_size] for i in range(0, len(body), chunk_size)]
    out, start = [], prefix_length
    for i, piece in enumerate(pieces):
        if i == 0:
            request = list(prompt.first_ids)
        else:
            request = list(prompt.next_ids) + pieces[i - 1][-prompt.overlap :]
        suffix = prompt.chat_suffix_ids if prefix_length else prompt.suffix_ids
        out.append((start, start + len(piece), tuple(request + list(suffix) + piece)))
        start += len(piece)
    return out


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.integers(1, 5),
    body=st.integers(1, 30),
    chunk=st.integers(1, 9),
    overlap=st.integers(1, 12),
    templated=st.booleans(),
)
def test_prompt_chunks_equal_kvpress_prepare(prefix, body, chunk, overlap, templated):
    prompt = ReconstructionPrompt(
        (7, 8), (9,), (5,), chunk_tokens=chunk, overlap=overlap,
        chat_prefix_ids=tuple(range(1, prefix + 1)), chat_suffix_ids=(3, 4),
    )  # fmt: skip
    head = list(range(1, prefix + 1)) if templated else [0] * prefix
    ctx = head + list(range(100, 100 + body))
    want = _kvpress_layout(ctx, prompt, prefix if templated else 0, chunk)
    got = [(c.start, c.end, c.ids) for c in prompt.chunks(ctx)]
    assert got == want


class _ChatMLTokenizer:
    """A tokenizer stand-in with a ChatML chat template (Qwen2.5's layout) and one id per
    character."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        assert not tokenize and add_generation_prompt
        text = "<s>system\nYou help.</s>\n"
        for m in messages:
            text += f"<s>{m['role']}\n{m['content']}</s>\n"
        return text + "<s>assistant\n"

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


def test_from_tokenizer_takes_the_chat_templates_prefix_and_suffix():
    assert chat_template_parts(_ChatMLTokenizer()) == (
        "<s>system\nYou help.</s>\n<s>user\n",
        "</s>\n<s>assistant\n",
    )
    prompt = ReconstructionPrompt.from_tokenizer(_ChatMLTokenizer())
    assert prompt.chat_prefix_ids == tuple(map(ord, "<s>system\nYou help.</s>\n<s>user\n"))
    assert prompt.chat_suffix_ids == tuple(map(ord, "</s>\n<s>assistant\n"))
    assert prompt.suffix_ids == (ord("\n"),)
    raw = ReconstructionPrompt.from_tokenizer(_ChatMLTokenizer(), chat=False)
    assert raw.chat_prefix_ids == raw.chat_suffix_ids == ()
    plain = _ChatMLTokenizer()
    plain.chat_template = None
    assert chat_template_parts(plain) is None


def test_from_tokenizer_without_text_before_the_user_message_rebuilds_as_raw_text():
    class Bare(_ChatMLTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
            return messages[0]["content"] + "\n\nAssistant:"

    assert chat_template_parts(Bare()) == ("", "\n\nAssistant:")
    prompt = ReconstructionPrompt.from_tokenizer(Bare())
    assert prompt.chat_prefix_ids == prompt.chat_suffix_ids == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(first_ids=(1,), next_ids=(1,), suffix_ids=(), chat_prefix_ids=(1,)),
        dict(first_ids=(1,), next_ids=(1,), suffix_ids=(), chat_suffix_ids=(1,)),
        dict(first_ids=(), next_ids=(1,), suffix_ids=()),
        dict(first_ids=(1,), next_ids=(1,), suffix_ids=(), chunk_tokens=0),
        dict(first_ids=(1,), next_ids=(1,), suffix_ids=(), overlap=-1),
    ],
)
def test_prompt_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        ReconstructionPrompt(**kwargs)


def test_scorer_refuses_bad_kernel_and_missing_scores():
    with pytest.raises(ValueError, match="odd"):
        KVzipScorer(kernel_size=2)
    keys = torch.randn(1, 2, 6, 4)
    inputs = ScoreInputs(
        keys=keys,
        values=keys,
        valid=torch.ones(1, 2, 6, dtype=torch.bool),
        original_positions=torch.arange(6).expand(1, 2, 6),
    )
    with pytest.raises(ValueError, match="reconstruction scores"):
        KVzipScorer().score(inputs)


def test_scorer_value_norm_multiplies_the_reconstruction_scores():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(1, 2, 6, 4, generator=gen)
    recon = torch.rand(1, 2, 6, generator=gen)
    inputs = ScoreInputs(
        keys=values,
        values=values,
        valid=torch.ones(1, 2, 6, dtype=torch.bool),
        original_positions=torch.arange(6).expand(1, 2, 6),
        reconstruction=recon,
    )
    assert torch.equal(KVzipScorer().score(inputs), recon)
    torch.testing.assert_close(
        KVzipScorer(value_norm=True).score(inputs), recon * values.norm(dim=-1)
    )
