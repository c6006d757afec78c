"""Speculative decoding through each kvlab cache: greedy tokens per second of plain ``generate``
against prompt lookup (and, with ``--assistant``, an assistant model), with the same cache
kind, in one run on one thread (docs/design.md, "Cache life cycle": decode steps).

Every speculative run must give plain greedy decoding's tokens (checked: the script stops with
an error otherwise); no kvlab-only call is made (``transformers``' ``generate`` as with
``DynamicCache``, which is timed too, as the reference). Caches: ``PNMixConfig()``,
``EvictionConfig(ratio=0.5)`` and the two composed; the prompt is a short function and a
comment asking for a copy; SmolLM2-135M's continuation writes a function and copies it, so
prompt lookup's drafts are often accepted (the case speculative decoding is for). Each timing
is the best of ``--repeats`` runs; the ratios are taken within this run; ``forwards`` counts
the target model's forwards of the last run (plain greedy: one per token after the first).

    PYTHONPATH=src python benchmarks/speculative_decode.py [--new-tokens 48] [--repeats 3]
    PYTHONPATH=src python benchmarks/speculative_decode.py --model qwen2.5-coder-1.5b \\
        --assistant qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from kvlab.integrations import (
    ComposedModelCache,
    EvictionConfig,
    PNMixModelCache,
    RelayModelCache,
    enable_kvlab_attention,
)
from kvlab.models import load_model
from kvlab.pnmix import PNMixConfig

CODE = (
    "def merge(left, right):\n    out = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            out.append(left[i])\n            i += 1\n        else:\n"
    "            out.append(right[j])\n            j += 1\n    out.extend(left[i:])\n"
    "    out.extend(right[j:])\n    return out\n"
)
#: SmolLM2-135M continues this by writing a function and copying it (prompt lookup's case)
PROMPT = CODE + "\n# the same function, copied:\n"


class _Forwards:
    """Counts a model's forwards (a forward pre-hook)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1


def _timed(run: Callable[[], torch.Tensor], repeats: int) -> tuple[torch.Tensor, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    assert out is not None
    return out, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--assistant", default=None, help="an assistant model (same tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--lookup-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model = loaded.model.eval()
    enable_kvlab_attention(model)
    assistant = None if args.assistant is None else load_model(args.assistant).model.eval()
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    forwards = _Forwards(model)
    print(f"model {args.model}, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, ")
    print(f"1 thread, best of {args.repeats}; tokens/s and speed-up over plain greedy")
    ratio = EvictionConfig(ratio=0.5)
    caches: dict[str, Callable[[], Any]] = {
        "DynamicCache": DynamicCache,
        "pnmix": lambda: PNMixModelCache(model.config, PNMixConfig()),
        "relay": lambda: RelayModelCache(model.config, ratio),
        "composed": lambda: ComposedModelCache(model.config, ratio, PNMixConfig()),
    }
    modes: dict[str, dict[str, Any]] = {"lookup": {"prompt_lookup_num_tokens": args.lookup_tokens}}
    if assistant is not None:
        modes["assistant"] = {"assistant_model": assistant}
    for name, make in caches.items():

        def run(extra: dict[str, Any], make: Callable[[], Any] = make) -> torch.Tensor:
            with torch.no_grad():
                out = model.generate(
                    ids,
                    cache=make(),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    **extra,
                )
            return out[0, ids.shape[1] :]

        plain, plain_s = _timed(lambda: run({}), args.repeats)
        line = f"{name:>12}: plain {plain.numel() / plain_s:6.1f} tok/s"
        for mode, extra in modes.items():
            forwards.count = 0
            got, seconds = _timed(lambda extra=extra: run(extra), args.repeats)
            if got.tolist() != plain.tolist():
                raise SystemExit(f"{name} {mode}: tokens differ from plain greedy decoding")
            line += (
                f" | {mode} {got.numel() / seconds:6.1f} tok/s ({plain_s / seconds:.2f}x, "
                f"{forwards.count // args.repeats} forwards)"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
