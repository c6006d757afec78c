"""kvlab's RULER results as rows for benchmarks/kvpress/ruler_side_by_side.py, with each row's ids
digest recomputed from kvlab's own planner.

``kvlab eval --protocol ruler`` keeps each sample's token ids in its task (hashed into the
task key), not in ``raw-ruler-<device>.json``. This script regenerates the run's samples with
the configuration the raw file records (tasks, lengths, samples, seed, chat template, the
default or ``--text`` haystack) through :func:`kvlab.evaluation.ruler_protocol.ruler_units`,
checks every row's context and question token counts against them, and writes one row per
(method, sample) with ``ids_sha256`` — the digest of ``[context_ids, question_ids, outputs]``
that ruler_side_by_side.py compares with the samples file both tools ran (``--suffix`` renames
the methods, so two runs of other code can share a table; ``--method`` keeps only the named
methods' rows, e.g. an older run's rows beside a newer run's)::

    python benchmarks/kvpress/ruler_kvlab_rows.py runs/ruler-qwen05/raw-ruler-cpu.json \\
        --model qwen2.5-coder-0.5b --out runs/ruler-qwen05/kvlab-rows.json

The input may instead be a run's output folder (or its ``tasks/`` folder): the rows
and the configuration then come from the task files themselves (:func:`raw_from_tasks`), so a
run whose code is not at hand — an older commit's committed task files — needs no replay.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _digest(context_ids: list[int], question_ids: list[int], outputs: list[str]) -> str:
    """:func:`kvlab.evaluation.ruler.samples_digest` of the one sample."""
    from kvlab.evaluation.ruler import samples_digest

    sample = SimpleNamespace(context_ids=context_ids, question_ids=question_ids, outputs=outputs)
    return samples_digest([sample])  # type: ignore[list-item]


def raw_from_tasks(folder: Path, model: str) -> dict[str, Any]:
    """The ``configuration`` and ``results`` of a ``raw-ruler-<device>.json`` rebuilt from a RULER
    run's task files (``folder/*.json``, or ``folder/tasks/*.json``), each read with
    :func:`kvlab.evaluation.runfiles.read_sealed` (a sealed file's checksum verified).

    ``samples_per_task`` is the largest index plus one: the rows name their samples, and the
    regenerated units only serve as a lookup, so a run with gaps in its indices works too.

    Raises:
        SystemExit: no RULER task file; files of several models, seeds, chat or shared-prefill
            settings (two runs mixed in one folder); a model other than ``model``; a damaged
            file (the reason from :class:`~kvlab.evaluation.runfiles.DamagedRunFile`).
    """
    from kvlab.evaluation.runfiles import DamagedRunFile, StoredTask, read_sealed

    if (folder / "tasks").is_dir():
        folder = folder / "tasks"
    results: dict[str, list[dict[str, Any]]] = {}
    settings: set[tuple[Any, ...]] = set()
    tasks: set[str] = set()
    lengths: set[int] = set()
    for path in sorted(folder.glob("*.json")):
        try:
            document = read_sealed(path, StoredTask, require_checksum=False)
        except DamagedRunFile as exc:
            raise SystemExit(str(exc)) from None
        assert document is not None  # the file exists: glob found it
        task = document["task"]
        if task.get("protocol") != "ruler":
            continue
        unit, where = task["unit"], task["where"]
        settings.add((task["model"]["spec"], unit["seed"], unit["chat"], unit["shared_prefill"]))
        tasks.add(where["task"])
        lengths.add(int(where["length"]))
        row = dict(document["result"])
        row.update(
            task=where["task"],
            length=where["length"],
            index=where["index"],
            outputs=unit["outputs"],
            context_tokens=unit["context_tokens"],
            question_tokens=task["tokens"] - unit["context_tokens"],
        )
        results.setdefault(task["method"], []).append(row)
    if not results:
        raise SystemExit(f"{folder}: no RULER task file")
    if len(settings) > 1:
        raise SystemExit(
            f"{folder}: task files of {len(settings)} runs (model, seed, chat, shared prefill: "
            f"{sorted(settings, key=str)}); give one run's folder"
        )
    spec, seed, chat, shared_prefill = settings.pop()
    if spec != model:
        raise SystemExit(f"{folder}: the run's model is {spec!r}, not --model {model!r}")
    return {
        "configuration": {
            "tasks": sorted(tasks),
            "lengths": sorted(lengths),
            "samples_per_task": 1 + max(r["index"] for rows in results.values() for r in rows),
            "seed": seed,
            "chat_template": chat,
            "shared_prefill": shared_prefill,
        },
        "results": results,
    }


def load_run(path: Path, model: str) -> dict[str, Any]:
    """The raw file at ``path`` (``configuration`` and ``results``), or one rebuilt from the
    task files when ``path`` is a run's output folder or its ``tasks/`` folder
    (:func:`raw_from_tasks`).

    Raises:
        SystemExit: no such path; a file that is not a kvlab RULER raw file (not JSON, another
            protocol, missing fields); a run of another model than ``model``; the errors of
            :func:`raw_from_tasks`.
    """
    if path.is_dir():
        return raw_from_tasks(path, model)
    if not path.exists():
        raise SystemExit(f"{path}: no such file or folder")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: not a kvlab raw-ruler JSON file ({exc})") from None
    if not (
        isinstance(raw, dict)
        and raw.get("protocol") == "ruler"
        and isinstance(raw.get("configuration"), dict)
        and isinstance(raw.get("results"), dict)
    ):
        raise SystemExit(f"{path}: not a kvlab raw-ruler file (protocol, configuration, results)")
    ran = raw["configuration"].get("model")
    if ran is not None and ran != model:
        raise SystemExit(f"{path}: the run's model is {ran!r}, not --model {model!r}")
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "raw",
        type=Path,
        help="kvlab's raw-ruler-<device>.json, or the run's output folder (or its tasks/)",
    )
    parser.add_argument("--model", required=True, help="the model spec the run used")
    parser.add_argument("--text", type=Path, help="the --text the run used (default: none)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--suffix",
        default="",
        help="appended to every method name (rows of two code versions in one table, e.g. "
        "' (2dfe3dc)')",
    )
    parser.add_argument(
        "--method",
        action="append",
        default=[],
        help="only this method's rows (repeatable; default: every method of the run)",
    )
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        raise SystemExit(f"--out {args.out}: its folder does not exist")

    from kvlab.data import load_text
    from kvlab.evaluation.ruler_protocol import ruler_units
    from kvlab.models import load_tokenizer

    raw = load_run(args.raw, args.model)
    missing = sorted(set(args.method) - set(raw["results"]))
    if missing:
        raise SystemExit(
            f"--method {', '.join(missing)}: not in the run ({', '.join(raw['results'])})"
        )
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
        if args.method and method not in args.method:
            continue
        for r in results:
            unit, ids = by_key[(r["task"], r["length"], r["index"])]
            split = unit["context_tokens"]
            if (split, len(ids) - split) != (r["context_tokens"], r["question_tokens"]):
                raise SystemExit(f"{method} {r['task']} {r['index']}: not the run's sample")
            if "outputs" in r and list(r["outputs"]) != list(unit["outputs"]):
                raise SystemExit(f"{method} {r['task']} {r['index']}: other reference answers")
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
    rows.sort(key=lambda r: (r["method"], r["task"], r["length"], r["index"]))  # either input
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
