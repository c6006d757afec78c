"""The PN-Mix mechanism diagnostic (paper key ``pn-mix``; docs/diagnostics.md, reference record
004; the cache: docs/design.md, "PN-Mix").

Protocol, per seed: build :class:`~kvlab.models.byte_rope_gqa.ByteRopeGQA` from the seed;
take the first 448 bytes of the text; prefill 384 tokens into a :class:`PNMixCache` and run
one attention call over them (the mix mask is computed here); decode the remaining 64 tokens
one at a time (append, then one attention call each, online); then one call with the 64
decode queries over the final cache: 66 attention calls, all from packed codes.

Metrics against the float32 cache: ``key_mse``/``value_mse`` over the quantized tokens;
``attention_kl`` = KL(reference ‖ quantized) of the decode-step attention distributions,
averaged over decode steps and query heads (the quantized distribution comes from the
cache's dequantized state at that step, which packed attention equals to float32 rounding);
``attention_output_mse`` and ``attention_output_cosine`` of the decode-step outputs;
``online_vs_final_cache_attention_max_delta`` between decode-step outputs and the final-cache
call. Two 2-bit baselines run on the same bytes and model: ``kivi_2bit`` (every key pair
Cartesian per channel, KIVI-style; the same storage less the 4-byte mask) and
``per_token_2bit`` (keys per token over the head's channels; 2,300 more key bytes for the
per-token scales); their metrics, bytes included, are reported beside PN-Mix as
``<baseline>.<metric>``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
from pathlib import Path
from typing import Any

import torch

from kvlab.artifacts import build_validation_record, source_hashes, write_json_atomic
from kvlab.artifacts.provenance import git_state
from kvlab.device import AcceleratorInfo, accelerator_info
from kvlab.diagnostics.paper import Paper, PaperRun, RunContext, SeedResult
from kvlab.models.byte_rope_gqa import ByteRopeGQA, ByteRopeGQAConfig
from kvlab.pnmix.attention import pnmix_attention
from kvlab.pnmix.cache import PNMixCache
from kvlab.pnmix.config import PNMixConfig
from kvlab.pnmix.kernels.dispatch import select_backend

__all__ = ["CPU_CUDA_TOLERANCE", "PAPER", "run_protocol", "run_seed"]

TEXT_BYTES = 448
PREFILL_TOKENS = 384
DECODE_TOKENS = TEXT_BYTES - PREFILL_TOKENS
BASELINES = {"kivi_2bit": "cartesian", "per_token_2bit": "per_token"}
BASELINE_METRICS = (
    "key_mse",
    "value_mse",
    "attention_kl",
    "attention_output_mse",
    "attention_output_cosine",
    "key_bytes",
    "value_bytes",
    "persistent_cache_bytes",
)
FUSED_BACKENDS = ("triton",)
"""Packed-attention backends that count as a fused kernel on an accelerator (the validation
record's ``fused_kernel`` check: every seed's attention ran on one of them; the torch
reference is composed of torch operations)."""
CPU_CUDA_TOLERANCE = {"relative": 1e-3, "absolute": 1e-5}
"""Same-seed CPU vs CUDA agreement: every measured metric within
``absolute + relative * |cpu value|``; every deterministic metric exactly equal."""

MODEL = ByteRopeGQAConfig()
CACHE = PNMixConfig(bits=2, sink_tokens=32, residual_tokens=32, group_tokens=128)
CONFIGURATION: dict[str, Any] = {
    "model": "random-initialized single-layer byte-level RoPE GQA",
    "vocab_size": MODEL.vocab_size,
    "hidden_size": MODEL.hidden_size,
    "num_attention_heads": MODEL.num_attention_heads,
    "num_key_value_heads": MODEL.num_key_value_heads,
    "head_dim": MODEL.head_dim,
    "rotary_dim": MODEL.head_dim,
    "rope_base": MODEL.rope_base,
    "text_bytes": TEXT_BYTES,
    "prefill_tokens": PREFILL_TOKENS,
    "decode_tokens": DECODE_TOKENS,
    "bits": CACHE.bits,
    "sink_tokens": CACHE.sink_tokens,
    "residual_tokens": CACHE.residual_tokens,
    "group_tokens": CACHE.group_tokens,
    "storage_dtype": "float16",
    "baselines": list(BASELINES),
}


def _softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference single-query attention. ``q [H_q, D]``, ``k/v [H_kv, T, D]`` →
    probabilities ``[H_q, T]`` and output ``[H_q, Dv]`` (float64 math)."""
    k = k.double().repeat_interleave(groups, dim=0)
    v = v.double().repeat_interleave(groups, dim=0)
    logits = torch.einsum("hd,htd->ht", q.double(), k) / q.shape[-1] ** 0.5
    probs = torch.softmax(logits, dim=-1)
    return probs, torch.einsum("ht,htd->hd", probs, v)


