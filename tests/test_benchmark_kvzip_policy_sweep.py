"""benchmarks/kvpress/kvzip_policy_sweep.py: its configs (each policy a valid KVzip eviction, the
``kvpress`` one kvpress's), its argument checks and the summary's pairing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from benchmark_modules import load_benchmark

from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.methods.caches import eviction_config

sweep = load_benchmark("kvpress/kvzip_policy_sweep")
retention = load_benchmark("kvpress/kvzip_needle_retention")
PROMPT = {"kvzip_prompt": {"first_ids": [5, 6], "next_ids": [7], "suffix_ids": [8]}}


@pytest.mark.parametrize("policy", sorted(sweep.POLICIES))
def test_every_policy_builds_an_eviction_config(policy: str) -> None:
    base = parse_method("evict-no-relay:kvzip@0.5", protocol="ruler")
    method = dataclasses.replace(base, params={**base.params, **sweep.POLICIES[policy]})
    config = eviction_config(method.params, PROMPT)
    assert config.ratio == 0.5 and not config.relay
    if policy == "kvlab":
        assert method.params == base.params  # the library default, untouched
    if policy.startswith("nowindow") or policy == "kvpress":
        assert config.window_tokens == 0


def test_the_kvpress_policy_is_the_retention_probe_s() -> None:
    """One statement of kvpress's KVzipPress policy: the one whose kept set matched kvpress's
    (docs/archive/results-history.md 12.5.2) is benchmarks/kvpress/kvzip_needle_retention.py's."""
    assert sweep.POLICIES["kvpress"] == {
        k: v for k, v in retention.KVPRESS_POLICY.items() if k != "scorer"
    }


def test_bad_configs_and_indices() -> None:
    assert sweep.parse_config("chat:kvlab") == ("chat", "kvlab")
    for bad in ("chat", "json:kvlab", "raw:best"):
        with pytest.raises(ValueError, match="PROMPT:POLICY"):
            sweep.parse_config(bad)
    assert sweep.parse_indices("2-4") == [2, 3, 4]
    assert sweep.parse_indices("0,5") == [0, 5]
    with pytest.raises(SystemExit):
        sweep.main(["--samples", "x.jsonl", "--ratio", "0.5"])  # no --config, --out


def _row(task: str, index: int, config: str, ratio: float, score: float) -> dict[str, Any]:
    return {
        "task": task,
        "length": 4096,
        "index": index,
        "config": config,
        "ratio": ratio,
        "score": score,
        "nll_full_answer": None if config == "full" else 0.5 * score,
    }


def test_summary_pairs_only_samples_every_row_holds() -> None:
    rows = [
        _row("vt", 0, "chat:kvlab", 0.5, 1.0),
        _row("vt", 1, "chat:kvlab", 0.5, 0.0),
        _row("cwe", 0, "chat:kvlab", 0.5, 0.5),
        _row("vt", 0, "chat:kvpress", 0.5, 0.0),
        _row("vt", 1, "chat:kvpress", 0.5, 0.0),
        _row("cwe", 0, "chat:kvpress", 0.5, 0.5),
        _row("cwe", 1, "chat:kvpress", 0.5, 1.0),  # kvlab lacks it: not counted
    ]
    text = sweep.summarize(rows, "chat:kvpress")
    assert text.splitlines()[0] == "samples held by every row: 3 (2 tasks)"
    kvlab = next(line for line in text.splitlines() if line.startswith("| chat:kvlab |"))
    # task means: vt 0.5, cwe 0.5 -> 50.0; kvpress vt 0.0, cwe 0.5 -> 25.0; Δ +25 (vt +0.5/2)
    assert [c.strip() for c in kvlab.split("|")[3:6]] == ["50.0", "50.0", "50.0"]  # cwe, vt, mean
    assert kvlab.split("|")[7].strip().startswith("+25.0")
    kvpress = next(line for line in text.splitlines() if line.startswith("| chat:kvpress |"))
    assert [c.strip() for c in kvpress.split("|")[3:6]] == ["50.0", "0.0", "25.0"]
    assert kvpress.split("|")[7].strip() == ""


def test_summary_averages_each_config_over_its_ratios() -> None:
    rows = [_row("vt", 0, "full", 0.0, 1.0)]
    rows += [_row("vt", 0, "chat:kvlab", 0.5, 1.0), _row("vt", 0, "chat:kvlab", 0.75, 0.0)]
    rows += [_row("vt", 0, "raw:kvlab", 0.5, 1.0), _row("vt", 0, "raw:kvlab", 0.75, 1.0)]
    text = sweep.summarize(rows, "chat:kvlab").split("averaged over the ratios")[1]
    cells = {line.split("|")[1].strip(): line.split("|")[2:5] for line in text.splitlines()[4:]}
    assert set(cells) == {"chat:kvlab", "raw:kvlab"}  # full is not a candidate
    # chat:kvlab: (100 + 0) / 2 = 50, NLL (0.5 + 0) / 2; raw:kvlab: 100, NLL 0.5
    assert [c.strip() for c in cells["chat:kvlab"]] == ["2", "50.00", "0.2500"]
    assert [c.strip() for c in cells["raw:kvlab"]] == ["2", "100.00", "0.5000"]
