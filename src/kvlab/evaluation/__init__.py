"""``kvlab eval``: KV-cache methods against the full cache on a pretrained model and real text.

* :mod:`~kvlab.evaluation.methods` — the method registry (``full``, PN-Mix family, peer rows,
  eviction with and without RoPE-Relay).
* :mod:`~kvlab.evaluation.protocols` — ``prefill-score`` and ``stream``.
* :mod:`~kvlab.evaluation.metrics` — NLL, perplexity, KL, storage accounting.
* :mod:`~kvlab.evaluation.harness` — :func:`run_eval`, writing table, artifact, raw JSON, plot.
* :mod:`~kvlab.evaluation.command` — the typer command.
"""

from __future__ import annotations

from kvlab.evaluation.harness import EvalConfig, EvalOutcome, run_eval
from kvlab.evaluation.methods import DEFAULT_METHODS, Method, parse_method

__all__ = ["DEFAULT_METHODS", "EvalConfig", "EvalOutcome", "Method", "parse_method", "run_eval"]
