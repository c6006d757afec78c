"""How a per-layer calibration's measurement is recorded in artifacts, shared by PN-Mix's group
allocation (:class:`~kvlab.integrations.pnmix_calibration.GroupAllocation`) and the eviction
layer budgets (:class:`~kvlab.integrations.relay_calibration.LayerBudgetCalibration`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CalibrationMeasurement", "measurement_settings"]


class CalibrationMeasurement(Protocol):
    """What a calibration measured, and where (the fields both calibration results carry).

    Attributes:
        sensitivities: per layer, ``{candidate: mean KL in nats}`` as measured (a candidate
            group size or kept fraction).
        text_id, text_sha256: the calibration text.
        start, prefill, score: the calibration window (tokens).
        seconds: wall time of the calibration (s).
        measure: how the sensitivities were measured (``"scaled"`` or ``"exact"``,
            :func:`kvlab.integrations.calibration_capture.layer_sensitivities`).
    """

    @property
    def sensitivities(self) -> Sequence[Mapping[Any, float]]: ...
    @property
    def text_id(self) -> str: ...
    @property
    def text_sha256(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def prefill(self) -> int: ...
    @property
    def score(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def measure(self) -> str: ...


def measurement_settings(result: CalibrationMeasurement) -> dict[str, Any]:
    """The JSON-ready record of ``result``'s measurement: ``calibration_text``,
    ``calibration_window``, ``calibration_seconds`` (rounded to 0.1 s), ``calibration_measure``
    and ``sensitivity_kl_nats`` (per layer, candidate as a string -> KL rounded to 6
    decimals)."""
    return {
        "calibration_text": {"id": result.text_id, "sha256": result.text_sha256},
        "calibration_window": {
            "start": result.start,
            "prefill": result.prefill,
            "score": result.score,
        },
        "calibration_seconds": round(result.seconds, 1),
        "calibration_measure": result.measure,
        "sensitivity_kl_nats": [
            {str(g): round(v, 6) for g, v in s.items()} for s in result.sensitivities
        ],
    }
