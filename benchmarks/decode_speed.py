"""Whole-model decode on the CPU against the bytes limit (docs/benchmarks.md, "Decode on the CPU
against the bytes limit").

For each context ``P`` and batch ``B``, every method's cache is filled with ``P`` tokens per
sequence, then ``--steps`` single-token forwards run **interleaved** across the methods (step
``j`` of every method, in an order rotated with ``j``), each timed by the CPU time of this
process (``time.process_time``: one thread; another job on a shared machine slows the step
through the memory system, not by taking its core); tokens/s = ``B * steps`` / the summed CPU
time of a method's forwards. ``--steps`` 32 covers one group flush of every PN-Mix stream
(groups of 32 tokens), so PN-Mix rates include it amortized.

Methods: ``full`` (``kvlab eval``'s: ``transformers``' ``DynamicCache`` under the ``"sdpa"``
attention), ``full-dense`` (the same exact keys and values in a
:class:`~kvlab.integrations.dense_cache.DenseModelCache`: written in place, attended by one
compiled call per layer that reads each kv head once for its query heads — the fastest plain
path found), and any name of ``kvlab methods`` (built by ``parse_method``; calibrated ones
prepared with ``kvlab.prepare``, cached in ``$KVLAB_CALIBRATION_CACHE``).

Synthetic filling (decode speed depends on the cache's shapes and counts, not on its values):
a real prefill of ``--prefix`` tokens of the package's text records every layer's rotated
queries, keys and values; copies of them, each turned by a pure rotation to its later positions
(``kvlab.rope.rotate_by_delta``), make ``P`` tokens of the model's shapes at positions
``0 .. P-1``; each layer of a fresh cache receives them as one prefill forward does
(``Cache.update``, then the ``"kvlab"`` attention with outputs unused: eviction scores, packing
and per-pair tables run on them; no ``P x P`` attention, no MLP), batch 1; the filled cache is
then repeated to ``B`` rows (``batch_repeat_interleave``).

Bytes (:class:`kvlab.pnmix.kernels.bytes_model.ModelStepBytes`): the weights one step reads,
the stored cache (``kvlab.cache_storage``: kv + index bytes; the exact caches' closed form),
and PN-Mix's tables (the cos/sin rows of ``P`` positions and the Hadamard matrix per layer);
``limit`` = the speed-up over ``full`` those bytes allow; ``of limit`` = (measured ratio − 1) /
(limit − 1) against ``full`` (sdpa). About 13 minutes here for the default grid (the model load
2 minutes, the fills 3, decode 8); peak memory about 17 GB (two exact caches at 32K × 8).

    OMP_NUM_THREADS=1 KVLAB_CALIBRATION_CACHE=/tmp/decode-calib python benchmarks/decode_speed.py \\
        --contexts 8192,32768 --batches 1,8 --steps 32 --out runs/bench/decode_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface

import kvlab
from kvlab.data import default_text
from kvlab.integrations.attention import (
    CacheView,
    attention_outputs_unused,
    kvlab_attention_forward,
    use_attention,
)
from kvlab.integrations.dense_cache import DenseModelCache
from kvlab.integrations.model_support import layer_rotary
from kvlab.integrations.prefill_replay import attention_modules, capture_prefill
from kvlab.pnmix import PNMixCache
from kvlab.pnmix.kernels import cpu as pnmix_cpu
from kvlab.pnmix.kernels.bytes_model import (
    ModelStepBytes,
    decode_weight_bytes,
    dense_cache_bytes,
    pnmix_table_bytes,
)
from kvlab.relay.kernels import cpu as relay_cpu
from kvlab.rope import rotate_by_delta

FULL_DENSE = "full-dense"
RECORD = "kvlab-decode-speed-record"


@dataclass
class Entry:
    """A benchmarked method: its name, attention implementation and cache factory."""

    name: str
    attention: str
    make: Any


def entries(names: list[str], loaded: Any) -> list[Entry]:
    """The methods of ``--methods`` (module docstring)."""
    config = loaded.model.config
    out = []
    for name in names:
        if name == FULL_DENSE:
            out.append(Entry(name, "kvlab", lambda: DenseModelCache(config)))
            continue
        method = kvlab.parse_method(name)
        prepared = kvlab.prepare(method, loaded)

        def make(method: Any = method, prepared: Any = prepared) -> Any:
            return method.make_cache(config, prepared)

        out.append(Entry(name, method.attention, make))
    return out


@torch.no_grad()
def layer_states(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's rotated queries ``[1, H_q, T, D]``, keys and values ``[1, H_kv, T, D]``
    of a real prefill of ``ids`` (``[T]``)."""
    capture = capture_prefill(model, ids.view(1, -1))
    states: list[tuple[torch.Tensor, ...]] = []

    def record(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        states.append((query, key, value))
        b, h, t, _ = query.shape
        return query.new_zeros(b, t, h, value.shape[-1]), None

    AttentionInterface.register(RECORD, record)
    with use_attention(model, RECORD):
        for module, (args, kwargs) in zip(attention_modules(model), capture.calls, strict=True):
            module(*args, **kwargs)
    return states


def tiled(x: torch.Tensor, tokens: int, rotary: Any) -> torch.Tensor:
    """``x`` ``[1, H, T0, D]`` repeated to ``tokens`` along the sequence, copy ``j`` rotated by
    ``j * T0`` positions (``rotary``; ``None``: values, repeated as they are)."""
    t0 = x.shape[2]
    parts = []
    for j in range(-(-tokens // t0)):
        parts.append(x if rotary is None or j == 0 else rotate_by_delta(x, j * t0, rotary))
    return torch.cat(parts, dim=2)[:, :, :tokens].contiguous()


@torch.no_grad()
def fill(
    model: Any, entry: Entry, states: list[tuple[torch.Tensor, ...]], tokens: int, batch: int
) -> Any:
    """A fresh cache of ``entry`` holding ``tokens`` synthetic tokens per row, ``batch`` rows."""
    cache = entry.make()
    rotary = layer_rotary(model.config)
    position_ids = torch.arange(tokens).view(1, -1)
    modules = attention_modules(model)
    with use_attention(model, "kvlab"), attention_outputs_unused():
        for module, (q0, k0, v0) in zip(modules, states, strict=True):
            q, k, v = tiled(q0, tokens, rotary), tiled(k0, tokens, rotary), tiled(v0, tokens, None)
            key, value = cache.update(k, v, module.layer_idx, kwargs={"position_ids": position_ids})
            if isinstance(key, CacheView):
                kvlab_attention_forward(
                    module,
                    q,
                    key,
                    value,
                    None,
                    scaling=module.scaling,
                    sliding_window=getattr(module, "sliding_window", None),
                    position_ids=position_ids,
                )
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    return cache


def rope_span(kv: Any) -> int:
    """Positions the cos/sin table spans for a store's quantized groups (what the CPU kernel
    reads of it: every row of the batch at equal offsets shares it)."""
    first = kv.position_offsets + kv.sink_tokens if kv.position_offsets is not None else None
    used = kv.group_counts > 0
    if first is None or not used.any():
        return 0
    last = first + kv.group_counts * kv.group_tokens
    return int(last[used].max() - first[used].min())


def step_bytes(model: Any, entry: Entry, cache: Any, tokens: int, batch: int) -> ModelStepBytes:
    """Bytes one decode step of ``entry`` reads (module docstring)."""
    config = model.config.get_text_config(decoder=True)
    seen: set[int] = set()
    params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            params.append((name, tuple(p.shape), p.element_size()))
    embedding = model.get_input_embeddings().weight
    embed_name = next(n for n, p in model.named_parameters() if p is embedding)
    tied = model.get_output_embeddings().weight is embedding
    weights = decode_weight_bytes(params, batch, embed_name, tied=tied)
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if entry.name in ("full", FULL_DENSE):
        size = model.dtype.itemsize
        stored = dense_cache_bytes(
            layers, batch, config.num_key_value_heads, tokens, head_dim, element_size=size
        )
        return ModelStepBytes(weights, stored)
    storage = kvlab.cache_storage(cache)
    tables = 0
    for layer in cache.layers:
        store = layer.held_store() if hasattr(layer, "held_store") else None
        if isinstance(store, PNMixCache) and not isinstance(store.kernel_decode, str):
            tables += pnmix_table_bytes(
                1,
                rope_span(store.packed_kv()),
                store.rotary_dim,
                store.value_head_dim,
                prerope=store.kernel_decode.rotate_to_position,
                hadamard_values=store.kernel_decode.value_hadamard,
            )
    return ModelStepBytes(weights, storage.kv_bytes + storage.index_bytes, tables)


@torch.no_grad()
def measure(
    model: Any, runs: list[tuple[Entry, Any]], ids: torch.Tensor, batch: int, steps: int
) -> dict[str, tuple[float, float]]:
    """``steps`` interleaved single-token forwards (one untimed first); per method the summed
    CPU seconds and wall seconds of the timed ones."""
    cpu = {e.name: 0.0 for e, _ in runs}
    wall = dict(cpu)
    for j in range(steps + 1):
        token = ids[j].view(1, 1).expand(batch, 1)
        shift = j % len(runs)
        for entry, cache in runs[shift:] + runs[:shift]:
            with use_attention(model, entry.attention):
                c0, w0 = time.process_time(), time.perf_counter()
                model(token, use_cache=True, logits_to_keep=1, cache=cache)
                if j:
                    cpu[entry.name] += time.process_time() - c0
                    wall[entry.name] += time.perf_counter() - w0
    return {name: (cpu[name], wall[name]) for name in cpu}


def run(loaded: Any, ids: torch.Tensor, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (context, batch) of ``args``; one record per method."""
    model = loaded.model
    names = [m.strip() for m in args.methods.split(",")]
    if "full" not in names:
        raise SystemExit("--methods must include 'full' (the ratios' reference)")
    methods = entries(names, loaded)
    t0 = time.process_time()
    states = layer_states(model, ids[: args.prefix])
    print(f"prefix of {args.prefix} tokens recorded in {time.process_time() - t0:.1f} s CPU")
    decode_ids = ids[args.prefix :]
    records = []
    for tokens in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            runs, fills, sizes = [], {}, {}
            for entry in methods:
                c0 = time.process_time()
                cache = fill(model, entry, states, tokens, batch)
                fills[entry.name] = time.process_time() - c0
                sizes[entry.name] = step_bytes(model, entry, cache, tokens, batch)
                runs.append((entry, cache))
            load_before = os.getloadavg()
            times = measure(model, runs, decode_ids, batch, args.steps)
            load_after = os.getloadavg()
            rates = {n: batch * args.steps / cpu for n, (cpu, _) in times.items()}
            for entry, _ in runs:
                b = sizes[entry.name]
                limit = b.limit_over(sizes["full"])
                ratio = rates[entry.name] / rates["full"]
                record = {
                    "context": tokens,
                    "batch": batch,
                    "method": entry.name,
                    "weights_bytes": b.weights,
                    "cache_bytes": b.cache,
                    "table_bytes": b.tables,
                    "step_bytes": b.total,
                    "bytes_limit": limit,
                    "tokens_per_second": rates[entry.name],
                    "cpu_seconds": times[entry.name][0],
                    "wall_seconds": times[entry.name][1],
                    "ratio_vs_full": ratio,
                    "ratio_vs_full_dense": (
                        rates[entry.name] / rates[FULL_DENSE] if FULL_DENSE in rates else None
                    ),
                    "of_limit": (ratio - 1) / (limit - 1) if limit > 1.0 + 1e-9 else None,
                    "fill_cpu_seconds": fills[entry.name],
                    "load_average": [load_before[0], load_after[0]],
                }
                records.append(record)
                print(row(record), flush=True)
            del runs
    return records


HEADER = (
    "| P | B | method | weights MB | cache MB | tables MB | step MB | limit | tok/s | "
    "vs full | vs full-dense | of limit | load |\n" + "|---" * 13 + "|"
)


def row(r: dict[str, Any]) -> str:
    """One markdown line of a record (MB = 10^6 bytes; load: 1-minute average before/after)."""
    dense = r["ratio_vs_full_dense"]
    of = r["of_limit"]
    return (
        f"| {r['context']} | {r['batch']} | {r['method']} | {r['weights_bytes'] / 1e6:,.0f} "
        f"| {r['cache_bytes'] / 1e6:,.1f} | {r['table_bytes'] / 1e6:,.1f} "
        f"| {r['step_bytes'] / 1e6:,.0f} | {r['bytes_limit']:.2f}× "
        f"| {r['tokens_per_second']:.2f} | {r['ratio_vs_full']:.2f}× "
        f"| {'–' if dense is None else f'{dense:.2f}×'} | {'–' if of is None else f'{of:.2f}'} "
        f"| {r['load_average'][0]:.1f} / {r['load_average'][1]:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--contexts", default="8192,32768", help="tokens per sequence P")
    parser.add_argument("--batches", default="1,8", help="sequences B")
    parser.add_argument("--steps", type=int, default=32, help="timed single-token forwards")
    parser.add_argument(
        "--methods",
        default=f"full,{FULL_DENSE},pn-mix,relay:snapkv@0.5+pn-mix",
        help=f"'full', '{FULL_DENSE}' and kvlab method names",
    )
    parser.add_argument("--prefix", type=int, default=1024, help="real prefill tokens tiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/decode_speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = kvlab.load_model(args.model)
    text = default_text().data[:400_000].decode("utf-8", errors="ignore")
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < args.prefix + args.steps + 1:
        raise SystemExit("the package text is too short for --prefix and --steps")
    pnmix_cpu.load(), relay_cpu.load()  # compiled (or found) before any timing
    print(HEADER)
    records = run(loaded, ids, args)
    machine = {
        "model": loaded.checkpoint,
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "pnmix_cpu_kernel": pnmix_cpu.cpu_kernel_status(),
        "relay_cpu_kernel": relay_cpu.cpu_kernel_status(),
        "steps": args.steps,
        "prefix": args.prefix,
    }
    print(json.dumps(machine))
    print(HEADER)
    print("\n".join(row(r) for r in records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": records}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
