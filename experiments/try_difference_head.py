"""A measured, not adopted, cheaper head for the per-layer calibrations: each calibration runs
twice in one process, first exact (the library's path), then with the head of every perturbed
forward computed as a difference from the exact forward's — ``z = z0 + bf16(W) @ bf16(x - x0)``
(``x0``, ``z0``: the exact scoring forward's final hidden states and logits; bf16 matrix
products, AMX on recent Intel CPUs; the KL stays the library's float64 one). Prints both
times, the sensitivities' largest relative difference and whether the chosen per-layer values
are the same.

    OMP_NUM_THREADS=1 python experiments/try_difference_head.py --model smollm2-135m \\
        'relay:snapkv@0.5' kivi-2bit-calibrated

Only for models whose logits are the output embedding's product (no soft-capping or scaling).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from kvlab.evaluation.methods import PREPARATIONS, parse_method
from kvlab.integrations import pnmix_calibration, relay_calibration
from kvlab.models import load_model


@contextlib.contextmanager
def difference_head(model: Any, score: int) -> Iterator[None]:
    """The first head call over ``score`` tokens is exact and recorded; later ones over
    ``score`` tokens are ``z0 + bf16(W) (x - x0)`` (the KL stays the library's float64 one)."""
    head = model.get_output_embeddings()
    weight16 = head.weight.detach().to(torch.bfloat16)
    state: dict[str, Tensor] = {}
    original_forward = head.forward

    def forward(x: Tensor) -> Tensor:
        if x.shape[-2] != score:
            return original_forward(x)
        if "x0" not in state:
            state["x0"], state["z0"] = x.detach().clone(), original_forward(x).detach()
            return state["z0"]
        d = torch.nn.functional.linear((x - state["x0"]).to(torch.bfloat16), weight16)
        return state["z0"] + d.float()

    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="+", metavar="METHOD")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    for name in args.methods:
        method = parse_method(name)
        prep = PREPARATIONS[method.preparation]
        runs = []
        for variant in ("exact", "difference head"):
            measured: list[Any] = []
            saved = {}
            for module, attr in (
                (pnmix_calibration, "layer_group_sensitivity"),
                (relay_calibration, "layer_eviction_sensitivity"),
            ):
                original = saved[module, attr] = getattr(module, attr)

                def recording(
                    *a: Any, _f: Any = original, _m: list[Any] = measured, **k: Any
                ) -> Any:
                    result = _f(*a, **k)
                    _m.append(result)
                    return result

                setattr(module, attr, recording)
            began = time.perf_counter()
            with contextlib.ExitStack() as stack:
                if variant != "exact":
                    stack.enter_context(difference_head(model, 128))
                settings = prep.run(method.params, model, tokenizer, prep.text(), None)
            seconds = time.perf_counter() - began
            for (module, attr), original in saved.items():
                setattr(module, attr, original)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"{name} ({variant}): {seconds:.1f} s, load average {load}", flush=True)
            runs.append((settings, measured[0]))
        (exact, sens0), (cheap, sens1) = runs
        worst = max(
            abs(b[k] - a[k]) / abs(a[k])
            for a, b in zip(sens0, sens1, strict=True)
            for k in a
            if a[k] > 0
        )
        chosen0 = {k: v for k, v in exact.items() if k.startswith("layer_")}
        chosen1 = {k: v for k, v in cheap.items() if k.startswith("layer_")}
        print(
            f"{name}: max relative difference {worst:.3g}; chosen identical: {chosen0 == chosen1}"
        )
        if chosen0 != chosen1:
            print("  exact ", chosen0, "\n  cheap ", chosen1)


if __name__ == "__main__":
    main()
