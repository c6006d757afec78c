"""RULER's scoring (scripts/eval/evaluate.py postprocess_pred, scripts/eval/synthetic/constants.py
string_match_all / string_match_part) on hand-written cases, and the samples' JSONL and digest."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from ruler_tokenizers import word_tokenizer

from kvlab.evaluation.ruler import (
    RulerSample,
    generate_samples,
    postprocess_prediction,
    read_jsonl,
    samples_digest,
    score_prediction,
    string_match_all,
    string_match_part,
    write_jsonl,
)
from kvlab.evaluation.ruler.scoring import match_all, match_part


def _sample(outputs: tuple[str, ...], metric: str = "all") -> RulerSample:
    return RulerSample(
        task="niah_multivalue",
        length=100,
        index=0,
        seed=0,
        context="ctx",
        question="q",
        context_ids=(1, 2),
        question_ids=(3,),
        outputs=outputs,
        max_new_tokens=128,
        metric=metric,
    )


def test_postprocess_is_rulers() -> None:
    assert postprocess_prediction("  1234\t5678\x00x\n ") == "1234\n5678\nx"
    assert postprocess_prediction("\n\n") == ""
    assert postprocess_prediction(" a\x1fb\x7f ") == "a\nb\x7f"  # only \x00-\x1f


def test_match_all_and_part_by_hand() -> None:
    refs = ["1234567", "7654321", "ABCDE", "hello"]
    pred = "The numbers are 1234567 and abcde, HELLO."
    assert match_all(pred, refs) == 3 / 4
    assert match_part(pred, refs) == 1.0
    assert match_part("nothing", refs) == 0.0
    assert match_all("12345678", ["1234567"]) == 1.0  # substring, as RULER
    assert match_all("", ["x"]) == 0.0
    with pytest.raises(ValueError, match="at least one reference"):
        match_all("x", [])


def test_score_prediction_is_a_fraction() -> None:
    sample = _sample(("1111111", "2222222", "3333333", "4444444"))
    assert score_prediction("1111111, 2222222\n3333333", sample) == 0.75
    assert score_prediction("", sample) == 0.0
    assert score_prediction("4444444 3333333 2222222 1111111", sample) == 1.0
    part = _sample(("Paris", "paris, France"), metric="part")
    assert score_prediction(" paris ", part) == 1.0
    with pytest.raises(ValueError, match="unknown RULER metric"):
        score_prediction("x", replace(sample, metric="exact"))


def test_task_scores_are_rulers_percentages() -> None:
    preds = ["a b", "a", ""]
    refs = [["a", "b"], ["a", "c", "d"], ["z"]]
    # (1 + 1/3 + 0) / 3 * 100 = 44.444... -> 44.44
    assert string_match_all(preds, refs) == 44.44
    # (1 + 1 + 0) / 3 * 100 = 66.666... -> 66.67
    assert string_match_part(preds, refs) == 66.67
    with pytest.raises(ValueError, match="as many predictions"):
        string_match_all(["a"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="as many predictions"):
        string_match_part([], [])


def test_jsonl_round_trip_and_digest(tmp_path) -> None:
    tok = word_tokenizer()
    samples = generate_samples("niah_multikey_3", 600, 2, 4, tok) + generate_samples(
        "vt", 900, 1, 4, tok
    )
    path = write_jsonl(tmp_path / "ruler.jsonl", samples)
    assert read_jsonl(path) == samples
    line = json.loads(path.read_text("utf-8").splitlines()[0])
    assert set(line) == {
        "task",
        "length",
        "index",
        "seed",
        "context",
        "question",
        "context_ids",
        "question_ids",
        "outputs",
        "max_new_tokens",
        "metric",
    }
    assert isinstance(line["context_ids"], list) and line["context_ids"] == list(
        samples[0].context_ids
    )
    digest = samples_digest(samples)
    assert digest == samples_digest(read_jsonl(path))
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert samples_digest(samples[::-1]) != digest
    changed = [replace(samples[0], outputs=("other",)), *samples[1:]]
    assert samples_digest(changed) != digest
    fewer_ids = [replace(samples[0], question_ids=samples[0].question_ids[:-1]), *samples[1:]]
    assert samples_digest(fewer_ids) != digest
    # the digest covers ids and outputs only: the same tokens with another index pair up
    assert samples_digest([replace(samples[0], index=9), *samples[1:]]) == digest


def test_read_jsonl_refuses_bad_lines(tmp_path) -> None:
    good = _sample(("x",)).to_json()
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\nnot json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        read_jsonl(path)
    for broken in (
        {k: v for k, v in good.items() if k != "outputs"},
        {**good, "extra": 1},
        {**good, "context_ids": [1, "2"]},
        {**good, "length": True},
        {**good, "metric": "exact"},
    ):
        path.write_text(json.dumps(broken) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
            read_jsonl(path)
