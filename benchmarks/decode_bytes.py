"""The bytes one packed decode step reads, and the time that implies at a memory bandwidth
(kvlab.pnmix.kernels.bytes_model; docs/benchmarks.md, "Decode bytes model").

For each model shape (:data:`~kvlab.pnmix.kernels.bytes_model.MODEL_SHAPES`) and coding
(seed layout, ``pn-mix``, ``kivi-2bit``): the bytes by component, the step's total (cache,
rope table, queries, output, split-K partials at :func:`~kvlab.pnmix.kernels.splits.
choose_splits`' count for ``--sm-count``), float16 SDPA's cache bytes, and the times at
``--bandwidth`` (default: H200, 4.8 TB/s). CPU only; no device needed.

    python benchmarks/decode_bytes.py --batch 8 --tokens 65536
"""

from __future__ import annotations

import argparse
import json

from kvlab.pnmix.kernels.bytes_model import (
    CODINGS,
    H200_BANDWIDTH,
    MODEL_SHAPES,
    decode_bytes,
    sdpa_fp16_bytes,
)
from kvlab.pnmix.kernels.splits import choose_splits


def rows(
    batch: int, tokens: int, shapes: list[str], codings: list[str], sm_count: int
) -> list[dict[str, object]]:
    """One record per (shape, coding): bytes by component and totals."""
    out = []
    for shape in shapes:
        hq, hkv, d = MODEL_SHAPES[shape]
        splits = choose_splits(batch, hkv, tokens, sm_count)
        for coding in codings:
            model = decode_bytes(
                coding,
                batch=batch,
                kv_heads=hkv,
                query_heads=hq,
                head_dim=d,
                tokens=tokens,
                splits=splits,
            )
            out.append(
                {
                    "shape": shape,
                    "coding": coding,
                    "batch": batch,
                    "tokens": tokens,
                    "splits": splits,
                    **model.as_dict(),
                    "sdpa_fp16": sdpa_fp16_bytes(batch, hkv, d, tokens),
                }
            )
    return out


def table(records: list[dict[str, object]], bandwidth: float) -> str:
    """Markdown table of ``records`` (MB = 1e6 bytes, µs at ``bandwidth``)."""
    lines = [
        f"Bandwidth {bandwidth / 1e12:.2f} TB/s; MB = 10^6 bytes",
        "",
        "| shape | coding | codes | scalars | tables + outliers | exact | rope table | cache "
        "| step total | fp16 SDPA | SDPA / cache | step µs | SDPA µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:

        def mb(*keys: str, r: dict[str, object] = r) -> str:
            return f"{sum(int(r[k]) for k in keys) / 1e6:.1f}"  # type: ignore[call-overload]

        cache, total, sdpa = int(r["cache"]), int(r["total"]), int(r["sdpa_fp16"])  # type: ignore[call-overload]
        lines.append(
            f"| {r['shape']} | {r['coding']} | {mb('key_codes', 'value_codes')} "
            f"| {mb('key_scalars', 'value_scalars')} | {mb('tables', 'outliers')} "
            f"| {mb('exact')} | {mb('rope_tables')} | {cache / 1e6:.1f} | {total / 1e6:.1f} "
            f"| {sdpa / 1e6:.1f} | {sdpa / cache:.2f}× | {total / bandwidth * 1e6:.1f} "
            f"| {sdpa / bandwidth * 1e6:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s")
    parser.add_argument("--sm-count", type=int, default=132, help="for the split count")
    parser.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    parser.add_argument("--codings", default=",".join(CODINGS))
    parser.add_argument("--json", help="also write the records here")
    args = parser.parse_args()
    records = rows(
        args.batch,
        args.tokens,
        args.shapes.split(","),
        args.codings.split(","),
        args.sm_count,
    )
    print(table(records, args.bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "rows": records}, f, indent=2)


if __name__ == "__main__":
    main()
