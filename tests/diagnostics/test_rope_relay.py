"""The RoPE-Relay diagnostic: computed checks, reference field layout, end-to-end CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.artifacts import validate_artifact
from kvlab.diagnostics.paper import RunContext
from kvlab.diagnostics.rope_relay import CONFIGURATION, run_seed

SEED_000 = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "seeds" / "000_8249d5d9ce5c6fb7.txt"
    ).read_text()
)


def _context(tmp_path: Path) -> RunContext:
    return RunContext(torch.device("cpu"), "smoke", None, ["kvlab"], tmp_path, [42])


def test_configuration_is_the_reference_one() -> None:
    assert CONFIGURATION == SEED_000["configuration"]
    assert list(CONFIGURATION) == list(SEED_000["configuration"])


@pytest.mark.parametrize("seed", [42, 43, 44])
def test_one_seed_meets_the_spec(tmp_path: Path, seed: int) -> None:
    result = run_seed(_context(tmp_path), seed)
    m = result.metrics
    assert list(m) == list(SEED_000["metrics"])
    assert m["max_reference_absolute_error"] < 1e-6
    for key in (
        "values_unchanged",
        "nonrotary_tail_unchanged",
        "heterogeneous_endpoints_aligned",
        "query_and_answer_positions_synchronized",
    ):
        assert m[key] is True, key
    for key in ("gradient_norm_keys", "gradient_norm_values", "gradient_norm_queries"):
        assert 0 < m[key] < float("inf"), key
    assert m["unsynchronized_query_mean_logit_error"] > 1.0
    assert result.details["kept_counts"] == CONFIGURATION["retained_counts"]
    assert result.details["next_positions"] == [CONFIGURATION["slots"]]


def test_same_seed_is_deterministic_and_seeds_differ(tmp_path: Path) -> None:
    a, b = run_seed(_context(tmp_path), 42), run_seed(_context(tmp_path), 42)
    assert a.metrics == b.metrics and a.data_sha256 == b.data_sha256
    assert run_seed(_context(tmp_path), 43).data_sha256 != a.data_sha256


def _nested_keys(obj: object, prefix: str = "") -> list[str]:
    if not isinstance(obj, dict):
        return []
    keys = []
    for key, value in obj.items():
        keys.append(prefix + key)
        if key not in ("metrics", "configuration", "provenance"):
            keys.extend(_nested_keys(value, prefix + key + "."))
    return keys


@pytest.mark.slow
def test_cli_end_to_end_writes_a_valid_artifact_in_reference_layout(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlab.cli",
            "reproduce",
            "--paper",
            "rope-relay",
            "--seeds",
            "42,43,44",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unsynchronized_query_mean_logit_error" in done.stdout
    artifact_path = tmp_path / "rope-relay" / "metrics-cpu-seeds42-44.json"
    raw_path = tmp_path / "rope-relay" / "raw-cpu-seeds42-44.json"
    artifact = json.loads(artifact_path.read_text())
    assert list(artifact) == list(SEED_000)
    assert _nested_keys(artifact) == _nested_keys(SEED_000)
    assert list(artifact["metrics"]) == list(SEED_000["metrics"])
    assert [list(r) for r in artifact["per_seed"]] == [list(r) for r in SEED_000["per_seed"]]
    seed_prov = list(SEED_000["provenance"])
    assert list(artifact["provenance"])[: len(seed_prov)] == seed_prov
    assert artifact["evaluation_protocol"]["formal_comparison"] is False
    assert artifact["provenance"]["command_argv"][:5] == [
        "python",
        "-m",
        "kvlab.cli",
        "reproduce",
        "--paper",
    ]
    assert raw_path.is_file()
    assert validate_artifact(artifact_path).ok
    done = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "validate", str(artifact_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout


def test_cli_rejects_unknown_paper_and_absent_device(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "reproduce", "--paper", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "known papers: rope-relay, pn-mix" in done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvlab.cli",
                "reproduce",
                "--paper",
                "rope-relay",
                "--device",
                "cuda",
                "--output-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2
        assert "CUDA is not available" in done.stderr
        assert not (tmp_path / "rope-relay").exists()


def _wrong_tokens(keys, values, positions, keep, cfg, endpoint=None):
    from kvlab.relay import relay

    shifted = keep.roll(1, dims=-1)  # same counts, different tokens
    return relay(keys, values, positions, shifted, cfg, endpoint)


def _wrong_endpoint(keys, values, positions, keep, cfg, endpoint=None):
    from kvlab.relay import relay

    return relay(keys, values, positions, keep, cfg, endpoint=keys.shape[2])


@pytest.mark.parametrize("broken", [_wrong_tokens, _wrong_endpoint])
def test_a_broken_relay_fails_the_computed_checks(tmp_path: Path, monkeypatch, broken) -> None:
    from kvlab.diagnostics import rope_relay

    monkeypatch.setattr(rope_relay, "relay", broken)
    m = run_seed(_context(tmp_path), 42).metrics
    flags = [
        m["values_unchanged"],
        m["heterogeneous_endpoints_aligned"],
        m["query_and_answer_positions_synchronized"],
    ]
    assert not all(flags)
    if broken is _wrong_tokens:
        assert m["max_reference_absolute_error"] > 1e-3
