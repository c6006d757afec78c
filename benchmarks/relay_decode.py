"""Decode-step time of a whole model: RelayModelCache (ragged store) against DynamicCache.

Prefills ``P`` random tokens into each cache, then times single-token decode steps (the
model forward only, ``torch.no_grad``), rounds interleaved across the methods so machine noise
hits them alike; prints the median step time per method and its ratio to ``full``:

* ``full``                 — ``transformers``' ``DynamicCache`` with ``sdpa`` attention;
* ``relay:snapkv@R``       — :class:`kvlab.integrations.RelayModelCache`, RoPE-Relay after a
  ratio-``R`` eviction at the prefill (ragged per-head counts: adaptive allocation);
* ``evict-no-relay:snapkv@R`` — the same eviction without relay;
* ``relay:...+positions``  — the relay cache fed its own RoPE positions
  (``cache.position_ids(1)``), so no re-rotation happens.

Also printed: the aten ops one decode step dispatches (counted with a ``TorchDispatchMode``;
deterministic, unlike the times).

Model: SmolLM2-135M (``--model smollm2-135m``, offline) or a random-initialized model with its
shapes (``--model random``: 30 layers, 9 query / 3 kv heads, head_dim 64). Timings on a shared
machine are noisy: compare ratios from one run.

    OMP_NUM_THREADS=1 python benchmarks/relay_decode.py --prefill 512,2048 --steps 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _model(spec: str) -> Any:
    if spec == "random":
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config).eval()
    from kvlab.models import load_model

    return load_model(spec).model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefill", default="512,2048", help="comma-separated P")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = _model(args.model)
    vocab = model.config.vocab_size
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, ratio {args.ratio}")
    for prefill in [int(p) for p in args.prefill.split(",")]:
        gen = torch.Generator().manual_seed(prefill)
        ids = torch.randint(0, vocab, (1, prefill + args.steps), generator=gen)
        evict = {"ratio": args.ratio, "scorer": "snapkv"}
        methods = {
            "full": ("sdpa", lambda: DynamicCache(config=model.config), False),
            f"relay:snapkv@{args.ratio}": (
                KVLAB_ATTENTION,
                lambda evict=evict: RelayModelCache(model.config, EvictionConfig(**evict)),
                False,
            ),
            f"evict-no-relay:snapkv@{args.ratio}": (
                KVLAB_ATTENTION,
                lambda evict=evict: RelayModelCache(
                    model.config, EvictionConfig(**evict, relay=False)
                ),
                False,
            ),
            f"relay:snapkv@{args.ratio}+positions": (
                KVLAB_ATTENTION,
                lambda evict=evict: RelayModelCache(model.config, EvictionConfig(**evict)),
                True,
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in methods}
        ops: dict[str, int] = {}
        with torch.no_grad():
            for _ in range(args.rounds):
                for name, (attention, make, own_positions) in methods.items():
                    with use_attention(model, attention):
                        cache = make()
                        model(ids[:, :prefill], cache=cache, logits_to_keep=1)
                        for t in range(prefill, prefill + args.steps):
                            extra = {}
                            if own_positions and hasattr(cache, "position_ids"):
                                extra = {"position_ids": cache.position_ids(1)}
                            start = time.perf_counter()
                            model(ids[:, t : t + 1], cache=cache, logits_to_keep=1, **extra)
                            times[name].append(time.perf_counter() - start)
                        if name not in ops:
                            if own_positions and hasattr(cache, "position_ids"):
                                extra = {"position_ids": cache.position_ids(1)}
                            with _OpCounter() as counter:
                                model(ids[:, -1:], cache=cache, logits_to_keep=1, **extra)
                            ops[name] = counter.ops
        full = statistics.median(times["full"])
        print(f"P = {prefill}: median decode step over {len(times['full'])} steps")
        for name, values in times.items():
            step = statistics.median(values)
            print(
                f"  {name:34s} {step * 1e3:8.2f} ms   x{full / step:5.2f} of full's speed   "
                f"{ops[name]:6d} aten ops per step"
            )


if __name__ == "__main__":
    main()
