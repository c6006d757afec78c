"""``kvlab validate``: schema check plus recomputation of every recorded source sha256."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvlab.artifacts.io import read_json
from kvlab.artifacts.provenance import file_sha256, manifest_digest, source_root
from kvlab.artifacts.schemas import AcceleratorValidationRecordV1, MetricArtifactV2

__all__ = ["ValidationReport", "validate_artifact"]


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_artifact`: the detected kind and every problem found."""

    path: str
    kind: str | None = None
    problems: list[str] = field(default_factory=list)
    checked_files: int = 0

    @property
    def ok(self) -> bool:
        return self.kind is not None and not self.problems


def _check_files(recorded: dict[str, str], root: Path, report: ValidationReport) -> None:
    for rel, expected in recorded.items():
        report.checked_files += 1
        file = root / rel
        if not file.is_file():
            report.problems.append(f"{rel}: missing from the tree at {root}")
            continue
        actual = file_sha256(file)
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
    base = source_root() if root is None else Path(root)
    try:
        data: Any = read_json(path)
    except (OSError, ValueError) as exc:
        report.problems.append(f"cannot read JSON: {exc}")
        return report
    version = data.get("schema_version") if isinstance(data, dict) else None
    try:
        if version == 2:
            artifact = MetricArtifactV2.model_validate(data)
            report.kind = "metric artifact v2"
            sources = artifact.provenance.source_sha256
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
                _check_files(files, base, report)
        elif version == 1:
            record = AcceleratorValidationRecordV1.model_validate(data)
            report.kind = "accelerator validation record v1"
            _check_files(record.executed_source_sha256, base, report)
        else:
            report.problems.append(f"unknown schema_version {version!r} (expected 1 or 2)")
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            report.problems.append(f"schema: {loc}: {err['msg']}")
    return report
