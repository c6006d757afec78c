"""A measured, not adopted, cheaper calibration: the model in bfloat16. Layers 0 .. N-1 of each
per-layer calibration (``snap``: SnapKV kept fractions 0.25/0.5/0.75; ``pn``: PN-Mix groups)
run in float32 then with ``model.to(torch.bfloat16)``, in one process, one thread: prints both
times, the KLs, and their largest and median relative difference.

    OMP_NUM_THREADS=1 python experiments/try_bfloat16_tail.py qwen2.5-coder-0.5b 2 snap pn
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any

import torch

from kvlab.data import default_text
from kvlab.integrations import calibration_capture, pnmix_calibration, relay_calibration
from kvlab.integrations.relay_cache import EvictionConfig
from kvlab.models import load_model
from kvlab.pnmix import PNMixConfig
from kvlab.relay.policies import default_policy


class _Stop(Exception):
    pass


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model(sys.argv[1])
    model, tokenizer = loaded.model, loaded.tokenizer
    layers = int(sys.argv[2])
    text = default_text().data[:200_000].decode("utf-8", "replace")
    ids = tokenizer(text, return_tensors="pt").input_ids
    snapkv = EvictionConfig(ratio=0.5, relay=False, **default_policy("snapkv"))
    pn = dataclasses.replace(PNMixConfig(), bits=2, key_coding="cartesian", group_tokens=32)
    prefill = pn.sink_tokens + pn.residual_tokens + 3 * 128
    seen: list[float] = []
    kl = calibration_capture.ExactDistribution.kl

    def recording(self: Any, logits: torch.Tensor, **kwargs: Any) -> float:
        value = kl(self, logits.float(), **kwargs)
        seen.append(value)
        return value

    calibration_capture.ExactDistribution.kl = recording  # type: ignore[method-assign]

    def stop(done: int, total: int) -> None:
        if done == layers:
            raise _Stop

    def run(kind: str) -> tuple[list[float], float]:
        seen.clear()
        began = time.perf_counter()
        with contextlib.suppress(_Stop):
            if kind == "snap":
                relay_calibration.layer_eviction_sensitivity(
                    model, ids[:, 10_000:10_640], snapkv, prefill=512, progress=stop
                )
            else:
                pnmix_calibration.layer_group_sensitivity(
                    model,
                    ids[:, 10_000 : 10_000 + prefill + 128],
                    pn,
                    prefill=prefill,
                    progress=stop,
                )
        return list(seen), time.perf_counter() - began

    for kind in sys.argv[3:]:
        full, t_full = run(kind)
        model.to(torch.bfloat16)
        try:
            half, t_half = run(kind)
        finally:
            model.to(torch.float32)
        rel = sorted(abs(a - b) / abs(a) for a, b in zip(full, half, strict=True))
        print(
            f"{kind}: float32 {t_full:.1f} s, bfloat16 {t_half:.1f} s, relative difference "
            f"max {rel[-1]:.3g}, median {rel[len(rel) // 2]:.3g}"
        )
        print("  float32 ", " ".join(f"{x:.3g}" for x in full))
        print("  bfloat16", " ".join(f"{x:.3g}" for x in half))
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
