"""RoPE-Relay decode attention: the compiled CPU kernel against the SDPA reference.

One decode step (one query per sequence) over a ragged store with SmolLM2-135M shapes
(``H_kv = 3``, ``G = 3``, ``D = Dv = 64``), heads holding ``n``, ``3n/4`` and ``n/2`` tokens,
float32, ``ragged_attention(backend="torch")`` vs ``backend="cpu"``, both timed in the same
run, alternating, median of ``--repeats`` calls (warm caches: the inputs stay in cache between
calls). Not a test: a ratio on this machine.

    OMP_NUM_THREADS=1 python benchmarks/relay_decode_kernel.py --lengths 256,512,2048,8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlab.relay.attention import ragged_attention
from kvlab.relay.kernels import cpu as relay_cpu
from kvlab.relay.storage import RelayStore


def make_store(longest: int, batch: int, seed: int = 0) -> RelayStore:
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 3, 64
    store = RelayStore(batch, heads, dim, dim, dtype=torch.float32, device="cpu")
    keys = torch.randn(batch, heads, longest, dim, generator=gen)
    store.append(keys, keys.flip(-1), real=[longest] * batch, original_start=[0] * batch,
                 rotary_start=[0] * batch)  # fmt: skip
    counts = [longest, 3 * longest // 4, longest // 2]
    for b in range(batch):
        view = store.padded([b])
        store.write_front(b, counts, [0] * heads, view.keys[0], view.values[0],
                          view.original_positions[0], view.rotary_positions[0])  # fmt: skip
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,512,2048,8192", help="longest head (tokens)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if relay_cpu.load() is None:
        raise SystemExit(f"the kernel is {relay_cpu.cpu_kernel_status()}")
    print("| longest head | SDPA reference (µs) | compiled kernel (µs) | ratio | max abs diff |")
    print("|---|---|---|---|---|")
    for longest in (int(x) for x in args.lengths.split(",")):
        store = make_store(longest, args.batch)
        query = torch.randn(args.batch, 9, 1, 64)
        times: dict[str, list[float]] = {"torch": [], "cpu": []}
        repeats = max(20, args.repeats * 256 // max(longest, 256))
        for _ in range(repeats):
            for backend in ("torch", "cpu"):
                start = time.perf_counter()
                ragged_attention(query, store, scale=0.125, backend=backend)
                times[backend].append(time.perf_counter() - start)
        diff = (
            (
                ragged_attention(query, store, scale=0.125, backend="torch")
                - ragged_attention(query, store, scale=0.125, backend="cpu")
            )
            .abs()
            .max()
            .item()
        )
        ref, ker = (statistics.median(times[b]) * 1e6 for b in ("torch", "cpu"))
        print(f"| {longest} | {ref:.1f} | {ker:.1f} | {ref / ker:.2f}× | {diff:.1e} |")


if __name__ == "__main__":
    main()
