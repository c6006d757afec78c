"""Torch ops per single-token decode step of one PN-Mix layer (torch.profiler, 1 thread).

SmolLM2-135M layer shape (3 kv heads, 9 query heads, head_dim 64), the model cache's groups of
32 tokens, a 512-token prefill, then 32 single-token steps (one of them flushes a group):
``--mode reference`` runs ``append(checks="deferred")`` + ``pnmix_attention(backend="torch")``
(what a decode step did before the compiled backends), ``--mode fused`` runs
``pnmix_decode_step`` (one C++ call on the CPU backend). Prints aten ops per step, all and
top-level (not called from another aten op). Data are seeded (the mix mask, hence the
reference's Phase–Norm ops, depends on them).

    OMP_NUM_THREADS=1 python benchmarks/decode_step_ops.py --mode reference
    OMP_NUM_THREADS=1 python benchmarks/decode_step_ops.py --mode fused
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("reference", "fused"), default="fused")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    cache = PNMixCache(
        PNMixConfig(group_tokens=32), batch_size=1, num_key_value_heads=3, head_dim=64
    )
    cache.append(
        torch.randn(1, 3, 512, 64, generator=gen), torch.randn(1, 3, 512, 64, generator=gen)
    )
    query = torch.randn(1, 9, 1, 64, generator=gen)
    tokens = [torch.randn(1, 3, 1, 64, generator=gen) for _ in range(args.steps + 1)]

    def step(kv: torch.Tensor) -> None:
        if args.mode == "fused":
            pnmix_decode_step(query, kv, kv, cache, scale=0.125)
        else:
            cache.append(kv, kv, checks="deferred")
            pnmix_attention(query, cache, scale=0.125, backend="torch")

    step(tokens[0])  # warm-up (loads the CPU kernel)
    groups = int(cache.group_counts.max())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for kv in tokens[1:]:
            step(kv)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    n = args.steps
    print(
        f"{args.mode}: {len(events) / n:.1f} aten ops per step ({len(top) / n:.1f} top-level) "
        f"over {n} steps, {int(cache.group_counts.max()) - groups} flushing"
    )


if __name__ == "__main__":
    main()
