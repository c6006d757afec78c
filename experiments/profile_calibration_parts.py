"""What one calibration measurement's parts cost on a real model, in one process (one thread
unless given): the head over 128 tokens (float32, per row when 3 candidates are stacked, and
bfloat16), the library's float64 KL over the vocabulary and its pieces, one decoder MLP.

    OMP_NUM_THREADS=1 python experiments/profile_calibration_parts.py qwen2.5-coder-0.5b 1
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvlab.integrations.calibration_capture import ExactDistribution
from kvlab.models import load_model


def _seconds(f: Callable[[], Any], n: int = 3) -> float:
    f()
    began = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - began) / n


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    model = load_model(name).model
    width, score = model.config.hidden_size, 128
    head = model.get_output_embeddings()
    h1, h3 = torch.randn(1, score, width), torch.randn(3, score, width)
    w16, h16 = head.weight.to(torch.bfloat16), h1.to(torch.bfloat16)
    with torch.no_grad():
        z = head(h1)[0]
        exact = ExactDistribution(z + 0.1 * torch.randn_like(z))
        zd = z.double()
        mlp = model.model.layers[len(model.model.layers) // 2].mlp
        rows = {
            "head float32, 1 x 128 tokens": _seconds(lambda: head(h1)),
            "head float32, 3 x 128 tokens, per 128": _seconds(lambda: head(h3)) / 3,
            "head bfloat16, 1 x 128 tokens": _seconds(lambda: torch.nn.functional.linear(h16, w16)),
            "KL float64 (ExactDistribution.kl)": _seconds(lambda: exact.kl(z)),
            "  of which logits.double()": _seconds(lambda: z.double()),
            "  of which logsumexp float64": _seconds(lambda: torch.logsumexp(zd, -1)),
            "  of which sum_v p z float64": _seconds(
                lambda: torch.einsum("sv,sv->s", exact.probs, zd)
            ),
            "one decoder MLP, 128 tokens": _seconds(lambda: mlp(h1)),
        }
    for label, seconds in rows.items():
        print(f"{label}: {seconds:.3f} s")
    print(f"{torch.get_num_threads()} thread(s), load average", os.getloadavg())


if __name__ == "__main__":
    main()
