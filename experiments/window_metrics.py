"""Per-window figures of a finished prefill-score ``kvlab eval`` run (its task store), which
the table averages over windows: window index, start token, method, ΔPPL %, KL mean and p95.

    PYTHONPATH=src python experiments/window_metrics.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlab.evaluation.report import window_metrics, window_score


def main() -> None:
    tasks = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1], "tasks").glob("*.json"))]
    by_key = {t["key"]: t for t in tasks}
    rows = []
    for t in tasks:
        task = t["task"]
        if task.get("protocol") != "prefill-score" or task.get("reference") is None:
            continue
        ref = by_key[task["reference"]]
        m = window_metrics(window_score(t["result"]), window_score(ref["result"]))
        w = task["where"]
        rows.append((w["window"], w["start"], task["method"], m))
    for window, start, method, m in sorted(rows, key=lambda r: (r[0], r[2])):
        print(
            f"window {window} (start {start}) {method:14s} ΔPPL {m['delta_ppl_pct']:+.3f} %"
            f"  KL mean {m['kl_mean']:.5f}  p95 {m['kl_p95']:.5f}  "
            f"KV 16-bit {m['kv_bytes_16bit']}"
        )


if __name__ == "__main__":
    main()
