"""``kvlab sweep`` on a tiny model: the grid, resume, Ctrl-C, and Ray against local."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eval_helpers import strip_timing

from kvlab.artifacts import validate_artifact
from kvlab.evaluation.execute import Runtime
from kvlab.evaluation.sweep import SweepOptions, run_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_sweep(folder: Path, model: Path, text: Path, *, windows: int = 2) -> Path:
    path = folder / "tiny.toml"
    path.write_text(
        f"""
models = ["{model}"]
texts = ["{text}"]
protocols = ["prefill-score", "stream"]
methods = ["relay:snapkv", "streaming-llm", "pn-mix-uniform"]
ratios = [0.25, 0.5]

[prefill-score]
windows = {windows}
prefill = 192
score = 3

[stream]
stream_length = 400
chunk_size = 64
cache_slots = 160
segment = 100
""",
        encoding="utf-8",
    )
    return path


def test_sweep_writes_every_group_a_summary_and_a_pareto_plot_then_resumes(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch
):
    sweep = write_sweep(tmp_path, tiny_model_dir, tiny_text)
    out = tmp_path / "out"
    options = SweepOptions(
        output_dir=out,
        device="cpu",
        progress=False,
        cpu_threads=1,
        argv=["kvlab", "sweep", str(sweep)],
    )
    outcome = run_sweep(sweep, options)
    group = out / f"{tiny_model_dir.name}--{tiny_text.stem}"
    for name in ("table-prefill-score.md", "table-stream.md", "kl-vs-bytes.png"):
        assert (group / name).is_file()
    for artifact in group.glob("metrics-*.json"):
        assert validate_artifact(artifact).ok
    # 2 windows x (full + 5 methods) + 5 streams (full only where listed, or prefill-score)
    assert len(list((out / "tasks").glob("*.json"))) == 12 + 5
    summary = (out / "summary.md").read_text()
    assert summary == outcome.summary
    assert summary.count("| relay:snapkv@0.25 |") == 2 and "model s" not in summary
    [pareto] = outcome.pareto_paths
    assert pareto.name == f"pareto-{tiny_model_dir.name}--{tiny_text.stem}.png"
    assert pareto.read_bytes()[:8] == PNG_SIGNATURE

    calls = []
    real = Runtime.run
    monkeypatch.setattr(
        Runtime, "run", lambda self, task, **kw: calls.append(task) or real(self, task, **kw)
    )
    again = run_sweep(sweep, options)
    assert calls == [] and again.summary == summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_and_local_executors_give_identical_results(tiny_model_dir, tiny_text, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, tiny_text)
    sweep.write_text(sweep.read_text().replace('"pn-mix-uniform"', '"pn-mix"'))
    results = {}
    for executor in ("local", "ray"):
        options = SweepOptions(
            output_dir=tmp_path / executor,
            executor=executor,
            workers=2,
            device="cpu",
            cpu_threads=1,
            progress=False,
            calibration_cache=tmp_path / f"calibration-{executor}",
            argv=["kvlab", "sweep"],
        )
        outcome = run_sweep(sweep, options)
        group = next(p for p in (tmp_path / executor).iterdir() if p.name.endswith(tiny_text.stem))
        raws = {p.name: json.loads(p.read_text()) for p in sorted(group.glob("raw-*.json"))}
        workers = {
            json.loads(p.read_text())["result"]["worker_pid"]
            for p in (tmp_path / executor / "tasks").glob("*.json")
        }
        results[executor] = (outcome.summary, raws, workers)
    local, ray = results["local"], results["ray"]
    assert ray[0] == local[0]  # summary.md, character for character
    assert strip_timing(ray[1]) == strip_timing(local[1])  # every per-token figure, bit for bit
    assert len(ray[2]) >= 2 and os.getpid() not in ray[2]  # Ray workers shared the tasks
    assert local[2] == {os.getpid()}


@pytest.mark.slow
def test_ctrl_c_then_rerun_finishes_only_the_missing_tasks(tiny_model_dir, tiny_text, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, tiny_text, windows=6)
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "kvlab.cli",
        "sweep",
        str(sweep),
        "--output-dir",
        str(out),
        "--device",
        "cpu",
        "--cpu-threads",
        "1",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell may have started us with SIGINT ignored (background jobs): give it back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tasks = out / "tasks"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(tasks.glob("*.json"))) < 5:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert re.search(
        rf"interrupted: \d+ finished tasks are kept in {re.escape(str(tasks))}", stderr
    )
    assert "Traceback" not in stderr
    stored = len(list(tasks.glob("*.json")))
    total = 6 * 6 + 5
    assert 5 <= stored < total
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{total} tasks: {total - stored} to run, {stored} already done" in done.stderr
    assert len(list(tasks.glob("*.json"))) == total
