"""KVzip eviction policies and repeat prompts on RULER samples, from one prefill and one
reconstruction pass per (sample, prompt): the tuning sweep behind ``evict-no-relay:kvzip``'s
RULER rows (docs/archive/results-history.md 12.5.3).

For each sample (a samples JSONL of benchmarks/kvpress/ruler_samples.py: the token ids, answers and
metric) the context's prefill is captured once
(:func:`kvlab.integrations.prefill_replay.capture_prefill`); ``full`` answers the question
greedily; then each *config* ``PROMPT:POLICY`` at each ratio compresses the context from the
capture (:func:`kvlab.evaluation.questions.compress_context`: configs with the same prompt and
``prefill_queries`` share one reconstruction pass) and

* answers greedily: ``score`` (RULER string match in [0, 1], kvlab.evaluation.ruler);
* scores ``full``'s answer by teacher forcing (:func:`kvlab.evaluation.questions.answer_nll`):
  ``nll_full_answer``, the mean NLL in nats per token of full's answer tokens — a per-sample
  measure of how far the compression moves the model, finer than right or wrong.

Prompts (:class:`kvlab.relay.kvzip.ReconstructionPrompt`): ``chat`` — the library's (the chat
template's suffix after the repeat request, the template prefix not rebuilt: kvpress's and
KVzip's handling, docs/design.md "Reconstruction scoring"); ``raw`` — the raw-text request on
every context (``from_tokenizer(chat=False)``, kvlab before commit 2dfe3dc).

Policies (overrides of ``evict-no-relay:kvzip@R``'s params, the library default first):

* ``kvlab`` — :func:`kvlab.relay.policies.default_policy_settings` ``("kvzip")``: protected
  recent window of 3/8 of each head's budget, 3/4 of the budget split across layers by the
  scores, the prefill's last 128 queries scored too;
* ``kvpress`` — kvpress 0.5.5 ``KVzipPress``'s (no window, the whole budget to the top scores
  over all layers and heads, reconstruction queries only: its kept set,
  docs/archive/results-history.md 12.5.2);
* ``nowindow`` — ``kvlab`` without the protected window;
* ``nowindow-share1`` — no window, the whole budget split by the scores (``kvpress`` plus the
  128 prefill queries);
* ``window-0.125`` — ``kvlab`` with a window of 1/8 of the budget;
* ``adakv`` — ``kvpress`` with every layer the same budget, its heads sharing it by the scores
  (Ada-KV's head-adaptive split of one layer budget, Feng et al. 2024, arXiv:2407.11550);
* ``share0.75`` — ``kvpress`` with 3/4 of the model's budget split across layers by the scores,
  the rest uniform (``kvlab``'s layer split without its window and prefill queries).

Rows (JSON lines, appended to ``--out`` as they finish; a rerun skips the rows it holds):
``{"task", "length", "index", "config", "ratio", "prediction", "score", "nll_full_answer",
"answer_tokens", "kv_bytes"}``; ``config`` ``"full"`` rows have ``ratio`` 0. ``--summary``
prints per config and ratio the accuracy (%) of each task and their mean, the mean
``nll_full_answer`` and the paired difference against ``--baseline`` (percentile bootstrap over
samples within tasks, kvlab.evaluation.ruler_report.paired_bootstrap), then per config the two
averaged over the ratios (the metric of docs/results/runs/kvzip-prompt-seed1/DECISION_RULE.md).

    OMP_NUM_THREADS=1 python benchmarks/kvpress/kvzip_policy_sweep.py --samples samples-s1.jsonl \\
        --indices 0-3 --ratio 0.5 --ratio 0.75 --config chat:kvlab --config chat:kvpress \\
        --out sweep.jsonl
    python benchmarks/kvpress/kvzip_policy_sweep.py --summary sweep.jsonl --baseline chat:kvpress
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: overrides of ``evict-no-relay:kvzip@R``'s method params (module docstring)
POLICIES: dict[str, dict[str, Any]] = {
    "kvlab": {},
    "kvpress": {
        "scorer_options": {},
        "window_fraction": None,
        "window_tokens": 0,
        "layer_budget": "scores",
        "scores_share": 1.0,
    },
    "nowindow": {"window_fraction": None, "window_tokens": 0},
    "nowindow-share1": {"window_fraction": None, "window_tokens": 0, "scores_share": 1.0},
    "window-0.125": {"window_fraction": 0.125},
    "adakv": {
        "scorer_options": {},
        "window_fraction": None,
        "window_tokens": 0,
        "layer_budget": "uniform",
        "scores_share": 1.0,
    },
    "share0.75": {
        "scorer_options": {},
        "window_fraction": None,
        "window_tokens": 0,
        "layer_budget": "scores",
        "scores_share": 0.75,
    },
}
PROMPTS = ("chat", "raw")


def parse_config(text: str) -> tuple[str, str]:
    """``PROMPT:POLICY`` → its parts.

    Raises:
        ValueError: an unknown prompt or policy.
    """
    prompt, _, policy = text.partition(":")
    if prompt not in PROMPTS or policy not in POLICIES:
        raise ValueError(
            f"config {text!r}: PROMPT:POLICY with PROMPT in {PROMPTS}, POLICY in {list(POLICIES)}"
        )
    return prompt, policy


def parse_indices(text: str) -> list[int]:
    """``"0-3"`` or ``"0,2,5"`` → sample indices."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def row_key(row: dict[str, Any]) -> tuple[str, int, int, str, float]:
    return (row["task"], int(row["length"]), int(row["index"]), row["config"], float(row["ratio"]))


