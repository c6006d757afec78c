"""GPU sweep of packed decode attention: the older Triton kernel, the split-K GQA kernel and
float16 SDPA, each replayed from a CUDA graph (docs/benchmarks.md, "Split-K decode kernel").

For each model shape (SmolLM2-135M: 9 query / 3 kv heads, head_dim 64; Qwen2.5-1.5B: 12 / 2,
head_dim 128) and coding (seed layout, ``pn-mix``, ``kivi-2bit``) at ``--batch`` x
``--context`` tokens: builds the cache (random RoPE'd keys, values; the tables of the
query-aware codings from random prefill queries, as benchmarks/cuda_decode.py does), checks
each kernel configuration against the torch reference (tests/fixtures/kernel_checks.py
tolerance), and times it replayed from a CUDA graph: ``triton.testing.do_bench_cudagraph``
(back-to-back replays, L2 warm) and :func:`cold_graph_ms` (L2 flushed before each replay).
Achieved bandwidth = the bytes model's step bytes (kvlab.pnmix.kernels.bytes_model) / the
flushed time, and its fraction of the device's peak (by device name, or ``--bandwidth``).

Results are written as they come (``--out``: ``results.jsonl``, ``results.md``); past
``--budget-s`` seconds the remaining measurements are skipped (recorded as such).
``--dry-run`` prints the plan and the bytes model without CUDA (and checks on tiny CPU caches
that the split-K kernel accepts every planned coding).

    python benchmarks/splitk_decode.py --out runs/gpu/sweep
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.pnmix.kernels.bytes_model import (
    H200_BANDWIDTH,
    MODEL_SHAPES,
    PEAK_BANDWIDTH,
    decode_bytes,
    sdpa_fp16_bytes,
)
from kvlab.pnmix.kernels.splits import choose_splits

CODINGS = ("seed", "pn-mix", "kivi-2bit")

#: (kernel, options) timed per cache, in two passes: the first row of every cache before the
#: variants ("old" = triton_decode.triton_launcher, "splitk" = triton_splitk.splitk_launcher;
#: splits "x2": twice choose_splits' count). Every cache stays on the device (a few GB).
FIRST: list[tuple[str, dict[str, Any]]] = [
    ("sdpa_fp16", {}),
    ("splitk", {}),
    ("old", {"dot": False, "num_warps": 4}),
]
VARIANTS: list[tuple[str, dict[str, Any]]] = [  # most informative first (the budget cuts)
    ("splitk", {"precision": "tf32x3"}),
    ("splitk", {"precision": "bf16x6"}),
    ("splitk", {"dot": False, "block_t": 16}),
    ("splitk", {"precision": "tf32"}),
    ("splitk", {"splits": "x2"}),
    ("splitk", {"num_warps": 4}),
    ("splitk", {"num_warps": 8}),
    ("splitk", {"block_t": 16}),
    ("old", {"dot": True, "num_warps": 4}),
]
#: skipped: the older kernel's dot path on pn-mix (~90 ms a call, docs/benchmarks.md)
SKIP = {("pn-mix", "old", True)}


def peak_bandwidth(name: str, override: float | None) -> float:
    """Peak bytes/s of device ``name`` (:data:`PEAK_BANDWIDTH`), ``override`` if given, else
    the H200's."""
    if override:
        return override
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return H200_BANDWIDTH


