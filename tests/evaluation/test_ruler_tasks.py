"""kvlab.evaluation.ruler's generators: determinism, the length fit, the needles, chains and
word counts really in the context, the context/question split, and bad input.

Tokens are counted with a WordLevel tokenizer built in memory (tests/fixtures/ruler_tokenizers.py);
one slow test uses the real Qwen tokenizer when its GGUF file is there.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ruler_tokenizers import word_tokenizer

from kvlab.evaluation.ruler import TASKS, generate_samples
from kvlab.evaluation.ruler.haystack import DEPTHS, NOISE, split_sentences
from kvlab.evaluation.ruler.tasks import NEEDLE, _fwe_counts, _zeta, build_draft
from kvlab.evaluation.ruler.templates import render_split

TOK = word_tokenizer()
TOK_PLAIN = word_tokenizer(chat=False)
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
QWEN = Path("/work/models_dl/gguf/qwen05.gguf")


def _tokens(text: str, tok=TOK) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _slack(task: str) -> int:
    """Tokens one more haystack unit would add (the fit leaves less than that unused)."""
    kind = TASKS[task].kind
    if task in ("niah_single_1", "vt"):
        return _tokens(NOISE)
    if task == "niah_multikey_2":
        # a distractor's key is an adjective-noun pair of any length: 14 tokens for "old-carbon"
        # (old, -, carbon), up to 20 for the longest of the 6,171,620 keys (more hyphenated
        # pieces; every key counted once with this tokenizer); the seed 35260 at length 358
        # leaves 15 unused because its next distractor takes 16
        return 20
    if task == "niah_multikey_3":
        key = "0f6b44f1-0ba5-4d8a-9a71-6d3c2a8f3e55"
        return _tokens(NEEDLE.format(type_needle_v="uuids", key=key, value=key))
    if kind == "niah":  # essay: one word, up to 3 pieces ("1:1")
        return 4
    if kind == "common_words_extraction":  # one more word, 3 times "123. a-b"
        return 3 * 5
    return 8  # fwe: one more word raises a few Zipf counts by one


MIN_LENGTH = {"vt": 800, "cwe": 600}


def _min_length(task: str) -> int:
    return MIN_LENGTH.get(task, 300)


def test_task_list_is_rulers_synthetic_yaml() -> None:
    assert list(TASKS) == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
    ]
    assert {t: TASKS[t].tokens_to_generate for t in ("niah_single_1", "vt", "cwe", "fwe")} == {
        "niah_single_1": 128,
        "vt": 30,
        "cwe": 120,
        "fwe": 50,
    }
    assert dict(TASKS["niah_multikey_3"].args) == {
        "type_haystack": "needle",
        "type_needle_k": "uuids",
        "type_needle_v": "uuids",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    }
    assert all(t.metric == "all" for t in TASKS.values())


def test_depths_match_numpy_and_zeta() -> None:
    assert list(DEPTHS) == list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
    assert _zeta(2.0) == pytest.approx(np.pi**2 / 6, rel=1e-15)
    assert _fwe_counts(1000, 4, 2.0) == [int(1000 * k**-2.0 / (np.pi**2 / 6)) for k in (1, 2, 3, 4)]


def test_split_sentences() -> None:
    assert split_sentences(' A b. C d!  E? "F." G') == ["A b.", "C d!", "E?", '"F."', "G"]
    assert split_sentences("Genesis 1:1 In the beginning. Genesis 1:2 And") == [
        "Genesis 1:1 In the beginning.",
        "Genesis 1:2 And",
    ]
    assert split_sentences("   ") == []


@pytest.mark.parametrize("task", list(TASKS))
def test_same_arguments_same_samples_and_indices_differ(task: str) -> None:
    length = max(_min_length(task), 1200)
    a = generate_samples(task, length, 2, 7, TOK)
    b = generate_samples(task, length, 2, 7, TOK)
    assert a == b
    assert [s.index for s in a] == [0, 1]
    assert a[0].outputs != a[1].outputs
    assert a[0].context != a[1].context
    other = generate_samples(task, length, 1, 8, TOK)[0]
    assert other.outputs != a[0].outputs
    # one sample alone is the same as in a batch
    assert generate_samples(task, length, 1, 7, TOK)[0] == a[0]


def _check_fit_and_split(sample, tok=TOK, chat=True) -> None:
    total = len(sample.context_ids) + len(sample.question_ids) + sample.max_new_tokens
    assert total <= sample.length
    assert sample.length - total < _slack(sample.task), (sample.length, total)
    assert list(sample.context_ids) == tok(sample.context, add_special_tokens=False)["input_ids"]
    assert list(sample.question_ids) == tok(sample.question, add_special_tokens=False)["input_ids"]
    question_text = sample.question.replace(ASSISTANT, " ")  # the chat markup aside
    for out in sample.outputs:
        assert out.lower() not in question_text.lower()
    kind = TASKS[sample.task].kind
    starts = {
        "niah": ("What is the special magic", "What are all the special magic"),
        "variable_tracking": ("Question: Find all variables",),
        "common_words_extraction": ("Question: What are the 10 most common words",),
        "freq_words_extraction": ("Question: Do not provide any explanation.",),
    }[kind]
    assert sample.question.startswith(starts)
    if chat:
        assert sample.context.startswith("<|im_start|>user\n")
        assert sample.question.count(ASSISTANT) == 1
        user = sample.context[len("<|im_start|>user\n") :] + sample.question.split(ASSISTANT)[0]
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        answer = sample.question.split(ASSISTANT)[1]
        assert sample.context + sample.question == rendered + answer
        assert answer.startswith(("The special magic", "Answer:"))
        assert "<|im_start|>" not in sample.question.split(ASSISTANT)[0]


def _check_content(sample) -> None:
    kind = TASKS[sample.task].kind
    ctx, question = sample.context, sample.question
    if kind == "niah":
        args = TASKS[sample.task].args
        assert len(sample.outputs) == args["num_needle_v"] * args["num_needle_q"]
        query = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
        queried = set(re.split(r", and |, ", query))
        assert len(queried) == args["num_needle_q"]
        needle = r"One of the special magic \w+ for ([^.\n]+?) is: ([0-9a-f-]+)\."
        needles = re.findall(needle, ctx)
        for value in sample.outputs:
            assert ctx.count(value) == 1
            (key,) = [k for k, v in needles if v == value]
            assert key in queried
        asked = [v for k, v in needles if k in queried]
        assert sorted(asked) == sorted(sample.outputs)
        if args["type_haystack"] != "needle":
            count = max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
            assert len(needles) == count
    elif kind == "variable_tracking":
        binding = {}
        for name, ref, number in re.findall(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))", ctx):
            assert name not in binding
            binding[name] = ("var", ref) if ref else ("value", number)

        def resolve(name: str) -> str:
            kind_, target = binding[name]
            return target if kind_ == "value" else resolve(target)

        value = re.search(r"assigned the value (\d+)", question).group(1)
        bound = [name for name in binding if resolve(name) == value]
        assert set(bound) == set(sample.outputs) and len(bound) == 5
        assert binding[sample.outputs[0]] == ("value", value)
        for prev, name in zip(sample.outputs, sample.outputs[1:], strict=False):
            assert binding[name] == ("var", prev)
        # the in-context example: a second chain, to another value
        values = {target for kind_, target in binding.values() if kind_ == "value"}
        assert len(values) == 2
    elif kind == "common_words_extraction":
        main = ctx.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        counts = Counter(re.findall(r"\d+\. (\S+)", main))
        assert len(sample.outputs) == 10
        least_common = min(counts[w] for w in sample.outputs)
        others = [c for w, c in counts.items() if w not in sample.outputs]
        assert least_common > max(others, default=0)
    else:
        coded = ctx.rsplit("Find the three most frequently appeared coded words. ", 1)[1]
        coded = coded.split("\n", 1)[0]
        counts = Counter(coded.split(" "))
        assert counts["..."] == max(counts.values())
        del counts["..."]
        ranked = [c for _, c in counts.most_common()]
        assert {w for w, _ in counts.most_common(3)} == set(sample.outputs)
        assert ranked[2] > ranked[3]


@pytest.mark.parametrize("task", list(TASKS))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_every_task_fits_its_length_and_holds_its_answers(task: str, data) -> None:
    length = data.draw(st.integers(_min_length(task), 2500), label="length")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    (sample,) = generate_samples(task, length, 1, seed, TOK)
    assert (sample.task, sample.length, sample.seed, sample.metric) == (task, length, seed, "all")
    assert sample.max_new_tokens == TASKS[task].tokens_to_generate
    _check_fit_and_split(sample)
    _check_content(sample)


def test_a_long_next_distractor_is_room_left_not_a_bad_fit() -> None:
    """The case a random hypothesis run found: 15 tokens left unused, fewer than one distractor
    line can take (its next one takes 16), so the fit is the largest."""
    (sample,) = generate_samples("niah_multikey_2", 358, 1, 35260, TOK)
    _check_fit_and_split(sample)
    assert len(sample.context_ids) + len(sample.question_ids) + sample.max_new_tokens == 343


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe"])
def test_long_lengths_fit(task: str) -> None:
    """4096 and more: cwe's full frequencies (30 / 3), vt's and fwe's larger haystacks."""
    for sample in generate_samples(task, 4200, 2, 3, TOK):
        _check_fit_and_split(sample)
        _check_content(sample)
    if task == "cwe":
        main = sample.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        counts = Counter(re.findall(r"\d+\. (\S+)", main))
        assert {counts[w] for w in sample.outputs} == {30}
        assert {c for w, c in counts.items() if w not in sample.outputs} == {3}


