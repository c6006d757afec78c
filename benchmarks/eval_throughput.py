"""Whole-model decode throughput: ``kvlab eval``'s methods on SmolLM2-135M, one process.

For each prefill length ``P`` and each round, every method (by default ``full``,
``pn-mix-uniform`` and ``relay:snapkv@0.5``, built by :func:`kvlab.evaluation.methods.
parse_method` exactly as ``kvlab eval`` builds them) prefills ``P`` tokens of the package's
default text into its own cache; then ``--steps`` single-token forwards (``logits_to_keep=1``,
the next token of the text) run **interleaved**: step ``j`` of every method, in an order rotated
with ``j``, before step ``j + 1`` — so that the load of a shared machine falls on all methods
alike. Decode tokens/s = steps / the summed wall time of a method's forwards; ratios against
``full`` are taken within a round and their median over rounds is reported (with the medians
of tokens/s).

Prefill: ``full`` and the PN-Mix methods prefill in chunks of ``--prefill-chunk`` tokens (their
stored state does not depend on the chunking); eviction methods prefill in one forward (their
protocol evicts once, after the first forward). Prefill time is recorded, not part of the
decode rate.

    OMP_NUM_THREADS=1 python benchmarks/eval_throughput.py --prefill 512,8192 --steps 64 \\
        --rounds 3 --out runs/bench/eval_throughput.json

PN-Mix attention runs on the backend ``pnmix_attention`` picks (on the CPU the compiled kernel,
compiled on first use; ``KVLAB_PNMIX_BACKEND=torch`` for the reference); RoPE-Relay decode steps
likewise (``KVLAB_RELAY_BACKEND=torch`` for SDPA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvlab.data import default_text
from kvlab.evaluation.methods import PREPARATIONS, parse_method
from kvlab.evaluation.protocols import cache_keyword
from kvlab.integrations.attention import use_attention
from kvlab.models import load_model
from kvlab.pnmix.kernels import ENV_VAR, cpu
from kvlab.relay.kernels import cpu as relay_cpu

MODEL = "smollm2-135m"


def _cache_bytes(cache: Any) -> int | None:
    nbytes = getattr(cache, "nbytes", None)
    if callable(nbytes):
        return int(nbytes())
    try:  # DynamicCache: its key/value tensors
        return sum(
            int(layer.keys.numel() * layer.keys.element_size() * 2) for layer in cache.layers
        )
    except AttributeError:
        return None


@torch.no_grad()
def prefill_cache(
    model: Any, method: Any, tokens: torch.Tensor, prefill: int, chunk: int, prepared: Any
) -> tuple[Any, float]:
    """A fresh cache of ``method`` holding ``prefill`` tokens, and the prefill's wall time."""
    cache = method.make_cache(model.config, prepared.get(method.name))
    key = cache_keyword(model)
    with use_attention(model, method.attention):
        start = time.perf_counter()
        size = prefill if method.family == "eviction" else chunk
        for s in range(0, prefill, size):
            piece = tokens[s : min(prefill, s + size)].view(1, -1)
            model(piece, use_cache=True, logits_to_keep=1, **{key: cache})
        return cache, time.perf_counter() - start


@torch.no_grad()
def decode_step(model: Any, method: Any, cache: Any, token: torch.Tensor) -> float:
    """One single-token forward; its wall time."""
    key = cache_keyword(model)
    with use_attention(model, method.attention):
        start = time.perf_counter()
        model(token.view(1, 1), use_cache=True, logits_to_keep=1, **{key: cache})
        return time.perf_counter() - start


