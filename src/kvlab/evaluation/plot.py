"""PNG plots of ``kvlab eval`` results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_kl_vs_bytes", "plot_stream"]

_FAMILY_STYLE = {
    "full": ("black", "s"),
    "quantized": ("tab:blue", "o"),
    "hf-quantized": ("tab:orange", "D"),
    "eviction": ("tab:green", "^"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_kl_vs_bytes(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Mean KL(full || method) (nats, log scale) against KV bytes normalized to 16-bit floats,
    one point per method (marker by family, colour per method, named in the legend); the full
    cache (KL 0) is a dashed vertical line.

    Returns:
        ``path`` (parents created).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120)
    colors = plt.get_cmap("tab20").colors
    for i, s in enumerate(summaries):
        kib = s["kv_bytes_16bit"] / 1024
        if s["family"] == "full" or s["kl_mean"] <= 0:
            ax.axvline(
                kib, color="black", linestyle="--", linewidth=1, label=f"{s['method']} (KL 0)"
            )
            continue
        _, marker = _FAMILY_STYLE.get(s["family"], ("gray", "o"))
        ax.scatter(
            [kib],
            [s["kl_mean"]],
            color=colors[i % len(colors)],
            marker=marker,
            s=44,
            zorder=3,
            edgecolors="black",
            linewidths=0.4,
            label=s["method"],
        )
    ax.set_yscale("log")
    ax.set_xlabel("KV cache bytes at the end of scoring, normalized to 16-bit floats (KiB)")
    ax.set_ylabel("mean KL(full ‖ method) per scored token (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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
    plt = _pyplot()
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