def test_singular_template_text() -> None:
    (sample,) = generate_samples("niah_single_1", 400, 1, 0, TOK_PLAIN, chat=False)
    key = re.search(r"for (\S+) mentioned", sample.question).group(1)
    assert sample.context.startswith(
        "<s>A special magic number is hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the number afterwards.\n"
    )
    assert sample.context.split("\n")[1] in (
        NOISE,
        f"One of the special magic numbers for {key} is: {sample.outputs[0]}.",
    )
    assert sample.context.endswith("There and back again.\n")
    assert sample.question == (
        f"What is the special magic number for {key} mentioned in the provided text? The "
        f"special magic number for {key} mentioned in the provided text is"
    )
    (multi,) = generate_samples("niah_multivalue", 400, 1, 0, TOK_PLAIN, chat=False)
    key = re.search(r"for (\S+) mentioned", multi.question).group(1)
    assert multi.context.startswith("<s>Some special magic numbers are hidden within")
    assert multi.question == (
        f"What are all the special magic numbers for {key} mentioned in the provided text? The "
        f"special magic numbers for {key} mentioned in the provided text are"
    )
    (query,) = generate_samples("niah_multiquery", 400, 1, 0, TOK_PLAIN, chat=False)
    assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned", query.question)


def test_base_template_puts_bos_once_in_the_context() -> None:
    bos = TOK_PLAIN.bos_token_id
    for task in TASKS:
        (sample,) = generate_samples(task, max(_min_length(task), 900), 1, 1, TOK_PLAIN, chat=False)
        _check_fit_and_split(sample, TOK_PLAIN, chat=False)
        ids = sample.context_ids + sample.question_ids
        assert sample.context_ids[0] == bos and ids.count(bos) == 1
        _check_content(sample)
    no_bos = word_tokenizer(bos=False, chat=False)
    (sample,) = generate_samples("fwe", 900, 1, 1, no_bos, chat=False)
    assert not sample.context.startswith("<s>")