def run_protocol(
    model: ByteRopeGQA, token_ids: torch.Tensor, config: PNMixConfig
) -> dict[str, Any]:
    """Run the 66-call protocol with one cache configuration; returns metrics and state."""
    proj = model.project(token_ids)
    q, k, v = proj.queries, proj.keys, proj.values
    groups = q.shape[1] // k.shape[1]
    cache = PNMixCache(
        config, batch_size=1, num_key_value_heads=k.shape[1], head_dim=k.shape[-1], device=k.device
    )
    cache.append(k[:, :, :PREFILL_TOKENS], v[:, :, :PREFILL_TOKENS])
    mask_after_prefill = None if cache.mix_mask is None else cache.mix_mask.clone()
    pnmix_attention(q[:, :, :PREFILL_TOKENS], cache)
    online, kls, out_mse, cosines = [], [], [], []
    for t in range(PREFILL_TOKENS, TEXT_BYTES):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = pnmix_attention(q[:, :, t : t + 1], cache)[0, :, 0]  # [H_q, Dv]
        online.append(out)
        ref_p, ref_out = _softmax_attention(q[0, :, t], k[0, :, : t + 1], v[0, :, : t + 1], groups)
        deq_k, deq_v = cache.dequantize()
        quant_p, _ = _softmax_attention(q[0, :, t], deq_k[0], deq_v[0], groups)
        kl = (ref_p * (ref_p.clamp_min(1e-300).log() - quant_p.clamp_min(1e-300).log())).sum(-1)
        kls.append(kl)
        out_mse.append(((out.double() - ref_out) ** 2).mean(-1))
        cosines.append(torch.nn.functional.cosine_similarity(out.double(), ref_out, dim=-1))
    final = pnmix_attention(q[:, :, PREFILL_TOKENS:], cache)[0].transpose(0, 1)  # [Q, H, Dv]
    online_delta = (torch.stack(online) - final).abs().max()
    deq_k, deq_v = cache.dequantize()
    quantized = slice(config.sink_tokens, config.sink_tokens + cache.quantized_tokens)
    sink = slice(0, config.sink_tokens)
    sink_error = (deq_k[:, :, sink] - k[:, :, sink].to(config.storage_dtype).float()).abs()
    metrics = {
        "key_mse": float(((deq_k[:, :, quantized] - k[:, :, quantized]) ** 2).mean()),
        "value_mse": float(((deq_v[:, :, quantized] - v[:, :, quantized]) ** 2).mean()),
        "attention_kl": float(torch.stack(kls).mean()),
        "attention_output_mse": float(torch.stack(out_mse).mean()),
        "attention_output_cosine": float(torch.stack(cosines).mean()),
        "sink_key_max_error": float(sink_error.max()) if sink_error.numel() else 0.0,
        "saliency_computations": int(cache.saliency_computations),
        "actual_attention_calls": int(cache.attention_calls),
        "online_vs_final_cache_attention_max_delta": float(online_delta),
        "key_bytes": int(cache.key_bytes),
        "value_bytes": int(cache.value_bytes),
        "persistent_cache_bytes": int(cache.persistent_bytes),
        "quantized_tokens": int(cache.quantized_tokens),
        "sink_tokens": int(cache.sink_length),
        "residual_tokens": int(cache.residual_length),
        "key_bits_per_element_including_sink_residual": (
            cache.key_bytes * 8 / (cache.seq_length * k.shape[1] * k.shape[-1])
        ),
    }
    mask_frozen = (
        mask_after_prefill is not None
        and cache.mix_mask is not None
        and bool(torch.equal(mask_after_prefill, cache.mix_mask))
    )
    return {
        "metrics": metrics,
        "cache": cache,
        "final_output": final,
        "mask_frozen_after_prefill": mask_frozen,
        "queries": q,
    }


