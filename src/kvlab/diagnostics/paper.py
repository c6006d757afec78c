"""What a registered diagnostic ("paper") declares, and what one run of it produced."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlab.data import TextSource

__all__ = ["Paper", "PaperRun", "RunContext", "SeedResult"]


@dataclass(frozen=True)
class RunContext:
    """Everything a diagnostic needs from the command line.

    Attributes:
        device: where tensors live.
        budget: ``"smoke"`` or ``"standard"``.
        text: the input text, for diagnostics that read one (else ``None``).
        argv: the command as an argv list (recorded in provenance).
        output_dir: folder for this paper's files.
        seeds: the seeds of the run, in order.
    """

    device: torch.device
    budget: str
    text: TextSource | None
    argv: list[str]
    output_dir: Path
    seeds: list[int]


@dataclass(frozen=True)
class SeedResult:
    """One seed's metrics (numbers and computed booleans, in artifact order) and a sha256 of
    the exact input data it consumed."""

    metrics: dict[str, Any]
    data_sha256: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PaperRun:
    """The outcome of running a paper over all seeds: raw results and the written files."""

    paper: Paper
    context: RunContext
    results: list[SeedResult]
    artifact: dict[str, Any]
    artifact_path: Path
    raw_path: Path
    extra_paths: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Paper:
    """A registered diagnostic.

    Attributes:
        key: the ``--paper`` key (e.g. ``"rope-relay"``).
        title: one line for listings.
        manifest_ref, tier, claim_policy, implementation_status, diagnostic_only: artifact
            fields (see the metric artifact schema v2).
        implementation_modules / runner_modules: dotted module names whose source files are
            hashed into provenance.
        configuration: the artifact's ``configuration`` block.
        run_seed: runs one seed.
        dataset: builds the artifact's ``dataset`` block and the content sha256 of the input
            data from the context and the per-seed results.
        baselines_compared: whether each seed's result compares against a baseline.
        uses_text: whether ``--text`` applies.
        min_text_bytes: the least text the diagnostic reads (bytes), checked before running.
        finalize: optional hook after the artifact is written (returns extra files written).
    """

    key: str
    title: str
    manifest_ref: str
    tier: str
    claim_policy: str
    implementation_status: str
    diagnostic_only: bool
    implementation_modules: tuple[str, ...]
    runner_modules: tuple[str, ...]
    configuration: Mapping[str, Any]
    run_seed: Callable[[RunContext, int], SeedResult]
    dataset: Callable[[RunContext, list[SeedResult]], tuple[dict[str, Any], str]]
    baselines_compared: bool = False
    uses_text: bool = False
    min_text_bytes: int = 0
    finalize: Callable[[PaperRun], list[Path]] | None = None
