"""RULER side by side: one paired accuracy table from kvlab's RULER rows and the kvpress side's
JSON (benchmarks/kvpress/ruler_kvpress.py), after checking both ran the same token ids.

Runs in kvlab's venv (or any Python with torch; it imports kvlab only for ``--diff`` and
``--plot``)::

    python benchmarks/kvpress/ruler_side_by_side.py --samples ruler.jsonl \\
        --kvpress runs/ruler/kvpress.json --kvlab runs/ruler/kvlab.json [--json table.json] \\
        [--plot frontier.png]

Inputs:

* ``--samples``: the samples JSONL both sides ran (the format of
  benchmarks/kvpress/ruler_kvpress.py). Each sample's digest
  (:func:`ruler_kvpress.sample_ids_sha256`, the sha256 of its ``[context_ids, question_ids,
  outputs]`` in canonical JSON) is recomputed from it.
* ``--kvpress`` (optional, repeatable: e.g. one file per process): the kvpress side's JSON
  (``rows`` with ``ids_sha256``); without it, a table of kvlab rows alone.
* ``--kvlab`` (optional, repeatable): kvlab's RULER results — a JSON list of rows, an object
  with ``rows``, or a JSONL of rows. A row needs ``task``, ``length``, ``index``, ``method``
  and ``score`` (or ``prediction``, then scored here with the sample's metric); ``ratio`` is
  optional. Its ids are checked by a per-row ``ids_sha256`` or, failing that, a file-level
  ``samples_digest`` (top level or under ``provenance``) equal to the digest of the samples
  the file's rows name, in ``--samples`` order.

A method in several files (``full``, which every kvlab RULER run includes, or a press split
over processes) is merged: where two
files hold the same sample they must give the same score and prediction.

Any row whose digest differs from its sample's is refused (the tools fed different tokens);
rows naming a (task, length, index) absent from ``--samples`` are refused too.

Pairing: only samples (task, length, index) that EVERY listed method has are scored, so each
column compares the methods on the same samples; the count is printed. Accuracy per task is the
mean score over its paired samples (x100); ``mean`` is the mean over tasks (RULER's average).
``--diff A B`` (repeatable; labels as the table prints them) adds the paired difference of row
``A``'s mean minus row ``B``'s on the paired samples with its 95 % percentile-bootstrap interval
— kvlab's :func:`kvlab.evaluation.ruler_report.paired_bootstrap`, the interval of kvlab's own
RULER table, so ``--diff`` needs kvlab importable (its venv) — and the number of those samples
where the two rows' decoded answers are the same text.

``kv/full`` is the mean over paired samples of a row's ``cache_bytes_16bit_effective`` (else
``cache_bytes_16bit``) over the no-press row's, where both carry it: the fraction of the
cache's entries kept, at 16 bits (a quantized cache: its real bits over 16). For masked
presses (KVzip) the memory actually held stays the full cache's (``cache_bytes``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _kvpress_module() -> Any:
    spec = importlib.util.spec_from_file_location("ruler_kvpress", _HERE / "ruler_kvpress.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ruler_kvpress", module)
    spec.loader.exec_module(module)
    return module


rk = _kvpress_module()

Key = tuple[str, int, int]


def load_rows(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """(rows, file-level samples digest or None) of a results file (module docstring).

    Raises:
        SystemExit: unreadable JSON or no rows.
    """
    text = path.read_text()
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}: neither JSON nor JSONL ({err})") from None
    digest = None
    if isinstance(data, dict):
        digest = data.get("samples_digest") or data.get("provenance", {}).get("samples_digest")
        data = data.get("rows")
    if not isinstance(data, list) or not data:
        raise SystemExit(f"{path}: no rows")
    return data, digest


def method_label(row: dict[str, Any], side: str) -> str:
    ratio = row.get("ratio")
    name = str(row["method"])
    if ratio not in (None, 0, 0.0) and "@" not in name:
        name = f"{name}@{float(ratio):g}"
    return f"{side}:{name}" if not name.startswith(f"{side}:") else name


def check_and_index(
    rows: list[dict[str, Any]],
    file_digest: str | None,
    side: str,
    samples: dict[Key, dict[str, Any]],
    order: list[Key],
    path: Path,
) -> dict[str, dict[Key, dict[str, Any]]]:
    """``{method label: {sample key: row}}`` after the id checks (module docstring).

    Raises:
        SystemExit: a row for an unknown sample, a digest mismatch, no way to check the ids,
            or a (method, sample) given twice.
    """
    out: dict[str, dict[Key, dict[str, Any]]] = defaultdict(dict)
    named: set[Key] = set()
    for row in rows:
        key = (str(row["task"]), int(row["length"]), int(row["index"]))
        if key not in samples:
            raise SystemExit(f"{path}: row for sample {key}, which --samples does not hold")
        sample = samples[key]
        if "ids_sha256" in row:
            if row["ids_sha256"] != sample["ids_sha256"]:
                raise SystemExit(f"{path}: sample {key} ran other token ids than --samples")
        elif file_digest is None:
            raise SystemExit(f"{path}: rows carry no ids_sha256 and the file no samples_digest")
        if "score" not in row:
            row = {
                **row,
                "score": rk.ruler_score(row["prediction"], sample["outputs"], sample["metric"]),
            }
        label = method_label(row, side)
        if key in out[label]:
            raise SystemExit(f"{path}: {label} has sample {key} twice")
        out[label][key] = row
        named.add(key)
    if file_digest is not None and not all("ids_sha256" in r for r in rows):
        held = [samples[k] for k in order if k in named]
        if rk.samples_digest(held) != file_digest:
            raise SystemExit(f"{path}: samples_digest differs from --samples' (other token ids)")
    return dict(out)


def _kv16(row: dict[str, Any]) -> Any:
    """The row's 16-bit cache bytes, the unmasked entries' where the press masks (KVzip)."""
    return row.get("cache_bytes_16bit_effective", row.get("cache_bytes_16bit"))


def paired_table(
    methods: dict[str, dict[Key, dict[str, Any]]], samples: dict[Key, dict[str, Any]]
) -> dict[str, Any]:
    """Per-task accuracy (x100) of every method on the samples all methods share."""
    shared = set(samples)
    for rows in methods.values():
        shared &= set(rows)
    tasks = sorted({k[0] for k in shared})
    full = next((m for m in methods if m.endswith(":full")), None)
    table: dict[str, Any] = {
        "paired_samples": len(shared),
        "samples": sorted(shared),
        "tasks": tasks,
        "rows": {},
    }
    for label, rows in methods.items():
        per_task = {}
        for task in tasks:
            keys = [k for k in shared if k[0] == task]
            per_task[task] = 100.0 * sum(float(rows[k]["score"]) for k in keys) / len(keys)
        entry: dict[str, Any] = {
            "per_task": per_task,
            "mean": sum(per_task.values()) / len(per_task) if per_task else float("nan"),
        }
        if full is not None and shared:
            fracs = [
                _kv16(rows[k]) / _kv16(methods[full][k])
                for k in shared
                if _kv16(rows[k]) is not None and _kv16(methods[full][k])
            ]
            if len(fracs) == len(shared):
                entry["kv_over_full"] = sum(fracs) / len(fracs)
        table["rows"][label] = entry
    return table


def paired_differences(
    methods: dict[str, dict[Key, dict[str, Any]]],
    shared: Sequence[Key],
    diffs: Sequence[Sequence[str]],
) -> list[dict[str, Any]]:
    """``A − B`` in accuracy points for each pair of row labels over the ``shared`` samples,
    with the paired bootstrap interval (module docstring).

    Raises:
        SystemExit: a label that is no row of the table, or no shared sample.
    """
    from kvlab.evaluation.ruler_report import paired_bootstrap

    if diffs and not shared:
        raise SystemExit("--diff: the rows share no sample")
    out = []
    for a, b in diffs:
        for label in (a, b):
            if label not in methods:
                raise SystemExit(f"--diff: no row {label!r}; rows: {', '.join(methods)}")
        score = {m: {k: float(methods[m][k]["score"]) for k in shared} for m in (a, b)}
        delta, low, high = paired_bootstrap(score[a], score[b])
        texts = [(methods[a][k].get("prediction"), methods[b][k].get("prediction")) for k in shared]
        same = sum(x is not None and x == y for x, y in texts)
        out.append(
            {"a": a, "b": b, "delta": delta, "low": low, "high": high, "same_prediction": same}
        )
    return out


def render(table: dict[str, Any]) -> str:
    tasks = table["tasks"]
    head = "| method | " + " | ".join(tasks) + " | mean | kv/full |"
    lines = [head, "|---|" + "---:|" * (len(tasks) + 2)]
    # the no-press rows first, then by size (largest first), then by name
    order = sorted(
        table["rows"].items(),
        key=lambda item: (
            not item[0].endswith(":full"),
            -item[1].get("kv_over_full", 0.0),
            item[0],
        ),
    )
    for label, entry in order:
        cells = [f"{entry['per_task'][t]:.1f}" for t in tasks]
        kv = f"{entry['kv_over_full']:.3f}" if "kv_over_full" in entry else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {entry['mean']:.1f} | {kv} |")
    return "\n".join(lines)


def merge_repeated(
    held: dict[Key, dict[str, Any]], more: dict[Key, dict[str, Any]], label: str, path: Path
) -> None:
    """Add ``more``'s samples of method ``label`` to ``held`` (the same method from another
    run, e.g. ``full``, which every kvlab RULER run includes). Where both hold a sample they must
    agree on its score and, when both carry it, its prediction.

    Raises:
        SystemExit: the two runs disagree on a shared sample.
    """
    for key, row in more.items():
        if key in held:
            old = held[key]
            same = old["score"] == row["score"] and (
                "prediction" not in old
                or "prediction" not in row
                or old["prediction"] == row["prediction"]
            )
            if not same:
                raise SystemExit(
                    f"{path}: {label} on sample {key} differs from another file's "
                    f"({row.get('prediction')!r} vs {old.get('prediction')!r})"
                )
        else:
            held[key] = row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples", required=True)
    parser.add_argument(
        "--kvpress",
        action="append",
        default=[],
        help="benchmarks/kvpress/ruler_kvpress.py's JSON (repeatable: one file per process; "
        "optional: kvlab rows alone)",
    )
    parser.add_argument("--kvlab", action="append", default=[], help="kvlab RULER rows")
    parser.add_argument(
        "--diff",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="also print row A minus row B, paired, with its bootstrap interval (repeatable)",
    )
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument(
        "--title",
        help="the plot's title (default: RULER, the paired count, the samples' file name)",
    )
    parser.add_argument(
        "--plot",
        help="also draw accuracy against kv/full here (PNG): kvlab's and kvpress's rows, the "
        "kvlab rows' Pareto front (needs kvlab's venv: matplotlib)",
    )
    args = parser.parse_args(argv)
    listed = rk.read_samples(Path(args.samples))
    order = [(s["task"], int(s["length"]), int(s["index"])) for s in listed]
    samples = dict(zip(order, listed, strict=True))
    methods: dict[str, dict[Key, dict[str, Any]]] = {}
    inputs = [(Path(p), "kvpress") for p in args.kvpress]
    inputs += [(Path(p), "kvlab") for p in args.kvlab]
    if not inputs:
        raise SystemExit("give --kvpress and/or --kvlab rows")
    for path, side in inputs:
        rows, digest = load_rows(path)
        for label, by_key in check_and_index(rows, digest, side, samples, order, path).items():
            if label in methods:
                merge_repeated(methods[label], by_key, label, path)
            else:
                methods[label] = by_key
    table = paired_table(methods, samples)
    shared = table["samples"]
    table["differences"] = paired_differences(methods, shared, args.diff)
    print(f"token ids identical to {args.samples} in every row ({len(methods)} methods)")
    print(f"paired samples (held by every method): {table['paired_samples']}\n")
    print(render(table))
    for d in table["differences"]:
        print(
            f"{d['a']} − {d['b']}: {d['delta']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]; "
            f"the same answer text on {d['same_prediction']} of {len(shared)} samples"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    if args.plot:
        title = args.title or (
            f"RULER, {table['paired_samples']} paired samples ({Path(args.samples).name})"
        )
        print(f"plot: {plot_frontier(table, Path(args.plot), title)}")


def plot_frontier(table: dict[str, Any], path: Path, title: str) -> Path:
    """Task-mean accuracy (%) against ``kv/full`` for every row of ``table`` with a
    ``kv_over_full``: kvlab's rows as circles, kvpress's as triangles, each point its own colour
    and numbered, a legend outside the axes naming each number's row with its accuracy and size
    (labels beside the points overlap where rows sit close), and the kvlab rows' Pareto front
    (the best accuracy at or below each size) as a step line. Returns ``path`` (parents
    created)."""
    from kvlab.evaluation.plot import pareto_front, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=120)
    points = sorted(
        (
            (label, row["kv_over_full"], row["mean"])
            for label, row in table["rows"].items()
            if row.get("kv_over_full") is not None
        ),
        key=lambda p: (-p[2], p[1], p[0]),
    )
    colours = plt.get_cmap("tab20").colors
    for number, (label, x, y) in enumerate(points, start=1):
        marker = "^" if label.startswith("kvpress:") else "o"
        ax.scatter([x], [y], marker=marker, s=26, color=colours[(number - 1) % len(colours)],
                   label=f"{number}. {label}: {y:.1f} at {x:.3f}", zorder=3)  # fmt: skip
        below = (3, -8) if marker == "^" else (3, 2)  # kvpress's numbers under their points
        ax.annotate(str(number), (x, y), fontsize=6, xytext=below, textcoords="offset points")
    ours = [(x, -y) for label, x, y in points if label.startswith("kvlab:")]  # fewer bytes, more %
    front = [(ours[i][0], -ours[i][1]) for i in pareto_front(ours)]
    if len(front) > 1:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", alpha=0.4)
    ax.set_xlabel("kv/full (cache entries kept, at 16 bits)")
    ax.set_ylabel("RULER accuracy, task mean (%)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                  title="kvlab ●  kvpress ▲  (accuracy at kv/full)", title_fontsize=6)  # fmt: skip
    ax.set_title(title, fontsize=8)
    return save_figure(fig, path)


if __name__ == "__main__":
    main()
