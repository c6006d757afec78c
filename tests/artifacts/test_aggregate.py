"""The aggregator against reference record 000, and its edge cases."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.artifacts import aggregate_metrics, numeric_per_seed

SEEDS = Path(__file__).resolve().parents[1] / "fixtures" / "seeds"


def _seed(name: str) -> dict:
    return json.loads((SEEDS / name).read_text())


def test_reproduces_seed_000_metrics_from_its_per_seed_block() -> None:
    record = _seed("000_8249d5d9ce5c6fb7.txt")
    booleans = {k: v for k, v in record["metrics"].items() if isinstance(v, bool)}
    per_seed = [
        {**{k: v for k, v in row.items() if k != "seed"}, **booleans} for row in record["per_seed"]
    ]
    got = aggregate_metrics(per_seed)
    for key, value in record["metrics"].items():
        assert got[key] == value, key
    assert numeric_per_seed(record["seeds"], per_seed) == record["per_seed"]


def test_integer_means_stay_integers_and_one_seed_has_zero_std() -> None:
    record = _seed("004_aa707ff1932edf16.txt")
    rows = [{"actual_attention_calls": 66, "key_bytes": 15108, "x": 0.5}] * 3
    got = aggregate_metrics(rows)
    assert got["actual_attention_calls"] == record["metrics"]["actual_attention_calls"]
    assert type(got["key_bytes"]["mean"]) is int
    assert aggregate_metrics(rows[:1])["x"] == {"mean": 0.5, "std": 0.0, "n": 1}


def test_boolean_true_only_if_true_for_every_seed() -> None:
    assert aggregate_metrics([{"ok": True}, {"ok": True}])["ok"] is True
    assert aggregate_metrics([{"ok": True}, {"ok": False}, {"ok": True}])["ok"] is False


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=8))
def test_mean_and_sample_std_match_statistics(values: list[float]) -> None:
    got = aggregate_metrics([{"m": v} for v in values])["m"]
    assert got["mean"] == statistics.mean(values)
    assert got["std"] == (statistics.stdev(values) if len(values) > 1 else 0.0)
    assert got["n"] == len(values)


def test_metric_order_follows_first_seed() -> None:
    got = aggregate_metrics([{"b": 1.0, "a": True, "c": 2}, {"c": 3, "a": True, "b": 2.0}])
    assert list(got) == ["b", "a", "c"]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([], "at least one seed"),
        ([{"a": 1.0}, {"b": 1.0}], "has metrics"),
        ([{"a": 1.0}, {"a": True}], "mixes types"),
        ([{"a": "text"}], "mixes types or is not numeric"),
        ([{"a": math.nan}], "non-finite"),
    ],
)
def test_bad_input_is_a_clear_error(rows: list[dict], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate_metrics(rows)


def test_per_seed_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 seeds but 1 results"):
        numeric_per_seed([1, 2], [{"a": 1.0}])
