"""One PN-Mix group flush: the torch codecs against the compiled CPU flush (1 thread).

SmolLM2-135M layer shape (batch 1, 3 kv heads, head_dim 64), ``kvlab eval``'s ``pn-mix``
coding (2 bits, per-pair widths 0/2/3/4, 1 % exact key outliers, pre-RoPE keys, Hadamard
values, groups of 32 tokens): a 512-token prefill (with queries: the per-pair widths are
computed there), then single-token appends up to the one that flushes a group per row. That
flushing append is timed on copies of the cache, the two paths interleaved in one process —
``KVLAB_PNMIX_BACKEND=torch`` (the torch codecs, the reference) and the default (the compiled
flush, docs/design.md "Kernels", "Flush") — and the stored bytes of the two are compared. Prints
the median wall and thread CPU time of each, their ratio, and the load average before and after
(the machine may be shared: read the ratio).

    OMP_NUM_THREADS=1 python benchmarks/pnmix_flush.py --repeats 200
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from kvlab.pnmix import PNMixCache, PNMixConfig
from kvlab.pnmix.kernels import cpu
from kvlab.rope import RotaryConfig

ENV = "KVLAB_PNMIX_BACKEND"
PN_MIX = dict(
    bits=2, key_coding="bit_alloc", group_tokens=32, key_outlier_fraction=0.01,
    value_coding="hadamard",
)  # fmt: skip


def _ready_cache(prefill: int, seed: int) -> tuple[PNMixCache, torch.Tensor]:
    """A cache one token short of a flush, and that token (keys = values)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PNMixCache(
        PNMixConfig(**PN_MIX),  # type: ignore[arg-type]
        batch_size=1,
        num_key_value_heads=3,
        head_dim=64,
        rotary=RotaryConfig(head_dim=64, base=100000.0),
    )
    cache.append(
        torch.randn(1, 3, prefill, 64, generator=gen),
        torch.randn(1, 3, prefill, 64, generator=gen),
        queries=torch.randn(1, 9, prefill, 64, generator=gen),
    )
    while int(cache.store.single_token_room) > 0:
        kv = torch.randn(1, 3, 1, 64, generator=gen)
        cache.append(kv, kv, checks="deferred")
    # room for the flushed group (the buffers grow by doubling: not what is timed here)
    cache.store.reserve_groups(int(cache.group_counts.max()) + 1)
    return cache, torch.randn(1, 3, 1, 64, generator=gen)


def _flush(cache: PNMixCache, token: torch.Tensor, env: str | None) -> tuple[float, float]:
    if env is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = env
    groups = int(cache.group_counts.sum())
    wall, thread = time.perf_counter(), time.thread_time()
    cache.append(token, token, checks="deferred")
    wall, thread = time.perf_counter() - wall, time.thread_time() - thread
    assert int(cache.group_counts.sum()) == groups + 3, "the append did not flush"
    return wall, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    saved = os.environ.get(ENV)
    if cpu.load() is None:
        raise SystemExit(f"the CPU kernel is unavailable: {cpu.cpu_kernel_status()}")
    load_before = os.getloadavg()
    base, token = _ready_cache(args.prefill, args.seed)
    times: dict[str, list[tuple[float, float]]] = {"torch": [], "compiled": []}
    stores = {}
    for i in range(args.repeats + 2):
        order = ("torch", "compiled") if i % 2 == 0 else ("compiled", "torch")
        for name in order:
            cache = copy.deepcopy(base)
            t = _flush(cache, token, "torch" if name == "torch" else None)
            if i >= 2:  # the first two rounds warm up
                times[name].append(t)
            stores[name] = cache.store
    if saved is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = saved
    load_after = os.getloadavg()
    same = all(
        torch.equal(
            getattr(stores["torch"], b).contiguous().view(torch.uint8),
            getattr(stores["compiled"], b).contiguous().view(torch.uint8),
        )
        for b in ("key_codes", "key_scalars", "value_codes", "value_scalars", "key_payload")
    )
    print(f"one flush (3 groups of 32 tokens), P={args.prefill}, {args.repeats} repeats each")
    med = {}
    for name, rows in times.items():
        wall = statistics.median(r[0] for r in rows) * 1e3
        thread = statistics.median(r[1] for r in rows) * 1e3
        med[name] = (wall, thread)
        print(f"  {name:9s} wall {wall:7.3f} ms   thread CPU {thread:7.3f} ms")
    print(
        f"  torch / compiled: wall {med['torch'][0] / med['compiled'][0]:.1f}x, "
        f"thread CPU {med['torch'][1] / med['compiled'][1]:.1f}x"
    )
    print(f"  stored bytes identical: {same}")
    print(
        "  load average before "
        + "/".join(f"{x:.2f}" for x in load_before)
        + ", after "
        + "/".join(f"{x:.2f}" for x in load_after)
    )


if __name__ == "__main__":
    main()
