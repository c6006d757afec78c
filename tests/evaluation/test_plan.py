"""Plans: content hashes, dependencies, needle prompts, sweep grids (no model runs)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.evaluation.execute import Schedule
from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.needle import (
    NEEDLE,
    PREFIX,
    QUESTION,
    answer_is_correct,
    build_needle_prompt,
    make_passkey,
)
from kvlab.evaluation.plan import EvalConfig, ModelRef, PrepTask, TextRef, plan_eval, select_methods
from kvlab.evaluation.sweep import SweepOptions, expand_methods, load_sweep

MODEL = ModelRef("m", "local:m", "a" * 64, "float32", "cpu")
TEXT = TextRef("file:t.txt", "b" * 64)


class ByteTokenizer:
    """One token per UTF-8 byte (what the tiny test model's tokenizer does)."""

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _plan(methods, tokens, **overrides):
    config = EvalConfig(methods=methods, **overrides)
    chosen = select_methods(config)
    return plan_eval(config, chosen, MODEL, TEXT, tokens, ByteTokenizer())


def test_prefill_score_plan_adds_the_reference_and_threads_it_per_window():
    # methods without a preparation (relay:snapkv calibrates its layer budgets since issue 9)
    methods = ["relay-legacy:snapkv@0.5", "pn-mix-uniform"]
    plan = _plan(methods, list(range(1000)), windows=3, prefill=64, score=16)
    assert [t.method.name for t in plan.tasks[:3]] == ["full", *methods]
    assert len(plan.tasks) == 9 and not plan.preparations
    for w in range(3):
        full, *others = plan.tasks[3 * w : 3 * w + 3]
        assert full.reference is None and full.where["window"] == w
        assert all(t.reference == full.key and t.tokens == full.tokens for t in others)
        assert len(full.tokens) == 80
    assert [t.where["start"] for t in plan.tasks[::3]] == [0, 460, 920]
    assert len({t.key for t in plan.tasks}) == 9
    # a task is plain data: it pickles with its key
    clone = pickle.loads(pickle.dumps(plan.tasks[4]))
    assert clone == plan.tasks[4] and clone.key == plan.tasks[4].key


def test_task_keys_are_content_hashes():
    tokens = list(range(500))
    base = _plan(["relay:snapkv@0.5"], tokens, windows=2, prefill=64, score=16).tasks
    again = _plan(["relay:snapkv@0.5"], tokens, windows=2, prefill=64, score=16).tasks
    assert [t.key for t in base] == [t.key for t in again]
    # the same window in a plan with other methods has the same reference key
    other = _plan(["streaming-llm@0.5"], tokens, windows=2, prefill=64, score=16).tasks
    assert other[0].key == base[0].key and other[1].key != base[1].key
    changed = [
        _plan(["relay:snapkv@0.25"], tokens, windows=2, prefill=64, score=16).tasks[1],
        _plan(["relay:snapkv@0.5"], tokens, windows=2, prefill=63, score=17).tasks[1],
        _plan(["relay:snapkv@0.5"], [t + 1 for t in tokens], windows=2, prefill=64, score=16).tasks[
            1
        ],
    ]
    assert len({base[1].key, *(t.key for t in changed)}) == 4


def test_calibrated_methods_depend_on_one_preparation():
    plan = _plan(
        ["pn-mix-v1", "kivi-2bit-calibrated"], list(range(300)), windows=2, prefill=64, score=16
    )
    assert len(plan.preparations) == 2
    assert all(isinstance(p, PrepTask) for p in plan.preparations)
    by_name = {t.method.name: t for t in plan.tasks}
    keys = {p.method.name: p.key for p in plan.preparations}
    assert by_name["pn-mix-v1"].preparation == keys["pn-mix-v1"]
    assert by_name["full"].preparation is None


def test_schedule_skips_stored_tasks_and_reruns_a_stored_reference_for_its_dependents():
    plan = _plan(
        ["relay:snapkv@0.5", "streaming-llm@0.5"], list(range(300)), windows=2, prefill=64, score=16
    )
    full0, relay0, stream0, full1, relay1, stream1 = plan.tasks
    stored = {t.key: {"stored": True} for t in (full0, relay0, stream0, full1, relay1)}
    schedule = Schedule(plan, stored)
    assert schedule.skipped == 5 and schedule.total_tasks == 6
    assert [(j.item.key, j.store, j.keep_logprobs) for j in schedule.jobs] == [
        (full1.key, False, True),  # run again only for its log-probabilities
        (stream1.key, True, False),
    ]
    assert schedule.next_ready(set()) == 0
    assert schedule.next_ready({0}) is None  # its dependent waits for the reference
    schedule.finish(0, {"again": True}, logprobs="LP")
    assert schedule.results[full1.key] == {"stored": True}  # the stored result is kept
    assert schedule.inputs(schedule.jobs[1]) == (None, "LP")
    schedule.finish(1, {"new": True})
    assert schedule.done and schedule.logprobs == {}  # released after its last dependent


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(260, 900),
    depth=st.sampled_from([0, 10, 25, 50, 75, 90, 100]),
    trial=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_needle_prompt_has_the_length_and_the_needle_at_its_depth(length, depth, trial, seed):
    text = [ord(c) for c in "lorem ipsum dolor sit amet " * 40]
    tok = ByteTokenizer()
    prompt = build_needle_prompt(tok, text, length=length, depth=depth, trial=trial, seed=seed)
    assert len(prompt.tokens) == length
    assert len(prompt.passkey) == 5 and prompt.passkey.isdigit() and prompt.passkey[0] != "0"
    needle = list(NEEDLE.format(key=prompt.passkey).encode())
    start = prompt.needle_start
    assert list(prompt.tokens[start : start + len(needle)]) == needle
    cut = start - len(PREFIX.encode())
    assert abs(cut - prompt.filler_tokens * depth / 100) <= 0.5
    assert list(prompt.tokens[-len(QUESTION) :]) == list(QUESTION.encode())
    again = build_needle_prompt(tok, text, length=length, depth=depth, trial=trial, seed=seed)
    assert again == prompt  # seeded: the same prompt in every process
    assert prompt.passkey == make_passkey(seed, length, depth, trial)


def test_needle_prompt_refuses_what_it_cannot_build():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="shorter than the prompt's fixed parts"):
        build_needle_prompt(tok, [65] * 1000, length=20, depth=50, trial=0, seed=0)
    with pytest.raises(ValueError, match="tokens of filler"):
        build_needle_prompt(tok, [65] * 10, length=400, depth=50, trial=0, seed=0)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        build_needle_prompt(tok, [65] * 1000, length=400, depth=101, trial=0, seed=0)


