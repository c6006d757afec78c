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

``--compare`` runs each calibration twice in the same process, first one forward per candidate
(``batch_candidates=False``, the former path) then batched (the default), and prints both times,
whether the float64 sensitivities are identical (else their largest relative difference) and
whether the chosen per-layer values are.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlab.evaluation.methods import PREPARATIONS, parse_method
from kvlab.integrations import pnmix_calibration, relay_calibration
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
    parser.add_argument("--compare", action="store_true", help="former path, then batched")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    out: dict[str, Any] = {}
    for name in args.methods:
        if not args.compare:
            out[name] = _timed(name, model, tokenizer)[0]
        else:
            former, former_sens = _timed(name, model, tokenizer, batch_candidates=False)
            batched, batched_sens = _timed(name, model, tokenizer)
            same = former_sens == batched_sens
            worst = max(
                abs(b[k] - a[k]) / max(abs(a[k]), 1e-300)
                for fa, fb in zip(former_sens, batched_sens, strict=True)
                for a, b in zip(fa, fb, strict=True)
                for k in a
            )
            chosen = {k: v for k, v in former.items() if "layer_" in k} == {
                k: v for k, v in batched.items() if "layer_" in k
            }
            print(
                f"{name}: sensitivities identical: {same} (max relative difference "
                f"{worst:.3g}); chosen per-layer values identical: {chosen}",
                flush=True,
            )
            out[name] = {"former": former, "batched": batched}
        Path(args.out).write_text(json.dumps(out, indent=1))


def _timed(
    name: str, model: Any, tokenizer: Any, **options: Any
) -> tuple[dict[str, Any], list[list[dict[Any, float]]]]:
    """One calibration's settings and its raw sensitivities (one list per measurement)."""
    began = time.perf_counter()
    measured: list[list[dict[Any, float]]] = []
    saved = {}
    for module, attr in (
        (pnmix_calibration, "layer_group_sensitivity"),
        (relay_calibration, "layer_eviction_sensitivity"),
    ):
        original = saved[module, attr] = getattr(module, attr)

        def recording(*a: Any, _f: Callable[..., Any] = original, **k: Any) -> Any:
            result = _f(*a, **k)
            measured.append(result)
            return result

        setattr(module, attr, functools.partial(recording, **options))

    def progress(done: int, total: int) -> None:
        print(f"  {name} layer {done}/{total} at {time.perf_counter() - began:.1f} s")

    try:
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
    finally:
        for (module, attr), original in saved.items():
            setattr(module, attr, original)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    how = "one forward per candidate" if options else "batched"
    print(
        f"{name} ({how}): {time.perf_counter() - began:.1f} s, {torch.get_num_threads()} "
        f"thread(s), load average {load}",
        flush=True,
    )
    return settings, measured


if __name__ == "__main__":
    main()
