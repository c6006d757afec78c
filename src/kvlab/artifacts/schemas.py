"""Typed schemas of the two artifact kinds kvlab writes.

* :class:`MetricArtifactV2` — the metric artifact, schema v2. Its top-level fields and their
  order are exactly those of the reference record ``000_8249d5d9ce5c6fb7`` (RoPE-Relay).
* :class:`AcceleratorValidationRecordV1` — the accelerator validation record, schema v1, with
  exactly the fields of reference record ``004_aa707ff1932edf16`` (PN-Mix).

Pydantic keeps declaration order on dump, so ``model.model_dump(mode="json")`` serializes in
the reference order. Every model forbids unknown fields, so a typo or a stray key is an error.
Strict scalar types keep integer means integers (``66``, not ``66.0``) and booleans booleans.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

__all__ = [
    "AcceleratorDescription",
    "AcceleratorValidationRecordV1",
    "Aggregate",
    "CheckpointBlock",
    "DatasetV2",
    "EvaluationProtocol",
    "FullExperiment",
    "MetricArtifactV2",
    "ProvenanceV1",
    "ProvenanceV2",
    "ValidationDataset",
]

Number = StrictInt | StrictFloat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Aggregate(_Strict):
    """A numeric metric over seeds: ``statistics.mean``, sample ``statistics.stdev`` (0.0 for
    one seed) and the number of seeds ``n``."""

    mean: Number
    std: StrictFloat = Field(ge=0.0)
    n: StrictInt = Field(ge=1)


class EvaluationProtocol(_Strict):
    tier: StrictStr
    formal_comparison: StrictBool
    claim_policy: StrictStr
    seeds: list[StrictInt]


class DatasetV2(_Strict):
    id: StrictStr
    revision: StrictStr
    checkpoint: StrictStr | None
    capability_benchmark: StrictBool


class ProvenanceV2(_Strict):
    """Provenance of a metric artifact.

    The first nine fields are the reference record's, in its order. kvlab also records a
    dirty flag, the command as an argv list and per-file source hashes (so ``kvlab validate``
    can recompute them); those follow as ``code_dirty``, ``command_argv``
    and ``source_sha256``, optional so that the reference record itself validates.
    ``implementation_sha256`` / ``runner_sha256`` are digests of the
    per-file manifest (see :func:`kvlab.artifacts.provenance.manifest_digest`).
    """

    artifact_path: StrictStr
    raw_result: StrictStr
    code_commit: StrictStr | None
    implementation_sha256: StrictStr
    runner_sha256: StrictStr
    command: StrictStr
    accelerator: StrictStr
    checkpoint: StrictStr | None
    dataset_fingerprint: StrictStr
    # kvlab's extras: absent from records written before them (reference record 000), which
    # stay schema-valid; ``kvlab validate`` then says which checks it could not make.
    code_dirty: StrictBool | None = None
    command_argv: list[StrictStr] | None = None
    source_sha256: dict[StrictStr, dict[StrictStr, StrictStr]] | None = None


class FullExperiment(_Strict):
    status: StrictStr
    review_done: StrictBool


class MetricArtifactV2(_Strict):
    """Metric artifact, schema v2 (field order of reference record 000)."""

    schema_version: Literal[2]
    method: StrictStr
    manifest_ref: StrictStr
    adapter: StrictStr | None
    implementation_status: StrictStr
    diagnostic_only: StrictBool
    promotion_eligible: StrictBool
    evolve_integrated: StrictBool
    measured_locally: StrictBool
    evaluation_tier: StrictStr
    seeds: list[StrictInt]
    evaluation_protocol: EvaluationProtocol
    dataset: DatasetV2
    configuration: dict[StrictStr, Any]
    metrics: dict[StrictStr, StrictBool | Aggregate]
    per_seed: list[dict[StrictStr, Number]]
    provenance: ProvenanceV2
    full_experiment: FullExperiment


class AcceleratorDescription(_Strict):
    vendor: StrictStr
    model: StrictStr


class ValidationDataset(_Strict):
    id: StrictStr
    revision: StrictStr = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    source_url: StrictStr | None
    split: StrictStr


class CheckpointBlock(_Strict):
    public_id: StrictStr
    revision: StrictStr
    pretrained: StrictBool
    initialization_seeds: list[StrictInt]


class ProvenanceV1(_Strict):
    commit: StrictStr | None
    artifact_path: StrictStr
    metrics_artifact: StrictStr
    scope: StrictStr


class AcceleratorValidationRecordV1(_Strict):
    """Accelerator validation record, schema v1 (fields of reference record 004)."""

    schema_version: Literal[1]
    adapter_key: StrictStr
    validated_at: StrictStr = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    accelerator: AcceleratorDescription
    command: list[StrictStr]
    additional_seeds: list[StrictInt]
    additional_validated_commands: list[list[StrictStr]]
    dataset: ValidationDataset
    checkpoint: CheckpointBlock
    result: Literal["passed", "failed"]
    metrics: dict[StrictStr, Aggregate]
    execution_checks: dict[StrictStr, StrictBool | StrictInt]
    executed_source_sha256: dict[StrictStr, StrictStr]
    provenance: ProvenanceV1
