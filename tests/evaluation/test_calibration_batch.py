"""prepare_methods: SnapKV layer budgets at several ratios from one measurement, each cached
under the key prepare_method reads."""

from __future__ import annotations

import pytest
import torch

from kvlab.evaluation.calibration import prepare_method, prepare_methods
from kvlab.evaluation.methods import parse_method


def test_several_ratios_share_one_measurement_and_are_cached_each(monkeypatch, tmp_path):
    from kvlab.integrations import relay_calibration
    from kvlab.integrations.relay_calibration import LayerBudgetCalibration

    calls = []

    def fake(model, tokenizer, config, ratios, **kwargs):
        calls.append(list(ratios))
        return {
            r: LayerBudgetCalibration((1 - r, 1 - r), (), "text", "sha", 0, 512, 128, 1.0)
            for r in ratios
        }

    monkeypatch.setattr(relay_calibration, "calibrate_layer_budgets_for_ratios", fake)
    model = torch.nn.Linear(1, 1)
    names = ["relay:snapkv@0.5", "evict-no-relay:snapkv@0.5", "relay:snapkv@0.75", "full"]
    methods = [parse_method(n) for n in names]
    kwargs = dict(checkpoint_sha256="a" * 64, dtype="float32", cache_dir=tmp_path)
    prepared = prepare_methods(methods[:3], model, None, **kwargs)
    assert calls == [[0.5, 0.75]]  # one measurement; relay and no relay share a key
    assert [p["layer_fractions"] for p in prepared] == [[0.5, 0.5], [0.5, 0.5], [0.25, 0.25]]
    assert [p["calibration_cache"]["status"] for p in prepared] == ["computed"] * 3
    assert prepared[0]["calibration_cache"]["key"] == prepared[1]["calibration_cache"]["key"]
    assert len(list(tmp_path.glob("*.json"))) == 2
    # each entry is the one prepare_method reads
    alone = prepare_method(methods[2], model, None, **kwargs)
    assert alone["calibration_cache"] == {
        "status": "reused",
        "key": prepared[2]["calibration_cache"]["key"],
    }
    assert alone["layer_fractions"] == [0.25, 0.25]
    again = prepare_methods(methods[:3], model, None, **kwargs)
    assert calls == [[0.5, 0.75]]
    assert [p["calibration_cache"]["status"] for p in again] == ["reused"] * 3
    # no cache folder: computed, nothing stored
    calls.clear()
    fresh = prepare_methods([methods[2]], model, None, **{**kwargs, "cache_dir": None})
    assert calls == [[0.75]] and fresh[0]["calibration_cache"]["status"] == "computed"
    with pytest.raises(ValueError, match="has no preparation"):
        prepare_methods([methods[2], methods[3]], model, None, **kwargs)
    assert calls == [[0.75]]
