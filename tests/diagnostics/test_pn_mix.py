"""The PN-Mix diagnostic: the reference record's deterministic figures, measured figures near
it, baselines beside it, and the accelerator validation record built with a fake device."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kvlab.artifacts import AcceleratorValidationRecordV1, validate_artifact
from kvlab.data import default_text
from kvlab.device import AcceleratorInfo
from kvlab.diagnostics.paper import RunContext
from kvlab.diagnostics.pn_mix import PAPER, PN_MIX_METRICS, validation_record
from kvlab.diagnostics.runner import run_paper

SEED_004 = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "seeds" / "004_aa707ff1932edf16.txt"
    ).read_text()
)
DETERMINISTIC = (
    "sink_key_max_error",
    "saliency_computations",
    "actual_attention_calls",
    "key_bytes",
    "value_bytes",
    "persistent_cache_bytes",
    "quantized_tokens",
    "sink_tokens",
    "residual_tokens",
    "key_bits_per_element_including_sink_residual",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("pnmix")
    context = RunContext(
        torch.device("cpu"), "smoke", default_text(), ["kvlab", "reproduce"], out, [42, 43, 44]
    )
    return run_paper(PAPER, context, Console(file=io.StringIO()))


def test_deterministic_metrics_equal_the_reference_exactly(run) -> None:
    metrics = run.artifact["metrics"]
    for name in DETERMINISTIC:
        assert metrics[name] == SEED_004["metrics"][name], name
    assert type(metrics["key_bytes"]["mean"]) is int


def test_measured_fidelity_lands_near_the_reference(run) -> None:
    metrics = run.artifact["metrics"]
    for name in ("key_mse", "value_mse"):
        ref = SEED_004["metrics"][name]["mean"]
        assert abs(metrics[name]["mean"] - ref) <= 0.25 * ref, (name, metrics[name])
    assert 0 < metrics["attention_kl"]["mean"] < 0.1
    assert 0.8 < metrics["attention_output_cosine"]["mean"] < 1.0
    assert metrics["online_vs_final_cache_attention_max_delta"]["mean"] > 0


def test_baselines_reported_beside_and_comparison_is_formal(run) -> None:
    metrics = run.artifact["metrics"]
    assert metrics["kivi_2bit.key_bytes"]["mean"] == 15108 - 4  # no mix-mask bytes
    assert metrics["per_token_2bit.value_bytes"]["mean"] == 17408
    assert run.artifact["evaluation_protocol"]["formal_comparison"] is True
    assert validate_artifact(run.artifact_path).ok


def test_validation_record_with_fake_accelerator(run) -> None:
    fake = AcceleratorInfo(vendor="NVIDIA", model="FAKE-GPU-80GB")
    record = validation_record(run, fake, run.results)
    AcceleratorValidationRecordV1.model_validate(record)
    assert list(record) == list(SEED_004)
    assert list(record["metrics"]) == list(PN_MIX_METRICS) == list(SEED_004["metrics"])
    checks = record["execution_checks"]
    assert list(checks) == list(SEED_004["execution_checks"])
    assert checks["packed_codes_consumed_by_attention"] is True
    assert checks["prefill_only_mask"] is True
    assert checks["three_initializations"] is True
    assert checks["actual_attention_calls_per_run"] == 66
    assert checks["unified_cli_cuda_and_same_seed_agreement"] is True
    assert record["result"] == "passed"
    assert record["accelerator"] == {"vendor": "NVIDIA", "model": "FAKE-GPU-80GB"}
    assert record["dataset"]["revision"] == f"sha256:{run.context.text.sha256}"


def test_validation_record_fails_on_disagreement_and_one_seed(run) -> None:
    fake = AcceleratorInfo(vendor="NVIDIA", model="FAKE")
    drifted = [
        dataclasses.replace(r, metrics={**r.metrics, "key_mse": r.metrics["key_mse"] * 2})
        for r in run.results
    ]
    record = validation_record(run, fake, drifted)
    assert record["execution_checks"]["unified_cli_cuda_and_same_seed_agreement"] is False
    assert record["result"] == "failed"
    one = dataclasses.replace(
        run, context=dataclasses.replace(run.context, seeds=[42]), results=run.results[:1]
    )
    record = validation_record(one, fake, run.results[:1])
    assert record["execution_checks"]["three_initializations"] is False
    assert record["result"] == "failed"


def test_cpu_run_writes_no_validation_record(run) -> None:
    assert run.extra_paths == []
    assert not list(run.context.output_dir.glob("validation-*"))


def test_fused_kernel_check_is_computed_from_the_backend_each_seed_used(run) -> None:
    """``fused_kernel`` is true only when every seed's packed attention ran on the Triton
    kernel (the CPU run here used the C++ kernel or the torch reference)."""
    fake = AcceleratorInfo(vendor="NVIDIA", model="FAKE")
    assert {r.details["attention_backend"] for r in run.results} <= {"cpu", "torch"}
    assert validation_record(run, fake, run.results)["execution_checks"]["fused_kernel"] is False
    fused = [
        dataclasses.replace(r, details={**r.details, "attention_backend": "triton"})
        for r in run.results
    ]
    one_not = [fused[0], *run.results[1:]]
    for results, expected in ((fused, True), (one_not, False)):
        record = validation_record(dataclasses.replace(run, results=results), fake, run.results)
        assert record["execution_checks"]["fused_kernel"] is expected
