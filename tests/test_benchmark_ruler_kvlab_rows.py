"""benchmarks/kvpress/ruler_kvlab_rows.py: a run's task files give the raw file's rows and
configuration (checked on a committed run that has both), and mixed or damaged folders are
refused with one clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "results" / "runs" / "ruler-qwen05-4k-seed2-kvzip-default"
MODEL = "qwen2.5-coder-0.5b"

rows_mod = load_benchmark("kvpress/ruler_kvlab_rows")

# the fields ruler_kvlab_rows.py reads from a raw row
_READ = ("task", "length", "index", "outputs", "context_tokens", "question_tokens", "score",
         "prediction", "storage")  # fmt: skip


def _by_key(results: dict[str, list[dict]]) -> dict[tuple, dict]:
    return {
        (method, r["task"], r["length"], r["index"]): {f: r[f] for f in _READ}
        for method, rows in results.items()
        for r in rows
    }


def test_task_files_give_the_committed_raw_files_rows_and_configuration() -> None:
    raw = json.loads((RUN / "raw-ruler-cpu.json").read_text())
    rebuilt = rows_mod.raw_from_tasks(RUN, MODEL)  # the output folder: its tasks/ is read
    assert _by_key(rebuilt["results"]) == _by_key(raw["results"])
    assert len(_by_key(raw["results"])) == 880
    conf = raw["configuration"]
    for field in ("tasks", "lengths", "seed", "chat_template", "shared_prefill"):
        assert rebuilt["configuration"][field] == conf[field], field
    assert rebuilt["configuration"]["samples_per_task"] == conf["samples_per_task"] == 10


def _copy(tmp_path: Path, n: int) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    for path in sorted((RUN / "tasks").glob("*.json"))[:n]:
        shutil.copy(path, folder)
    return folder


def test_mixed_damaged_empty_or_other_model_folders_are_refused(tmp_path: Path) -> None:
    folder = _copy(tmp_path, 3)
    with pytest.raises(SystemExit, match="not --model 'smollm2-135m'"):
        rows_mod.raw_from_tasks(folder, "smollm2-135m")
    # a file of another run (seed 3) in the same folder
    other = json.loads(next(folder.glob("*.json")).read_text())
    other.pop("content_sha256")
    other["task"]["unit"]["seed"] = 3
    (folder / ("f" * 64 + ".json")).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="task files of 2 runs"):
        rows_mod.raw_from_tasks(folder, MODEL)
    # an edited sealed file: the checksum no longer matches
    (folder / ("f" * 64 + ".json")).unlink()
    path = next(folder.glob("*.json"))
    edited = json.loads(path.read_text())
    edited["result"]["score"] = 1.0 - edited["result"]["score"]
    path.write_text(json.dumps(edited))
    with pytest.raises(SystemExit, match="does not match its content_sha256"):
        rows_mod.raw_from_tasks(folder, MODEL)
    with pytest.raises(SystemExit, match="no RULER task file"):
        rows_mod.raw_from_tasks(tmp_path / "empty", MODEL)


def test_bad_raw_inputs_get_one_clear_error(tmp_path: Path) -> None:
    raw = rows_mod.load_run(RUN / "raw-ruler-cpu.json", MODEL)
    assert len(raw["results"]) == 8
    with pytest.raises(SystemExit, match="no such file or folder"):
        rows_mod.load_run(tmp_path / "nope", MODEL)
    (tmp_path / "notes.md").write_text("# not JSON\n")
    with pytest.raises(SystemExit, match="not a kvlab raw-ruler JSON file"):
        rows_mod.load_run(tmp_path / "notes.md", MODEL)
    (tmp_path / "other.json").write_text(json.dumps({"protocol": "stream", "results": {}}))
    with pytest.raises(SystemExit, match="not a kvlab raw-ruler file"):
        rows_mod.load_run(tmp_path / "other.json", MODEL)
    with pytest.raises(SystemExit, match="not --model 'smollm2-135m'"):
        rows_mod.load_run(RUN / "raw-ruler-cpu.json", "smollm2-135m")
