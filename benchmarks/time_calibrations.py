"""Wall time of the per-layer calibrations, run as ``kvlab eval``'s preparations run them.

Each ``METHOD`` (e.g. ``kivi-2bit-calibrated``, ``relay:snapkv@0.5``) runs its preparation
(:data:`kvlab.evaluation.methods.PREPARATIONS`, no calibration cache) and prints the time at
every decoder layer — the first layer's measurements are full forwards, as every layer's were
before the one-forward capture (:mod:`kvlab.integrations.calibration_capture`), so ``L`` times
the first layer's time estimates the former cost — then the total and the load average.
``ratios=R1,R2`` measures SnapKV layer budgets at several ratios at once
(:func:`kvlab.integrations.relay_calibration.calibrate_layer_budgets_for_ratios`). The
prepared settings go to ``--out`` as JSON (``{method: settings}``).

    OMP_NUM_THREADS=1 python benchmarks/time_calibrations.py --model smollm2-135m \\
        --out times.json kivi-2bit-calibrated 'relay:snapkv@0.5625' 'ratios=0.5,0.5625'
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvlab.evaluation.methods import PREPARATIONS, parse_method
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.integrations.relay_calibration import calibrate_layer_budgets_for_ratios
from kvlab.models import load_model
from kvlab.relay.policies import default_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="+", metavar="METHOD")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    out = {}
    for name in args.methods:
        began = time.perf_counter()

        def progress(done: int, total: int, name: str = name, began: float = began) -> None:
            print(f"  {name} layer {done}/{total} at {time.perf_counter() - began:.1f} s")

        if name.startswith("ratios="):
            ratios = [float(r) for r in name.removeprefix("ratios=").split(",")]
            config = EvictionConfig(ratio=ratios[0], relay=False, **default_policy("snapkv"))
            results = calibrate_layer_budgets_for_ratios(
                model, tokenizer, config, ratios, progress=progress
            )
            settings = {str(r): c.settings() for r, c in results.items()}
        else:
            method = parse_method(name)
            if method.preparation is None:
                raise SystemExit(f"{name!r} has no calibration")
            prep = PREPARATIONS[method.preparation]
            settings = prep.run(method.params, model, tokenizer, prep.text(), progress)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"{name}: {time.perf_counter() - began:.1f} s, {torch.get_num_threads()} thread(s), "
            f"load average {load}",
            flush=True,
        )
        out[name] = settings
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
