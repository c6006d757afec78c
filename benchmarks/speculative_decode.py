"""Speculative decoding through each kvlab cache: greedy tokens per second of plain ``generate``
against prompt lookup (and, with ``--assistant``, an assistant model), with the same cache
kind, in one run on one thread (docs/design.md, "Cache life cycle": decode steps).

A speculative run must give plain greedy decoding's tokens: the script stops with an error
where it does not for `DynamicCache`, `pn-mix` or the relay cache, and prints where the
composed cache's first differs (the first speculative forward holds the prompt and the drafts,
so its projections round differently from the prompt alone, and 2-bit codes and eviction
scores near a boundary can flip: logits agree to ~1e-5 before quantization, not after). No
kvlab-only call is made (``transformers``' ``generate`` as with ``DynamicCache``, which is timed
too, as the reference). Caches: the ``pn-mix`` method's, ``EvictionConfig(ratio=0.5)``, and
the two composed. The prompt asks the chat model to repeat a passage of the package's text
(``--prompt code``: a function to copy), the input-grounded case prompt lookup is for. Times
are process CPU seconds (``time.process_time``), best of ``--repeats``; the ratios are taken
within this run; ``forwards`` counts the target model's forwards of the last run (plain
greedy: one per token).

    PYTHONPATH=src python benchmarks/speculative_decode.py [--new-tokens 64] [--repeats 3]
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

from kvlab.data import default_text
from kvlab.evaluation.methods import PNMIX_METHODS, parse_method
from kvlab.integrations import (
    ComposedModelCache,
    EvictionConfig,
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
#: caches whose speculative tokens must equal plain greedy decoding's (module docstring)
EXACT = ("DynamicCache", "pnmix", "relay")


def _prompt(tokenizer: Any, kind: str) -> torch.Tensor:
    """``[1, T]`` int64: the chat model asked to repeat 8 verses of the package's text, or the
    ``code`` prompt as raw text."""
    if kind == "code":
        return tokenizer(PROMPT, return_tensors="pt").input_ids
    verses = default_text().data.decode().splitlines()[:8]
    passage = " ".join(verse.split(" ", 2)[2] for verse in verses)  # without "Genesis 1:1"
    ask = "Repeat the following text exactly, word for word:"
    chat = [{"role": "user", "content": f"{ask}\n\n{passage}"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


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
        start = time.process_time()
        out = run()
        best = min(best, time.process_time() - start)
    assert out is not None
    return out, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--assistant", default=None, help="an assistant model (same tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup-tokens", type=int, default=4)
    parser.add_argument("--prompt", choices=("repeat", "code"), default="repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model = loaded.model.eval()
    enable_kvlab_attention(model)
    assistant = None if args.assistant is None else load_model(args.assistant).model.eval()
    ids = _prompt(loaded.tokenizer, args.prompt)
    forwards = _Forwards(model)
    print(f"model {args.model}, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, ")
    print(f"1 thread, best of {args.repeats}; tokens per CPU second and speed-up over plain greedy")
    ratio = EvictionConfig(ratio=0.5)
    pn_mix = parse_method("pn-mix")
    lean = PNMixConfig(**PNMIX_METHODS["pn-mix-lean"])
    caches: dict[str, Callable[[], Any]] = {
        "DynamicCache": DynamicCache,
        "pnmix": lambda: pn_mix.make_cache(model.config),
        "relay": lambda: RelayModelCache(model.config, ratio),
        "composed": lambda: ComposedModelCache(model.config, ratio, lean),
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
            same = got.tolist() == plain.tolist()
            if not same and name in EXACT:
                raise SystemExit(f"{name} {mode}: tokens differ from plain greedy decoding")
            first = next((i for i, (a, b) in enumerate(zip(got, plain, strict=True)) if a != b), 0)
            line += (
                f" | {mode} {got.numel() / seconds:6.1f} tok/s ({plain_s / seconds:.2f}x, "
                f"{forwards.count // args.repeats} forwards"
                + ("" if same else f"; tokens differ from token {first}")
                + ")"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
