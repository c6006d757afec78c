"""``kvlab validate``: schema check plus recomputation of every recorded source sha256.

Checks that cannot be made are listed in :attr:`ValidationReport.unchecked` with the reason,
and do not fail the validation: a v2 record without kvlab's provenance extras (``code_dirty``,
``command_argv``, ``source_sha256``; e.g. reference record 000) has no per-file hashes to
recompute; a record none of whose recorded source files exists under the root (e.g. reference
record 004, made by another code base) cannot be checked against this tree. A record some of
whose files exist and others not still fails: that is a tree that changed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ValidationError

from kvlab.artifacts.aggregate import aggregate_metrics
from kvlab.artifacts.io import read_json
from kvlab.artifacts.provenance import (
    command_string,
    file_sha256,
    manifest_digest,
    source_root,
)
from kvlab.artifacts.schemas import AcceleratorValidationRecordV1, MetricArtifactV2

__all__ = ["ValidationReport", "validate_artifact"]


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_artifact`: the detected kind and every problem found."""

    path: str
    kind: str | None = None
    problems: list[str] = field(default_factory=list)
    checked_files: int = 0
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind is not None and not self.problems

    def summary(self) -> str:
        """One line: what matched."""
        if self.checked_files:
            return f"schema valid, {self.checked_files} source file(s) match"
        return "schema valid, no source file checked"


PASS_REQUIRES = (
    "packed_codes_consumed_by_attention",
    "prefill_only_mask",
    "three_initializations",
    "unified_cli_cuda_and_same_seed_agreement",
)
"""Execution checks that a v1 record with ``result: "passed"`` must have true (when present)."""


def _check_order(data: Any, model: type[BaseModel], where: str, report: ValidationReport) -> None:
    """Keys in the schema's declared order, recursively for nested models."""
    if not isinstance(data, dict):
        return
    expected = [
        name for name, info in model.model_fields.items() if name in data or info.is_required()
    ]
    if list(data) != expected:
        report.problems.append(
            f"{where or 'top level'}: fields {list(data)} not in order {expected}"
        )
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and name in data:
            _check_order(data[name], sub, f"{where}.{name}".lstrip("."), report)


def _check_files(recorded: dict[str, str], root: Path, report: ValidationReport) -> None:
    if not recorded:
        report.problems.append("no source files recorded: nothing ties this artifact to code")
    inside = {}
    for rel, expected in recorded.items():
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
            report.problems.append(f"{rel}: not a relative POSIX path inside the source tree")
            continue
        inside[rel] = expected
    present = {rel: digest for rel, digest in inside.items() if (root / rel).is_file()}
    if inside and not present:
        report.unchecked.append(
            f"source sha256 of {len(inside)} recorded file(s): none exists under {root} (the "
            f"record comes from another source tree; --root DIR checks it against that tree): "
            + ", ".join(inside)
        )
        return
    for rel, expected in inside.items():
        report.checked_files += 1
        if rel not in present:
            report.problems.append(f"{rel}: missing from the tree at {root}")
            continue
        actual = file_sha256(root / rel)
        if actual != expected:
            report.problems.append(f"{rel}: sha256 {actual} != recorded {expected}")