def _dequantized_attention(query: torch.Tensor, cache: PNMixCache) -> torch.Tensor:
    """Dequantize-then-attend reference for queries that are the last Q cache tokens."""
    deq_k, deq_v = cache.dequantize()
    groups = query.shape[1] // deq_k.shape[1]
    k = deq_k.repeat_interleave(groups, dim=1)
    v = deq_v.repeat_interleave(groups, dim=1)
    q_len, total = query.shape[2], deq_k.shape[2]
    causal = torch.ones(q_len, total, dtype=torch.bool, device=query.device).tril(total - q_len)
    return torch.nn.functional.scaled_dot_product_attention(query.float(), k, v, attn_mask=causal)


def packed_codes_consumed(cache: PNMixCache, query: torch.Tensor) -> bool:
    """Computed check that attention reads the packed codes.

    On copies of ``cache`` (its own call count is untouched): packed attention must equal
    dequantize-then-attend; then every packed key and value code byte of the copy is
    inverted, and packed attention must change and still equal dequantize-then-attend of the
    altered codes — so the output is a function of the packed codes, not of a hidden copy.
    """
    original = copy.deepcopy(cache)
    out = pnmix_attention(query, original)
    matches = torch.allclose(out, _dequantized_attention(query, original), atol=1e-5, rtol=1e-4)
    altered = copy.deepcopy(cache)
    if not altered.groups:
        return False
    for group in altered.groups:
        group.key_codes.bitwise_not_()
        group.value_codes.bitwise_not_()
    out_altered = pnmix_attention(query, altered)
    follows = torch.allclose(
        out_altered, _dequantized_attention(query, altered), atol=1e-5, rtol=1e-4
    )
    return bool(matches and follows and not torch.allclose(out, out_altered))


def _token_ids(context: RunContext) -> torch.Tensor:
    assert context.text is not None
    data = context.text.data[:TEXT_BYTES]
    if len(data) < TEXT_BYTES:
        raise ValueError(
            f"the pn-mix diagnostic needs at least {TEXT_BYTES} bytes of text, got {len(data)}"
        )
    return torch.tensor(list(data), dtype=torch.int64, device=context.device)


def run_seed(context: RunContext, seed: int) -> SeedResult:
    """One seed: PN-Mix plus the two baselines on the same model and bytes."""
    model = ByteRopeGQA.from_seed(seed, context.device)
    ids = _token_ids(context)
    main = run_protocol(model, ids, CACHE)
    metrics = dict(main["metrics"])
    for name, coding in BASELINES.items():
        base = run_protocol(
            model,
            ids,
            PNMixConfig(
                bits=CACHE.bits,
                sink_tokens=CACHE.sink_tokens,
                residual_tokens=CACHE.residual_tokens,
                group_tokens=CACHE.group_tokens,
                key_coding=coding,
            ),
        )
        metrics.update({f"{name}.{m}": base["metrics"][m] for m in BASELINE_METRICS})
    last_query = main["queries"][:, :, -1:]
    details = {
        "model_parameter_sha256": model.parameter_sha256(),
        "mask_frozen_after_prefill": main["mask_frozen_after_prefill"],
        "packed_codes_consumed_by_attention": packed_codes_consumed(main["cache"], last_query),
        "attention_backend": select_backend("auto", context.device, main["cache"].kernel_decode),
    }
    assert context.text is not None
    return SeedResult(metrics=metrics, data_sha256=context.text.sha256, details=details)


