"""CUDA check of the Triton packed decode kernel, ready for a machine with a GPU.

Needs CUDA and the ``triton`` extra (``pip install -e ".[test,triton]"`` on top of a CUDA torch).
Two parts, written to ``--out`` (``results.json``, ``results.md``, the reproduce log):

1. **Decode attention**: one query per head (SmolLM2-135M shape: 9 query heads, 3 kv heads,
   head_dim 64), batch 8, 64K tokens per sequence. Times (CUDA events, median of
   ``triton.testing.do_bench``) the Triton packed decode (``pnmix_attention(...,
   backend="triton")``), ``torch`` SDPA in float16 over the exact cache (the issue's baseline,
   target: Triton ≥ 2× faster) and the torch reference backend; reports the bytes each reads
   (PN-Mix persistent bytes vs the float16 cache) and checks Triton against the reference.
   Rows: the seed coding at each ``--group-tokens``, and ``pn-mix`` (the ``kvlab eval``
   method's configuration: pre-RoPE per-pair widths, 1 % outliers, Hadamard values, groups of
   32; its tables from random prefill queries) unless ``--codings seed``.
2. **Diagnostic record**: ``kvlab reproduce --paper pn-mix --device cuda --seeds 42`` into
   ``--out/reproduce`` (its stdout in ``reproduce.log``).

    python benchmarks/cuda_decode.py --out runs/cuda_decode

Nothing here runs on a machine without CUDA (it exits with a one-line reason).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS_Q, HEADS_KV, HEAD_DIM = 9, 3, 64


def decode_attention(
    batch: int, context: int, group_tokens: int, device: torch.device, coding: str = "seed"
) -> dict[str, object]:
    import triton.testing

    from kvlab.evaluation.methods import PNMIX_METHODS
    from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
    from kvlab.rope import RotaryConfig, apply_rotary

    gen = torch.Generator(device=device).manual_seed(0)
    rotary = RotaryConfig(head_dim=HEAD_DIM, base=100000.0)
    positions = torch.arange(context, device=device)
    keys = apply_rotary(
        torch.randn(batch, HEADS_KV, context, HEAD_DIM, generator=gen, device=device),
        positions,
        rotary,
    ).half()
    values = torch.randn(batch, HEADS_KV, context, HEAD_DIM, generator=gen, device=device).half()
    query = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, generator=gen, device=device).half()
    config = (
        PNMixConfig(group_tokens=group_tokens)
        if coding == "seed"
        else PNMixConfig(**PNMIX_METHODS[coding])
    )
    cache = PNMixCache(
        config,
        batch_size=batch,
        num_key_value_heads=HEADS_KV,
        head_dim=HEAD_DIM,
        device=device,
        rotary=rotary,
    )
    for start in range(0, context, 8192):  # appends in chunks bound the encoder's temporaries
        chunk = slice(start, start + 8192)
        queries = None
        if config.key_codec.table_bits and start == 0:  # tables: the first chunk's queries
            queries = apply_rotary(
                torch.randn(batch, HEADS_Q, keys[:, :, chunk].shape[2], HEAD_DIM, device=device),
                positions[chunk],
                rotary,
            ).half()
        cache.append(keys[:, :, chunk], values[:, :, chunk], queries=queries)
    torch.cuda.synchronize(device)

    def triton_packed() -> torch.Tensor:
        return pnmix_attention(query, cache, causal=False, backend="triton")

    def torch_packed() -> torch.Tensor:
        return pnmix_attention(query, cache, causal=False, backend="torch")

    def sdpa_fp16() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    ref = torch_packed().float()
    out = triton_packed().float()
    err = float((out - ref).abs().max())
    times = {
        name: float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
        for name, fn in (
            ("triton_packed_ms", triton_packed),
            ("sdpa_fp16_ms", sdpa_fp16),
            ("torch_packed_ms", torch_packed),
        )
    }
    fp16_bytes = 2 * keys.numel() * keys.element_size()
    return {
        "coding": coding,
        "batch": batch,
        "context_tokens": context,
        "group_tokens": config.group_tokens,
        **times,
        "sdpa_fp16_over_triton": times["sdpa_fp16_ms"] / times["triton_packed_ms"],
        "pnmix_persistent_bytes": cache.persistent_bytes,
        "fp16_cache_bytes": fp16_bytes,
        "bytes_ratio": fp16_bytes / cache.persistent_bytes,
        "triton_vs_torch_max_abs_error": err,
        "output_max_abs": float(ref.abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/cuda_decode"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--group-tokens", default="32,128", help="PN-Mix key groups to time")
    parser.add_argument("--codings", default="seed,pn-mix", help="'seed' and/or 'pn-mix'")
    parser.add_argument("--skip-reproduce", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_decode.py needs a CUDA device (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("cuda_decode.py needs triton: pip install -e '.[triton]'")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    codings = [c.strip() for c in args.codings.split(",")]
    rows = []
    if "seed" in codings:
        rows += [
            decode_attention(args.batch, args.context, int(g), device)
            for g in args.group_tokens.split(",")
        ]
    rows += [
        decode_attention(args.batch, args.context, 32, device, coding)
        for coding in codings
        if coding != "seed"
    ]
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "decode_attention": rows,
    }
    if not args.skip_reproduce:
        cmd = [
            sys.executable,
            "-m",
            "kvlab.cli",
            "reproduce",
            "--paper",
            "pn-mix",
            "--device",
            "cuda",
            "--seeds",
            "42",
            "--output-dir",
            str(args.out / "reproduce"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (args.out / "reproduce.log").write_text(proc.stdout + proc.stderr)
        result["reproduce"] = {"command": " ".join(cmd[2:]), "returncode": proc.returncode}
    lines = [
        f"Device: {result['device']}, torch {result['torch']}, triton {result['triton']}",
        "",
        "| coding | batch | context | groups | Triton packed | SDPA fp16 | SDPA / Triton "
        "| torch packed | PN-Mix bytes | fp16 bytes | bytes ratio | max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['coding']} | {r['batch']} | {r['context_tokens']} | {r['group_tokens']} "
            f"| {r['triton_packed_ms']:.3f} ms | {r['sdpa_fp16_ms']:.3f} ms "
            f"| {r['sdpa_fp16_over_triton']:.2f}× | {r['torch_packed_ms']:.3f} ms "
            f"| {r['pnmix_persistent_bytes']:,} | {r['fp16_cache_bytes']:,} "
            f"| {r['bytes_ratio']:.2f}× | {r['triton_vs_torch_max_abs_error']:.2e} |"
        )
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
