"""A resumed ``kvlab eval`` reuses every stored task: a prefill-score ``full`` task's
log-probabilities are kept with it while its window has tasks to run; where they are not,
the plan line says what runs again and why, and the progress bar counts it; an interrupted
run names only folders that exist (issue 38, item 7)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from eval_helpers import strip_timing

from kvlab.evaluation.execute import Runtime
from kvlab.evaluation.plan import EvalConfig
from kvlab.evaluation.store import LOGPROBS_SUFFIX, TaskStore


def _config(model: Path, text: Path, out: Path, **overrides) -> EvalConfig:
    base = dict(
        model=str(model),
        text=text,
        methods=["streaming-llm@0.5", "evict-no-relay-legacy:keynorm@0.5"],
        windows=2,
        prefill=192,
        score=4,
        device="cpu",
        output_dir=out,
        progress=False,
        argv=["kvlab", "eval"],
        cpu_threads=1,
    )
    return EvalConfig(**{**base, **overrides})


def _run(config: EvalConfig):
    from rich.console import Console

    from kvlab.evaluation import run_eval

    text = io.StringIO()
    outcome = run_eval(config, Console(file=text, width=400, soft_wrap=True))
    return outcome, text.getvalue().splitlines()


@pytest.fixture
def interrupted(tiny_model_dir, tiny_text, tmp_path, monkeypatch):
    """A reference run, and a run interrupted right after window 0's full task was stored
    (the issue's case: ``8 tasks: 7 to run, 1 already done``); yields (reference, out, calls)
    with ``Runtime.run`` recording (method, window) from then on."""
    reference, _ = _run(_config(tiny_model_dir, tiny_text, tmp_path / "whole"))
    out = tmp_path / "out"
    calls: list[tuple[str, int]] = []
    real = Runtime.run

    def recording(self, task, **kwargs):
        calls.append((task.method.name, task.where["window"]))
        if interrupt[0] and len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during window 0's first method
        return real(self, task, **kwargs)

    interrupt = [True]
    monkeypatch.setattr(Runtime, "run", recording)
    with pytest.raises(KeyboardInterrupt):
        _run(_config(tiny_model_dir, tiny_text, out))
    interrupt[0] = False
    calls.clear()
    return reference, out, calls


def test_the_stored_full_task_is_not_run_again(interrupted, tiny_model_dir, tiny_text):
    reference, out, calls = interrupted
    [kept] = (out / "tasks").glob(f"*{LOGPROBS_SUFFIX}")
    outcome, lines = _run(_config(tiny_model_dir, tiny_text, out))
    assert lines[0] == (
        f"6 tasks: 5 to run, 1 already done in {out / 'tasks'} (reused; --no-resume reruns them)"
    )
    assert ("full", 0) not in calls and len(calls) == 5
    assert strip_timing(outcome.summaries) == strip_timing(reference.summaries)  # bit for bit
    assert not kept.exists()  # gone with the window's last task


@pytest.mark.parametrize("how", ["missing", "damaged"])
def test_without_kept_log_probabilities_the_line_says_what_runs_again(
    interrupted, tiny_model_dir, tiny_text, how
):
    reference, out, calls = interrupted
    [kept] = (out / "tasks").glob(f"*{LOGPROBS_SUFFIX}")
    if how == "missing":  # a run from before they were kept
        kept.unlink()
    else:  # one byte of the tensor changed
        data = bytearray(kept.read_bytes())
        data[-5] ^= 0x40
        kept.write_bytes(bytes(data))
    outcome, lines = _run(_config(tiny_model_dir, tiny_text, out))
    if how == "missing":
        assert lines[0].endswith(
            "; 1 of the done ones (full) run again first, for the log-probabilities their "
            "windows' other tasks need (not kept by the run that stored them): 6 to run in all"
        )
    else:
        assert lines[0].startswith("6 tasks: 5 to run, 1 already done in ")
        [warning] = [line for line in lines if line.startswith("warning: ")]
        assert warning == (
            f"warning: log-probabilities file {kept}: its content does not match its "
            "content_sha256; recomputing it (the damaged file is replaced)"
        )
    assert calls[0] == ("full", 0) and len(calls) == 6
    assert strip_timing(outcome.summaries) == strip_timing(reference.summaries)
    assert list((out / "tasks").glob(f"*{LOGPROBS_SUFFIX}")) == []


def test_the_progress_bar_counts_what_runs(interrupted, tiny_model_dir, tiny_text, monkeypatch):
    from kvlab.evaluation import executors

    _, out, _ = interrupted
    totals = []
    real = executors._Display.__init__

    def record(self, schedule, enabled):
        real(self, schedule, enabled)
        totals.append((self.bar.total, schedule.loads, schedule.reruns))

    monkeypatch.setattr(executors._Display, "__init__", record)
    _run(_config(tiny_model_dir, tiny_text, out))
    assert totals == [(5, 1, 0)]  # 5 tasks to run; the kept log-probabilities are read


def test_kept_log_probabilities_round_trip_exactly(tmp_path):
    store = TaskStore(tmp_path)
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(4, 257), dim=-1)
    store.save_logprobs("a" * 64, logprobs)
    loaded = store.load_logprobs("a" * 64)
    assert loaded.dtype == torch.float32 and torch.equal(loaded, logprobs)
    # another task's file under this name is damaged, not used
    store.logprobs_path("a" * 64).rename(store.logprobs_path("b" * 64))
    with pytest.warns(UserWarning, match=r"it holds task aaaaaaaaaaaa\.\.\., not bbbb"):
        assert store.load_logprobs("b" * 64) is None
    store.drop_logprobs("b" * 64)
    assert not store.has_logprobs("b" * 64) and store.load_logprobs("b" * 64) is None


@pytest.mark.parametrize("finished", [0, 1])
def test_an_interrupted_run_names_only_folders_that_exist(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch, finished
):
    from typer.testing import CliRunner

    from kvlab.cli import app

    calls = []
    real = Runtime.run

    def interrupt(self, task, **kwargs):
        calls.append(task)
        if len(calls) > finished:
            raise KeyboardInterrupt
        return real(self, task, **kwargs)

    monkeypatch.setattr(Runtime, "run", interrupt)
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_model_dir), "--text", str(tiny_text),
            "--method", "streaming-llm@0.5", "--windows", "1", "--prefill", "192",
            "--score", "2", "--device", "cpu", "--output-dir", str(out), "--no-progress",
            "--cpu-threads", "1"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130
    [line] = [line for line in result.stderr.splitlines() if line.startswith("interrupted")]
    if finished:
        assert line == (
            f"interrupted: 1 finished task is kept in {out / 'tasks'}; rerun the same "
            "command to resume"
        )
    else:
        assert not (out / "tasks").exists()
        assert line == (
            "interrupted: no task had finished, nothing was kept; rerun the same command to "
            "start again"
        )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_resumes_from_the_kept_log_probabilities(interrupted, tiny_model_dir, tiny_text):
    reference, out, _ = interrupted
    assert list((out / "tasks").glob(f"*{LOGPROBS_SUFFIX}"))
    config = _config(tiny_model_dir, tiny_text, out, executor="ray", workers=2)
    outcome, lines = _run(config)
    assert lines[0].startswith("6 tasks: 5 to run, 1 already done in ")
    assert strip_timing(outcome.summaries) == strip_timing(reference.summaries)
    assert list((out / "tasks").glob(f"*{LOGPROBS_SUFFIX}")) == []


def test_the_plan_line_counts_the_preparations_the_bar_counts(tmp_path):
    """A resumed run whose one task left is a calibrated method's: the bar counts the method's
    preparation too, and the plan line says so (a newcomer saw "1 to run" above a bar of 2)."""
    from types import SimpleNamespace

    from kvlab.evaluation.harness import plan_line

    schedule = SimpleNamespace(total_tasks=3, skipped=2, reruns=0, computing_jobs=2)
    assert plan_line(schedule, tmp_path) == (
        f"3 tasks: 1 to run, 2 already done in {tmp_path} (reused; --no-resume reruns them); "
        "before them 1 method preparation (calibration, reused when cached), on the progress "
        "bar too"
    )
    schedule = SimpleNamespace(total_tasks=3, skipped=0, reruns=0, computing_jobs=3)
    assert plan_line(schedule, tmp_path) == "3 tasks: 3 to run"
