"""The CPU-side logic of the prepared GPU session (benchmarks/gpu_session.sh,
benchmarks/splitk_decode.py; docs/benchmarks.md, "Decode bytes model and the split-K
kernel"): the plan, the peak bandwidths, and a dry run of the whole script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def sweep_module():
    return load_benchmark("splitk_decode")


def test_plan_measures_every_cache_first_then_the_variants() -> None:
    sweep = sweep_module()
    shapes, codings = ["smollm2-135m", "qwen2.5-1.5b"], ["seed", "pn-mix", "kivi-2bit"]
    plan = sweep.plan(shapes, codings)
    first = len(shapes) * len(codings) * len(sweep.FIRST)
    assert [(k, o) for _, _, k, o in plan[:3]] == sweep.FIRST
    assert {(s, c) for s, c, _, _ in plan[:first]} == {(s, c) for s in shapes for c in codings}
    assert all((k, o) in sweep.VARIANTS for _, _, k, o in plan[first:])
    assert ("pn-mix", "old", {"dot": True, "num_warps": 4}) not in [
        (c, k, o) for _, c, k, o in plan
    ]
    assert sweep.peak_bandwidth("NVIDIA H200", None) == 4.8e12
    assert sweep.peak_bandwidth("NVIDIA H100 80GB HBM3", None) == 3.35e12
    assert sweep.peak_bandwidth("something else", 1e12) == 1e12


def test_gpu_session_dry_run(tmp_path: Path) -> None:
    """The script prints its steps and the sweep's plan, runs nothing on a device and
    writes no status file."""
    env = dict(os.environ, OUT=str(tmp_path / "gpu"), PYTHON=sys.executable)
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for step in ("env", "install", "tests_splitk", "bytes", "tests_triton", "agreement"):
        assert f"== {step} (timeout" in proc.stdout
    assert "smollm2-135m seed splitk" in proc.stdout
    assert not (tmp_path / "gpu" / "status.txt").exists()
    if "triton missing" in proc.stdout:
        pytest.skip("triton is not installed: the dry run could not ask the kernel")
    assert proc.stdout.count("split-K: supported") == 6


def test_results_table(tmp_path: Path) -> None:
    sweep = sweep_module()
    records = [
        dict(
            shape="smollm2-135m",
            coding="seed",
            kernel="splitk",
            options={},
            ms=0.02,
            cold_ms=0.025,
            gb_s=2400.0,
            of_peak=0.5,
            max_abs_error=1e-6,
            tolerance=4e-5,
        ),
        dict(shape="smollm2-135m", coding="seed", kernel="old", options={}, status="skipped"),
    ]
    sweep.write_md(tmp_path, records, "NVIDIA H200", 4.8e12)
    text = (tmp_path / "results.md").read_text()
    assert "| 0.0200 | 0.0250 | 2400 | 50.0% | 1.0e-06 (4.0e-05) |" in text
    assert "| skipped |" in text
    rows = [line for line in text.splitlines() if line.startswith("| smollm2")]
    assert all(line.count("|") == rows[0].count("|") for line in rows)
