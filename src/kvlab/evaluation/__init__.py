"""``kvlab eval`` and ``kvlab sweep``: KV-cache methods against the full cache on a pretrained
model and real text, as a plan of independent tasks that an executor runs.

* :mod:`~kvlab.evaluation.methods` — methods as data, and the registry that builds their
  caches (how to add a method: its docstring).
* :mod:`~kvlab.evaluation.plan` — configuration, content-hashed tasks and their dependencies.
* :mod:`~kvlab.evaluation.protocols` / :mod:`~kvlab.evaluation.needle` — one task:
  ``prefill-score``, ``stream``, ``needle``.
* :mod:`~kvlab.evaluation.execute` — per-process runtime, task store (resume), schedule.
* :mod:`~kvlab.evaluation.executors` — ``local`` and ``ray``.
* :mod:`~kvlab.evaluation.calibration` — preparations (calibrations) cached on disk.
* :mod:`~kvlab.evaluation.report` — table, raw JSON, metric artifact, plot.
* :mod:`~kvlab.evaluation.sweep` — ``kvlab sweep FILE.toml``: grids, Pareto plots.
* :mod:`~kvlab.evaluation.metrics`, :mod:`~kvlab.evaluation.table`,
  :mod:`~kvlab.evaluation.plot`, :mod:`~kvlab.evaluation.outputs` — figures and files.
* :mod:`~kvlab.evaluation.harness` — :func:`run_eval`; :mod:`~kvlab.evaluation.command` — the
  typer commands.

Importing this package is cheap: names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DEFAULT_METHODS", "EvalConfig", "EvalOutcome", "Method", "parse_method", "run_eval"]

_WHERE = {
    "DEFAULT_METHODS": "kvlab.evaluation.methods",
    "Method": "kvlab.evaluation.methods",
    "parse_method": "kvlab.evaluation.methods",
    "EvalConfig": "kvlab.evaluation.plan",
    "EvalOutcome": "kvlab.evaluation.report",
    "run_eval": "kvlab.evaluation.harness",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvlab.evaluation' has no attribute {name!r}")