def _dataset(context: RunContext, results: list[SeedResult]) -> tuple[dict[str, Any], str]:
    assert context.text is not None
    dataset = {
        "id": f"{context.text.id}-byte-diagnostic",
        "revision": f"sha256:{context.text.sha256}",
        "checkpoint": None,
        "capability_benchmark": False,
    }
    return dataset, context.text.sha256


PN_MIX_METRICS = (
    "key_mse",
    "value_mse",
    "attention_kl",
    "attention_output_mse",
    "attention_output_cosine",
    "sink_key_max_error",
    "saliency_computations",
    "actual_attention_calls",
    "online_vs_final_cache_attention_max_delta",
    "key_bytes",
    "value_bytes",
    "persistent_cache_bytes",
    "quantized_tokens",
    "sink_tokens",
    "residual_tokens",
    "key_bits_per_element_including_sink_residual",
)
"""The metrics of the accelerator validation record, in reference record 004's order."""


def agree_within_tolerance(cpu: dict[str, Any], accel: dict[str, Any]) -> bool:
    """Same-seed agreement of two metric dicts (see :data:`CPU_CUDA_TOLERANCE`): integers
    exactly equal, floats within ``absolute + relative * |cpu|``."""
    for name, expected in cpu.items():
        got = accel[name]
        if isinstance(expected, int) and not isinstance(expected, bool):
            if got != expected:
                return False
        elif isinstance(expected, float):
            bound = CPU_CUDA_TOLERANCE["absolute"] + CPU_CUDA_TOLERANCE["relative"] * abs(expected)
            if abs(got - expected) > bound:
                return False
    return True


def validation_record(
    run: PaperRun, accelerator: AcceleratorInfo, cpu_results: list[SeedResult]
) -> dict[str, Any]:
    """The accelerator validation record (schema v1, reference record 004's fields) of a run.

    Every execution check is computed from the run: packed codes consumed (per seed, see
    :func:`packed_codes_consumed`), mask computed at prefill only (one saliency computation
    and the mask unchanged after prefill), three distinct initializations (three seeds whose
    model parameter hashes differ), the counted attention calls, and same-seed agreement of
    the accelerator run with ``cpu_results`` within :data:`CPU_CUDA_TOLERANCE`.

    Args:
        run: the finished accelerator run (artifact already written).
        accelerator: vendor and model of the accelerator.
        cpu_results: the same seeds run on the CPU, in the same order.

    Raises:
        pydantic.ValidationError: the record does not fit schema v1.
    """
    from kvlab.artifacts import aggregate_metrics
    from kvlab.diagnostics.runner import COMMON_RUNNER_MODULES, display_path, module_paths

    context = run.context
    assert context.text is not None
    agreement = len(cpu_results) == len(run.results) and all(
        agree_within_tolerance(cpu.metrics, accel.metrics)
        for cpu, accel in zip(cpu_results, run.results, strict=True)
    )
    parameter_hashes = {r.details["model_parameter_sha256"] for r in run.results}
    calls = {r.metrics["actual_attention_calls"] for r in run.results}
    checks: dict[str, bool | int] = {
        "packed_codes_consumed_by_attention": all(
            r.details["packed_codes_consumed_by_attention"] for r in run.results
        ),
        "prefill_only_mask": all(
            r.details["mask_frozen_after_prefill"] and r.metrics["saliency_computations"] == 1
            for r in run.results
        ),
        "three_initializations": len(context.seeds) == 3 and len(parameter_hashes) == 3,
        "actual_attention_calls_per_run": calls.pop() if len(calls) == 1 else -1,
        "unified_cli_cuda_and_same_seed_agreement": agreement,
        "fused_kernel": all(r.details["attention_backend"] in FUSED_BACKENDS for r in run.results),
        "offline_checkpoint_extraction_tested": False,
        "full_pretrained_llm_quality_tested": False,
    }
    required = (
        "packed_codes_consumed_by_attention",
        "prefill_only_mask",
        "three_initializations",
        "unified_cli_cuda_and_same_seed_agreement",
    )
    passed = all(checks[k] is True for k in required) and (
        checks["actual_attention_calls_per_run"] == 2 + DECODE_TOKENS
    )
    now = _dt.datetime.now(_dt.timezone.utc)
    record_path = context.output_dir / f"validation-{accelerator.model.lower()}-{now:%Y%m%d}.json"
    files = module_paths(
        PAPER.implementation_modules + PAPER.runner_modules + COMMON_RUNNER_MODULES
    )
    commit, _dirty = git_state()
    record = {
        "schema_version": 1,
        "adapter_key": PAPER.key,
        "validated_at": f"{now:%Y-%m-%d}",
        "accelerator": {"vendor": accelerator.vendor, "model": accelerator.model},
        "command": context.argv,
        "additional_seeds": context.seeds[1:],
        "additional_validated_commands": [],
        "dataset": {
            "id": f"{context.text.id}-byte-diagnostic",
            "revision": f"sha256:{context.text.sha256}",
            "source_url": context.text.source_url,
            "split": "fixed-input-mechanism-diagnostic-no-task-labels",
        },
        "checkpoint": {
            "public_id": "none-random-initialized-single-layer-RoPE-GQA",
            "revision": "kvlab-pn-mix-byte-rope-gqa-v1",
            "pretrained": False,
            "initialization_seeds": context.seeds,
        },
        "result": "passed" if passed else "failed",
        "metrics": aggregate_metrics(
            [{m: r.metrics[m] for m in PN_MIX_METRICS} for r in run.results]
        ),
        "execution_checks": checks,
        "executed_source_sha256": source_hashes(files),
        "provenance": {
            "commit": commit,
            "artifact_path": display_path(record_path),
            "metrics_artifact": display_path(run.artifact_path),
            "scope": "l1_component_only",
        },
    }
    return build_validation_record(record)


