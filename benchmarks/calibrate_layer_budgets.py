"""Per-layer eviction budgets for SmolLM2-135M, calibrated on the package's own King James text.

Measures :func:`kvlab.integrations.relay_calibration.calibrate_layer_budgets` for the default
SnapKV policy (``kvlab.relay.policies.default_policy("snapkv")``, no relay) at 50 % eviction and
writes the chosen per-layer kept fractions and the sensitivities as JSON; pass the fractions to
``benchmarks/eviction_vs_kvpress.py kvlab --policy 'NAME={"ratio":0.5,"layer_budget":[...]}'``.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_layer_budgets.py --out calibration.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.integrations.relay_calibration import calibrate_layer_budgets
from kvlab.models import load_model
from kvlab.relay.policies import default_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--score", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    config = EvictionConfig(ratio=args.ratio, relay=False, **default_policy("snapkv"))
    result = calibrate_layer_budgets(
        loaded.model, loaded.tokenizer, config, prefill=args.prefill, score=args.score
    )
    settings = result.settings()
    print("layer_fractions", json.dumps(settings["layer_fractions"]))
    print(f"calibration took {result.seconds:.0f} s")
    Path(args.out).write_text(json.dumps(settings, indent=1))


if __name__ == "__main__":
    main()
