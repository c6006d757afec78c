"""Provenance-stamped artifacts: metric artifact v2 and accelerator validation record v1."""

from kvlab.artifacts.aggregate import aggregate_metrics, numeric_per_seed
from kvlab.artifacts.builders import (
    build_metric_artifact,
    build_validation_record,
    is_formal_comparison,
)
from kvlab.artifacts.io import read_json, write_json_atomic
from kvlab.artifacts.provenance import (
    command_string,
    file_sha256,
    git_state,
    manifest_digest,
    provenance_block,
    sha256_bytes,
    source_hashes,
    source_root,
)
from kvlab.artifacts.schemas import AcceleratorValidationRecordV1, MetricArtifactV2
from kvlab.artifacts.validate import ValidationReport, validate_artifact

__all__ = [
    "AcceleratorValidationRecordV1",
    "MetricArtifactV2",
    "ValidationReport",
    "aggregate_metrics",
    "build_metric_artifact",
    "build_validation_record",
    "command_string",
    "file_sha256",
    "git_state",
    "is_formal_comparison",
    "manifest_digest",
    "numeric_per_seed",
    "provenance_block",
    "read_json",
    "sha256_bytes",
    "source_hashes",
    "source_root",
    "validate_artifact",
    "write_json_atomic",
]
