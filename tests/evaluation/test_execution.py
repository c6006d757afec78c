"""Executing plans on a tiny model: resume after an interruption, calibration cache, needle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import strip_timing

from kvlab.artifacts import validate_artifact
from kvlab.evaluation.execute import Runtime
from kvlab.evaluation.plan import EvalConfig

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _config(model: Path, text: Path, out: Path, **overrides) -> EvalConfig:
    base = dict(
        model=str(model),
        text=text,
        # preparation-free methods (relay:snapkv calibrates its layer budgets since issue 9,
        # and a calibration records "computed" or "reused" in the settings)
        methods=["relay-legacy:snapkv@0.5", "streaming-llm@0.5"],
        windows=3,
        prefill=192,
        score=4,
        device="cpu",
        output_dir=out,
        progress=False,
        argv=["kvlab", "eval"],
        cpu_threads=1,
    )
    return EvalConfig(**{**base, **overrides})


def test_an_interrupted_run_resumes_with_only_the_missing_tasks(
    tiny_model_dir, tiny_text, tmp_path, monkeypatch
):
    from kvlab.evaluation import run_eval

    reference = run_eval(_config(tiny_model_dir, tiny_text, tmp_path / "whole"))
    out = tmp_path / "out"
    calls: list[tuple[str, str]] = []
    interrupt_at = [5]
    real = Runtime.run

    def flaky(self, task, **kwargs):
        calls.append((task.method.name, task.where["window"]))
        if len(calls) == interrupt_at[0]:
            raise KeyboardInterrupt  # Ctrl-C while window 1's relay task runs
        return real(self, task, **kwargs)

    monkeypatch.setattr(Runtime, "run", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_config(tiny_model_dir, tiny_text, out))
    stored = {p.stem for p in (out / "tasks").glob("*.json")}
    assert len(stored) == 4  # each finished task was written as it finished
    assert not (out / "table-prefill-score.md").exists()
    # window 1's full-cache log-probabilities are kept for its two tasks still to run;
    # window 0's went once its last task was stored
    [kept] = (out / "tasks").glob("*.logprobs.safetensors")
    assert kept.name.split(".")[0] in stored

    calls.clear()
    interrupt_at[0] = 0
    outcome = run_eval(_config(tiny_model_dir, tiny_text, out))
    assert calls == [  # window 1's full task is not run again: its log-probabilities were kept
        ("relay-legacy:snapkv@0.5", 1),
        ("streaming-llm@0.5", 1),
        ("full", 2),
        ("relay-legacy:snapkv@0.5", 2),
        ("streaming-llm@0.5", 2),
    ]
    assert len(list((out / "tasks").glob("*.json"))) == 9
    assert list((out / "tasks").glob("*.logprobs.*")) == []  # every window finished
    assert strip_timing(outcome.summaries) == strip_timing(reference.summaries)
    assert validate_artifact(outcome.artifact_path).ok

    calls.clear()
    again = run_eval(_config(tiny_model_dir, tiny_text, out))
    assert calls == []  # everything stored
    assert again.table == outcome.table
    calls.clear()
    run_eval(_config(tiny_model_dir, tiny_text, out, resume=False))
    assert len(calls) == 9


def test_calibration_is_cached_on_disk_and_recorded(tiny_model_dir, tiny_text, tmp_path):
    from kvlab.evaluation import run_eval

    cache = tmp_path / "calibration"
    first = run_eval(
        _config(
            tiny_model_dir,
            tiny_text,
            tmp_path / "a",
            methods=["pn-mix-v1"],
            windows=1,
            prefill=192,
            calibration_cache=cache,
        )
    )
    entries = list(cache.glob("*.json"))
    assert len(entries) == 1
    record = first.artifact["configuration"]["methods"]["pn-mix-v1"]
    assert record["calibration_cache"] == {"status": "computed", "key": entries[0].stem}
    assert len(record["layer_group_tokens"]) == 2
    second = run_eval(
        _config(
            tiny_model_dir,
            tiny_text,
            tmp_path / "b",
            methods=["pn-mix-v1"],
            windows=1,
            prefill=192,
            calibration_cache=cache,
        )
    )
    again = second.artifact["configuration"]["methods"]["pn-mix-v1"]
    assert again["calibration_cache"] == {"status": "reused", "key": entries[0].stem}
    assert again["layer_group_tokens"] == record["layer_group_tokens"]

    def numbers(summaries):
        return [{k: v for k, v in s.items() if k != "settings"} for s in strip_timing(summaries)]

    assert numbers(second.summaries) == numbers(first.summaries)


def test_calibration_key_covers_model_settings_text_and_code(monkeypatch):
    from kvlab.evaluation import calibration
    from kvlab.evaluation.methods import parse_method

    pnmix, kivi = parse_method("pn-mix-v1"), parse_method("kivi-2bit-calibrated")
    base = dict(checkpoint_sha256="a" * 64, text_sha256="b" * 64, dtype="float32", device="cpu")
    fields, key = calibration.calibration_key(pnmix, **base)
    assert set(fields) >= {"params", "checkpoint_sha256", "text_sha256", "code_sha256"}
    assert calibration.calibration_key(pnmix, **base)[1] == key
    others = [
        calibration.calibration_key(kivi, **base)[1],
        calibration.calibration_key(pnmix, **{**base, "checkpoint_sha256": "c" * 64})[1],
        calibration.calibration_key(pnmix, **{**base, "text_sha256": "c" * 64})[1],
        calibration.calibration_key(pnmix, **{**base, "dtype": "bfloat16"})[1],
    ]
    monkeypatch.setattr(calibration, "code_digest", lambda modules: "edited")
    others.append(calibration.calibration_key(pnmix, **base)[1])
    assert len({key, *others}) == 6
    with pytest.raises(ValueError, match="no preparation"):
        calibration.calibration_key(parse_method("full"), **base)


def test_code_digest_follows_the_modules_source(tmp_path, monkeypatch):
    from kvlab.evaluation import fingerprint

    module = tmp_path / "kvlab_probe_module.py"
    module.write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = fingerprint.code_digest(["kvlab_probe_module"])
    fingerprint._DIGESTS.clear()
    module.write_text("x = 2\n")
    second = fingerprint.code_digest(["kvlab_probe_module"])
    assert second != first
    # a C++ source beside the module (a kernel it compiles) is part of its digest
    kernel = tmp_path / "kernel.cpp"
    kernel.write_text("int f() { return 1; }\n")
    fingerprint._DIGESTS.clear()
    third = fingerprint.code_digest(["kvlab_probe_module"])
    kernel.write_text("int f() { return 2; }\n")
    fingerprint._DIGESTS.clear()
    assert len({second, third, fingerprint.code_digest(["kvlab_probe_module"])}) == 3
    fingerprint._DIGESTS.clear()


def test_needle_protocol_mechanics(tiny_model_dir, long_text, tmp_path):
    from kvlab.evaluation import run_eval

    config = _config(
        tiny_model_dir,
        long_text,
        tmp_path,
        protocol="needle",
        methods=["full", "relay:snapkv@0.5"],
        needle_lengths=[300, 500],
        needle_depths=[0, 50, 100],
        needle_trials=2,
        cache_slots=160,
        chunk=64,
    )
    outcome = run_eval(config)
    table = outcome.table.splitlines()
    assert table[0].startswith("| method | length (tokens) | depth 0 % | depth 50 % | depth 100 %")
    assert len(table) == 2 + 2 * 2  # header, rule, (method x length)
    full, relay = outcome.summaries
    for summary in outcome.summaries:
        assert [(c["length"], c["depth"], c["trials"]) for c in summary["cells"]] == [
            (n, d, 2) for n in (300, 500) for d in (0, 50, 100)
        ]
        assert 0.0 <= summary["accuracy"] <= 1.0
    assert full["max_final_position"] == 500 + config.needle_digits + 3 - 1
    assert relay["max_final_position"] <= 2 * 80 + 64  # positions stay inside the relay slots
    assert relay["peak_kv_bytes_16bit"] < full["peak_kv_bytes_16bit"]
    raw = json.loads(outcome.raw_path.read_text())
    cells = raw["results"]["full"]
    assert len(cells) == 12 and all(len(c["passkey"]) == 5 for c in cells)
    # the same prompts for every method: passkeys agree cell by cell
    assert [c["passkey"] for c in cells] == [
        c["passkey"] for c in raw["results"]["relay:snapkv@0.5"]
    ]
    assert outcome.plot_path.name == "needle-heatmap.png"
    assert outcome.plot_path.read_bytes()[:8] == PNG_SIGNATURE
    report = validate_artifact(outcome.artifact_path)
    assert report.ok, report.problems
    assert outcome.artifact["seeds"] == [0, 1]