def test_render_split_on_a_hand_written_prompt() -> None:
    context, question = render_split(TOK, "Head\nhay\n", "Q?", " The answer", chat=True)
    assert context == "<|im_start|>user\nHead\nhay\n"
    assert question == "Q?<|im_end|>\n<|im_start|>assistant\nThe answer"
    assert render_split(TOK_PLAIN, "Head\n", "Q?", " The answer", chat=False) == (
        "<s>Head\n",
        "Q? The answer",
    )


def test_haystack_text_replaces_the_essay() -> None:
    text = "Alpha beta gamma. Delta epsilon zeta! " * 400
    (sample,) = generate_samples("niah_single_2", 900, 1, 0, TOK, haystack_text=text)
    assert "Alpha beta gamma. Delta epsilon zeta!" in sample.context
    _check_fit_and_split(sample)
    _check_content(sample)
    (default,) = generate_samples("niah_single_2", 900, 1, 0, TOK)
    assert "Genesis 1:1 In the beginning God created the heaven and the earth." in default.context
    # a short text is repeated to fill the haystack
    (short,) = generate_samples("niah_multikey_1", 900, 1, 0, TOK, haystack_text="Tiny text.")
    assert short.context.count("Tiny text.") > 50
    # noise tasks ignore it
    assert generate_samples("niah_single_1", 500, 1, 0, TOK, haystack_text=text) == (
        generate_samples("niah_single_1", 500, 1, 0, TOK)
    )


