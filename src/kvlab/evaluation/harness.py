"""``kvlab eval``: run KV-cache methods on a pretrained model and a text, write the results.

:func:`run_eval` loads the model (:func:`kvlab.models.load_model`, offline) and the text
(:func:`kvlab.data.load_text`), tokenizes the text once, runs the protocol
(:mod:`kvlab.evaluation.protocols`) for every method, and writes into the output folder:

* ``raw-<protocol>-<device>.json`` — every per-window (or per-stream) figure;
* ``metrics-<protocol>-<device>.json`` — a metric artifact, schema v2, tier ``l2_public_text``:
  its "seeds" are the window indices (the evaluation is deterministic; windows are the
  independent repetitions), each per-seed entry holds ``<method>/<metric>`` for every method;
* ``table-<protocol>.md`` — the markdown table (figures pooled over all scored tokens);
* ``kl-vs-bytes.png`` (prefill-score) or ``stream-ppl.png`` (stream).

Prefill-score windows are ``P + S`` tokens long, evenly spaced over the tokenized text (first
at token 0, last ending at the text's end), non-overlapping when the text is long enough. The
``full`` method (``DynamicCache``) always runs first on each window: it is the reference of the
KL and of ΔPPL, added when not requested.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from tqdm import tqdm

from kvlab.artifacts import build_metric_artifact, provenance_block, write_json_atomic
from kvlab.evaluation.methods import Method, parse_method
from kvlab.evaluation.metrics import percentile, perplexity
from kvlab.evaluation.plot import plot_kl_vs_bytes, plot_stream
from kvlab.evaluation.protocols import WindowScore, score_window, stream_tokens
from kvlab.evaluation.table import prefill_score_table, stream_table

__all__ = [
    "PROTOCOLS",
    "EvalConfig",
    "EvalOutcome",
    "run_eval",
    "summarize_prefill_score",
    "summarize_stream",
    "window_starts",
]

PROTOCOLS = ("prefill-score", "stream")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_IMPLEMENTATION_MODULES = (
    "kvlab.rope",
    "kvlab.relay.core",
    "kvlab.pnmix.cache",
    "kvlab.pnmix.attention",
    "kvlab.pnmix.packing",
    "kvlab.pnmix.quantizers",
    "kvlab.pnmix.allocation",
    "kvlab.integrations.attention",
    "kvlab.integrations.pnmix_cache",
    "kvlab.integrations.pnmix_calibration",
    "kvlab.integrations.relay_cache",
    "kvlab.relay.scorers",
    "kvlab.relay.budgets",
    "kvlab.models.loading",
)
_RUNNER_MODULES = (
    "kvlab.evaluation.harness",
    "kvlab.evaluation.protocols",
    "kvlab.evaluation.methods",
    "kvlab.evaluation.metrics",
    "kvlab.evaluation.table",
    "kvlab.evaluation.plot",
    "kvlab.evaluation.command",
    "kvlab.data",
)


@dataclass
class EvalConfig:
    """Everything ``kvlab eval`` needs (see ``kvlab eval --help`` for the meaning of each)."""

    model: str = "smollm2-135m"
    text: Path | None = None
    methods: Sequence[str] = ()
    protocol: str = "prefill-score"
    windows: int = 4
    prefill: int = 512
    score: int = 512
    device: str = "auto"
    dtype: str = "float32"
    output_dir: Path = Path("runs/eval")
    cache_slots: int = 2048
    chunk: int = 256
    stream_length: int = 12288
    segment: int = 1024
    argv: list[str] = field(default_factory=list)
    progress: bool = True

    def validate(self) -> None:
        """Raises ValueError for an unknown protocol or dtype, or non-positive sizes."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}")
        for name in ("windows", "prefill", "score", "cache_slots", "chunk", "segment"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.stream_length < 2:
            raise ValueError("--stream-length must be >= 2")


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


def window_starts(n_tokens: int, length: int, windows: int) -> list[int]:
    """Start indices of ``windows`` windows of ``length`` tokens, evenly spaced over
    ``n_tokens`` (first at 0, last ending at ``n_tokens``).

    Raises:
        ValueError: the text is shorter than one window.
    """
    if n_tokens < length:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window ({length})")
    if windows == 1:
        return [0]
    span = n_tokens - length
    return [round(i * span / (windows - 1)) for i in range(windows)]


def _tokenize(tokenizer: Any, text: bytes) -> torch.Tensor:
    decoded = text.decode("utf-8", errors="replace")
    ids = tokenizer(decoded, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def _method_fields(method: Method, nll: torch.Tensor) -> dict[str, Any]:
    """The entries every protocol's summary starts with."""
    return {
        "method": method.name,
        "family": method.family,
        "description": method.description,
        "settings": method.settings,
        "scored_tokens": int(nll.numel()),
    }


def summarize_prefill_score(
    method: Method, scores: Sequence[WindowScore], reference: Sequence[WindowScore]
) -> dict[str, Any]:
    """Pooled figures of one method over all windows (NLL/KL pooled over every scored token;
    bytes averaged over windows; time summed)."""
    nll = torch.cat([s.nll for s in scores])
    ref_ppl = perplexity(torch.cat([s.nll for s in reference]))
    kl = torch.cat([s.kl for s in scores]) if scores[0].kl is not None else torch.zeros_like(nll)
    ref_bytes = statistics.mean(s.storage_final.kv_bytes_16bit for s in reference)
    seconds = sum(s.model_seconds for s in scores)
    ppl = perplexity(nll)
    kv16 = statistics.mean(s.storage_final.kv_bytes_16bit for s in scores)
    return {
        **_method_fields(method, nll),
        "ppl": ppl,
        "delta_ppl_pct": 100.0 * (ppl / ref_ppl - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_p95": percentile(kl, 0.95),
        "kv_bytes": statistics.mean(s.storage_final.kv_bytes for s in scores),
        "kv_bytes_16bit": kv16,
        "kv_fraction_of_full": kv16 / ref_bytes,
        "prefill_kv_bytes": statistics.mean(s.storage_prefill.kv_bytes for s in scores),
        "prefill_kv_bytes_16bit": statistics.mean(s.storage_prefill.kv_bytes_16bit for s in scores),
        "index_bytes": statistics.mean(s.storage_final.index_bytes for s in scores),
        "model_seconds": seconds,
        "tokens_per_second": nll.numel() / seconds if seconds > 0 else 0.0,
        "details": [s.details for s in scores],
    }


def _window_metrics(score: WindowScore, reference: WindowScore) -> dict[str, float]:
    ppl = perplexity(score.nll)
    kl = score.kl if score.kl is not None else torch.zeros_like(score.nll)
    return {
        "ppl": ppl,
        "delta_ppl_pct": 100.0 * (ppl / perplexity(reference.nll) - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_p95": percentile(kl, 0.95),
        "kv_bytes": score.storage_final.kv_bytes,
        "kv_bytes_16bit": score.storage_final.kv_bytes_16bit,
        "prefill_kv_bytes_16bit": score.storage_prefill.kv_bytes_16bit,
        "model_seconds": score.model_seconds,
    }


def summarize_stream(
    method: Method,
    nll: torch.Tensor,
    *,
    context: int,
    segment: int,
    final_position: int,
    peak_kv_bytes: int,
    peak_kv_bytes_16bit: int,
    model_seconds: float,
    details: dict[str, Any],
) -> dict[str, Any]:
    """Stream figures: perplexity overall, of targets at stream index ``< context`` and
    ``>= context``, and per ``segment`` tokens. ``nll[t]`` scores stream token ``t + 1``."""
    target_index = torch.arange(1, nll.numel() + 1)
    within = nll[target_index < context]
    beyond = nll[target_index >= context]
    ppl_within = perplexity(within) if within.numel() else None
    ppl_beyond = perplexity(beyond) if beyond.numel() else None
    segments = []
    for start in range(0, nll.numel() + 1, segment):
        part = nll[(target_index >= start) & (target_index < start + segment)]
        if part.numel():
            segments.append((int(min(start + segment, nll.numel() + 1)), perplexity(part)))
    return {
        **_method_fields(method, nll),
        "ppl": perplexity(nll),
        "ppl_within_context": ppl_within,
        "ppl_beyond_context": ppl_beyond,
        "beyond_over_within": (ppl_beyond / ppl_within) if ppl_within and ppl_beyond else None,
        "segments": segments,
        "final_position": final_position,
        "peak_kv_bytes": peak_kv_bytes,
        "peak_kv_bytes_16bit": peak_kv_bytes_16bit,
        "model_seconds": model_seconds,
        "tokens_per_second": nll.numel() / model_seconds if model_seconds > 0 else 0.0,
        "details": details,
    }


def _methods(config: EvalConfig) -> list[Method]:
    from kvlab.evaluation.methods import DEFAULT_METHODS, hf_quantized_backend_available

    names = list(config.methods)
    if not names:
        names = list(DEFAULT_METHODS)
        if config.protocol == "prefill-score":
            for backend in ("quanto", "hqq"):
                if hf_quantized_backend_available(backend):
                    names.append(f"hf-{backend}-2bit")
        else:
            names = ["full", "relay:snapkv@0.5", "evict-no-relay:snapkv@0.5", "streaming-llm@0.5"]
    seen: set[str] = set()
    methods = []
    for name in names:
        method = parse_method(name, protocol=config.protocol, cache_slots=config.cache_slots)
        if method.name in seen:
            raise ValueError(f"method {method.name!r} given twice")
        seen.add(method.name)
        methods.append(method)
    if config.protocol == "prefill-score" and "full" not in seen:
        methods.insert(0, parse_method("full"))
    # the reference runs first
    methods.sort(key=lambda m: m.name != "full")
    return methods


def _provenance(
    config: EvalConfig,
    artifact_path: Path,
    raw_path: Path,
    accelerator: str,
    checkpoint: str,
    data_sha256: str,
) -> dict[str, Any]:
    from kvlab.diagnostics.runner import display_path, module_paths

    return provenance_block(
        artifact_path=display_path(artifact_path),
        raw_result_path=display_path(raw_path),
        implementation_files=module_paths(_IMPLEMENTATION_MODULES),
        runner_files=module_paths(_RUNNER_MODULES),
        argv=config.argv or ["kvlab", *sys.argv[1:]],
        accelerator=accelerator,
        checkpoint=checkpoint,
        data_sha256=data_sha256,
    )


_CLAIM_POLICY = (
    "next-token perplexity and KL(full || method) on a public text with one small pretrained "
    "checkpoint (GGUF de-quantized); KV-cache bytes measured from stored tensors; no downstream "
    "task capability claims"
)


def run_eval(config: EvalConfig, console: Console | None = None) -> EvalOutcome:
    """Run ``kvlab eval`` (module docstring) and write its files.

    Raises:
        ValueError: invalid options, unknown methods, a text shorter than one window.
        kvlab.models.ModelNotAvailableError: the model is not installed.
    """
    from kvlab.data import load_text
    from kvlab.device import accelerator_info, resolve_device
    from kvlab.models import load_model

    console = console or Console(stderr=True)
    config.validate()
    methods = _methods(config)
    device = resolve_device(config.device)
    text = load_text(config.text)  # a bad text fails before the model loads
    loaded = load_model(config.model, device=device, dtype=_DTYPES[config.dtype])
    console.print(
        f"model {config.model}: {loaded.checkpoint} loaded in {loaded.load_seconds:.1f} s"
    )
    tokens = _tokenize(loaded.tokenizer, text.data).to(device)
    model = loaded.model
    for method in methods:
        if method.prepare is not None:
            console.print(f"{method.name}: preparing ({method.prepare_note or 'calibration'}) ...")
            began = time.perf_counter()
            method.settings.update(method.prepare(model, loaded.tokenizer))
            console.print(f"{method.name}: prepared in {time.perf_counter() - began:.1f} s")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    accelerator = accelerator_info(device).label
    out_dir = Path(config.output_dir)
    label = f"{config.protocol}-{device.type}"
    raw_path = out_dir / f"raw-{label}.json"
    artifact_path = out_dir / f"metrics-{label}.json"
    table_path = out_dir / f"table-{config.protocol}.md"
    dataset = {
        "id": text.id,
        "revision": f"sha256:{text.sha256}",
        "checkpoint": loaded.checkpoint,
        "capability_benchmark": False,
    }
    common = {
        "protocol": config.protocol,
        "model": config.model,
        "dtype": config.dtype,
        "text_tokens": int(tokens.numel()),
        "methods": {m.name: {"description": m.description, **m.settings} for m in methods},
    }

    if config.protocol == "prefill-score":
        length = config.prefill + config.score
        starts = window_starts(tokens.numel(), length, config.windows)
        configuration = {
            **common,
            "windows": config.windows,
            "window_starts": starts,
            "prefill_tokens": config.prefill,
            "scored_tokens_per_window": config.score,
            "scoring": "one token at a time",
            "seeds_are": "window indices",
        }
        per_method: dict[str, list[WindowScore]] = {m.name: [] for m in methods}
        total = len(starts) * len(methods) * config.score
        with tqdm(
            total=total,
            disable=not config.progress,
            desc="eval",
            unit="tok",
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            for w, start in enumerate(starts):
                window = tokens[start : start + length]
                reference_logprobs = None
                for method in methods:
                    bar.set_description(f"window {w + 1}/{len(starts)} {method.name}")
                    result = score_window(
                        model,
                        window,
                        method,
                        prefill=config.prefill,
                        score=config.score,
                        reference_logprobs=reference_logprobs,
                        keep_logprobs=method.name == "full",
                        on_token=bar.update,
                    )
                    if method.name == "full":
                        reference_logprobs = result.reference_logprobs
                        result.reference_logprobs = None
                        result.kl = torch.zeros_like(result.nll)
                    per_method[method.name].append(result)
        reference = per_method["full"]
        summaries = [summarize_prefill_score(m, per_method[m.name], reference) for m in methods]
        per_seed = []
        for w in range(len(starts)):
            row: dict[str, float] = {}
            for m in methods:
                for key, value in _window_metrics(per_method[m.name][w], reference[w]).items():
                    row[f"{m.name}/{key}"] = value
            per_seed.append(row)
        seeds = list(range(len(starts)))
        table = prefill_score_table(summaries)
        plot_path = plot_kl_vs_bytes(
            summaries,
            out_dir / "kl-vs-bytes.png",
            f"{config.model}: {len(starts)} windows, prefill {config.prefill}, "
            f"{config.score} tokens scored one at a time",
        )
        raw_results: Any = {
            m.name: [
                {
                    "window": w,
                    "start": starts[w],
                    **_window_metrics(s, reference[w]),
                    "index_bytes": s.storage_final.index_bytes,
                    "details": s.details,
                }
                for w, s in enumerate(per_method[m.name])
            ]
            for m in methods
        }
    else:
        stream = tokens[: config.stream_length]
        configuration = {
            **common,
            "stream_tokens": int(stream.numel()),
            "chunk_tokens": config.chunk,
            "cache_slots": config.cache_slots,
            "segment_tokens": config.segment,
            "trained_context": context,
            "seeds_are": "one stream from the start of the text",
        }
        summaries = []
        with tqdm(
            total=len(methods) * (stream.numel() - 1),
            disable=not config.progress,
            desc="stream",
            unit="tok",
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            for method in methods:
                bar.set_description(f"stream {method.name}")
                result = stream_tokens(
                    model, stream, method, chunk=config.chunk, on_chunk=bar.update
                )
                summaries.append(
                    summarize_stream(
                        method,
                        result.nll,
                        context=context or stream.numel() + 1,
                        segment=config.segment,
                        final_position=result.final_position,
                        peak_kv_bytes=result.peak_storage.kv_bytes,
                        peak_kv_bytes_16bit=result.peak_storage.kv_bytes_16bit,
                        model_seconds=result.model_seconds,
                        details=result.details,
                    )
                )
        per_seed = [{}]
        for s in summaries:
            for key in ("ppl", "final_position", "peak_kv_bytes_16bit", "model_seconds"):
                per_seed[0][f"{s['method']}/{key}"] = s[key]
            for key in ("ppl_within_context", "ppl_beyond_context"):
                if s[key] is not None:
                    per_seed[0][f"{s['method']}/{key}"] = s[key]
        seeds = [0]
        table = stream_table(summaries, context)
        plot_path = plot_stream(
            {s["method"]: s["segments"] for s in summaries},
            context,
            out_dir / "stream-ppl.png",
            f"{config.model}: {stream.numel()} tokens streamed in chunks of {config.chunk}",
        )
        raw_results = summaries

    raw = {
        "protocol": config.protocol,
        "device": device.type,
        "accelerator": accelerator,
        "checkpoint": loaded.checkpoint,
        "model_load_seconds": loaded.load_seconds,
        "dataset": dataset,
        "configuration": configuration,
        "command_argv": config.argv or ["kvlab", *sys.argv[1:]],
        "summaries": summaries,
        "results": raw_results,
    }
    write_json_atomic(raw_path, raw)
    provenance = _provenance(
        config, artifact_path, raw_path, accelerator, loaded.checkpoint, text.sha256
    )
    artifact = build_metric_artifact(
        method=f"kv-cache-eval/{config.protocol}",
        manifest_ref="kvlab:eval",
        seeds=seeds,
        per_seed=per_seed,
        configuration=configuration,
        tier="l2_public_text",
        claim_policy=_CLAIM_POLICY,
        dataset=dataset,
        provenance=provenance,
        baselines_compared=len(methods) > 1,
        implementation_status="integrated_pretrained_model",
        diagnostic_only=False,
        full_experiment={"status": "measured_small_scale", "review_done": False},
    )
    write_json_atomic(artifact_path, artifact)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(table, encoding="utf-8")
    return EvalOutcome(
        summaries=summaries,
        artifact=artifact,
        artifact_path=artifact_path,
        raw_path=raw_path,
        table_path=table_path,
        plot_path=plot_path,
        table=table,
    )
