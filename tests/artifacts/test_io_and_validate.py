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
        method="m", manifest_ref="r", seeds=[1], per_seed=[{"x": 1.0, "ok": True}],
        configuration={}, tier="l1_mechanism", claim_policy="p",
        dataset={"id": "d", "revision": "v", "checkpoint": None, "capability_benchmark": False},
        provenance=provenance, baselines_compared=False,
        implementation_status="component_only", diagnostic_only=True,
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
    broken = tmp_path / "c.json"
    broken.write_text("{")
    assert validate_artifact(broken).problems[0].startswith("cannot read JSON")
