"""Reporting: task results merged into ``kvlab eval``'s files.

Written into the output folder, in this order, each as soon as it exists:

* ``table-<protocol>.md`` — the markdown table (prefill-score: figures pooled over all scored
  tokens; stream: perplexity within / beyond the trained context; needle: accuracy per length
  and depth);
* ``raw-<protocol>-<device>.json`` — every per-window (per-stream, per-prompt) figure;
* ``metrics-<protocol>-<device>.json`` — a metric artifact, schema v2, tier
  ``l2_public_text``: its "seeds" are the window indices (prefill-score; the evaluation is
  deterministic, windows are the independent repetitions), the one stream (stream), or the
  trial indices (needle); each per-seed entry holds ``<method>/<metric>`` for every method;
* the plot: ``kl-vs-bytes.png`` (prefill-score), ``stream-ppl.png`` (stream) or
  ``needle-heatmap.png`` (needle).

Results come from the task store or a live run alike (JSON-ready, float64 values round-trip
exactly), so a resumed run reports the same numbers as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.evaluation.methods import MODULES as METHOD_MODULES
from kvlab.evaluation.methods import Method
from kvlab.evaluation.outputs import EvalPaths
from kvlab.evaluation.plan import (
    IMPLEMENTATION_MODULES,
    EvalConfig,
    ModelRef,
    Plan,
    Task,
    TextRef,
)
from kvlab.evaluation.summaries import (
    summarize_needle,
    summarize_prefill_score,
    summarize_stream,
    window_metrics,
    window_score,
)

__all__ = [
    "IMPLEMENTATION_MODULES",
    "RUNNER_MODULES",
    "EvalOutcome",
    "summarize_needle",
    "summarize_prefill_score",
    "summarize_stream",
    "window_metrics",
    "window_score",
    "write_eval_report",
]

RUNNER_MODULES = (
    "kvlab.evaluation.harness",
    "kvlab.evaluation.plan",
    "kvlab.evaluation.execute",
    "kvlab.evaluation.executors",
    "kvlab.evaluation.report",
    "kvlab.evaluation.protocols",
    "kvlab.evaluation.needle",
    "kvlab.evaluation.ruler_protocol",
    "kvlab.evaluation.ruler_report",
    "kvlab.evaluation.questions",
    "kvlab.evaluation.methods",
    *METHOD_MODULES,
    "kvlab.evaluation.calibration",
    "kvlab.evaluation.metrics",
    "kvlab.evaluation.table",
    "kvlab.evaluation.plot",
    "kvlab.evaluation.command",
    "kvlab.evaluation.outputs",
    "kvlab.evaluation.fingerprint",
    "kvlab.evaluation.sweep",
    "kvlab.data",
)

_CLAIM_POLICY = (
    "next-token perplexity and KL(full || method) on a public text with one small pretrained "
    "checkpoint (GGUF de-quantized); KV-cache bytes measured from stored tensors; no downstream "
    "task capability claims"
)
_RULER_CLAIM_POLICY = (
    "RULER synthetic tasks generated offline (string-match accuracy of greedy answers after "
    "query-agnostic context compression) on one small instruction model; a capability "
    "measurement of the cache methods on these tasks only, at these lengths and sample counts"
)
_NEEDLE_CLAIM_POLICY = (
    "synthetic passkey retrieval (exact match of greedy decoding) in filler from a public "
    "text, with one small pretrained checkpoint; no downstream task capability claims"
)


@dataclass
class EvalOutcome:
    """Paths written and the per-method summaries."""

    summaries: list[dict[str, Any]]
    artifact: dict[str, Any]
    artifact_path: Path
    raw_path: Path
    table_path: Path
    plot_path: Path
    table: str


def _settings(method: Method, results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The method's settings with its prepared state (calibration) as its tasks used it."""
    prepared = next((r["prepared"] for r in results if r.get("prepared")), None)
    return {**method.settings, **(prepared or {})}


def _methods_in(plan: Plan) -> list[Method]:
    seen: dict[str, Method] = {}
    for task in plan.tasks:
        seen.setdefault(task.method.name, task.method)
    return list(seen.values())


def _provenance(
    config: EvalConfig,
    paths: EvalPaths,
    accelerator: str,
    checkpoint: str,
    data_sha256: str,
) -> dict[str, Any]:
    from kvlab.artifacts import provenance_block
    from kvlab.diagnostics.runner import display_path, module_paths

    return provenance_block(
        artifact_path=display_path(paths.artifact),
        raw_result_path=display_path(paths.raw),
        implementation_files=module_paths(IMPLEMENTATION_MODULES),
        runner_files=module_paths(RUNNER_MODULES),
        argv=config.argv,
        accelerator=accelerator,
        checkpoint=checkpoint,
        data_sha256=data_sha256,
    )


