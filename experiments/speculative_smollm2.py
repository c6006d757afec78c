"""Prompt-lookup decoding through each kvlab cache on SmolLM2-135M (installed, CPU): whether
its greedy tokens equal plain ``generate``'s with the same cache, and both wall times
(docs/design.md, "Cache life cycle": crop). Default caches: ``PNMixConfig()``,
``EvictionConfig(ratio=0.5)``, both composed; a 210-token prompt, 40 new tokens.

    PYTHONPATH=src OMP_NUM_THREADS=1 python experiments/speculative_smollm2.py
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvlab.integrations import (
    ComposedModelCache,
    EvictionConfig,
    PNMixModelCache,
    RelayModelCache,
    enable_kvlab_attention,
)
from kvlab.models import load_model
from kvlab.pnmix import PNMixConfig

FUNCTION = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"


def main() -> None:
    loaded = load_model("smollm2-135m")
    model = loaded.model
    enable_kvlab_attention(model)
    ids = loaded.tokenizer(FUNCTION * 6 + "def fact(n):\n", return_tensors="pt").input_ids
    print(f"prompt tokens {ids.shape[1]}")
    caches: dict[str, Any] = {
        "pnmix": lambda: PNMixModelCache(model.config, PNMixConfig()),
        "relay": lambda: RelayModelCache(model.config, EvictionConfig(ratio=0.5)),
        "composed": lambda: ComposedModelCache(
            model.config, EvictionConfig(ratio=0.5), PNMixConfig()
        ),
    }
    for name, make in caches.items():
        with torch.no_grad():
            start = time.perf_counter()
            plain = model.generate(ids, cache=make(), max_new_tokens=40, do_sample=False)
            plain_s = time.perf_counter() - start
            cache = make()
            cache.expect_prompt(ids.shape[1])
            start = time.perf_counter()
            lookup = model.generate(
                ids, cache=cache, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=8
            )
            lookup_s = time.perf_counter() - start
        same = plain[0].tolist() == lookup[0].tolist()
        print(f"{name}: same tokens {same}, plain {plain_s:.1f} s, prompt lookup {lookup_s:.1f} s")


if __name__ == "__main__":
    main()
