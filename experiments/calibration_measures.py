"""How much the scaled calibration measure moves the per-layer choices, against how much the
exact measure itself moves between two windows of the calibration text.

For ``relay:snapkv@R`` (per-layer kept fractions) and ``kivi-2bit-calibrated`` (per-layer PN-Mix
group sizes) this runs three calibrations of each (no calibration cache): the exact measure on
the default window (start 10,000 tokens), the scaled measure (the default,
:func:`kvlab.integrations.calibration_capture.layer_sensitivities`) on the same window, and the
exact measure on a second window (``--other-start``); it prints each one's wall time and
choices, and how many layers' choices differ between exact and scaled, and between the two
exact windows::

    OMP_NUM_THREADS=1 python experiments/calibration_measures.py --model qwen2.5-coder-0.5b \\
        --out measures.json

The JSON (``--out``) holds every calibration's settings (sensitivities included).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.methods.caches import eviction_kwargs, eviction_params, pnmix_config
from kvlab.integrations.pnmix_calibration import CALIBRATION_START, calibrate_group_tokens
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.integrations.relay_calibration import calibrate_layer_budgets
from kvlab.models import load_model


def _calibrate(kind: str, model: Any, tokenizer: Any, start: int, measure: str) -> Any:
    if kind == "kivi-2bit-calibrated":
        config = pnmix_config(parse_method(kind).params)
        return calibrate_group_tokens(
            model,
            tokenizer,
            config,
            budget_group_tokens=config.group_tokens,
            start=start,
            measure=measure,
        )
    params = {**eviction_params(parse_method(kind).params), "relay": False}
    config = EvictionConfig(**eviction_kwargs(params))
    return calibrate_layer_budgets(model, tokenizer, config, start=start, measure=measure)


def _chosen(result: Any) -> list[Any]:
    return list(getattr(result, "layer_group_tokens", None) or result.layer_fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ratio", type=float, default=0.5, help="SnapKV eviction ratio")
    parser.add_argument("--other-start", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    runs = {
        "exact": (CALIBRATION_START, "exact"),
        "scaled": (CALIBRATION_START, "scaled"),
        "exact-other-window": (args.other_start, "exact"),
    }
    out: dict[str, Any] = {}
    for kind in (f"relay:snapkv@{args.ratio}", "kivi-2bit-calibrated"):
        chosen: dict[str, list[Any]] = {}
        out[kind] = {}
        for label, (start, measure) in runs.items():
            began = time.perf_counter()
            result = _calibrate(kind, loaded.model, loaded.tokenizer, start, measure)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            chosen[label] = _chosen(result)
            print(
                f"{kind} {label} (start {result.start}): {time.perf_counter() - began:.1f} s, "
                f"load {load}\n  {chosen[label]}",
                flush=True,
            )
            out[kind][label] = result.settings()
            Path(args.out).write_text(json.dumps(out, indent=1))
        for a, b in (("exact", "scaled"), ("exact", "exact-other-window")):
            pairs = zip(chosen[a], chosen[b], strict=True)
            differ = [i for i, (x, y) in enumerate(pairs) if x != y]
            print(f"{kind}: {a} vs {b}: {len(differ)} of {len(chosen[a])} layers differ {differ}")


if __name__ == "__main__":
    main()