def write_eval_report(
    config: EvalConfig,
    plan: Plan,
    results: Mapping[str, Mapping[str, Any]],
    paths: EvalPaths,
    *,
    model: ModelRef,
    text: TextRef,
    text_tokens: int,
    accelerator: str,
    device_type: str,
) -> EvalOutcome:
    """Merge the results of ``plan`` into the table, raw JSON, artifact and plot (module
    docstring), written in that order.

    Raises:
        KeyError: a task of the plan has no result.
    """
    from kvlab.artifacts import build_metric_artifact, write_json_atomic

    methods = _methods_in(plan)
    by_method: dict[str, list[Task]] = {m.name: [] for m in methods}
    for task in plan.tasks:
        by_method[task.method.name].append(task)
    task_results = {name: [results[t.key] for t in tasks] for name, tasks in by_method.items()}
    settings = {m.name: _settings(m, task_results[m.name]) for m in methods}
    dataset = {
        "id": text.id,
        "revision": f"sha256:{text.sha256}",
        "checkpoint": model.checkpoint,
        "capability_benchmark": False,
    }
    common = {
        "protocol": config.protocol,
        "model": config.model,
        "dtype": config.dtype,
        "text_tokens": text_tokens,
        "methods": {m.name: {"description": m.description, **settings[m.name]} for m in methods},
    }
    first = next(iter(task_results.values()))[0]
    context = int(first["context"])
    claim_policy = _CLAIM_POLICY
    if config.protocol == "prefill-score":
        table, configuration, summaries, per_seed, seeds, raw_results, plot = _prefill_score(
            config, methods, by_method, task_results, settings, common
        )
    elif config.protocol == "stream":
        table, configuration, summaries, per_seed, seeds, raw_results, plot = _stream(
            config, methods, by_method, task_results, settings, common, context
        )
    elif config.protocol == "ruler":
        table, configuration, summaries, per_seed, seeds, raw_results, plot = _ruler(
            config, methods, by_method, task_results, common
        )
        claim_policy = _RULER_CLAIM_POLICY
    else:
        table, configuration, summaries, per_seed, seeds, raw_results, plot = _needle(
            config, methods, by_method, task_results, settings, common, context
        )
        claim_policy = _NEEDLE_CLAIM_POLICY
    paths.folder.mkdir(parents=True, exist_ok=True)
    paths.table.write_text(table, encoding="utf-8")
    raw = {
        "protocol": config.protocol,
        "device": device_type,
        "accelerator": accelerator,
        "checkpoint": model.checkpoint,
        "model_load_seconds": first.get("model_load_seconds"),
        "dataset": dataset,
        "configuration": configuration,
        "command_argv": config.argv,
        "summaries": summaries,
        "results": raw_results,
    }
    write_json_atomic(paths.raw, raw)
    artifact = build_metric_artifact(
        method=f"kv-cache-eval/{config.protocol}",
        manifest_ref="kvlab:eval",
        seeds=seeds,
        per_seed=per_seed,
        configuration=configuration,
        tier="l2_public_text",
        claim_policy=claim_policy,
        dataset=dataset,
        provenance=_provenance(config, paths, accelerator, model.checkpoint, text.sha256),
        baselines_compared=len(methods) > 1,
        implementation_status="integrated_pretrained_model",
        diagnostic_only=False,
        full_experiment={"status": "measured_small_scale", "review_done": False},
    )
    write_json_atomic(paths.artifact, artifact)
    plot_path = plot(paths.plot)
    return EvalOutcome(
        summaries=summaries,
        artifact=artifact,
        artifact_path=paths.artifact,
        raw_path=paths.raw,
        table_path=paths.table,
        plot_path=plot_path,
        table=table,
    )


_Parts = tuple[str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[int], Any, Any]
_ByMethod = Mapping[str, Sequence[Task]]
_Results = Mapping[str, Sequence[Mapping[str, Any]]]
_Settings = Mapping[str, Mapping[str, Any]]