def test_drafts_keep_their_needles_whatever_the_size() -> None:
    """The seed fixes keys, values and the vt chain; only the haystack grows with the size."""
    for task in ("niah_multivalue", "niah_multikey_3", "cwe", "fwe"):
        small = build_draft(task, 2000, 0, 5, 40)
        big = build_draft(task, 2000, 0, 5, 400)
        assert small.outputs == big.outputs
        assert small.question == big.question
        assert len(big.head) > len(small.head)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "qa_1"}, "unknown RULER task 'qa_1'"),
        ({"task": "niah"}, "unknown RULER task"),
        ({"n": 0}, "n >= 1"),
        ({"length": 0}, "length >= 1"),
        ({"length": 120}, "does not fit: its smallest prompt needs"),
        ({"task": "vt", "length": 700}, "does not fit"),
        ({"task": "fwe", "length": 299}, "length >= 300"),
        ({"seed": 1.5}, "seed is an int"),
        ({"haystack_text": " \n "}, "has no words"),
    ],
)
def test_bad_input_raises_one_value_error(kwargs, message) -> None:
    args = {"task": "niah_single_2", "length": 1000, "n": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_samples(
            args.pop("task"), args.pop("length"), args.pop("n"), args.pop("seed"), TOK, **args
        )


def test_chat_without_a_chat_template_is_refused() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        generate_samples("niah_single_1", 500, 1, 0, TOK_PLAIN)


@pytest.mark.slow
@pytest.mark.skipif(not QWEN.is_file(), reason="the Qwen 0.5B GGUF file is not here")
def test_qwen_tokenizer_samples_at_4k_to_16k() -> None:
    from kvlab.models import load_tokenizer

    tok = load_tokenizer(str(QWEN))
    for length in (4096, 16384):
        for task in ("niah_single_1", "niah_multikey_3", "vt", "cwe"):
            began = time.perf_counter()
            (sample,) = generate_samples(task, length, 1, 0, tok)
            assert time.perf_counter() - began < 30
            total = sample.prompt_tokens + sample.max_new_tokens
            assert length - 80 < total <= length
            assert sample.context.startswith("<|im_start|>system\n")
            assert "<|im_start|>assistant\n" in sample.question
            assert (
                list(sample.question_ids)
                == tok(sample.question, add_special_tokens=False)["input_ids"]
            )
            _check_content(sample)


@settings(max_examples=50, deadline=None)
@given(
    base=st.integers(0, 200),
    per=st.integers(1, 40),
    every=st.integers(1, 50),
    lo=st.integers(1, 30),
    budget=st.integers(0, 5000),
)
def test_fit_size_finds_the_largest_fitting_size(base, per, every, lo, budget) -> None:
    """Exact for a non-decreasing count (steps of ``per`` tokens every ``every`` units, so a
    probe of 16 units may add nothing); refused when the smallest size does not fit."""
    from kvlab.evaluation.ruler.tasks import _fit_size

    def total(size: int) -> int:
        return base + per * (size // every)

    if total(lo) > budget:
        with pytest.raises(ValueError, match="does not fit"):
            _fit_size(total, lo, budget, what="x")
        return
    size = _fit_size(total, lo, budget, what="x")
    assert total(size) <= budget < total(size + 1)