def validate_artifact(path: str | Path, root: Path | None = None) -> ValidationReport:
    """Check an artifact file against its schema and the current source tree.

    The kind is detected from ``schema_version`` (2: metric artifact, 1: accelerator
    validation record). For a v2 artifact every file in ``provenance.source_sha256`` is
    re-hashed and ``implementation_sha256``/``runner_sha256`` recomputed from the recorded
    manifests; for a v1 record every ``executed_source_sha256`` entry is re-hashed.

    Args:
        root: folder the recorded paths are relative to (default: kvlab's source root).

    Returns:
        A :class:`ValidationReport`; ``ok`` is true only with no problem at all.
    """
    report = ValidationReport(path=str(path))
    kinds = {1: "accelerator validation record v1", 2: "metric artifact v2"}
    base = source_root() if root is None else Path(root)
    try:
        data: Any = read_json(path)
    except (OSError, ValueError) as exc:
        report.problems.append(f"cannot read JSON: {exc}")
        return report
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, bool):
        version = None
    try:
        if version == 2:
            artifact = MetricArtifactV2.model_validate(data)
            report.kind = "metric artifact v2"
            sources = artifact.provenance.source_sha256
            if sources is None:
                report.unchecked.append(
                    "source sha256: provenance has no source_sha256 (per-file hashes, a kvlab "
                    "extra this record predates), so implementation_sha256 and runner_sha256 "
                    "cannot be recomputed"
                )
            else:
                recorded: dict[str, str] = {}
                for part, digest in (
                    ("implementation", artifact.provenance.implementation_sha256),
                    ("runner", artifact.provenance.runner_sha256),
                ):
                    files = sources.get(part)
                    if files is None:
                        report.problems.append(f"provenance.source_sha256 lacks {part!r}")
                        continue
                    if manifest_digest(files) != digest:
                        report.problems.append(
                            f"provenance.{part}_sha256 does not match its recorded file list"
                        )
                    if not files:
                        report.problems.append(
                            f"no source files recorded in {part}: nothing ties it to code"
                        )
                    recorded.update(files)
                if recorded:
                    _check_files(recorded, base, report)
            _check_order(data, MetricArtifactV2, "", report)
            _check_v2_consistency(artifact, report)
        elif version == 1:
            record = AcceleratorValidationRecordV1.model_validate(data)
            report.kind = "accelerator validation record v1"
            _check_files(record.executed_source_sha256, base, report)
            _check_order(data, AcceleratorValidationRecordV1, "", report)
            _check_v1_consistency(record, report)
        elif isinstance(data, dict) and "schema_version" not in data:
            hint = ""
            if {"protocol", "results", "summaries"} <= data.keys():
                hint = (
                    ": this looks like kvlab eval's raw results (raw-<protocol>-<device>.json); "
                    "its record is metrics-<protocol>-<device>.json in the same folder"
                )
            report.problems.append(f"not a kvlab record: no schema_version{hint}")
        else:
            report.problems.append(f"unknown schema_version {version!r} (expected 1 or 2)")
    except ValidationError as exc:
        report.kind = None
        report.problems.insert(0, f"does not fit the {kinds.get(version, '?')} schema")
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            report.problems.append(f"schema: {loc}: {err['msg']}")
    return report


def _check_v2_consistency(artifact: MetricArtifactV2, report: ValidationReport) -> None:
    """Numbers that must agree with each other inside one metric artifact."""
    seeds = artifact.seeds
    if artifact.evaluation_protocol.seeds != seeds:
        report.problems.append("evaluation_protocol.seeds differs from seeds")
    if [row.get("seed") for row in artifact.per_seed] != seeds:
        report.problems.append("per_seed seeds differ from seeds")
    if artifact.evaluation_protocol.formal_comparison and len(seeds) < 3:
        report.problems.append("formal_comparison is true with fewer than 3 seeds")
    prov = artifact.provenance
    if prov.command_argv is None:
        report.unchecked.append(
            "command: provenance has no command_argv (a kvlab extra this record predates) to "
            "check provenance.command against"
        )
    elif command_string(prov.command_argv) != prov.command:
        report.problems.append("provenance.command is not the shell form of command_argv")
    rows = [{k: v for k, v in row.items() if k != "seed"} for row in artifact.per_seed]
    numeric = {k for row in rows for k in row}
    for name, value in artifact.metrics.items():
        if isinstance(value, bool):
            if name in numeric:
                report.problems.append(f"metrics.{name} is boolean but per_seed has numbers")
            continue
        if name not in numeric:
            report.problems.append(f"metrics.{name} has no per-seed values")
            continue
        try:
            expected = aggregate_metrics([{name: row[name]} for row in rows])[name]
        except (KeyError, ValueError) as exc:
            report.problems.append(f"per_seed values of {name} cannot be aggregated: {exc}")
            continue
        if value.model_dump() != expected:
            report.problems.append(
                f"metrics.{name} {value.model_dump()} is not the aggregate of per_seed {expected}"
            )
    for name in sorted(numeric - set(artifact.metrics)):
        report.problems.append(f"per_seed metric {name} is missing from metrics")


def _check_v1_consistency(record: AcceleratorValidationRecordV1, report: ValidationReport) -> None:
    """Facts a validation record must be consistent with."""
    try:
        datetime.date.fromisoformat(record.validated_at)
    except ValueError:
        report.problems.append(f"validated_at {record.validated_at!r} is not a calendar date")
    if record.accelerator.vendor.upper() == "CPU":
        report.problems.append("an accelerator validation record cannot describe a CPU run")
    runs = 1 + len(record.additional_seeds)
    for name, value in record.metrics.items():
        if value.n != runs:
            report.problems.append(f"metrics.{name}.n = {value.n} but the record has {runs} seeds")
    if record.result == "passed":
        failed = [k for k in PASS_REQUIRES if record.execution_checks.get(k) is False]
        if failed:
            report.problems.append(f"result is 'passed' but checks are false: {failed}")
