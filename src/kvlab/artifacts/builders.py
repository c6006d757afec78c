"""Assembling artifacts from per-seed results, validated against their schemas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.artifacts.aggregate import aggregate_metrics, numeric_per_seed
from kvlab.artifacts.schemas import AcceleratorValidationRecordV1, MetricArtifactV2

__all__ = ["build_metric_artifact", "build_validation_record", "is_formal_comparison"]


def is_formal_comparison(seeds: Sequence[int], baselines_compared: bool) -> bool:
    """A comparison is formal only with at least 3 seeds *and* a baseline compared
    (docs/diagnostics.md, "PN-Mix")."""
    return len(seeds) >= 3 and bool(baselines_compared)


def build_metric_artifact(
    *,
    method: str,
    manifest_ref: str,
    seeds: Sequence[int],
    per_seed: Sequence[Mapping[str, Any]],
    configuration: Mapping[str, Any],
    tier: str,
    claim_policy: str,
    dataset: Mapping[str, Any],
    provenance: Mapping[str, Any],
    baselines_compared: bool,
    implementation_status: str,
    diagnostic_only: bool,
    adapter: str | None = None,
    full_experiment: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A metric artifact, schema v2, in the field order of reference record 000.

    Args:
        per_seed: one raw result per seed (metric name to number or boolean), in ``seeds``
            order; aggregated with :func:`~kvlab.artifacts.aggregate.aggregate_metrics`.
        baselines_compared: whether the run compared against a baseline; together with the
            seed count it decides ``evaluation_protocol.formal_comparison``.

    Returns:
        The artifact as a JSON-ready dict (validated by :class:`MetricArtifactV2`).

    Raises:
        pydantic.ValidationError: a field does not fit the schema.
        ValueError: per-seed results that cannot be aggregated.
    """
    seeds = [int(s) for s in seeds]
    artifact = {
        "schema_version": 2,
        "method": method,
        "manifest_ref": manifest_ref,
        "adapter": adapter,
        "implementation_status": implementation_status,
        "diagnostic_only": diagnostic_only,
        "promotion_eligible": False,
        "evolve_integrated": False,
        "measured_locally": True,
        "evaluation_tier": tier,
        "seeds": seeds,
        "evaluation_protocol": {
            "tier": tier,
            "formal_comparison": is_formal_comparison(seeds, baselines_compared),
            "claim_policy": claim_policy,
            "seeds": seeds,
        },
        "dataset": dict(dataset),
        "configuration": dict(configuration),
        "metrics": aggregate_metrics(per_seed),
        "per_seed": numeric_per_seed(seeds, per_seed),
        "provenance": dict(provenance),
        "full_experiment": dict(
            full_experiment or {"status": "not_reproduced_high_cost", "review_done": False}
        ),
    }
    return MetricArtifactV2.model_validate(artifact).model_dump(mode="json")


def build_validation_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """Validate an accelerator validation record (schema v1) and return it in field order.

    Raises:
        pydantic.ValidationError: a field does not fit the schema.
    """
    return AcceleratorValidationRecordV1.model_validate(dict(record)).model_dump(mode="json")
