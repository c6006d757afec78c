"""Which answer tokens a KVzip eviction keeps, layer by layer: kvlab's default KVzip policy
against kvpress's (``KVzipPress``'s) on the same RULER samples.

Diagnoses where two selections part (docs/archive/results-history.md 12.5.1: at 0.875 kvlab's
KVzip answers 6 points below kvpress's). For each sample (``TASK:INDEX`` of a samples JSONL
written by benchmarks/kvpress/ruler_samples.py, the token ids both tools ran) and each policy,
one prefill is captured, the context compressed
(:func:`kvlab.evaluation.questions.compress_context`) and the question answered greedily; then,
per decoder layer, the *answer tokens* — every context token whose text overlaps an occurrence
of one of the sample's reference answers (the needle values: ``outputs``) — are looked up in the
kept set of each kv head.

Policies (both no relay, 4 sinks, adaptive heads; :class:`kvlab.relay.EvictionConfig`):

* ``kvlab``: the library default (:func:`kvlab.relay.policies.default_policy_settings`
  ``("kvzip")``: protected recent window of 3/8 of each layer's per-head budget, three
  quarters of the budget split across layers by the scores, the prefill's last 128 queries
  scored too; chosen on perplexity windows of *Hamlet*, docs/archive/results-history.md section 7);
* ``kvpress``: kvpress 0.5.5's ``KVzipPress`` policy (no protected window, the whole budget to
  the top scores over every layer and kv head, reconstruction queries only), which reproduced
  ``KVzipPress``'s KL to every printed digit (docs/archive/results-history.md section 7, "Parity").

With ``--kvpress-kept`` (the JSON of ``benchmarks/kvpress/ruler_kvpress.py kept``, kvpress's own
``KVzipPress`` kept positions at the same ratio, run in kvpress's venv) each row also holds
``kvpress_press``: that kept set's difference from the policy's and its answer-token retention.

Prints one JSON object per (sample, policy): the answer, its RULER score, the answer tokens'
count, ``kept_any`` (per layer, the fraction of answer tokens kept by at least one kv head),
``kept_mean`` (its mean over layers), ``layers_all_kept`` (layers keeping every answer token in
some head), the tokens kept per layer (summed over kv heads) and ``recent_share``: the share of
all kept tokens that lie in the context's last ``recent_tokens`` (the default policy's
protected window under the uniform split, ``round(f * round((1 - R) * T))`` with ``f`` its
``window_fraction``, 0.375). A diagnostic: no
setting is chosen from it.

    OMP_NUM_THREADS=2 python benchmarks/kvpress/kvzip_needle_retention.py \\
        --samples samples-s2.jsonl --sample niah_multikey_1:0 --sample niah_multiquery:3 \\
        --ratio 0.875 --out kept.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

#: kvpress 0.5.5 ``KVzipPress``'s policy as ``kvlab eval`` method params
#: (docs/archive/results-history.md 7).
KVPRESS_POLICY = {
    "scorer": "kvzip",
    "scorer_options": {},
    "window_fraction": None,
    "window_tokens": 0,
    "layer_budget": "scores",
    "scores_share": 1.0,
}


def token_char_spans(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character span ``[start, end)`` of each token of ``ids`` in ``tokenizer.decode(ids)``.

    Raises:
        ValueError: the tokens' texts, decoded one by one, do not concatenate to the whole
            decode (a character split across tokens): spans would be wrong.
    """
    pieces = [tokenizer.decode([int(i)]) for i in ids]
    whole = tokenizer.decode([int(i) for i in ids])
    if "".join(pieces) != whole:
        raise ValueError("per-token decodes do not concatenate to the decoded context")
    spans, at = [], 0
    for piece in pieces:
        spans.append((at, at + len(piece)))
        at += len(piece)
    return spans


def answer_tokens(text: str, spans: Sequence[tuple[int, int]], answers: Sequence[str]) -> list[int]:
    """Indices of the tokens whose span overlaps an occurrence of any string of ``answers`` in
    ``text`` (every occurrence), sorted."""
    found: set[int] = set()
    for answer in answers:
        start = text.find(answer)
        while start >= 0:
            end = start + len(answer)
            found.update(i for i, (a, b) in enumerate(spans) if a < end and b > start)
            start = text.find(answer, start + 1)
    return sorted(found)


def kept_sets(cache: Any) -> list[list[set[int]]]:
    """Per relay layer, per kv head of sequence 0: the stream indices it keeps."""
    return [
        [
            set(layer.segment(0, h).original_positions.tolist())
            for h in range(len(layer.tokens_per_head(0)))
        ]
        for layer in cache.relay_layers()
    ]


def retention(kept: list[list[set[int]]], targets: Sequence[int]) -> dict[str, Any]:
    """Answer-token retention per layer (module docstring)."""
    per_layer = []
    for heads in kept:
        held = sum(any(t in h for h in heads) for t in targets)
        per_layer.append(held / len(targets) if targets else 1.0)
    return {
        "kept_any": [round(x, 3) for x in per_layer],
        "kept_mean": round(sum(per_layer) / len(per_layer), 4),
        "layers_all_kept": sum(x == 1.0 for x in per_layer),
    }


