"""Decode-attention benchmark: PN-Mix from packed codes against its baselines, one run.

Single-query decode attention (SmolLM2-135M shape: 9 query heads, 3 kv heads, head_dim 64,
batch 1) over contexts of 1K–32K tokens. Rows, timed in the same process with
``torch.utils.benchmark`` (median of ``blocked_autorange``):

* ``pnmix_<backend>`` — :func:`kvlab.pnmix.attention.pnmix_attention` on the packed cache with
  each backend of ``--backends`` (``torch``: the reference; ``cpu``: the compiled C++ kernel;
  ``triton``: the Triton kernel, CUDA);
* ``dequant_sdpa``   — dequantize the whole PN-Mix cache, then SDPA (what ``transformers``'
  ``QuantizedCache`` does every decode step);
* ``sdpa_fp16`` / ``sdpa_fp32`` — SDPA over the exact cache in that dtype.

``--codings`` names the PN-Mix configurations: ``seed`` (``PNMixConfig`` defaults with
``--group-tokens``: the 2-bit Cartesian/Phase–Norm mix) and any uncalibrated entry of
:data:`kvlab.evaluation.methods.PNMIX_METHODS` (e.g. ``pn-mix``: pre-RoPE per-pair widths, 1 %
exact outliers, Hadamard values, groups of 32), built with the shape's RoPE; its per-pair
tables are computed from the prefill's (random) queries, as in a model's prefill.

Ratios are against ``sdpa_fp32`` of the same context; the table has one line per context and
backend. Bytes are the cache's persistent bytes
(PN-Mix: counted from its stored tensors) and the exact cache's tensor bytes. Throughput of
quantize+pack is the time of one ``PNMixCache.append`` of the whole context (prefill).

    python benchmarks/pnmix_attention.py --contexts 1024,4096,16384,32768 --backends torch,cpu \
        --codings seed,pn-mix --out bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from kvlab.device import accelerator_info, resolve_device
from kvlab.evaluation.methods import PNMIX_METHODS
from kvlab.pnmix.attention import pnmix_attention
from kvlab.pnmix.cache import PNMixCache, PNMixConfig
from kvlab.rope import RotaryConfig, apply_rotary

HEADS_Q, HEADS_KV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M; --head-dim changes the last


def _median_seconds(fn, min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median


def coding_config(name: str, group_tokens: int) -> PNMixConfig:
    """The PN-Mix configuration ``name`` (module docstring)."""
    if name == "seed":
        return PNMixConfig(group_tokens=group_tokens)
    entry = dict(PNMIX_METHODS.get(name, {"missing": True}))
    if "missing" in entry or entry.pop("calibrated", False):
        raise SystemExit(f"--codings: {name!r} is not 'seed' or an uncalibrated PN-Mix method")
    return PNMixConfig(**entry)


def run(
    contexts: list[int],
    device: torch.device,
    min_run_time: float,
    group_tokens: int = 128,
    backends: tuple[str, ...] = ("torch",),
    codings: tuple[str, ...] = ("seed",),
    head_dim: int = HEAD_DIM,
) -> list[dict]:
    rows = []
    for coding in codings:
        rows += _run_coding(
            coding, contexts, device, min_run_time, group_tokens, backends, head_dim
        )
    return rows


def _run_coding(
    coding: str,
    contexts: list[int],
    device: torch.device,
    min_run_time: float,
    group_tokens: int,
    backends: tuple[str, ...],
    head_dim: int = HEAD_DIM,
) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryConfig(head_dim=head_dim, base=100000.0)
    config = coding_config(coding, group_tokens)
    for length in contexts:
        positions = torch.arange(length)
        keys = apply_rotary(
            torch.randn(1, HEADS_KV, length, head_dim, generator=gen), positions, rotary
        ).to(device)
        values = torch.randn(1, HEADS_KV, length, head_dim, generator=gen).to(device)
        query = apply_rotary(
            torch.randn(1, HEADS_Q, 1, head_dim, generator=gen), torch.tensor([length - 1]), rotary
        ).to(device)
        cache = PNMixCache(
            config,
            batch_size=1,
            num_key_value_heads=HEADS_KV,
            head_dim=head_dim,
            device=device,
            rotary=rotary,
        )
        prefill_queries = None
        if config.key_codec.table_bits:  # query-aware tables read the prefill's queries
            prefill_queries = apply_rotary(
                torch.randn(1, HEADS_Q, length, head_dim, generator=gen), positions, rotary
            ).to(device)
        start = time.perf_counter()
        cache.append(keys, values, queries=prefill_queries)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        quantize_seconds = time.perf_counter() - start

        def packed(backend: str, c: PNMixCache = cache, q: torch.Tensor = query) -> torch.Tensor:
            return pnmix_attention(q, c, causal=False, backend=backend)

        def dequant(c: PNMixCache = cache, q: torch.Tensor = query) -> torch.Tensor:
            k, v = c.dequantize()
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        exact = {}
        for dtype in (torch.float16, torch.float32):
            k, v, q = keys.to(dtype), values.to(dtype), query.to(dtype)
            exact[dtype] = (k, v, q)

        def sdpa(dtype: torch.dtype, tensors: dict = exact) -> torch.Tensor:
            k, v, q = tensors[dtype]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        reference = dequant()
        # a sanity check against gross errors (tests/pnmix pins the kernels' rounding): float32
        # sums over the Hadamard output transform's Dv products and the context's groups differ
        # in order, about 1e-4 at head_dim 64 and growing with it (8e-5 at 256 and 16K tokens)
        atol = 1e-4 * max(1.0, head_dim / 64)
        for backend in backends:
            assert torch.allclose(packed(backend), reference, atol=atol, rtol=1e-4), backend
        times = {
            f"pnmix_{b}": _median_seconds(lambda b=b: packed(b), min_run_time) for b in backends
        }
        times["dequant_sdpa"] = _median_seconds(dequant, min_run_time)
        times["sdpa_fp16"] = _median_seconds(lambda: sdpa(torch.float16), min_run_time)
        times["sdpa_fp32"] = _median_seconds(lambda: sdpa(torch.float32), min_run_time)
        base = times["sdpa_fp32"]
        rows.append(
            {
                "coding": coding,
                "context_tokens": length,
                "backends": list(backends),
                "seconds": times,
                "ratio_vs_sdpa_fp32": {name: t / base for name, t in times.items()},
                "pnmix_persistent_bytes": cache.persistent_bytes,
                "phase_norm_pairs": (
                    None if cache.phase_norm_pairs is None else int(cache.phase_norm_pairs.sum())
                ),
                "fp16_cache_bytes": 2 * keys.numel() * 2,
                "fp32_cache_bytes": 2 * keys.numel() * 4,
                "quantize_pack_tokens_per_second": length / quantize_seconds,
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    head = (
        "| coding | context | backend | PN-Mix packed | packed / SDPA fp32 | SDPA fp32 "
        "| SDPA fp16 | dequant+SDPA | PN-Mix bytes | fp16 bytes | quantize+pack tok/s "
        "| Phase–Norm pairs |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        s = r["seconds"]
        for backend in r["backends"]:
            t = s[f"pnmix_{backend}"]
            pn = "–" if r["phase_norm_pairs"] is None else f"{r['phase_norm_pairs']} / 96"
            lines.append(
                f"| {r['coding']} | {r['context_tokens']} | {backend} | {t * 1e3:.3f} ms "
                f"| {t / s['sdpa_fp32']:.2f}× | {s['sdpa_fp32'] * 1e3:.3f} ms "
                f"| {s['sdpa_fp16'] * 1e3:.3f} ms | {s['dequant_sdpa'] * 1e3:.3f} ms "
                f"| {r['pnmix_persistent_bytes']:,} | {r['fp16_cache_bytes']:,} "
                f"| {r['quantize_pack_tokens_per_second']:,.0f} | {pn} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per row")
    parser.add_argument("--group-tokens", type=int, default=128, help="PN-Mix key group (tokens)")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help="key and value head_dim (default 64, SmolLM2's; Gemma 3's is 256)",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="packed-attention backends to time, comma-separated (default: torch,cpu on the "
        "CPU, torch,triton on CUDA)",
    )
    parser.add_argument(
        "--codings",
        default="seed",
        help="PN-Mix configurations, comma-separated: 'seed' and/or PN-Mix method names "
        "(e.g. pn-mix)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/pnmix_attention.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    default = "torch,triton" if device.type == "cuda" else "torch,cpu"
    backends = tuple(b.strip() for b in (args.backends or default).split(","))
    codings = tuple(c.strip() for c in args.codings.split(","))
    rows = run(
        contexts, device, args.min_run_time, args.group_tokens, backends, codings, args.head_dim
    )
    machine = {
        "accelerator": accelerator_info(device).label,
        "processor": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": {
            "num_attention_heads": HEADS_Q,
            "num_key_value_heads": HEADS_KV,
            "head_dim": args.head_dim,
            "batch": 1,
            "query_tokens": 1,
        },
        "group_tokens": args.group_tokens,
        "codings": list(codings),
        "backends": list(backends),
    }
    table = render(rows)
    print(json.dumps(machine))
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