def test_exact_match_reads_the_first_digits():
    assert answer_is_correct(" 40213.", "40213")
    assert answer_is_correct("40213 is the pass key", "40213")
    assert not answer_is_correct(" 4021", "40213")
    assert not answer_is_correct(" 402135", "40213")
    assert not answer_is_correct(" 1 and 40213", "40213")
    assert not answer_is_correct("no digits", "40213")


def test_sweep_grid_expands_ratios_and_bits():
    names = expand_methods(
        ["full", "relay:snapkv", "streaming-llm@{ratio}", "pn-mix-{bits}bit", "pn-mix"],
        [0.25, 0.5],
        [3, 4],
    )
    assert names == [
        "full",
        "relay:snapkv@0.25",
        "relay:snapkv@0.5",
        "streaming-llm@0.25",
        "streaming-llm@0.5",
        "pn-mix-3bit",
        "pn-mix-4bit",
        "pn-mix",
    ]
    with pytest.raises(ValueError, match="needs 'ratios'"):
        expand_methods(["relay:snapkv"], [], [])


def test_sweep_file_errors_are_one_line(tmp_path: Path):
    options = SweepOptions(output_dir=tmp_path / "out")
    bad = tmp_path / "bad.toml"
    for content, message in [
        ("models = [", "sweep file"),
        ("modles = ['x']", "unknown key"),
        ("methods = ['full']\n[stream]\nwindows = 2", "unknown option 'windows'"),
        ("methods = ['full']\n[prefill-score]\nwindows = '2'", "must be an integer"),
        ("methods = ['full']\nprotocols = ['perplexity']", "unknown protocol"),
        ("methods = 'full'", "must be a list"),
    ]:
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            load_sweep(bad, options)
    with pytest.raises(FileNotFoundError, match="sweep file not found"):
        load_sweep(tmp_path / "none.toml", options)


def test_the_example_sweep_is_three_methods_by_two_ratios_on_two_windows():
    example = Path(__file__).resolve().parents[2] / "examples" / "sweep-smollm2.toml"
    groups = load_sweep(example, SweepOptions(output_dir=Path("out")))
    assert len(groups) == 1
    name, config = groups[0]
    assert name == "smollm2-135m--default"  # the committed example's folder, as before
    assert config.output_dir == Path("out") / name
    assert config.windows == 2 and config.protocol == "prefill-score"
    eviction = [m for m in config.methods if "@" in m]
    assert len(eviction) == 6 and {m.split("@")[1] for m in eviction} == {"0.25", "0.5"}
    for name in config.methods:
        parse_method(name)


def test_a_backend_variable_changes_the_keys_of_the_methods_it_runs(monkeypatch):
    """KVLAB_RELAY_BACKEND / KVLAB_PNMIX_BACKEND change the keys of the tasks whose mechanism
    they select (kernels agree with the references only to rounding: no resuming across
    them), and no other task's key."""
    methods = ["relay-legacy:snapkv@0.5", "pn-mix-uniform"]
    tokens = list(range(200))

    def keys():
        plan = _plan(methods, tokens, windows=1, prefill=64, score=16)
        return {t.method.name: (t.key, t.record()["backends"]) for t in plan.tasks}

    monkeypatch.delenv("KVLAB_RELAY_BACKEND", raising=False)
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
    auto = keys()
    assert auto["relay-legacy:snapkv@0.5"][1] == {"relay": "auto"}
    assert auto["pn-mix-uniform"][1] == {"pnmix": "auto"} and auto["full"][1] == {}
    monkeypatch.setenv("KVLAB_RELAY_BACKEND", "torch")
    relay_torch = keys()
    assert relay_torch["relay-legacy:snapkv@0.5"][0] != auto["relay-legacy:snapkv@0.5"][0]
    assert relay_torch["full"] == auto["full"]
    assert relay_torch["pn-mix-uniform"] == auto["pn-mix-uniform"]
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "torch")
    assert keys()["pn-mix-uniform"][0] != auto["pn-mix-uniform"][0]