def compare_kept(ours: list[list[set[int]]], theirs: list[list[set[int]]]) -> dict[str, Any]:
    """Two kept sets (per layer, per kv head): entries kept by either but not both, the heads
    and the layers where they differ.

    Raises:
        ValueError: different numbers of layers or heads.
    """
    if [len(h) for h in ours] != [len(h) for h in theirs]:
        raise ValueError("the kept sets have different layers or kv heads")
    per_layer = [
        sum(len(a ^ b) for a, b in zip(la, lb, strict=True))
        for la, lb in zip(ours, theirs, strict=True)
    ]
    return {
        "symmetric_difference": sum(per_layer),
        "heads_differing": sum(
            a != b for la, lb in zip(ours, theirs, strict=True) for a, b in zip(la, lb, strict=True)
        ),
        "layers_differing": [i for i, d in enumerate(per_layer) if d],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path, required=True)
    parser.add_argument("--sample", action="append", required=True, help="TASK:INDEX")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--policy", action="append", choices=("kvlab", "kvpress"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--kvpress-kept",
        type=Path,
        default=None,
        help="JSON of `ruler_kvpress.py kept` at the same ratio: compared with each policy",
    )
    parser.add_argument(
        "--kept-out",
        type=Path,
        default=None,
        help="write each policy's kept sets, {POLICY: {TASK:INDEX: [layers][heads][positions]}}",
    )
    args = parser.parse_args(argv)

    import torch

    sys.path.insert(0, str(_HERE))
    from ruler_kvpress import read_samples, ruler_score

    from kvlab.evaluation.calibration import prepare_method
    from kvlab.evaluation.methods import parse_method
    from kvlab.evaluation.questions import answer, compress_context
    from kvlab.evaluation.ruler_protocol import CAPTURE_ATTENTION, stop_token_ids
    from kvlab.integrations.prefill_replay import capture_prefill
    from kvlab.models.loading import checkpoint_sha256, load_model

    wanted = []
    for spec in args.sample:
        task, _, index = spec.rpartition(":")
        wanted.append((task, int(index)))
    samples = {(s["task"], int(s["index"])): s for s in read_samples(args.samples)}
    missing = [w for w in wanted if w not in samples]
    if missing:
        parser.error(f"not in {args.samples}: {missing}")
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    base = parse_method(f"evict-no-relay:kvzip@{args.ratio}", protocol="ruler")
    prepared = prepare_method(
        base, model, tokenizer, checkpoint_sha256=checkpoint_sha256(args.model),
        dtype="float32", cache_dir=None,
    )  # fmt: skip
    methods = {
        "kvlab": base,
        "kvpress": dataclasses.replace(base, params={**base.params, **KVPRESS_POLICY}),
    }
    stops = stop_token_ids(tokenizer)
    theirs = json.loads(args.kvpress_kept.read_text()) if args.kvpress_kept else {}
    written: dict[str, dict[str, Any]] = {}
    out = args.out.open("a") if args.out else None
    for key in wanted:
        sample = samples[key]
        ids = [int(i) for i in sample["context_ids"]]
        text = tokenizer.decode(ids)
        targets = answer_tokens(text, token_char_spans(tokenizer, ids), sample["outputs"])
        context = torch.tensor([ids], dtype=torch.int64)
        question = torch.tensor([sample["question_ids"]], dtype=torch.int64)
        capture = capture_prefill(model, context, attention=CAPTURE_ATTENTION)
        # the default policy's protected window under the uniform split (docs above)
        fraction = float(base.params["window_fraction"])
        recent = round(fraction * round((1 - args.ratio) * len(ids)))
        for policy in args.policy or ["kvlab", "kvpress"]:
            compressed = compress_context(
                model, context, methods[policy], prepared=prepared, capture=capture
            )
            kept = kept_sets(compressed.cache)
            if args.kept_out:
                name = f"{key[0]}:{key[1]}"
                written.setdefault(policy, {})[name] = [[sorted(h) for h in hs] for hs in kept]
                args.kept_out.write_text(json.dumps(written))
            got = answer(
                model, compressed, question,
                max_new_tokens=int(sample["max_new_tokens"]), stop_token_ids=stops,
            )  # fmt: skip
            prediction = tokenizer.decode([t for t in got.tokens if t not in stops])
            per_layer = [sum(len(h) for h in heads) for heads in kept]
            in_recent = sum(
                sum(p >= len(ids) - recent for p in head) for heads in kept for head in heads
            )
            row = {
                "task": key[0],
                "index": key[1],
                "policy": policy,
                "ratio": args.ratio,
                "prediction": prediction,
                "score": ruler_score(prediction, sample["outputs"], sample["metric"]),
                "answer_tokens": len(targets),
                **retention(kept, targets),
                "kept_per_layer": per_layer,
                "recent_tokens": recent,
                "recent_share": round(in_recent / sum(per_layer), 4),
            }
            other = theirs.get(f"{key[0]}:{key[1]}")
            if other is not None:
                sets = [[set(h) for h in heads] for heads in other]
                row["kvpress_press"] = {
                    **compare_kept(kept, sets),
                    **retention(sets, targets),
                    "kept_per_layer": [sum(len(h) for h in heads) for heads in sets],
                }
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
