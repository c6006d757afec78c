"""kvlab.prepare: a calibrated method prepared through the public API reuses the calibration
cache kvlab eval writes by default, under the same key."""

from __future__ import annotations

import json

import pytest

import kvlab
from kvlab.evaluation.calibration import calibration_key, default_calibration_dir
from kvlab.evaluation.methods.preparations import PREPARATIONS
from kvlab.models import checkpoint_sha256


def test_prepare_keys_and_reuses_the_default_cache(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path))
    loaded = kvlab.load_model(str(tiny_model_dir))
    method = kvlab.parse_method("evict-no-relay:kvzip@0.5")
    first = kvlab.prepare(method, loaded)
    assert first["calibration_cache"]["status"] == "computed"
    _, key = calibration_key(
        method,
        checkpoint_sha256=checkpoint_sha256(str(tiny_model_dir)),
        text_sha256=PREPARATIONS[method.preparation].text().sha256,
        dtype="float32",
        device="cpu",
    )
    assert first["calibration_cache"]["key"] == key  # the key kvlab eval computes
    assert (default_calibration_dir() / f"{key}.json").is_file()
    second = kvlab.prepare(method, loaded)
    assert second["calibration_cache"]["status"] == "reused"
    assert {k: v for k, v in second.items() if k != "calibration_cache"} == {
        k: v for k, v in first.items() if k != "calibration_cache"
    }
    stored = json.loads((tmp_path / f"{key}.json").read_text())
    assert stored["key"]["checkpoint_sha256"] == checkpoint_sha256(str(tiny_model_dir))


def test_prepare_without_a_preparation_is_none(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path))
    loaded = kvlab.load_model(str(tiny_model_dir))
    assert kvlab.prepare(kvlab.parse_method("pn-mix"), loaded) is None
    assert not list(tmp_path.iterdir())


def test_prepare_refuses_a_bare_model_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path))
    loaded = kvlab.load_model(str(tiny_model_dir))
    with pytest.raises(TypeError, match="LoadedModel"):
        kvlab.prepare(kvlab.parse_method("evict-no-relay:kvzip@0.5"), loaded.model)
    assert not list(tmp_path.iterdir())


def test_prepare_cache_dir_none_reads_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path))
    loaded = kvlab.load_model(str(tiny_model_dir))
    prepared = kvlab.prepare(kvlab.parse_method("evict-no-relay:kvzip@0.5"), loaded, cache_dir=None)
    assert prepared["calibration_cache"]["status"] == "computed"
    assert not list(tmp_path.iterdir())


def test_prepare_refuses_a_method_name_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CALIBRATION_CACHE", str(tmp_path))
    loaded = kvlab.load_model(str(tiny_model_dir))
    with pytest.raises(TypeError, match=r"got a str: call kvlab\.parse_method\('pn-mix'\) first"):
        kvlab.prepare("pn-mix", loaded)
    with pytest.raises(TypeError, match=r"method must be a Method .* got NoneType"):
        kvlab.prepare(None, loaded)
    assert not list(tmp_path.iterdir())
