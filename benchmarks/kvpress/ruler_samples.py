"""RULER sample generation with a model's tokenizer: tokens used and seconds per sample.

For each length and task, generates ``--n`` samples with
:func:`kvlab.evaluation.ruler.generate_samples` and prints the prompt tokens plus the tokens
to generate (<= the length), the seconds per sample and the samples' digest; ``--show TASK``
prints one sample's context head and tail and its question. ``--out DIR`` writes the samples
as ``DIR/<task>-<length>.jsonl``.

    OMP_NUM_THREADS=1 python benchmarks/kvpress/ruler_samples.py --model qwen2.5-coder-0.5b \\
        --lengths 4096,8192,16384 --show niah_single_1 --show vt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlab.evaluation.ruler import TASKS, generate_samples, samples_digest, write_jsonl
from kvlab.models import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model spec (load_tokenizer)")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat", action="store_true", help="RULER's base template")
    parser.add_argument("--show", action="append", default=[], help="print one sample of TASK")
    parser.add_argument("--out", type=Path, help="write DIR/<task>-<length>.jsonl")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print("length | task | tokens (max over samples) | s/sample | digest")
    for length in (int(x) for x in args.lengths.split(",")):
        for task in args.tasks.split(","):
            began = time.perf_counter()
            samples = generate_samples(
                task, length, args.n, args.seed, tokenizer, chat=not args.no_chat
            )
            seconds = (time.perf_counter() - began) / args.n
            used = max(s.prompt_tokens + s.max_new_tokens for s in samples)
            print(f"{length} | {task} | {used} | {seconds:.2f} | {samples_digest(samples)[:12]}")
            if args.out:
                write_jsonl(args.out / f"{task}-{length}.jsonl", samples)
            if task in args.show:
                s = samples[0]
                print(f"  context head: {s.context[:420]!r}")
                print(f"  context tail: {s.context[-160:]!r}")
                print(f"  question: {s.question!r}")
                print(f"  outputs: {s.outputs!r}")


if __name__ == "__main__":
    main()