def read_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def summarize(rows: Sequence[dict[str, Any]], baseline: str | None) -> str:
    """The summary table (module docstring) as Markdown; only samples every (config, ratio)
    row holds are counted, so the columns compare the same samples."""
    from kvlab.evaluation.ruler_report import paired_bootstrap, task_mean_accuracy

    by: dict[tuple[str, float], dict[tuple[str, int, int], dict[str, Any]]] = {}
    for row in rows:
        k = (row["config"], float(row["ratio"]))
        by.setdefault(k, {})[(row["task"], int(row["length"]), int(row["index"]))] = row
    common = set.intersection(*(set(v) for v in by.values()))
    tasks = sorted({k[0] for k in common})
    lines = [
        f"samples held by every row: {len(common)} ({len(tasks)} tasks)",
        "",
        "| config | ratio | " + " | ".join(tasks) + " | mean | NLL of full's answer (nats/token) "
        f"| Δ vs {baseline} [95 % CI] |",
        "|---|---:|" + "---:|" * len(tasks) + "---:|---:|---:|",
    ]
    per_config: dict[str, list[tuple[float, float | None]]] = {}
    for (config, ratio), held in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        scores = {k: float(held[k]["score"]) for k in common}
        nll = [held[k]["nll_full_answer"] for k in common if held[k]["nll_full_answer"] is not None]
        diff = ""
        ref = by.get((baseline, ratio)) if baseline else None
        if ref is not None and config != baseline:
            d, lo, hi = paired_bootstrap(scores, {k: float(ref[k]["score"]) for k in common})
            diff = f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]"
        mean = task_mean_accuracy(scores, tasks)
        mean_nll = statistics.fmean(nll) if nll else None
        if config != "full":
            per_config.setdefault(config, []).append((mean, mean_nll))
        nll_text = "—" if mean_nll is None else f"{mean_nll:.4f}"
        cells = " | ".join(f"{task_mean_accuracy(scores, [task]):.1f}" for task in tasks)
        lines.append(f"| {config} | {ratio:g} | {cells} | {mean:.1f} | {nll_text} | {diff} |")
    lines += [
        "",
        "averaged over the ratios (each ratio's task mean and mean NLL, then their mean):",
        "",
        "| config | ratios | mean | NLL of full's answer (nats/token) |",
        "|---|---:|---:|---:|",
    ]
    for config, by_ratio in sorted(per_config.items()):
        nlls = [n for _, n in by_ratio if n is not None]
        nll_text = f"{statistics.fmean(nlls):.4f}" if len(nlls) == len(by_ratio) else "—"
        mean = statistics.fmean(m for m, _ in by_ratio)
        lines.append(f"| {config} | {len(by_ratio)} | {mean:.2f} | {nll_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--indices", default="0-9", help="sample indices: 0-3 or 0,2,5")
    parser.add_argument("--tasks", default=None, help="comma-separated; default every task")
    parser.add_argument("--shard", default="0/1", help="K/N: every N-th sample from the K-th")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ratio", type=float, action="append")
    parser.add_argument("--config", action="append", help="PROMPT:POLICY (module docstring)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summary", type=Path, nargs="+", help="print the summary of JSONLs")
    parser.add_argument("--baseline", default=None, help="config to pair against")
    args = parser.parse_args(argv)
    if args.summary:
        print(summarize(read_rows(args.summary), args.baseline))
        return
    if not (args.samples and args.out and args.ratio and args.config):
        parser.error("--samples, --out, --ratio and --config are required to run")
    try:
        configs = [(c, *parse_config(c)) for c in args.config]
    except ValueError as error:
        parser.error(str(error))
    run(args, configs)