def run_round(
    model: Any,
    methods: list[Any],
    tokens: torch.Tensor,
    prefill: int,
    steps: int,
    chunk: int,
    prepared: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """Prefill every method's cache, then ``steps`` interleaved decode steps."""
    caches, prefill_seconds = {}, {}
    for method in methods:
        caches[method.name], prefill_seconds[method.name] = prefill_cache(
            model, method, tokens, prefill, chunk, prepared
        )
    decode = dict.fromkeys(caches, 0.0)
    for j in range(steps):
        shift = j % len(methods)
        for method in methods[shift:] + methods[:shift]:
            cache = caches[method.name]
            decode[method.name] += decode_step(model, method, cache, tokens[prefill + j])
    return {
        name: {
            "prefill_seconds": prefill_seconds[name],
            "decode_seconds": decode[name],
            "decode_tokens_per_second": steps / decode[name],
            "cache_bytes": _cache_bytes(caches[name]),
        }
        for name in caches
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", default="512,8192", help="prefill lengths P (tokens)")
    parser.add_argument("--steps", type=int, default=64, help="single-token forwards timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="full,pn-mix-uniform,relay:snapkv@0.5")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per forward")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/eval_throughput.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefills = [int(p) for p in args.prefill.split(",")]
    names = [m.strip() for m in args.methods.split(",")]
    if "full" not in names:
        raise SystemExit("--methods must include 'full' (the ratios' reference)")
    loaded = load_model(MODEL)
    model, tokenizer = loaded.model, loaded.tokenizer
    text = default_text().data[:200_000].decode("utf-8", errors="ignore")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    need = max(prefills) + args.steps + 1
    if ids.numel() < need:
        raise SystemExit(f"the text gives {ids.numel()} tokens; {need} needed")
    methods = [parse_method(name) for name in names]
    prepared: dict[str, Any] = {}
    for method in methods:  # one-time preparations (calibrations), untimed
        if method.preparation is not None:
            prep = PREPARATIONS[method.preparation]
            print(f"{method.name}: {prep.note}")
            prepared[method.name] = prep.run(
                method.params, model, tokenizer, prep.text(), lambda done, total: None
            )
    # warm-up (loads / compiles the PN-Mix CPU kernel once, outside the timings)
    run_round(model, methods, ids, 256, 2, args.prefill_chunk, prepared)
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    for prefill in prefills:
        per_method: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
        ratios: dict[str, list[float]] = {m.name: [] for m in methods}
        for r in range(args.rounds):
            this_round = run_round(
                model, methods, ids, prefill, args.steps, args.prefill_chunk, prepared
            )
            full_rate = this_round["full"]["decode_tokens_per_second"]
            for name, res in this_round.items():
                per_method[name].append(res)
                ratios[name].append(res["decode_tokens_per_second"] / full_rate)
                print(
                    f"P={prefill} round {r}: {name} {res['decode_tokens_per_second']:.2f} tok/s "
                    f"({ratios[name][-1]:.2f}× full; prefill {res['prefill_seconds']:.1f} s)",
                    flush=True,
                )
        for name, runs in per_method.items():
            rates = [x["decode_tokens_per_second"] for x in runs]
            results.append(
                {
                    "prefill_tokens": prefill,
                    "method": name,
                    "decode_tokens_per_second_median": statistics.median(rates),
                    "decode_tokens_per_second": rates,
                    "ratio_vs_full_median": statistics.median(ratios[name]),
                    "ratio_vs_full": ratios[name],
                    "prefill_seconds": [x["prefill_seconds"] for x in runs],
                    "cache_bytes": runs[-1]["cache_bytes"],
                }
            )
    machine = {
        "model": loaded.checkpoint,
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "pnmix_backend_env": os.environ.get(ENV_VAR, "auto"),
        "pnmix_cpu_kernel": cpu.cpu_kernel_status(),
        "relay_backend_env": os.environ.get(relay_cpu.ENV_VAR, "auto"),
        "relay_cpu_kernel": relay_cpu.cpu_kernel_status(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "steps": args.steps,
        "rounds": args.rounds,
        "prefill_chunk": args.prefill_chunk,
    }
    lines = [
        "| P | method | decode tok/s (median) | ratio vs full (median of rounds) | per round "
        "| cache bytes |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        per_round = ", ".join(f"{x:.2f}" for x in row["ratio_vs_full"])
        lines.append(
            f"| {row['prefill_tokens']} | {row['method']} "
            f"| {row['decode_tokens_per_second_median']:.2f} "
            f"| {row['ratio_vs_full_median']:.2f}× | {per_round} | {row['cache_bytes']:,} |"
        )
    print(json.dumps(machine))
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
