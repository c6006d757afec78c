"""PNG plots of ``kvlab eval`` results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "pareto_front",
    "plot_kl_vs_bytes",
    "plot_needle_heatmap",
    "plot_pareto",
    "plot_stream",
    "pyplot",
]

_FAMILY_STYLE = {
    "full": ("black", "s"),
    "quantized": ("tab:blue", "o"),
    "hf-quantized": ("tab:orange", "D"),
    "eviction": ("tab:green", "^"),
    "composed": ("tab:purple", "P"),
}


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, bbox_tight: bool = True) -> Path:
    """Write ``fig`` to ``path`` (parents created; ``bbox_tight``: cropped to what is drawn,
    legends outside the axes included) and close it.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if bbox_tight:
        fig.savefig(path, bbox_inches="tight")
    else:
        fig.savefig(path)
    pyplot().close(fig)
    return path


def plot_kl_vs_bytes(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Mean KL(full || method) (nats, log scale) against KV bytes normalized to 16-bit floats,
    one point per method (marker by family, colour per method, named in the legend); the full
    cache (KL 0) is a dashed vertical line.

    Returns:
        ``path`` (parents created).
    """
    return _plot_kl_bytes(summaries, path, title, pareto=False)


def plot_stream(
    segments: Mapping[str, Sequence[tuple[int, float]]],
    context: int,
    path: Path,
    title: str,
) -> Path:
    """Perplexity per stream segment (x: segment end, tokens) for each method, with the model's
    trained context as a vertical line.

    Args:
        segments: method -> list of ``(segment_end_token, perplexity)``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name, points in segments.items():
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.axvline(context, color="black", linestyle="--", linewidth=1)
    ax.annotate(
        f"trained context {context}",
        (context, 1),
        xycoords=("data", "axes fraction"),
        xytext=(4, -12),
        textcoords="offset points",
        fontsize=8,
    )
    ax.set_yscale("log")
    ax.set_xlabel("stream position (tokens, segment end)")
    ax.set_ylabel("perplexity of the segment")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, bbox_tight=False)


def plot_needle_heatmap(
    summaries: Sequence[Mapping[str, Any]],
    lengths: Sequence[int],
    depths: Sequence[float],
    path: Path,
    title: str,
) -> Path:
    """Needle accuracy heatmaps, one panel per method: x needle depth (% of the filler),
    y prompt length (tokens), colour the exact-match accuracy (0–1), each cell annotated
    ``correct/trials``.

    Returns:
        ``path`` (parents created).
    """
    plt = pyplot()
    n = len(summaries)
    fig, axes = plt.subplots(
        1, n, figsize=(3.2 * n + 1.2, 0.55 * len(lengths) + 2.2), dpi=120, squeeze=False
    )
    image = None
    for k, (ax, s) in enumerate(zip(axes[0], summaries, strict=True)):
        cells = {(c["length"], c["depth"]): c for c in s["cells"]}
        grid = [[cells[(length, d)]["accuracy"] for d in depths] for length in lengths]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for i, length in enumerate(lengths):
            for j, d in enumerate(depths):
                c = cells[(length, d)]
                ax.text(j, i, f"{c['correct']}/{c['trials']}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(length) for length in lengths])
        ax.tick_params(labelleft=k == 0)
        ax.set_xlabel("needle depth (% of filler)")
        ax.set_title(f"{s['method']} ({s['accuracy']:.0%})", fontsize=9)
    axes[0][0].set_ylabel("prompt length (tokens)")
    fig.suptitle(title, fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="exact-match accuracy")
    return save_figure(fig, path)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (lower or equal in both coordinates
    and lower in one), sorted by the first coordinate."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox <= x and oy <= y) and (ox < x or oy < y)
            for j, (ox, oy) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_pareto(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """:func:`plot_kl_vs_bytes` with the Pareto front (fewest bytes for a given KL) as a line.

    Returns:
        ``path`` (parents created).
    """
    return _plot_kl_bytes(summaries, path, title, pareto=True)


def _plot_kl_bytes(
    summaries: Sequence[Mapping[str, Any]], path: Path, title: str, *, pareto: bool
) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120)
    colors = plt.get_cmap("tab20").colors
    rows = [s for s in summaries if s["family"] != "full" and s["kl_mean"] > 0]
    for s in summaries:
        if s not in rows:
            ax.axvline(
                s["kv_bytes_16bit"] / 1024,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"{s['method']} (KL 0)",
            )
    points = [(s["kv_bytes_16bit"] / 1024, s["kl_mean"]) for s in rows]
    for i, s in enumerate(rows):
        _, marker = _FAMILY_STYLE.get(s["family"], ("gray", "o"))
        ax.scatter(
            [points[i][0]],
            [points[i][1]],
            color=colors[i % len(colors)],
            marker=marker,
            s=44,
            zorder=3,
            edgecolors="black",
            linewidths=0.4,
            label=s["method"],
        )
    front = pareto_front(points) if pareto else []
    if front:
        ax.step(
            [points[i][0] for i in front],
            [points[i][1] for i in front],
            where="post",
            color="gray",
            linewidth=1,
            zorder=2,
            label="Pareto front",
        )
    ax.set_yscale("log")
    ax.set_xlabel("KV cache bytes at the end of scoring, normalized to 16-bit floats (KiB)")
    ax.set_ylabel("mean KL(full ‖ method) per scored token (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return save_figure(fig, path, bbox_tight=False)
