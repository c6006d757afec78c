"""Seconds of one shared-prefill RULER sample: the capture, then each method's replay with the
prefill's own attention computed and skipped (the default), in one process, plus whether the
two replays stored the same bits.

:func:`kvlab.integrations.prefill_replay.replay_prefill` drops the attention outputs of a
replayed prefill; with ``skip_outputs=True`` (the default) it does not compute the prefill's
attention over its own tokens (docs/design.md, "One prefill, many caches"). This script times
both on one real sample, so the ratio is measured under the same load:

    OMP_NUM_THREADS=2 python benchmarks/replay_timing.py --model qwen2.5-coder-0.5b \\
        --task niah_single_1 --length 4096 --methods pn-mix,kivi-2bit,\\
    evict-no-relay:expected-attention@0.5

Methods with a preparation (calibrated budgets, KVzip's prompt) are prepared first, without the
calibration cache (``cache_dir=None``); a KVzip method's reconstruction pass is not timed here.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlab.evaluation.calibration import prepare_method
from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.ruler_protocol import ruler_units
from kvlab.integrations.prefill_replay import capture_prefill, replay_prefill
from kvlab.models.loading import load_model


def _state(cache) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(obj, depth: int) -> None:
        if depth > 6:
            return
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, depth + 1)

    walk(cache.layers, 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--methods", default="pn-mix,kivi-2bit,evict-no-relay:expected-attention@0.5"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    unit, _, ids = ruler_units(
        tokenizer,
        tasks=[args.task],
        lengths=[args.length],
        samples=1,
        seed=args.seed,
        haystack_text=None,
        chat=None,
        shared_prefill=True,
    )[0]
    context = torch.tensor(ids[: unit["context_tokens"]]).view(1, -1)
    began = time.perf_counter()
    capture = capture_prefill(model, context)
    print(f"capture ({context.shape[1]} tokens): {time.perf_counter() - began:.1f} s")
    print("method | replay, attention computed (s) | replay, skipped (s) | same bits")
    for name in args.methods.split(","):
        method = parse_method(name)
        prepared = None
        if method.preparation is not None:
            prepared = prepare_method(
                method,
                model,
                tokenizer,
                checkpoint_sha256=loaded.checkpoint.rsplit("sha256:", 1)[-1].rstrip(")"),
                dtype="float32",
                cache_dir=None,
            )
        seconds, states = [], []
        for skip in (False, True):
            cache = method.make_cache(model.config, prepared)
            began = time.perf_counter()
            replay_prefill(model, capture, cache, attention=method.attention, skip_outputs=skip)
            seconds.append(time.perf_counter() - began)
            states.append(_state(cache))
        same = len(states[0]) == len(states[1]) and all(
            torch.equal(a, b) for a, b in zip(*states, strict=True)
        )
        print(f"{name} | {seconds[0]:.1f} | {seconds[1]:.1f} | {same}")


if __name__ == "__main__":
    main()
