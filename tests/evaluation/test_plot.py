"""kvlab.evaluation.plot: the Pareto front's invariants, and the two KL-vs-bytes plots writing
a PNG (one drawing routine, with and without the front)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvlab.evaluation.plot import pareto_front, plot_kl_vs_bytes, plot_pareto


def _dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


@given(
    st.lists(
        st.tuples(st.integers(1, 20).map(float), st.integers(1, 20).map(float)),
        min_size=1,
        max_size=12,
    )
)
def test_pareto_front_is_exactly_the_undominated_points(points: list[tuple[float, float]]):
    front = pareto_front(points)
    assert front == sorted(front, key=lambda i: points[i])
    on = set(front)
    for i, p in enumerate(points):
        dominated = any(_dominates(q, p) for j, q in enumerate(points) if j != i)
        assert (i in on) == (not dominated)


def test_both_plots_write_a_png(tmp_path: Path) -> None:
    rows = [
        {"method": "full", "family": "full", "kv_bytes_16bit": 4096, "kl_mean": 0.0},
        {"method": "kivi-2bit", "family": "quantized", "kv_bytes_16bit": 1024, "kl_mean": 0.1},
        {"method": "snapkv@0.5", "family": "eviction", "kv_bytes_16bit": 2048, "kl_mean": 0.01},
    ]
    for plot in (plot_kl_vs_bytes, plot_pareto):
        path = plot(rows, tmp_path / "sub" / f"{plot.__name__}.png", "title")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
