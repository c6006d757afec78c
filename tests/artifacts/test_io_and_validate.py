"""Atomic writes and ``validate`` catching edited sources."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvlab.artifacts import (
    build_metric_artifact,
    manifest_digest,
    source_hashes,
    validate_artifact,
    write_json_atomic,
)
from kvlab.artifacts import io as artifacts_io


def test_atomic_write_leaves_old_file_when_replace_fails(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "a.json"
    write_json_atomic(target, {"v": 1})

    def boom(*_args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(artifacts_io.os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        write_json_atomic(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_atomic_write_rejects_nan_without_touching_target(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    with pytest.raises(ValueError):
        write_json_atomic(target, {"v": float("nan")})
    assert not target.exists() and not list(tmp_path.iterdir())


def _artifact(root: Path, impl: list[str], runner: list[str]) -> dict:
    impl_h, run_h = source_hashes(impl, root), source_hashes(runner, root)
    provenance = {
        "artifact_path": "a.json",
        "raw_result": "raw.json",
        "code_commit": None,
        "implementation_sha256": manifest_digest(impl_h),
        "runner_sha256": manifest_digest(run_h),
        "command": "kvlab reproduce",
        "accelerator": "CPU",
        "checkpoint": None,
        "dataset_fingerprint": "sha256:" + "0" * 64,
        "code_dirty": None,
        "command_argv": ["kvlab", "reproduce"],
        "source_sha256": {"implementation": impl_h, "runner": run_h},
    }
    return build_metric_artifact(
        method="m",
        manifest_ref="r",
        seeds=[1],
        per_seed=[{"x": 1.0, "ok": True}],
        configuration={},
        tier="l1_mechanism",
        claim_policy="p",
        dataset={"id": "d", "revision": "v", "checkpoint": None, "capability_benchmark": False},
        provenance=provenance,
        baselines_compared=False,
        implementation_status="component_only",
        diagnostic_only=True,
    )


def test_validate_accepts_then_catches_an_edited_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "impl.py").write_text("x = 1\n")
    (src / "pkg" / "run.py").write_text("y = 2\n")
    artifact = _artifact(src, ["pkg/impl.py"], ["pkg/run.py"])
    path = write_json_atomic(tmp_path / "a.json", artifact)
    report = validate_artifact(path, root=src)
    assert report.ok and report.checked_files == 2, report.problems
    (src / "pkg" / "impl.py").write_text("x = 2\n")
    report = validate_artifact(path, root=src)
    assert not report.ok
    assert any(p.startswith("pkg/impl.py: sha256") for p in report.problems)
    os.remove(src / "pkg" / "run.py")
    assert any("pkg/run.py: missing" in p for p in validate_artifact(path, root=src).problems)


def test_validate_catches_tampered_digest_and_schema(tmp_path: Path) -> None:
    (tmp_path / "f.py").write_text("z\n")
    artifact = _artifact(tmp_path, ["f.py"], ["f.py"])
    artifact["provenance"]["implementation_sha256"] = "0" * 64
    artifact["surprise"] = 1
    path = write_json_atomic(tmp_path / "a.json", artifact)
    problems = validate_artifact(path, root=tmp_path).problems
    assert any("surprise" in p for p in problems)
    artifact.pop("surprise")
    write_json_atomic(path, artifact)
    problems = validate_artifact(path, root=tmp_path).problems
    assert problems == ["provenance.implementation_sha256 does not match its recorded file list"]


def test_validate_unknown_schema_and_unreadable(tmp_path: Path) -> None:
    bad = tmp_path / "b.json"
    bad.write_text('{"schema_version": 7}')
    assert "unknown schema_version 7" in validate_artifact(bad).problems[0]
    raw = tmp_path / "raw-ruler-cpu.json"  # kvlab eval's raw results: not a record
    raw.write_text('{"protocol": "ruler", "summaries": [], "results": []}')
    assert validate_artifact(raw).problems == [
        "not a kvlab record: no schema_version: this looks like kvlab eval's raw results "
        "(raw-<protocol>-<device>.json); its record is metrics-<protocol>-<device>.json in the "
        "same folder"
    ]
    other = tmp_path / "d.json"
    other.write_text('{"a": 1}')
    assert validate_artifact(other).problems == ["not a kvlab record: no schema_version"]
    broken = tmp_path / "c.json"
    broken.write_text("{")
    assert validate_artifact(broken).problems[0].startswith("cannot read JSON")


def test_written_file_has_a_plain_files_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "m.json", {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def _valid_pair(tmp_path: Path) -> tuple[dict, Path]:
    (tmp_path / "f.py").write_text("z\n")
    return _artifact(tmp_path, ["f.py"], ["f.py"]), tmp_path


def _tamper(artifact: dict, edit) -> dict:
    copy = json.loads(json.dumps(artifact))
    edit(copy)
    return copy


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda a: a["metrics"]["x"].update(mean=2.0), "is not the aggregate of per_seed"),
        (lambda a: a["metrics"]["x"].update(n=99), "is not the aggregate of per_seed"),
        (lambda a: a["evaluation_protocol"].update(seeds=[7]), "evaluation_protocol.seeds"),
        (lambda a: a["evaluation_protocol"].update(formal_comparison=True), "fewer than 3"),
        (lambda a: a["provenance"].update(command="rm -rf /"), "shell form of command_argv"),
        (lambda a: a["metrics"].update(ok={"mean": 1.0, "std": 0.0, "n": 1}), "no per-seed"),
    ],
)
def test_validate_rejects_inconsistent_artifacts(tmp_path: Path, edit, problem: str) -> None:
    artifact, root = _valid_pair(tmp_path)
    bad = _tamper(artifact, edit)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    report = validate_artifact(path, root=root)
    assert not report.ok
    assert any(problem in p for p in report.problems), report.problems


def test_validate_rejects_reordered_fields_and_empty_or_escaping_sources(tmp_path: Path) -> None:
    artifact, root = _valid_pair(tmp_path)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(reversed(list(artifact.items())))))
    assert any("not in order" in p for p in validate_artifact(path, root=root).problems)
    empty = _tamper(
        artifact,
        lambda a: a["provenance"].update(
            source_sha256={"implementation": {}, "runner": {}},
            implementation_sha256=manifest_digest({}),
            runner_sha256=manifest_digest({}),
        ),
    )
    path.write_text(json.dumps(empty))
    assert any("no source files" in p for p in validate_artifact(path, root=root).problems)
    outside = {"/etc/hostname": "0" * 64}
    escaping = _tamper(
        artifact,
        lambda a: a["provenance"].update(
            source_sha256={"implementation": outside, "runner": outside},
            implementation_sha256=manifest_digest(outside),
            runner_sha256=manifest_digest(outside),
        ),
    )
    path.write_text(json.dumps(escaping))
    assert any(
        "not a relative POSIX path" in p for p in validate_artifact(path, root=root).problems
    )


def _v1(tmp_path: Path) -> tuple[dict, Path]:
    seeds = Path(__file__).resolve().parents[1] / "fixtures" / "seeds"
    record = json.loads((seeds / "004_aa707ff1932edf16.txt").read_text())
    (tmp_path / "f.py").write_text("z\n")
    record["executed_source_sha256"] = source_hashes(["f.py"], tmp_path)
    return record, tmp_path


def test_v1_record_accepted_then_inconsistencies_rejected(tmp_path: Path) -> None:
    record, root = _v1(tmp_path)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(record))
    assert validate_artifact(path, root=root).ok
    cases = [
        (lambda r: r["execution_checks"].update(prefill_only_mask=False), "checks are false"),
        (lambda r: r.update(accelerator={"vendor": "CPU", "model": "CPU"}), "CPU run"),
        (lambda r: r.update(validated_at="2026-99-99"), "not a calendar date"),
        (lambda r: r.update(additional_seeds=[43]), "the record has 2 seeds"),
        (lambda r: r.update(executed_source_sha256={}), "no source files"),
    ]
    for edit, problem in cases:
        path.write_text(json.dumps(_tamper(record, edit)))
        problems = validate_artifact(path, root=root).problems
        assert any(problem in p for p in problems), (problem, problems)


def test_boolean_schema_version_is_not_a_version(tmp_path: Path) -> None:
    record, root = _v1(tmp_path)
    record["schema_version"] = True
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(record))
    assert "unknown schema_version" in validate_artifact(path, root=root).problems[0]