@dataclasses.dataclass
class Answerer:
    """Answers one sample's question on compressed contexts and builds the rows."""

    model: Any
    tokenizer: Any
    stops: list[int]
    sample: dict[str, Any]

    @property
    def where(self) -> dict[str, Any]:
        s = self.sample
        return {"task": s["task"], "length": int(s["length"]), "index": int(s["index"])}

    def row(
        self, compressed: Any, config: str, ratio: float, reference: list[int] | None
    ) -> tuple[dict[str, Any], list[int]]:
        import torch

        from kvlab.evaluation.questions import answer, answer_nll
        from kvlab.evaluation.ruler import score_answer

        question = torch.tensor([self.sample["question_ids"]], dtype=torch.int64)
        got = answer(
            self.model, compressed, question,
            max_new_tokens=int(self.sample["max_new_tokens"]), stop_token_ids=self.stops,
        )  # fmt: skip
        kept = [t for t in got.tokens if t not in self.stops]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        nll = None
        if reference:
            ids = torch.tensor([reference], dtype=torch.int64)
            nll = statistics.fmean(answer_nll(self.model, compressed, question, ids))
        outputs, metric = list(self.sample["outputs"]), self.sample["metric"]
        return {
            **self.where,
            "config": config,
            "ratio": ratio,
            "prediction": text,
            "score": float(score_answer(text, outputs, metric)),
            "nll_full_answer": nll,
            "answer_tokens": len(got.tokens),
            "kv_bytes": compressed.storage.kv_bytes,
        }, got.tokens


def run(args: argparse.Namespace, configs: list[tuple[str, str, str]]) -> None:
    import torch

    from kvlab.evaluation.methods import parse_method
    from kvlab.evaluation.questions import compress_context
    from kvlab.evaluation.ruler_protocol import CAPTURE_ATTENTION, stop_token_ids
    from kvlab.integrations.prefill_replay import capture_prefill
    from kvlab.models.loading import load_model
    from kvlab.relay.kvzip import ReconstructionPrompt

    wanted = set(parse_indices(args.indices))
    tasks = set(args.tasks.split(",")) if args.tasks else None
    k, n = (int(x) for x in args.shard.split("/"))
    samples = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    samples = [
        s for s in samples if int(s["index"]) in wanted and (tasks is None or s["task"] in tasks)
    ]
    samples.sort(key=lambda s: (int(s["index"]), s["task"]))  # index-major: tasks stay even
    samples = samples[k::n]
    done = {row_key(r) for r in read_rows([args.out])}
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    base = {r: parse_method(f"evict-no-relay:kvzip@{r}", protocol="ruler") for r in args.ratio}
    # the preparation "kvzip-prompt" of each prompt (kvlab.evaluation.methods.preparations)
    prompts = {
        "chat": {"kvzip_prompt": ReconstructionPrompt.from_tokenizer(tokenizer).settings()},
        "raw": {
            "kvzip_prompt": ReconstructionPrompt.from_tokenizer(tokenizer, chat=False).settings()
        },
    }
    full = parse_method("full", protocol="ruler")
    stops = stop_token_ids(tokenizer)
    with args.out.open("a") as out:
        for sample in samples:
            asker = Answerer(model, tokenizer, stops, sample)
            here = (asker.where["task"], asker.where["length"], asker.where["index"])
            todo = [
                (name, prompt, policy, r)
                for name, prompt, policy in configs
                for r in args.ratio
                if (*here, name, float(r)) not in done
            ]
            if not todo and (*here, "full", 0.0) in done:
                continue
            context = torch.tensor([sample["context_ids"]], dtype=torch.int64)
            capture = capture_prefill(model, context, attention=CAPTURE_ATTENTION)
            reference = compress_context(model, context, full, capture=capture)
            rows = []
            row, ref_tokens = asker.row(reference, "full", 0.0, None)
            if (*here, "full", 0.0) not in done:
                rows.append(row)
            for name, prompt, policy, r in todo:
                method = dataclasses.replace(base[r], params={**base[r].params, **POLICIES[policy]})
                compressed = compress_context(
                    model, context, method, prepared=prompts[prompt], capture=capture
                )
                rows.append(asker.row(compressed, name, r, ref_tokens)[0])
            for row in rows:
                out.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k != "prediction"}), flush=True)
            out.flush()


if __name__ == "__main__":
    sys.exit(main())
