"""Run files kvlab reads back — task results, calibration entries — are sealed with a content
checksum and validated; a damaged one is recomputed with a warning naming it, never used and
never a bare key error (issue 38, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import strip_timing
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.evaluation.execute import Runtime
from kvlab.evaluation.plan import EvalConfig
from kvlab.evaluation.runfiles import (
    CHECKSUM_FIELD,
    CalibrationEntry,
    DamagedRunFile,
    DamagedRunFileWarning,
    StoredTask,
    read_sealed,
    seal,
)
from kvlab.evaluation.store import result_problem

ROOT = Path(__file__).resolve().parents[2]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


def _write(path: Path, document) -> Path:
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")
    return path


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_a_sealed_document_reads_back_as_written_and_any_change_is_caught(tmp_path_factory, body):
    path = tmp_path_factory.mktemp("sealed") / "entry.json"
    document = {"key": {"a": 1}, "prepared": body}
    sealed = seal(document)
    assert {k: v for k, v in sealed.items() if k != CHECKSUM_FIELD} == json.loads(
        json.dumps(document)
    )
    _write(path, sealed)
    assert read_sealed(path, CalibrationEntry, require_checksum=True) == sealed
    # white space is not content: the same document compact still reads
    path.write_text(json.dumps(sealed, separators=(",", ":")), encoding="utf-8")
    assert read_sealed(path, CalibrationEntry, require_checksum=True) == sealed
    # any change to the content, in range or not, is caught
    edited = {**sealed, "prepared": {**sealed["prepared"], "extra": 0}}
    with pytest.raises(DamagedRunFile, match="does not match its content_sha256"):
        read_sealed(_write(path, edited), CalibrationEntry, require_checksum=False)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"key": {}, "prep', "not readable as JSON"),  # cut
        ("", "not readable as JSON"),  # empty
        ("\0" * 64, "not readable as JSON"),  # NUL-filled
        ("[1, 2]", "a JSON list, not an object"),
        ('{"key": {}, "prepared": {"x": NaN}}', "no content_sha256"),
        ('{"key": {}, "prepared": 3}', "no content_sha256"),
    ],
)
def test_a_damaged_file_says_which_file_and_why(tmp_path, text, reason):
    path = tmp_path / "entry.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DamagedRunFile) as info:
        read_sealed(path, CalibrationEntry, require_checksum=True)
    assert reason in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)
    assert read_sealed(tmp_path / "absent.json", CalibrationEntry, require_checksum=True) is None


def test_a_schema_problem_names_the_field(tmp_path):
    path = _write(tmp_path / "e.json", seal({"key": {}, "prepared": 3}))
    with pytest.raises(DamagedRunFile, match=r"not a valid CalibrationEntry: prepared: "):
        read_sealed(path, CalibrationEntry, require_checksum=True)
    nan = {"key": {}, "prepared": {"x": 1.0}, CHECKSUM_FIELD: "0" * 64}
    path.write_text(json.dumps(nan).replace("1.0", "NaN"), encoding="utf-8")
    with pytest.raises(DamagedRunFile, match="does not match its content_sha256"):
        read_sealed(path, CalibrationEntry, require_checksum=True)


def test_every_committed_task_file_validates():
    """Every task file under docs/results/runs validates: files written before the checksum
    (committed runs that later sessions resume from) are accepted by their schema, sealed
    ones (later runs) by their schema and their content_sha256, which ``read_sealed`` checks."""
    files = sorted(ROOT.glob("docs/results/runs/*/tasks/*.json"))
    if not files:
        pytest.skip("no committed run folder in this tree")
    sealed = 0
    for path in files:
        document = read_sealed(
            path,
            StoredTask,
            require_checksum=False,
            check=lambda d: result_problem(d["task"]["protocol"], d["result"]),
        )
        assert document is not None
        sealed += CHECKSUM_FIELD in document
    assert 0 < sealed < len(files)  # both kinds are committed, so both paths ran


# --- task files, through kvlab eval ----------------------------------------------------------


def _config(model: Path, text: Path, out: Path, **overrides) -> EvalConfig:
    base = dict(
        model=str(model),
        text=text,
        methods=["streaming-llm@0.5"],
        windows=1,
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
    """``run_eval(config)`` and the lines it printed (its console)."""
    import io

    from rich.console import Console

    from kvlab.evaluation import run_eval

    text = io.StringIO()
    outcome = run_eval(config, Console(file=text, width=400, soft_wrap=True))
    return outcome, text.getvalue().splitlines()


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("warning: ")]


def _task_file(out: Path, method: str) -> Path:
    for path in (out / "tasks").glob("*.json"):
        if json.loads(path.read_text())["task"]["method"] == method:
            return path
    raise AssertionError(f"no task file of {method}")


def _missing_kl(document):
    del document["result"]["kl"]  # JSON parses, key matches, a field is gone
    document.pop(CHECKSUM_FIELD)  # as a file written before the checksum would be


def _edited_in_range(document):
    document["result"]["nll"][0] *= 1.001  # a plausible value: only the checksum tells


def _another_window(document):
    document["result"]["nll"] = document["result"]["nll"][:2]
    document["result"]["kl"] = document["result"]["kl"][:2]
    document.pop(CHECKSUM_FIELD)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_missing_kl, "result.kl: Field required"),
        (_edited_in_range, "does not match its content_sha256"),
        (_another_window, "its result scores [2] tokens, not 4"),
    ],
)
def test_a_damaged_task_file_is_recomputed_with_a_warning(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch, damage, reason
):
    out = tmp_path / "out"
    reference, _ = _run(_config(tiny_model_dir, tiny_text, out))
    path = _task_file(out, "streaming-llm@0.5")
    document = json.loads(path.read_text())
    assert CHECKSUM_FIELD in document
    damage(document)
    _write(path, document)

    calls = []
    real = Runtime.run

    def counting(self, task, **kwargs):
        calls.append(task.method.name)
        return real(self, task, **kwargs)

    monkeypatch.setattr(Runtime, "run", counting)
    again, lines = _run(_config(tiny_model_dir, tiny_text, out))
    [warning] = _warnings(lines)
    assert warning.startswith(f"warning: task file {path}: ") and reason in warning
    assert warning.endswith("; recomputing it (the damaged file is replaced)")
    assert "streaming-llm@0.5" in calls  # recomputed, not used
    assert strip_timing(again.summaries) == strip_timing(reference.summaries)
    assert CHECKSUM_FIELD in json.loads(path.read_text())  # replaced by a sound file


def test_a_legacy_task_file_that_validates_is_reused(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    reference, _ = _run(_config(tiny_model_dir, tiny_text, out))
    for path in (out / "tasks").glob("*.json"):
        document = json.loads(path.read_text())
        document.pop(CHECKSUM_FIELD)
        _write(path, document)
    calls = []
    monkeypatch.setattr(Runtime, "run", lambda self, task, **kw: calls.append(task))
    again, lines = _run(_config(tiny_model_dir, tiny_text, out))
    assert calls == [] and _warnings(lines) == []
    assert again.table == reference.table


def test_the_cli_warns_on_stderr_and_finishes(tiny_model_dir, tiny_text, tmp_path):
    from typer.testing import CliRunner

    from kvlab.cli import app

    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_model_dir), "--text", str(tiny_text),
            "--method", "streaming-llm@0.5", "--windows", "1", "--prefill", "192",
            "--score", "4", "--device", "cpu", "--output-dir", str(out), "--no-progress",
            "--cpu-threads", "1"]  # fmt: skip
    runner = CliRunner()
    assert runner.invoke(app, args).exit_code == 0
    path = _task_file(out, "streaming-llm@0.5")
    document = json.loads(path.read_text())
    _missing_kl(document)
    _write(path, document)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert lines == [
        f"warning: task file {path}: its result is not a prefill-score result: "
        "result.kl: Field required; recomputing it (the damaged file is replaced)"
    ]


# --- calibration entries -----------------------------------------------------------------------


def _fake_budgets(monkeypatch, fractions=(0.25, 0.75)):
    """Replace the layer-budget measurement by a counter (a 2-layer model's fractions)."""
    from kvlab.integrations import relay_calibration
    from kvlab.integrations.relay_calibration import LayerBudgetCalibration

    calls = []

    def fake(model, tokenizer, config, **kwargs):
        calls.append(config.ratio)
        return LayerBudgetCalibration(fractions, (), "text", "sha", 0, 512, 128, 1.0)

    monkeypatch.setattr(relay_calibration, "calibrate_layer_budgets", fake)
    return calls


def _prepare(cache: Path, warn=None):
    from kvlab.evaluation.calibration import prepare_method
    from kvlab.evaluation.methods import parse_method

    return prepare_method(
        parse_method("relay:snapkv@0.5"),
        torch.nn.Linear(1, 1),
        None,
        checkpoint_sha256="a" * 64,
        dtype="float32",
        cache_dir=cache,
        warn=warn,
    )


def _entry_damages():
    def edited_in_range(entry):
        entry["prepared"]["layer_fractions"] = [0.5]  # 1 weight for 2 layers: plausible JSON

    def legacy(entry):
        entry.pop(CHECKSUM_FIELD)  # written before entries were sealed

    def another_key(entry):
        entry["key"]["checkpoint_sha256"] = "b" * 64
        entry.pop(CHECKSUM_FIELD)
        entry.update(seal(entry))  # a sound entry of another model, under this name

    def nul_filled(entry):
        return "\0" * 100

    return [
        (edited_in_range, "does not match its content_sha256"),
        (legacy, "no content_sha256"),
        (another_key, "its key fields are another calibration's"),
        (nul_filled, "not readable as JSON"),
    ]


@pytest.mark.parametrize(("damage", "reason"), _entry_damages())
def test_a_damaged_calibration_entry_is_recomputed_with_a_warning(
    tmp_path, monkeypatch, damage, reason
):
    calls = _fake_budgets(monkeypatch)
    first = _prepare(tmp_path)
    assert first["calibration_cache"]["status"] == "computed"
    [path] = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    assert CHECKSUM_FIELD in entry and first["layer_fractions"] == [0.25, 0.75]
    assert _prepare(tmp_path)["calibration_cache"]["status"] == "reused" and len(calls) == 1

    text = damage(entry)
    path.write_text(text if text is not None else json.dumps(entry), encoding="utf-8")
    lines: list[str] = []
    again = _prepare(tmp_path, warn=lines.append)
    assert len(calls) == 2  # recomputed, not reused
    assert again["layer_fractions"] == [0.25, 0.75]
    assert again["calibration_cache"]["status"] == "computed"
    [line] = lines
    assert line.startswith(f"calibration entry {path}: ") and reason in line
    assert _prepare(tmp_path)["calibration_cache"]["status"] == "reused"  # replaced, sound
    assert len(calls) == 2


def test_a_damaged_calibration_entry_warns_by_default(tmp_path, monkeypatch):
    _fake_budgets(monkeypatch)
    _prepare(tmp_path)
    [path] = tmp_path.glob("*.json")
    path.write_text('{"key": {}}', encoding="utf-8")
    with pytest.warns(DamagedRunFileWarning, match="calibration entry .*no content_sha256"):
        _prepare(tmp_path)


def test_a_calibration_edited_for_another_model_is_not_used_by_kvlab_eval(
    tiny_model_dir, tiny_text, tmp_path
):
    """The issue's case: an entry whose key matches, edited to one layer weight for the
    2-layer model, reached the run ("calibration reused") and failed there with an error on a
    setting the user never gave. Now the entry is recomputed, and the run finishes."""
    cache = tmp_path / "calibration"
    config = dict(methods=["relay:snapkv@0.5"], calibration_cache=cache)
    reference, _ = _run(_config(tiny_model_dir, tiny_text, tmp_path / "a", **config))
    [path] = cache.glob("*.json")
    entry = json.loads(path.read_text())
    entry["prepared"]["layer_fractions"] = entry["prepared"]["layer_fractions"][:1]
    _write(path, entry)
    again, lines = _run(_config(tiny_model_dir, tiny_text, tmp_path / "b", **config))
    [warning] = _warnings(lines)
    assert warning.startswith(f"warning: calibration entry {path}: its content does not")
    record = again.artifact["configuration"]["methods"]["relay:snapkv@0.5"]
    assert record["calibration_cache"]["status"] == "computed"
    assert strip_timing(again.summaries) == strip_timing(reference.summaries)
