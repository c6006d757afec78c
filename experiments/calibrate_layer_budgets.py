"""Per-layer eviction budgets for SmolLM2-135M, calibrated on the package's own King James text.

Measures :func:`kvlab.integrations.relay_calibration.calibrate_layer_budgets_for_ratios` for the
default SnapKV policy (``kvlab.relay.policies.default_policy("snapkv")``, no relay) at each
``--ratio`` (default 50 % eviction; several ratios share one measurement) and writes, per ratio,
the chosen per-layer kept fractions and the sensitivities as JSON (``{ratio: settings}``); pass
the fractions to ``benchmarks/kvpress/eviction_vs_kvpress.py kvlab --policy
'NAME={"ratio":0.5,"layer_budget":[...]}'``.

    OMP_NUM_THREADS=1 python experiments/calibrate_layer_budgets.py --out calibration.json \
        --ratio 0.5 --ratio 0.5625
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.integrations.relay_calibration import calibrate_layer_budgets_for_ratios
from kvlab.models import load_model
from kvlab.relay.policies import default_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--score", type=int, default=128)
    parser.add_argument("--ratio", type=float, action="append", help="repeatable; default 0.5")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    ratios = args.ratio or [0.5]
    config = EvictionConfig(ratio=ratios[0], relay=False, **default_policy("snapkv"))
    results = calibrate_layer_budgets_for_ratios(
        loaded.model,
        loaded.tokenizer,
        config,
        ratios,
        prefill=args.prefill,
        score=args.score,
        progress=lambda done, total: print(f"layer {done}/{total}", flush=True),
    )
    settings = {str(ratio): result.settings() for ratio, result in results.items()}
    for ratio, record in settings.items():
        print(f"ratio {ratio} layer_fractions", json.dumps(record["layer_fractions"]))
    print(f"calibration took {next(iter(results.values())).seconds:.0f} s")
    Path(args.out).write_text(json.dumps(settings, indent=1))


if __name__ == "__main__":
    main()
