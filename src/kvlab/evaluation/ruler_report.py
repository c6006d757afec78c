"""Reporting the ``ruler`` protocol: accuracy per task and mean, a paired bootstrap confidence
interval of each method's difference to ``full``, bytes, the table and the two plots.

Accuracy is RULER's: the mean over samples of the string-match score (a sample's score is the
fraction of its references found in the answer, ``string_match_all``; or whether any is,
``string_match_part``), as a percentage. The mean over tasks weighs every task equally (RULER's
average). The difference to ``full`` is paired — the same samples, the same token ids — and its
95 % interval is the percentile bootstrap over samples (Efron & Tibshirani 1993, ch. 13):
``resamples`` draws, with replacement within each task, of the per-sample score differences,
the task-mean recomputed each time (numpy ``default_rng(seed)``: deterministic). Bytes are the
cache's after compression (before the question), averaged over samples; ``fraction`` is that
over ``full``'s bytes on the same samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "paired_bootstrap",
    "plot_accuracy_vs_bytes",
    "plot_ruler_heatmap",
    "ruler_table",
    "summarize_ruler",
    "task_mean_accuracy",
]


def _sample_key(where: Mapping[str, Any]) -> tuple[str, int, int]:
    return (str(where["task"]), int(where["length"]), int(where["index"]))


def task_mean_accuracy(scores: Mapping[tuple[str, int, int], float], tasks: Sequence[str]) -> float:
    """RULER's average in percent: the mean over ``tasks`` (each weighed equally) of the mean
    score of that task's samples.

    Args:
        scores: score in [0, 1] per sample key ``(task, length, index)``.
        tasks: the tasks to average; one task gives that task's accuracy.

    Raises:
        ValueError: ``tasks`` is empty, or a task has no sample in ``scores``.
    """
    if not tasks:
        raise ValueError("task_mean_accuracy: no task to average")
    per_task = _task_fractions(scores, tasks)
    return 100.0 * sum(per_task.values()) / len(per_task)


def _task_fractions(
    scores: Mapping[tuple[str, int, int], float], tasks: Sequence[str]
) -> dict[str, float]:
    """Each task's mean score in [0, 1]; ValueError for a task with no sample."""
    per_task = {}
    for task in tasks:
        values = [v for k, v in scores.items() if k[0] == task]
        if not values:
            raise ValueError(f"task_mean_accuracy: no sample of task {task!r} in the scores")
        per_task[task] = sum(values) / len(values)
    return per_task


