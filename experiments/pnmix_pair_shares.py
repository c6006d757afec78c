"""How PN-Mix's per-pair tables split the rotary pairs: the share of (layer, kv head, rotary
pair) slots at each key code width (``pn-mix``, ``pn-mix-alloc``: 0/2/3/4 bits) or coded in
Phase–Norm (the mixes: ``pn-mix-prerope-qmix``, ``pn-mix-uniform``), after the prefill of each
window `kvlab eval` picks (docs/design.md, "Per-pair tables"; the tables are computed once, in
the append that flushes a row's first group).

    OMP_NUM_THREADS=1 python experiments/pnmix_pair_shares.py --text hamlet.txt --windows 4 \
        --methods pn-mix,pn-mix-prerope-qmix

Prints one line per (method, window) and the share over all windows. Methods that need a
calibration (``pn-mix-v1``) are not supported here.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from kvlab.data import load_text
from kvlab.evaluation.harness import tokenize, window_starts
from kvlab.evaluation.methods import parse_method
from kvlab.evaluation.protocols import _position_kwargs, cache_keyword
from kvlab.integrations import use_attention
from kvlab.models import load_model


def pair_counts(cache: object) -> Counter[str]:
    """Counts of (layer, kv head, rotary pair) slots by coding, over the PN-Mix layers."""
    counts: Counter[str] = Counter()
    for layer in getattr(cache, "layers", []):
        inner = getattr(layer, "store", None)  # PNMixLayer.store: the layer's PNMixCache
        if inner is None:
            continue
        widths = getattr(inner, "pair_widths", None)
        if widths is not None:
            for bits, n in zip(*torch.unique(widths, return_counts=True), strict=True):
                counts[f"{int(bits)} bits"] += int(n)
            continue
        phase_norm = getattr(inner, "phase_norm_pairs", None)
        if phase_norm is not None:
            counts["Phase–Norm"] += int(phase_norm.sum())
            counts["Cartesian"] += int((~phase_norm).sum())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default=None, help="UTF-8 text (default: the package's own)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--score", type=int, default=512, help="window = prefill + score")
    parser.add_argument("--methods", default="pn-mix,pn-mix-prerope-qmix")
    args = parser.parse_args()

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenize(tokenizer, load_text(args.text).data)
    starts = window_starts(len(ids), args.prefill + args.score, args.windows)
    for name in args.methods.split(","):
        method = parse_method(name)
        if method.preparation is not None:
            raise SystemExit(f"{name}: needs a preparation ({method.preparation}); not supported")
        total: Counter[str] = Counter()
        for w, start in enumerate(starts):
            cache = method.make_cache(model.config, None)
            tokens = torch.tensor(ids[start : start + args.prefill]).view(1, -1)
            with torch.no_grad(), use_attention(model, method.attention):
                model(
                    tokens,
                    use_cache=True,
                    **{cache_keyword(model): cache},
                    **_position_kwargs(cache, args.prefill),
                )
            counts = pair_counts(cache)
            total += counts
            n = sum(counts.values())
            shares = ", ".join(f"{k} {100 * v / n:.1f} %" for k, v in sorted(counts.items()))
            print(f"{name} window {w} (start {start}): {n} slots: {shares}")
        n = sum(total.values())
        shares = ", ".join(f"{k} {100 * v / n:.1f} %" for k, v in sorted(total.items()))
        print(f"{name} all windows: {shares}")


if __name__ == "__main__":
    main()
