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
whether the chosen per-layer values are. ``--compare-measures`` runs each calibration with the
exact measure, then with the scaled one (the default: one candidate per layer through the later
layers and the head, the others scaled by their layer-output error;
:func:`kvlab.integrations.calibration_capture.layer_sensitivities`), and prints both times, the
relative differences of the sensitivities (median, largest, per layer) and the layers whose
chosen value differs. ``--measure exact`` times the exact measure alone.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument(
        "--compare-measures", action="store_true", help="exact measure, then scaled"
    )
    parser.add_argument("--measure", choices=("exact", "scaled"), default="scaled")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    out: dict[str, Any] = {}
    for name in args.methods:
        if args.compare_measures:
            exact, exact_sens = _timed(name, model, tokenizer, measure="exact")
            scaled, scaled_sens = _timed(name, model, tokenizer, measure="scaled")
            _report_measures(name, exact, exact_sens, scaled, scaled_sens)
            out[name] = {"exact": exact, "scaled": scaled}
        elif not args.compare:
            out[name] = _timed(name, model, tokenizer, measure=args.measure)[0]
        else:
            former, former_sens = _timed(
                name, model, tokenizer, batch_candidates=False, measure="exact"
            )
            batched, batched_sens = _timed(name, model, tokenizer, measure="exact")
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
            result = _f(*a, **{**k, **options})  # the options win over the caller's keywords
            measured.append(result)
            return result

        setattr(module, attr, recording)

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
    how = (
        "one forward per candidate"
        if options.get("batch_candidates") is False
        else f"{options.get('measure', 'scaled')} measure"
    )
    print(
        f"{name} ({how}): {time.perf_counter() - began:.1f} s, {torch.get_num_threads()} "
        f"thread(s), load average {load}",
        flush=True,
    )
    return settings, measured


def _chosen(settings: dict[str, Any]) -> list[Any]:
    """The per-layer chosen values of one calibration's settings."""
    for key in ("layer_group_tokens", "layer_fractions"):
        if key in settings:
            return list(settings[key])
    raise KeyError("no per-layer values in the settings")


def _report_measures(
    name: str,
    exact: dict[str, Any],
    exact_sens: list[list[dict[Any, float]]],
    scaled: dict[str, Any],
    scaled_sens: list[list[dict[Any, float]]],
) -> None:
    """Print how far the scaled sensitivities are from the exact ones, and the choices."""
    rel: list[float] = []
    for layer, (a, b) in enumerate(zip(exact_sens[0], scaled_sens[0], strict=True)):
        row = {k: (b[k] - a[k]) / max(abs(a[k]), 1e-12) for k in a}
        rel.extend(abs(v) for v in row.values())
        cells = " ".join(f"{k}:{a[k]:.3g}/{b[k]:.3g}" for k in a)
        print(f"  layer {layer}: exact/scaled {cells}")
    rel.sort()
    print(
        f"{name}: scaled vs exact relative difference median {rel[len(rel) // 2]:.3f}, "
        f"largest {rel[-1]:.3f} over {len(rel)} sensitivities"
    )
    runs = [exact] if not all(isinstance(v, dict) for v in exact.values()) else []
    pairs = [(exact, scaled)] if runs else list(zip(exact.values(), scaled.values(), strict=True))
    for a, b in pairs:
        ca, cb = _chosen(a), _chosen(b)
        differ = [i for i, (x, y) in enumerate(zip(ca, cb, strict=True)) if x != y]
        print(f"  chosen exact  {ca}\n  chosen scaled {cb}\n  layers that differ: {differ}")


if __name__ == "__main__":
    main()