def _prefill_score(
    config: EvalConfig,
    methods: Sequence[Method],
    by_method: _ByMethod,
    task_results: _Results,
    settings: _Settings,
    common: dict[str, Any],
) -> _Parts:
    from kvlab.evaluation.plot import plot_kl_vs_bytes
    from kvlab.evaluation.table import prefill_score_table

    scores = {name: [window_score(r) for r in rs] for name, rs in task_results.items()}
    reference = scores["full"]
    full_tasks = by_method["full"]
    starts = [t.where["start"] for t in full_tasks]
    configuration = {
        **common,
        "windows": len(starts),
        "window_starts": starts,
        "prefill_tokens": config.prefill,
        "scored_tokens_per_window": config.score,
        "scoring": "one token at a time",
        "seeds_are": "window indices",
    }
    kinds = reference[0].storage_final.layer_kinds
    if kinds:  # which layers a method can compress: the full-attention ones
        configuration["layers_by_kind"] = {k: int(v["layers"]) for k, v in sorted(kinds.items())}
    summaries = [
        summarize_prefill_score(m, scores[m.name], reference, settings[m.name]) for m in methods
    ]
    per_seed = []
    for w in range(len(starts)):
        row: dict[str, float] = {}
        for m in methods:
            for key, value in window_metrics(scores[m.name][w], reference[w]).items():
                row[f"{m.name}/{key}"] = value
        per_seed.append(row)
    raw_results = {
        m.name: [
            {
                "window": w,
                "start": starts[w],
                **window_metrics(s, reference[w]),
                "index_bytes": s.storage_final.index_bytes,
                "details": s.details,
            }
            for w, s in enumerate(scores[m.name])
        ]
        for m in methods
    }
    title = (
        f"{config.model}: {len(starts)} windows, prefill {config.prefill}, "
        f"{config.score} tokens scored one at a time"
    )
    return (
        prefill_score_table(summaries),
        configuration,
        summaries,
        per_seed,
        list(range(len(starts))),
        raw_results,
        lambda path: plot_kl_vs_bytes(summaries, path, title),
    )


def _stream(
    config: EvalConfig,
    methods: Sequence[Method],
    by_method: _ByMethod,
    task_results: _Results,
    settings: _Settings,
    common: dict[str, Any],
    context: int,
) -> _Parts:
    import torch

    from kvlab.evaluation.plot import plot_stream
    from kvlab.evaluation.table import stream_table

    stream_tokens = len(by_method[methods[0].name][0].tokens)
    configuration = {
        **common,
        "stream_tokens": stream_tokens,
        "chunk_tokens": config.chunk,
        "cache_slots": config.cache_slots,
        "segment_tokens": config.segment,
        "trained_context": context,
        "seeds_are": "one stream from the start of the text",
    }
    summaries = []
    for m in methods:
        result = task_results[m.name][0]
        summaries.append(
            summarize_stream(
                m,
                torch.tensor(result["nll"], dtype=torch.float64),
                context=context or stream_tokens + 1,
                segment=config.segment,
                final_position=result["final_position"],
                peak_kv_bytes=result["peak_storage"]["kv_bytes"],
                peak_kv_bytes_16bit=result["peak_storage"]["kv_bytes_16bit"],
                model_seconds=result["model_seconds"],
                details=result["details"],
                settings=settings[m.name],
            )
        )
    row: dict[str, float] = {}
    for s in summaries:
        for key in ("ppl", "final_position", "peak_kv_bytes_16bit", "model_seconds"):
            row[f"{s['method']}/{key}"] = s[key]
        for key in ("ppl_within_context", "ppl_beyond_context"):
            if s[key] is not None:
                row[f"{s['method']}/{key}"] = s[key]
    title = f"{config.model}: {stream_tokens} tokens streamed in chunks of {config.chunk}"
    return (
        stream_table(summaries, context),
        configuration,
        summaries,
        [row],
        [0],
        summaries,
        lambda path: plot_stream(
            {s["method"]: s["segments"] for s in summaries}, context, path, title
        ),
    )


