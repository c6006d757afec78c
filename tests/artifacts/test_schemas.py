"""Schemas accept the reference records' shapes and reject stray or mistyped fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvlab.artifacts import AcceleratorValidationRecordV1, MetricArtifactV2

SEEDS = Path(__file__).resolve().parents[1] / "fixtures" / "seeds"


def test_seed_004_is_a_valid_v1_record_and_round_trips_in_order() -> None:
    record = json.loads((SEEDS / "004_aa707ff1932edf16.txt").read_text())
    dumped = AcceleratorValidationRecordV1.model_validate(record).model_dump(mode="json")
    assert dumped == record
    assert list(dumped) == list(record)


def test_seed_000_fits_v2_once_the_spec_provenance_fields_are_added() -> None:
    record = json.loads((SEEDS / "000_8249d5d9ce5c6fb7.txt").read_text())
    record["provenance"].update(code_dirty=False, command_argv=["python", "x.py"], source_sha256={})
    dumped = MetricArtifactV2.model_validate(record).model_dump(mode="json")
    assert list(dumped) == list(record)
    assert dumped["metrics"] == record["metrics"]


def test_v1_rejects_unknown_field_and_bad_revision() -> None:
    record = json.loads((SEEDS / "004_aa707ff1932edf16.txt").read_text())
    with pytest.raises(ValidationError, match="extra"):
        AcceleratorValidationRecordV1.model_validate({**record, "hostname": "box"})
    bad = json.loads(json.dumps(record))
    bad["dataset"]["revision"] = "378fdfa5"
    with pytest.raises(ValidationError, match="revision"):
        AcceleratorValidationRecordV1.model_validate(bad)


def test_v1_rejects_string_typed_check() -> None:
    record = json.loads((SEEDS / "004_aa707ff1932edf16.txt").read_text())
    record["execution_checks"]["prefill_only_mask"] = "true"
    with pytest.raises(ValidationError):
        AcceleratorValidationRecordV1.model_validate(record)
