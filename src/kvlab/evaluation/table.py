"""Markdown tables of ``kvlab eval`` results (one row per method)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "format_bytes",
    "layer_kind_note",
    "markdown_table",
    "needle_table",
    "prefill_score_table",
    "stream_table",
]


def format_bytes(value: float) -> str:
    """Bytes in binary units with 3 significant digits (``"1.23 MiB"``)."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    size = float(value)
    for unit in units:
        if abs(size) < 1024 or unit == units[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; floats with 4 significant digits, ``None`` as ``–``."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def prefill_score_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The prefill-score table from per-method pooled summaries (keys as written by
    :func:`kvlab.evaluation.harness.summarize_prefill_score`)."""
    headers = [
        "method",
        "KV bytes (stored)",
        "KV held",
        "KV bytes (16-bit)",
        "vs full",
        "prefill KV (16-bit)",
        "PPL",
        "ΔPPL %",
        "KL mean (nats)",
        "KL p95 (nats)",
        "model s",
        "tok/s",
    ]
    rows = [
        [
            s["method"],
            format_bytes(s["kv_bytes"]),
            format_bytes(s.get("held_bytes", s["kv_bytes"] + s.get("index_bytes", 0))),
            format_bytes(s["kv_bytes_16bit"]),
            f"{s['kv_fraction_of_full']:.3f}",
            format_bytes(s["prefill_kv_bytes_16bit"]),
            f"{s['ppl']:.4f}",
            f"{s['delta_ppl_pct']:+.3f}",
            f"{s['kl_mean']:.5f}",
            f"{s['kl_p95']:.5f}",
            f"{s['model_seconds']:.1f}",
            f"{s['tokens_per_second']:.1f}",
        ]
        for s in summaries
    ]
    if not any(WINDOW in s.get("kv_bytes_by_layer_kind", {}) for s in summaries):
        return markdown_table(headers, rows)
    # a model with window layers: which bytes were compressible (full-attention layers)
    headers += ["full-attn KV (stored)", "full-attn KV (16-bit)", "full-attn vs full", "window KV"]
    for row, s in zip(rows, summaries, strict=True):
        kinds = s.get("kv_bytes_by_layer_kind", {})
        full, window = kinds.get(FULL, {}), kinds.get(WINDOW, {})
        ratio = full.get("fraction_of_full")
        row += [
            format_bytes(full["kv_bytes"]) if full else None,
            format_bytes(full["kv_bytes_16bit"]) if full else None,
            f"{ratio:.3f}" if ratio is not None else None,
            format_bytes(window["kv_bytes_16bit"]) if window else None,
        ]
    return markdown_table(headers, rows) + layer_kind_note(summaries)


FULL, WINDOW = "full_attention", "sliding_window"


def layer_kind_note(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The footnote of a model with window layers: how many layers each method compresses."""
    reference = next((s for s in summaries if s.get("family") == "full"), summaries[0])
    kinds = reference.get("kv_bytes_by_layer_kind", {})
    full, window = kinds.get(FULL, {}), kinds.get(WINDOW, {})
    total = reference["kv_bytes_16bit"]
    share = window.get("kv_bytes_16bit", 0) / total if total else 0.0
    layers = int(full.get("layers", 0)) + int(window.get("layers", 0))
    return (
        f"\nOnly the {int(full.get('layers', 0))} full-attention layers of {layers} are "
        f"compressed; the {int(window.get('layers', 0))} sliding-window layers keep their "
        f"window exact in every method ({share:.0%} of the full cache's 16-bit bytes here). "
        "'full-attn vs full' compares the full-attention layers alone.\n"
    )


def stream_table(summaries: Sequence[Mapping[str, Any]], context: int) -> str:
    """The stream table from per-method summaries (see
    :func:`kvlab.evaluation.harness.summarize_stream`); ``context`` is the model's trained
    context (``max_position_embeddings``)."""
    headers = [
        "method",
        f"PPL (< {context})",
        f"PPL (≥ {context})",
        "ratio",
        "PPL (all)",
        "final position",
        "peak KV (16-bit)",
        "model s",
        "tok/s",
    ]
    rows = [
        [
            s["method"],
            f"{s['ppl_within_context']:.4f}" if s["ppl_within_context"] is not None else None,
            f"{s['ppl_beyond_context']:.4f}" if s["ppl_beyond_context"] is not None else None,
            f"{s['beyond_over_within']:.3f}" if s["beyond_over_within"] is not None else None,
            f"{s['ppl']:.4f}",
            s["final_position"],
            format_bytes(s["peak_kv_bytes_16bit"]),
            f"{s['model_seconds']:.1f}",
            f"{s['tokens_per_second']:.1f}",
        ]
        for s in summaries
    ]
    return markdown_table(headers, rows)


def needle_table(
    summaries: Sequence[Mapping[str, Any]], lengths: Sequence[int], depths: Sequence[float]
) -> str:
    """The needle table: one row per (method, prompt length), one column per needle depth;
    each cell ``correct/trials`` (exact matches), then the row's accuracy."""
    headers = ["method", "length (tokens)", *[f"depth {d:g} %" for d in depths], "accuracy"]
    rows = []
    for s in summaries:
        cells = {(c["length"], c["depth"]): c for c in s["cells"]}
        for length in lengths:
            row_cells = [cells[(length, d)] for d in depths]
            correct = sum(c["correct"] for c in row_cells)
            trials = sum(c["trials"] for c in row_cells)
            rows.append(
                [
                    s["method"],
                    length,
                    *[f"{c['correct']}/{c['trials']}" for c in row_cells],
                    f"{correct / trials:.2f}",
                ]
            )
    return markdown_table(headers, rows)
