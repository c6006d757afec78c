"""CPU time of one prompt's prefill per KV-cache method, against the model's own ``sdpa``
attention with a ``DynamicCache``, all rows in one process:

    python benchmarks/prefill_cost.py --model smollm2-135m --tokens 2048 \\
        --methods kvlab,kivi-2bit,pn-mix --rounds 3

Each row feeds the same prompt (the first ``--tokens`` tokens of kvlab's default text) into a
fresh cache, in one forward or in ``--chunk``-token forwards, and counts the process CPU time
of those forwards (``time.process_time``, ``--threads`` torch threads, default 1); the rows are
interleaved round by round and each keeps its best of ``--rounds``. ``sdpa`` (always the first
row) is the model's own attention over a ``DynamicCache``; ``kvlab`` is the ``"kvlab"``
attention over the same ``DynamicCache`` (nothing compressed); any other name is a
``kvlab methods`` name, prepared first with :func:`kvlab.prepare` (the calibration cache of
``kvlab eval``; set ``KVLAB_CALIBRATION_CACHE`` to choose its folder) and run with its own
attention. ``ratio`` is the row's best over ``sdpa``'s best of the same run. The load average
(``os.getloadavg``) is printed before and after: the figures are CPU time of this process, but
a loaded machine still slows it (shared caches, memory bandwidth).

Runtime: about ``rounds x rows x`` one prefill (SmolLM2-135M, 2,048 tokens, one thread: about
10 s a prefill; Qwen2.5-Coder-0.5B: about 30 s), plus loading and any first calibration.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlab
from kvlab.data import default_text
from kvlab.evaluation.protocols import cache_keyword, position_kwargs

BASELINE = "sdpa"
PLAIN_KVLAB = "kvlab"


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of kvlab's default text, int64 ``[1, tokens]``."""
    text = default_text().data.decode("utf-8")
    ids = tokenizer(text[: tokens * 8], return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise SystemExit(f"the default text gave only {ids.shape[1]} tokens")
    return ids[:, :tokens]


class Row:
    """One method of the table: how to make its cache and which attention reads it."""

    def __init__(self, name: str, loaded) -> None:
        self.name = name
        self.config = loaded.model.config
        if name in (BASELINE, PLAIN_KVLAB):
            self.method = None
            self.attention = "sdpa" if name == BASELINE else "kvlab"
            self.prepared = None
        else:
            self.method = kvlab.parse_method(name)
            self.attention = self.method.attention
            self.prepared = kvlab.prepare(self.method, loaded)

    def cache(self):
        if self.method is None:
            return DynamicCache(config=self.config)
        return self.method.make_cache(self.config, self.prepared)


def prefill(model, row: Row, ids: torch.Tensor, chunk: int):
    """Feed ``ids`` into a fresh cache of ``row``; returns ``(cpu seconds, cache)``."""
    cache = row.cache()
    keyword = cache_keyword(model)
    step = ids.shape[1] if chunk <= 0 else chunk
    with torch.no_grad(), kvlab.use_attention(model, row.attention):
        start = time.process_time()
        for begin in range(0, ids.shape[1], step):
            part = ids[:, begin : begin + step]
            model(
                part,
                use_cache=True,
                logits_to_keep=1,
                **{keyword: cache},
                **position_kwargs(cache, part.shape[1]),
            )
        seconds = time.process_time() - start
    return seconds, cache


def commit() -> str:
    """The git commit of the kvlab source this run imported (``?`` outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(kvlab.__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--methods", default="kvlab,kivi-2bit,pn-mix")
    parser.add_argument("--chunk", type=int, default=0, help="tokens per forward (0: one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = kvlab.load_model(args.model)
    model = loaded.model.eval()
    ids = prompt_ids(loaded.tokenizer, args.tokens)
    names = [BASELINE] + [m for m in args.methods.split(",") if m and m != BASELINE]
    rows = [Row(name, loaded) for name in names]
    warm = ids[:, : min(512, args.tokens)]  # long enough for an eviction's budget
    prefill(model, rows[0], warm, 0)  # warm-up (first-call allocations)
    for row in rows:  # compile or load any CPU kernel before the clock runs
        prefill(model, row, warm, 0)

    load_before = os.getloadavg()
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for row in rows:
            seconds, _ = prefill(model, row, ids, args.chunk)
            best[row.name] = min(best.get(row.name, float("inf")), seconds)
            print(f"round {r + 1} {row.name}: {seconds:.2f} s", flush=True)
    load_after = os.getloadavg()

    fed = "one forward" if args.chunk <= 0 else f"chunks of {args.chunk}"
    print()
    print(
        f"{args.model}, {args.tokens} tokens in {fed}, {args.threads} thread(s), best of "
        f"{args.rounds}; torch {torch.__version__}, {platform.machine()}, commit {commit()}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print()
    print("| method | attention | CPU s | ratio to sdpa |")
    print("|---|---|---|---|")
    base = best[BASELINE]
    for row in rows:
        s = best[row.name]
        print(f"| {row.name} | {row.attention} | {s:.2f} | {s / base:.3f}× |")


if __name__ == "__main__":
    main()
