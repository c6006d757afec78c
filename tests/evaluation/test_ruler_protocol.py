"""``kvlab eval --protocol ruler`` end to end on a tiny local model: plan, shared prefill,
answers, scores, table, plots, artifact, resume; and the paired bootstrap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.artifacts import validate_artifact
from kvlab.evaluation import EvalConfig, run_eval
from kvlab.evaluation.ruler_report import paired_bootstrap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METHODS = ["full", "pn-mix", "relay:keynorm@0.5", "streaming-llm@0.5"]
TASKS = ["niah_multivalue", "niah_single_1"]


def _config(tiny_model_dir, tiny_text, out, **overrides) -> EvalConfig:
    settings = dict(
        model=str(tiny_model_dir),
        text=tiny_text,
        protocol="ruler",
        methods=METHODS,
        ruler_tasks=TASKS,
        ruler_lengths=[1600],
        ruler_samples=2,
        device="cpu",
        output_dir=out,
        progress=False,
        use_calibration_cache=False,
    )
    return EvalConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_ruler_protocol_end_to_end(tiny_model_dir, tiny_text, tmp_path):
    out = tmp_path / "out"
    outcome = run_eval(_config(tiny_model_dir, tiny_text, out))
    names = [s["method"] for s in outcome.summaries]
    assert names == METHODS
    full = outcome.summaries[0]
    assert full["samples"] == len(TASKS) * 2 and sorted(full["tasks"]) == TASKS
    assert full["fraction_of_full"] == 1.0 and full["fraction_of_full_16bit"] == 1.0
    for s in outcome.summaries[1:]:
        assert 0.0 < s["fraction_of_full"] < 1.0  # every other method compresses
        assert s["replayed"] == s["samples"]  # built from the shared prefill
        assert s["delta_ci95"][0] <= s["delta_vs_full"] <= s["delta_ci95"][1]
    assert (out / "ruler-heatmap.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "ruler-accuracy-vs-bytes.png").read_bytes()[:8] == PNG_SIGNATURE
    report = validate_artifact(out / "metrics-ruler-cpu.json")
    assert report.ok, report.problems
    artifact = json.loads((out / "metrics-ruler-cpu.json").read_text())
    assert artifact["seeds"] == [0, 1]
    raw = json.loads((out / "raw-ruler-cpu.json").read_text())
    rows = raw["results"]["relay:keynorm@0.5"]
    assert {r["task"] for r in rows} == set(TASKS)
    assert all(r["context_tokens"] + r["question_tokens"] <= 1600 for r in rows)
    # the scores are RULER's on the decoded answers
    from kvlab.evaluation.ruler import score_answer

    for row in rows:
        assert row["score"] == score_answer(row["prediction"], row["outputs"], "all")

    # resumed: nothing reruns, the same table
    again = run_eval(_config(tiny_model_dir, tiny_text, out))
    assert again.table == outcome.table

    # each method's own prefill: the same answers as the replayed one (tiny model)
    own = run_eval(_config(tiny_model_dir, tiny_text, tmp_path / "own", ruler_shared_prefill=False))
    for a, b in zip(own.summaries, outcome.summaries, strict=True):
        assert a["scores"] == b["scores"]
        assert a["kv_bytes"] == b["kv_bytes"]
    own_raw = json.loads((tmp_path / "own" / "raw-ruler-cpu.json").read_text())
    for name in METHODS:
        for x, y in zip(own_raw["results"][name], raw["results"][name], strict=True):
            assert x["generated_tokens"] == y["generated_tokens"]


def test_ruler_protocol_refuses_bad_options(tiny_model_dir, tiny_text, tmp_path):
    with pytest.raises(ValueError, match="unknown RULER task"):
        run_eval(_config(tiny_model_dir, tiny_text, tmp_path / "a", ruler_tasks=["qa_1"]))
    with pytest.raises(ValueError, match="--ruler-samples"):
        run_eval(_config(tiny_model_dir, tiny_text, tmp_path / "b", ruler_samples=0))
    assert not (tmp_path / "a" / "tasks").exists() or not any((tmp_path / "a" / "tasks").iterdir())


def test_paired_bootstrap_is_paired_and_deterministic():
    keys = [("t", 4096, i) for i in range(20)]
    reference = {k: float(i % 2) for i, k in enumerate(keys)}
    same = dict(reference)
    assert paired_bootstrap(same, reference) == (0.0, 0.0, 0.0)  # paired: no spread at all
    worse = {k: 0.0 for k in keys}
    point, low, high = paired_bootstrap(worse, reference, resamples=4000, seed=1)
    assert point == pytest.approx(-50.0)
    assert low < point < high <= 0.0
    assert paired_bootstrap(worse, reference, resamples=4000, seed=1) == (point, low, high)
    # the interval covers the standard error's span roughly (binomial, n = 20)
    se = 100.0 * np.sqrt(0.25 / 20)
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.25)
    with pytest.raises(ValueError, match="share no sample"):
        paired_bootstrap(worse, {("u", 1, 0): 1.0})


def test_task_mean_accuracy_weighs_tasks_equally_and_refuses_a_missing_task():
    from kvlab.evaluation.ruler_report import task_mean_accuracy

    # task a: 3 samples, 1 right (33.3 %); task b: 1 sample, right (100 %)
    scores = {("a", 4096, 0): 1.0, ("a", 4096, 1): 0.0, ("a", 4096, 2): 0.0, ("b", 4096, 0): 1.0}
    assert task_mean_accuracy(scores, ["a", "b"]) == pytest.approx(100.0 * (1 / 3 + 1) / 2)
    assert task_mean_accuracy(scores, ["b"]) == 100.0
    # partial scores (string_match_all) enter as they are
    assert task_mean_accuracy({("c", 1, 0): 0.25, ("c", 1, 1): 0.5}, ["c"]) == 37.5
    with pytest.raises(ValueError, match="no sample of task 'z'"):
        task_mean_accuracy(scores, ["a", "z"])
    with pytest.raises(ValueError, match="no task"):
        task_mean_accuracy(scores, [])


def test_ruler_summary_counts_bytes_per_layer_kind_and_flags_single_samples():
    from kvlab.evaluation.ruler_report import ruler_table, summarize_ruler

    def result(full_bytes: int, score: float) -> dict:
        kinds = {
            "full_attention": {"layers": 1, "kv_bytes": full_bytes, "kv_bytes_16bit": full_bytes},
            "sliding_window": {"layers": 5, "kv_bytes": 500, "kv_bytes_16bit": 500},
        }
        storage = {"kv_bytes": full_bytes + 500, "kv_bytes_16bit": full_bytes + 500}
        storage.update(held_bytes=None, layer_kinds=kinds)
        return {
            "score": score,
            "storage": storage,
            "compress_seconds": 0.0,
            "answer_seconds": 0.0,
            "replayed": True,
        }

    wheres = [{"task": "vt", "length": 4096, "index": 0}]
    full = summarize_ruler("full", wheres, [result(1000, 1.0)], None, None)
    ref = {("vt", 4096, 0): 1.0}
    half = summarize_ruler(
        "m", wheres, [result(250, 0.0)], ref, 1500.0, 1500.0, full["kv_bytes_by_layer_kind"]
    )
    assert half["kv_bytes_by_layer_kind"]["full_attention"]["fraction_of_full"] == 0.25
    assert half["kv_bytes_by_layer_kind"]["sliding_window"]["fraction_of_full"] == 1.0
    assert half["fraction_of_full"] == 0.5 and half["delta_ci95"] is None
    table = ruler_table([full, half])
    assert "Only the 1 full-attention layers of 6 are compressed" in table
    assert "[n = 1]" in table