def _needle(
    config: EvalConfig,
    methods: Sequence[Method],
    by_method: _ByMethod,
    task_results: _Results,
    settings: _Settings,
    common: dict[str, Any],
    context: int,
) -> _Parts:
    from kvlab.evaluation.plot import plot_needle_heatmap
    from kvlab.evaluation.table import needle_table

    configuration = {
        **common,
        "lengths": list(config.needle_lengths),
        "depths_percent": list(config.needle_depths),
        "trials": config.needle_trials,
        "seed": config.needle_seed,
        "passkey_digits": config.needle_digits,
        "chunk_tokens": config.chunk,
        "cache_slots": config.cache_slots,
        "trained_context": context,
        "scoring": "exact match of the first digits greedily decoded",
        "seeds_are": "trial indices",
    }
    summaries = [
        summarize_needle(m, by_method[m.name], task_results[m.name], settings[m.name])
        for m in methods
    ]
    per_seed = []
    for trial in range(config.needle_trials):
        row: dict[str, float] = {}
        for m in methods:
            hits = [
                (t, r)
                for t, r in zip(by_method[m.name], task_results[m.name], strict=True)
                if t.where["trial"] == trial
            ]
            row[f"{m.name}/accuracy"] = sum(bool(r["correct"]) for _, r in hits) / len(hits)
            for t, r in hits:
                cell = f"L{t.where['length']}_D{t.where['depth']:g}"
                row[f"{m.name}/correct_{cell}"] = int(bool(r["correct"]))
        per_seed.append(row)
    raw_results = {
        m.name: [
            {
                **dict(t.where),
                "passkey": t.unit["passkey"],
                "prompt_tokens": len(t.tokens),
                **{k: v for k, v in r.items() if k not in ("prepared", "worker_pid")},
            }
            for t, r in zip(by_method[m.name], task_results[m.name], strict=True)
        ]
        for m in methods
    }
    title = (
        f"{config.model}: passkey retrieval, {config.needle_trials} trial(s) per cell, "
        f"chunks of {config.chunk}, trained context {context}"
    )
    return (
        needle_table(summaries, list(config.needle_lengths), list(config.needle_depths)),
        configuration,
        summaries,
        per_seed,
        list(range(config.needle_trials)),
        raw_results,
        lambda path: plot_needle_heatmap(
            summaries, list(config.needle_lengths), list(config.needle_depths), path, title
        ),
    )


def _ruler(
    config: EvalConfig,
    methods: Sequence[Method],
    by_method: _ByMethod,
    task_results: _Results,
    common: dict[str, Any],
) -> _Parts:
    from kvlab.evaluation.ruler_report import (
        plot_accuracy_vs_bytes,
        plot_ruler_heatmap,
        ruler_table,
        summarize_ruler,
    )

    def wheres(name: str) -> list[Mapping[str, Any]]:
        return [t.where for t in by_method[name]]

    full = summarize_ruler("full", wheres("full"), task_results["full"], None, None)
    reference = {tuple(k.split("/")): v for k, v in full["scores"].items()}
    reference = {(k[0], int(k[1]), int(k[2])): v for k, v in reference.items()}
    summaries = [
        summarize_ruler(
            m.name,
            wheres(m.name),
            task_results[m.name],
            reference,
            full["kv_bytes"],
            full["kv_bytes_16bit"],
            full.get("kv_bytes_by_layer_kind"),
        )
        for m in methods
    ]
    first = by_method["full"][0]
    configuration = {
        **common,
        "tasks": sorted({t.where["task"] for t in by_method["full"]}),
        "lengths": list(config.ruler_lengths),
        "samples_per_task": config.ruler_samples,
        "seed": config.ruler_seed,
        "chat_template": bool(first.unit["chat"]),
        "shared_prefill": config.ruler_shared_prefill,
        "scoring": "RULER string_match_all / string_match_part of the greedy answer",
        "compression": "query-agnostic: the context is compressed before the question is fed",
        "seeds_are": "sample indices",
    }
    if "kv_bytes_by_layer_kind" in full:
        kinds = full["kv_bytes_by_layer_kind"]
        configuration["layers_by_kind"] = {k: int(v["layers"]) for k, v in sorted(kinds.items())}
    per_seed = []
    indices = sorted({t.where["index"] for t in by_method["full"]})
    for index in indices:
        row: dict[str, float] = {}
        for m in methods:
            hits = [
                (t, r)
                for t, r in zip(by_method[m.name], task_results[m.name], strict=True)
                if t.where["index"] == index
            ]
            row[f"{m.name}/accuracy"] = sum(float(r["score"]) for _, r in hits) / len(hits)
            for t, r in hits:
                row[f"{m.name}/score_{t.where['task']}_L{t.where['length']}"] = float(r["score"])
        per_seed.append(row)
    raw_results = {
        m.name: [
            {
                **dict(t.where),
                "outputs": t.unit["outputs"],
                "context_tokens": t.unit["context_tokens"],
                "question_tokens": len(t.tokens) - t.unit["context_tokens"],
                **{k: v for k, v in r.items() if k not in ("prepared", "worker_pid")},
            }
            for t, r in zip(by_method[m.name], task_results[m.name], strict=True)
        ]
        for m in methods
    }
    lengths = ", ".join(str(n) for n in config.ruler_lengths)
    title = f"{config.model}: RULER, {lengths} tokens, {config.ruler_samples} samples per task"

    def plot(path: Path) -> Path:
        plot_accuracy_vs_bytes(summaries, path.with_name("ruler-accuracy-vs-bytes.png"), title)
        return plot_ruler_heatmap(summaries, path, title)

    return (
        ruler_table(summaries),
        configuration,
        summaries,
        per_seed,
        indices,
        raw_results,
        plot,
    )