def paired_bootstrap(
    method: Mapping[tuple[str, int, int], float],
    reference: Mapping[tuple[str, int, int], float],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """``(difference, low, high)`` in accuracy points of the task-mean accuracy of ``method``
    minus ``reference`` over their common samples, with the percentile bootstrap interval
    (module docstring).

    Args:
        method / reference: score in [0, 1] per sample key ``(task, length, index)``.

    Raises:
        ValueError: no common sample, or ``resamples < 1``.
    """
    keys = sorted(set(method) & set(reference))
    if not keys:
        raise ValueError("the method and the reference share no sample")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    tasks = sorted({k[0] for k in keys})
    diffs = {t: np.array([method[k] - reference[k] for k in keys if k[0] == t]) for t in tasks}
    point = 100.0 * float(np.mean([d.mean() for d in diffs.values()]))
    rng = np.random.default_rng(seed)
    draws = np.zeros(resamples)
    for d in diffs.values():
        picks = rng.integers(0, d.size, size=(resamples, d.size))
        draws += d[picks].mean(axis=1)
    draws *= 100.0 / len(tasks)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(draws, [alpha, 1.0 - alpha])
    return point, float(low), float(high)


def summarize_ruler(
    name: str,
    wheres: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    reference: Mapping[tuple[str, int, int], float] | None,
    reference_bytes: float | None,
    reference_bytes_16bit: float | None = None,
    reference_kinds: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Figures of one method (module docstring): ``accuracy`` (task mean, %), ``tasks``
    (accuracy per task, %), ``samples``, bytes (``kv_bytes``, ``kv_bytes_16bit``,
    ``held_bytes``: means after compression), ``fraction_of_full`` (as stored, and at 16 bits
    against ``full``'s 16-bit bytes), ``kv_bytes_by_layer_kind`` where the caches measure per
    layer kind (full-attention and sliding-window layers: a window layer is never compressed),
    and, given the reference scores, ``delta_vs_full`` with ``delta_ci95`` (``None`` when a
    task has a single sample: no interval)."""
    scores = {_sample_key(w): float(r["score"]) for w, r in zip(wheres, results, strict=True)}
    tasks = sorted({k[0] for k in scores})
    per_task = {t: 100.0 * f for t, f in _task_fractions(scores, tasks).items()}

    def mean(field: str) -> float:
        return float(np.mean([r["storage"][field] or 0 for r in results]))

    summary: dict[str, Any] = {
        "method": name,
        "accuracy": task_mean_accuracy(scores, tasks),
        "tasks": per_task,
        "samples": len(scores),
        "kv_bytes": mean("kv_bytes"),
        "kv_bytes_16bit": mean("kv_bytes_16bit"),
        "held_bytes": mean("held_bytes"),
        "compress_seconds": float(sum(r["compress_seconds"] for r in results)),
        "answer_seconds": float(sum(r["answer_seconds"] for r in results)),
        "replayed": sum(bool(r["replayed"]) for r in results),
    }
    if reference_bytes:
        summary["fraction_of_full"] = summary["kv_bytes"] / reference_bytes
    if reference_bytes_16bit:
        summary["fraction_of_full_16bit"] = summary["kv_bytes_16bit"] / reference_bytes_16bit
    kinds = _layer_kinds(results, reference_kinds)
    if kinds:
        summary["kv_bytes_by_layer_kind"] = kinds
    if reference is not None:
        delta, low, high = paired_bootstrap(scores, reference)
        summary["delta_vs_full"] = delta
        single = min(sum(1 for k in scores if k[0] == t) for t in tasks) < 2
        summary["delta_ci95"] = None if single else [low, high]
    summary["scores"] = {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in sorted(scores.items())}
    return summary


def _layer_kinds(
    results: Sequence[Mapping[str, Any]], reference: Mapping[str, Mapping[str, float]] | None
) -> dict[str, dict[str, float]]:
    """Per layer kind: layer count, mean stored and 16-bit bytes after compression, and the
    16-bit fraction of ``reference``'s bytes of that kind; ``{}`` when not measured."""
    kinds = [r["storage"].get("layer_kinds") for r in results]
    if not kinds or any(k is None for k in kinds):
        return {}
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({k for entry in kinds for k in entry}):
        rows = [entry.get(kind, {}) for entry in kinds]
        item: dict[str, float] = {
            "layers": max(int(r.get("layers", 0)) for r in rows),
            "kv_bytes": float(np.mean([r.get("kv_bytes", 0) for r in rows])),
            "kv_bytes_16bit": float(np.mean([r.get("kv_bytes_16bit", 0) for r in rows])),
        }
        ref16 = (reference or {}).get(kind, {}).get("kv_bytes_16bit")
        item["fraction_of_full"] = item["kv_bytes_16bit"] / ref16 if ref16 else float("nan")
        out[kind] = item
    return out


def ruler_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: one row per method, accuracy per task (%), the task mean, its
    paired difference to ``full`` with the 95 % bootstrap interval, KV bytes after compression
    and their fraction of ``full``'s (as stored, and with floats at 16 bits)."""
    from kvlab.evaluation.table import format_bytes, markdown_table

    tasks = sorted({t for s in summaries for t in s["tasks"]})
    headers = [
        "method",
        *tasks,
        "mean",
        "Δ vs full [95% CI]",
        "KV bytes",
        "× full",
        "× full (16-bit)",
    ]
    rows = []
    for s in summaries:
        delta = "—"
        if "delta_vs_full" in s and s["method"] != "full":
            interval = s["delta_ci95"]
            spread = f"[{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else "[n = 1]"
            delta = f"{s['delta_vs_full']:+.1f} {spread}"
        rows.append(
            [
                s["method"],
                *[f"{s['tasks'][t]:.1f}" if t in s["tasks"] else "" for t in tasks],
                f"{s['accuracy']:.1f}",
                delta,
                format_bytes(s["kv_bytes"]),
                f"{s.get('fraction_of_full', float('nan')):.3f}",
                f"{s.get('fraction_of_full_16bit', float('nan')):.3f}",
            ]
        )
    table = markdown_table(headers, rows)
    if any("sliding_window" in s.get("kv_bytes_by_layer_kind", {}) for s in summaries):
        from kvlab.evaluation.table import layer_kind_note

        table += layer_kind_note(summaries)
    if any(s.get("delta_ci95", 0) is None for s in summaries):
        table += "\nOne sample per task: no bootstrap interval (`[n = 1]`).\n"
    return table


def plot_ruler_heatmap(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Method × task accuracy heatmap (colour 0–100 %, cells annotated), the task mean last.

    Returns:
        ``path`` (parents created).
    """
    from kvlab.evaluation.plot import pyplot, save_figure

    plt = pyplot()
    tasks = sorted({t for s in summaries for t in s["tasks"]})
    grid = [[s["tasks"].get(t, np.nan) for t in tasks] + [s["accuracy"]] for s in summaries]
    fig, ax = plt.subplots(figsize=(0.75 * len(tasks) + 3.5, 0.42 * len(summaries) + 1.8), dpi=120)
    image = ax.imshow(grid, vmin=0.0, vmax=100.0, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(tasks) + 1), [*tasks, "mean"], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(summaries)), [s["method"] for s in summaries], fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8, label="accuracy (%)")
    return save_figure(fig, path)


def plot_accuracy_vs_bytes(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Task-mean accuracy (%) against KV bytes after compression (fraction of ``full``, as
    stored), one labelled point per method.

    Returns:
        ``path`` (parents created).
    """
    from kvlab.evaluation.plot import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for s in summaries:
        x = s.get("fraction_of_full", np.nan)
        ax.scatter([x], [s["accuracy"]], s=18)
        ax.annotate(
            s["method"], (x, s["accuracy"]), fontsize=6, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_xlabel("KV bytes after compression (fraction of full)")
    ax.set_ylabel("RULER accuracy, task mean (%)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