def plan(shapes: list[str], codings: list[str]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(shape, coding, kernel, options) in the order they are measured."""
    out = []
    for rows in (FIRST, VARIANTS):
        for shape in shapes:
            for coding in codings:
                for kernel, opts in rows:
                    if (coding, kernel, opts.get("dot")) not in SKIP:
                        out.append((shape, coding, kernel, opts))
    return out


def config_for(coding: str) -> Any:
    from kvlab.evaluation.methods import PNMIX_METHODS
    from kvlab.pnmix import PNMixConfig

    return PNMixConfig() if coding == "seed" else PNMixConfig(**PNMIX_METHODS[coding])


def build(
    shape: str, coding: str, batch: int, context: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(float16 query [B, H_q, 1, D], keys, values [B, H_kv, T, D], the filled cache)."""
    from kvlab.pnmix import PNMixCache
    from kvlab.rope import RotaryConfig, apply_rotary

    hq, hkv, d = MODEL_SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    rotary = RotaryConfig(head_dim=d, base=100000.0)
    positions = torch.arange(context, device=device)
    keys = torch.randn(batch, hkv, context, d, generator=gen, device=device)
    keys = apply_rotary(keys, positions, rotary).half()
    values = torch.randn(batch, hkv, context, d, generator=gen, device=device).half()
    query = torch.randn(batch, hq, 1, d, generator=gen, device=device).half()
    config = config_for(coding)
    cache = PNMixCache(
        config,
        batch_size=batch,
        num_key_value_heads=hkv,
        head_dim=d,
        device=device,
        rotary=rotary,
    )
    for start in range(0, context, 8192):  # chunks bound the encoder's temporaries
        chunk = slice(start, start + 8192)
        queries = None
        if config.key_codec.table_bits and start == 0:
            n = keys[:, :, chunk].shape[2]
            queries = torch.randn(batch, hq, n, d, device=device)
            queries = apply_rotary(queries, positions[chunk], rotary).half()
        cache.append(keys[:, :, chunk], values[:, :, chunk], queries=queries)
    torch.cuda.synchronize(device)
    return query, keys, values, cache


def launcher(kernel: str, opts: dict[str, Any], query: torch.Tensor, cache: Any) -> Any:
    """A no-argument launch function of ``kernel`` over ``cache`` (float32 query)."""
    from kvlab.pnmix.attention import packed_kv
    from kvlab.pnmix.reference import reference_keys

    kv = packed_kv(cache)
    mu = reference_keys(kv)
    common = dict(scale=query.shape[-1] ** -0.5, causal=False, logit_softcap=None, sink_logits=None)
    if kernel == "old":
        from kvlab.pnmix.kernels.triton_decode import triton_launcher

        return triton_launcher(query, kv, cache.kernel_decode, mu, **common, **opts)
    from kvlab.pnmix.kernels.triton_splitk import splitk_launcher

    opts = dict(opts)
    if opts.get("splits") == "x2":
        sm = torch.cuda.get_device_properties(query.device).multi_processor_count
        b, _, _, _ = query.shape
        hkv = cache.num_key_value_heads
        opts["splits"] = 2 * choose_splits(b, hkv, int(kv.seq_lengths.max()), sm)
    return splitk_launcher(query, kv, cache.kernel_decode, mu, **common, **opts)


def cold_graph_ms(fn: Any) -> float:
    """Median ms of ``fn`` captured in one CUDA graph and replayed with the L2 cache flushed
    before every replay (``triton.testing.do_bench`` clears it): a packed cache of 60-130 MB
    would otherwise be partly L2-resident across back-to-back replays (H200 L2: 50 MB)."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median"))


def write_md(out: Path, records: list[dict[str, Any]], device: str, peak: float) -> None:
    lines = [
        f"Device: {device}; peak {peak / 1e12:.2f} TB/s; CUDA-graph medians",
        "",
        "| shape | coding | kernel | options | graph ms (L2 warm) | graph ms (L2 flushed) "
        "| GB/s (flushed) | of peak | max abs err (tol) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "ms" not in r:
            lines.append(
                f"| {r['shape']} | {r['coding']} | {r['kernel']} | {r['options']} "
                f"| {r.get('status', '')} | | | | |"
            )
            continue
        err = r.get("max_abs_error")
        check = "" if err is None else f"{err:.1e} ({r['tolerance']:.1e})"
        lines.append(
            f"| {r['shape']} | {r['coding']} | {r['kernel']} | {r['options']} | {r['ms']:.4f} "
            f"| {r['cold_ms']:.4f} | {r['gb_s']:.0f} | {r['of_peak']:.1%} | {check} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> None:
    import triton.testing

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    from kernel_checks import kernel_tolerance

    from kvlab.pnmix import pnmix_attention

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth(name, args.bandwidth)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "results.jsonl"
    jsonl.write_text("")
    start = time.monotonic()
    records: list[dict[str, Any]] = []
    built: dict[tuple[str, str], dict[str, Any]] = {}
    for shape, coding, kernel, opts in plan(args.shapes, args.codings):
        rec: dict[str, Any] = dict(shape=shape, coding=coding, kernel=kernel, options=opts)
        if time.monotonic() - start > args.budget_s:
            rec["status"] = "skipped (budget)"
        else:
            try:
                if isinstance(built.get((shape, coding)), Exception):
                    raise built[shape, coding]  # type: ignore[misc]
                if (shape, coding) not in built:
                    built[shape, coding] = RuntimeError("the cache build failed before")  # type: ignore[assignment]
                    q16, keys, values, cache = build(
                        shape, coding, args.batch, args.context, device
                    )
                    q32 = q16.float()
                    ref = pnmix_attention(q32, cache, causal=False, backend="torch")
                    built[shape, coding] = dict(
                        q16=q16,
                        q32=q32,
                        keys=keys,
                        values=values,
                        cache=cache,
                        ref=ref,
                        tol=kernel_tolerance(q32, cache),
                    )
                state = built[shape, coding]
                hq, hkv, d = MODEL_SHAPES[shape]
                if kernel == "sdpa_fp16":

                    def fn(st: dict[str, Any] = state) -> torch.Tensor:
                        return F.scaled_dot_product_attention(
                            st["q16"], st["keys"], st["values"], enable_gqa=True
                        )

                    nbytes = sdpa_fp16_bytes(args.batch, hkv, d, args.context)
                else:
                    fn = launcher(kernel, opts, state["q32"], state["cache"])
                    err = float((fn() - state["ref"]).abs().max())
                    rec.update(max_abs_error=err, tolerance=state["tol"], ok=err <= state["tol"])
                    nbytes = decode_bytes(
                        coding,
                        batch=args.batch,
                        kv_heads=hkv,
                        query_heads=hq,
                        head_dim=d,
                        tokens=args.context,
                    ).total
                ms = float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
                cold = cold_graph_ms(fn)
                gb_s = nbytes / cold / 1e6
                rec.update(ms=ms, cold_ms=cold, bytes=nbytes, gb_s=gb_s, of_peak=gb_s * 1e9 / peak)
            except Exception as exc:  # a first run on new hardware: record and go on
                rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
        with jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        write_md(args.out, records, name, peak)
    meta = dict(
        device=name,
        peak_bandwidth=peak,
        torch=torch.__version__,
        triton=triton.__version__,
        batch=args.batch,
        context=args.context,
        seconds=time.monotonic() - start,
    )
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print((args.out / "results.md").read_text())


def dry_run(args: argparse.Namespace) -> None:
    """Print the plan and the bytes model; check that the split-K kernel accepts a tiny CPU
    cache of every planned coding (so a GPU run fails only on the GPU's own grounds)."""
    from kvlab.pnmix import PNMixCache
    from kvlab.pnmix.attention import packed_kv
    from kvlab.rope import RotaryConfig, apply_rotary

    for i, (shape, coding, kernel, opts) in enumerate(plan(args.shapes, args.codings)):
        print(f"{i:2d} {shape} {coding} {kernel} {opts}")
    for shape in args.shapes:
        hq, hkv, d = MODEL_SHAPES[shape]
        splits = choose_splits(args.batch, hkv, args.context, 132)
        print(f"{shape}: H_q {hq}, H_kv {hkv}, D {d}; splits on 132 SMs: {splits}")
        for coding in args.codings:
            model = decode_bytes(
                coding,
                batch=args.batch,
                kv_heads=hkv,
                query_heads=hq,
                head_dim=d,
                tokens=args.context,
                splits=splits,
            )
            cfg = config_for(coding)
            rotary = RotaryConfig(head_dim=d, base=100000.0)
            cache = PNMixCache(
                cfg, batch_size=1, num_key_value_heads=hkv, head_dim=d, rotary=rotary
            )
            n = cfg.sink_tokens + cfg.residual_tokens + 2 * cfg.group_tokens
            gen = torch.Generator().manual_seed(0)
            keys = apply_rotary(torch.randn(1, hkv, n, d, generator=gen), torch.arange(n), rotary)
            cache.append(
                keys,
                torch.randn(1, hkv, n, d, generator=gen),
                queries=torch.randn(1, hq, n, d, generator=gen),
            )
            try:
                from kvlab.pnmix.kernels.triton_splitk import splitk_unsupported

                reason = splitk_unsupported(packed_kv(cache), cache.kernel_decode)
            except ImportError as exc:
                reason = f"(triton missing: {exc})"
            print(
                f"  {coding}: step {model.total / 1e6:.1f} MB, cache {model.cache / 1e6:.1f} MB, "
                f"{model.total / H200_BANDWIDTH * 1e6:.1f} µs at 4.8 TB/s; "
                f"split-K: {reason or 'supported'}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu/sweep"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=list(MODEL_SHAPES))
    parser.add_argument("--codings", type=lambda s: s.split(","), default=list(CODINGS))
    parser.add_argument("--bandwidth", type=float, default=None, help="peak bytes/s override")
    parser.add_argument("--budget-s", type=float, default=230.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args)
        return
    if not torch.cuda.is_available():
        sys.exit("splitk_decode.py needs CUDA (or --dry-run)")
    run(args)


if __name__ == "__main__":
    main()
