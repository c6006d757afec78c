"""Running a registered diagnostic over seeds and writing its raw result and artifact."""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvlab.artifacts import build_metric_artifact, provenance_block, write_json_atomic
from kvlab.artifacts.provenance import source_root
from kvlab.device import accelerator_info
from kvlab.diagnostics.paper import Paper, PaperRun, RunContext

__all__ = [
    "COMMON_RUNNER_MODULES",
    "display_path",
    "module_paths",
    "render_metrics_table",
    "run_paper",
    "seeds_label",
]

COMMON_RUNNER_MODULES: tuple[str, ...] = (
    "kvlab.cli",
    "kvlab.data",
    "kvlab.device",
    "kvlab.diagnostics.paper",
    "kvlab.diagnostics.registry",
    "kvlab.diagnostics.runner",
    "kvlab.artifacts.aggregate",
    "kvlab.artifacts.builders",
    "kvlab.artifacts.io",
    "kvlab.artifacts.provenance",
    "kvlab.artifacts.schemas",
)
"""Modules that shape every artifact (command line, aggregation, provenance, schemas); their
sources are hashed into every run's ``runner_sha256`` besides the paper's own runner."""


def module_paths(modules: Sequence[str]) -> list[str]:
    """POSIX paths, relative to the source root, of the given modules' source files."""
    root = source_root()
    paths = []
    for name in modules:
        file = Path(importlib.import_module(name).__file__ or "").resolve()
        paths.append(file.relative_to(root).as_posix())
    return paths


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute; POSIX."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.as_posix()


def seeds_label(seeds: Sequence[int]) -> str:
    """``seeds42-44`` for a contiguous run, ``seeds1_5_9`` otherwise, ``seed42`` for one."""
    if len(seeds) == 1:
        return f"seed{seeds[0]}"
    if list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds{seeds[0]}-{seeds[-1]}"
    return "seeds" + "_".join(str(s) for s in seeds)


def run_paper(paper: Paper, context: RunContext, console: Console | None = None) -> PaperRun:
    """Run ``paper`` for every seed of ``context`` and write two files under
    ``context.output_dir``: ``raw-<device>-<seeds>.json`` (each seed's full result) and
    ``metrics-<device>-<seeds>.json`` (the metric artifact v2). Then the paper's ``finalize``
    hook runs (e.g. the accelerator validation record).

    Returns:
        The :class:`PaperRun` with results, artifact and paths.
    """
    console = console or Console()
    results = []
    for seed in context.seeds:
        console.print(f"[bold]{paper.key}[/] seed {seed} on {context.device} …")
        results.append(paper.run_seed(context, seed))
    dataset, data_sha256 = paper.dataset(context, results)
    label = f"{context.device.type}-{seeds_label(context.seeds)}"
    out = context.output_dir
    raw_path = out / f"raw-{label}.json"
    artifact_path = out / f"metrics-{label}.json"
    accelerator = accelerator_info(context.device)
    raw = {
        "paper": paper.key,
        "seeds": context.seeds,
        "device": context.device.type,
        "accelerator": accelerator.label,
        "budget": context.budget,
        "configuration": dict(paper.configuration),
        "command_argv": context.argv,
        "results": [
            {"seed": seed, "metrics": r.metrics, "data_sha256": r.data_sha256, **r.details}
            for seed, r in zip(context.seeds, results, strict=True)
        ],
    }
    write_json_atomic(raw_path, raw)
    provenance = provenance_block(
        artifact_path=display_path(artifact_path),
        raw_result_path=display_path(raw_path),
        implementation_files=module_paths(paper.implementation_modules),
        runner_files=module_paths(paper.runner_modules + COMMON_RUNNER_MODULES),
        argv=context.argv,
        accelerator=accelerator.label,
        checkpoint=dataset.get("checkpoint"),
        data_sha256=data_sha256,
    )
    artifact = build_metric_artifact(
        method=paper.key,
        manifest_ref=paper.manifest_ref,
        seeds=context.seeds,
        per_seed=[r.metrics for r in results],
        configuration=paper.configuration,
        tier=paper.tier,
        claim_policy=paper.claim_policy,
        dataset=dataset,
        provenance=provenance,
        baselines_compared=paper.baselines_compared,
        implementation_status=paper.implementation_status,
        diagnostic_only=paper.diagnostic_only,
    )
    write_json_atomic(artifact_path, artifact)
    run = PaperRun(paper, context, results, artifact, artifact_path, raw_path)
    if paper.finalize is not None:
        run.extra_paths.extend(paper.finalize(run))
    console.print(render_metrics_table(paper.key, artifact["metrics"]))
    console.print(f"raw result: {display_path(raw_path)}")
    console.print(f"artifact:   {display_path(artifact_path)}")
    for extra in run.extra_paths:
        console.print(f"also wrote: {display_path(extra)}")
    return run


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def render_metrics_table(title: str, metrics: dict[str, Any]) -> Table:
    """A rich table of an artifact's ``metrics`` block (mean ± std over n seeds)."""
    table = Table(title=f"{title} metrics", title_justify="left")
    table.add_column("metric")
    table.add_column("mean / value", justify="right")
    table.add_column("std", justify="right")
    table.add_column("n", justify="right")
    for name, value in metrics.items():
        if isinstance(value, dict):
            table.add_row(name, _fmt(value["mean"]), _fmt(value["std"]), str(value["n"]))
        else:
            table.add_row(name, _fmt(value), "", "")
    return table


def default_output_dir(paper_key: str, base: str | os.PathLike[str] | None) -> Path:
    """``<base>/<paper_key>`` (base defaults to ``runs``)."""
    return Path(base or "runs") / paper_key
