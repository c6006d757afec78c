"""kvlab's RULER results as rows for benchmarks/kvpress/ruler_side_by_side.py, with each row's ids
digest recomputed from kvlab's own planner.

``kvlab eval --protocol ruler`` keeps each sample's token ids in its task (hashed into the
task key), not in ``raw-ruler-<device>.json``. This script regenerates the run's samples with
the configuration the raw file records (tasks, lengths, samples, seed, chat template, the
default or ``--text`` haystack) through :func:`kvlab.evaluation.ruler_protocol.ruler_units`,
checks every row's context and question token counts against them, and writes one row per
(method, sample) with ``ids_sha256`` — the digest of ``[context_ids, question_ids, outputs]``
that ruler_side_by_side.py compares with the samples file both tools ran (``--suffix`` renames
the methods, so two runs of other code can share a table)::

    python benchmarks/kvpress/ruler_kvlab_rows.py runs/ruler-qwen05/raw-ruler-cpu.json \\
        --model qwen2.5-coder-0.5b --out runs/ruler-qwen05/kvlab-rows.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace


def _digest(context_ids: list[int], question_ids: list[int], outputs: list[str]) -> str:
    """:func:`kvlab.evaluation.ruler.samples_digest` of the one sample."""
    from kvlab.evaluation.ruler import samples_digest

    sample = SimpleNamespace(context_ids=context_ids, question_ids=question_ids, outputs=outputs)
    return samples_digest([sample])  # type: ignore[list-item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="kvlab's raw-ruler-<device>.json")
    parser.add_argument("--model", required=True, help="the model spec the run used")
    parser.add_argument("--text", type=Path, help="the --text the run used (default: none)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--suffix",
        default="",
        help="appended to every method name (rows of two code versions in one table, e.g. "
        "' (2dfe3dc)')",
    )
    args = parser.parse_args()

    from kvlab.data import load_text
    from kvlab.evaluation.ruler_protocol import ruler_units
    from kvlab.models import load_tokenizer

    raw = json.loads(args.raw.read_text())
    conf = raw["configuration"]
    units = ruler_units(
        load_tokenizer(args.model),
        tasks=conf["tasks"],
        lengths=conf["lengths"],
        samples=conf["samples_per_task"],
        seed=conf["seed"],
        haystack_text=load_text(args.text).data.decode("utf-8"),
        chat=conf["chat_template"],
        shared_prefill=conf["shared_prefill"],
    )
    by_key = {(w["task"], w["length"], w["index"]): (u, ids) for u, w, ids in units}
    rows = []
    for method, results in raw["results"].items():
        for r in results:
            unit, ids = by_key[(r["task"], r["length"], r["index"])]
            split = unit["context_tokens"]
            if (split, len(ids) - split) != (r["context_tokens"], r["question_tokens"]):
                raise SystemExit(f"{method} {r['task']} {r['index']}: not the run's sample")
            rows.append(
                {
                    "task": r["task"],
                    "length": r["length"],
                    "index": r["index"],
                    "method": method + args.suffix,
                    "score": r["score"],
                    "prediction": r["prediction"],
                    "cache_bytes": r["storage"]["kv_bytes"],
                    "cache_bytes_16bit": r["storage"]["kv_bytes_16bit"],
                    "ids_sha256": _digest(ids[:split], ids[split:], list(unit["outputs"])),
                }
            )
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