def _write_validation_record(run: PaperRun) -> list[Path]:
    """Finalize hook: on an accelerator run only, rerun the seeds on the CPU and write the
    validation record next to the artifact."""
    context = run.context
    if context.device.type != "cuda":
        return []
    cpu_context = dataclasses.replace(context, device=torch.device("cpu"))
    cpu_results = [run_seed(cpu_context, seed) for seed in context.seeds]
    record = validation_record(run, accelerator_info(context.device), cpu_results)
    path = Path(record["provenance"]["artifact_path"])
    write_json_atomic(path, record)
    return [path]


PAPER = Paper(
    key="pn-mix",
    title="PN-Mix: 2-bit mixed Cartesian/Phase-Norm KV cache, attention from packed codes",
    manifest_ref="foundation-models:pn-mix",
    tier="l1_mechanism",
    claim_policy=(
        "random-initialized single-layer byte-level model on a fixed text; cache fidelity and "
        "attention diagnostics with two 2-bit baselines (bytes reported beside); "
        "no model capability evidence"
    ),
    implementation_status="component_only",
    diagnostic_only=True,
    implementation_modules=(
        "kvlab.pnmix.packing",
        "kvlab.pnmix.quantizers",
        "kvlab.pnmix.codecs",
        "kvlab.pnmix.key_codec",
        "kvlab.pnmix.pair_codecs",
        "kvlab.pnmix.mix_codec",
        "kvlab.pnmix.values",
        "kvlab.pnmix.store",
        "kvlab.pnmix.store_buffers",
        "kvlab.pnmix.config",
        "kvlab.pnmix.cache",
        "kvlab.pnmix.cache_state",
        "kvlab.pnmix.cache_tables",
        "kvlab.pnmix.cache_flush",
        "kvlab.pnmix.cache_decode",
        "kvlab.pnmix.attention",
        "kvlab.pnmix.reference",
        "kvlab.rope",
        "kvlab.rope.config",
        "kvlab.rope.scaling",
        "kvlab.rope.rotation",
    ),
    runner_modules=("kvlab.diagnostics.pn_mix", "kvlab.models.byte_rope_gqa"),
    configuration=CONFIGURATION,
    run_seed=run_seed,
    dataset=_dataset,
    baselines_compared=True,
    uses_text=True,
    min_text_bytes=TEXT_BYTES,
    finalize=_write_validation_record,
)
