"""Layers 0 and 1 of both per-layer calibrations on a real model, measured the new way (one
capture; each candidate's layer from the captured input of its layer, then the later layers and
the head once for the layer's candidates stacked along the batch) and by full forwards (the
former way, one forward of every layer per candidate), in one process: prints whether every
float64 KL is the same.

    OMP_NUM_THREADS=1 python experiments/check_calibration_capture.py \\
        --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvlab.data import default_text
from kvlab.integrations import calibration_capture, pnmix_calibration, relay_calibration
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.models import load_model
from kvlab.pnmix import PNMixConfig
from kvlab.relay.policies import default_policy


class _Stop(Exception):
    pass


def _stop(done: int, total: int) -> None:
    if done == 2:
        raise _Stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    text = default_text().data[:200_000].decode("utf-8", "replace")
    ids = tokenizer(text, return_tensors="pt").input_ids
    seen: list[float] = []
    kl = calibration_capture.ExactDistribution.kl

    def recording(self: Any, logits: Any, **kwargs: Any) -> float:
        value = kl(self, logits, **kwargs)
        seen.append(value)
        return value

    calibration_capture.ExactDistribution.kl = recording  # type: ignore[method-assign]
    pn = dataclasses.replace(PNMixConfig(), bits=2, key_coding="cartesian", group_tokens=32)
    p = pn.sink_tokens + pn.residual_tokens + 3 * 128
    snapkv = EvictionConfig(ratio=0.5, relay=False, **default_policy("snapkv"))
    jobs: dict[str, tuple[Any, Callable[[bool], Any]]] = {
        "kivi-2bit-calibrated": (
            pnmix_calibration,
            lambda batch: pnmix_calibration.layer_group_sensitivity(
                model,
                ids[:, 10_000 : 10_000 + p + 128],
                pn,
                prefill=p,
                progress=_stop,
                batch_candidates=batch,
            ),
        ),
        "snapkv@0.5": (
            relay_calibration,
            lambda batch: relay_calibration.layer_eviction_sensitivity(
                model,
                ids[:, 10_000:10_640],
                snapkv,
                prefill=512,
                fractions=relay_calibration.fractions_around(0.5),
                progress=_stop,
                batch_candidates=batch,
            ),
        ),
    }

    def measure(run: Callable[[bool], Any], batch: bool) -> tuple[list[float], float]:
        seen.clear()
        began = time.perf_counter()
        with contextlib.suppress(_Stop):
            run(batch)
        return list(seen), time.perf_counter() - began

    for name, (module, run) in jobs.items():
        new, t_new = measure(run, True)
        capture = module.start_at_layer
        module.start_at_layer = lambda model, layer, hidden: contextlib.nullcontext()
        try:
            old, t_old = measure(run, False)
        finally:
            module.start_at_layer = capture
        print(
            f"{name}: layers 0-1, {len(new)} KL values, identical: {new == old} "
            f"(new {t_new:.1f} s, full forwards {t_old:.1f} s)"
        )


if __name__ == "__main__":
    main()
