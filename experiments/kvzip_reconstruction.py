"""Time KVzip's compression of one RULER sample, and its reconstruction attention's share.

Loads a model (default Qwen2.5-Coder-0.5B), builds one RULER sample (``niah_single_1``, 4K,
seed 0, no shared prefill: the prefill is part of the time), and runs
:func:`kvlab.evaluation.questions.compress_context` with ``evict-no-relay:kvzip@0.5``. Prints
JSON: ``compress_seconds`` (prefill + reconstruction pass + eviction), ``pass_seconds``
(:func:`kvlab.integrations.kvzip.compress`: pass + eviction), ``attention_seconds`` (every
:func:`kvlab.relay.kvzip_attention.reconstruction_attention` call) and ``evict_seconds``.
``--reference`` runs the pass with
:func:`kvlab.relay.kvzip_attention.reconstruction_attention_reference` (the blockwise softmax)
instead of the CPU flash path. ``--kept FILE`` writes the kept
original positions per layer and kv head (JSON), which ``--compare A B`` compares.

    OMP_NUM_THREADS=1 python experiments/kvzip_reconstruction.py --kept /tmp/fast.json
    OMP_NUM_THREADS=1 python experiments/kvzip_reconstruction.py --reference --kept /tmp/ref.json
    python experiments/kvzip_reconstruction.py --compare /tmp/ref.json /tmp/fast.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any


def _timed(fn: Callable[..., Any], timers: dict[str, float], name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[name] += time.perf_counter() - start

    return run


def compare(a: str, b: str) -> dict[str, int]:
    """Kept positions of two ``--kept`` files: totals and the symmetric difference."""
    with open(a) as fa, open(b) as fb:
        left, right = json.load(fa), json.load(fb)
    heads = [
        (set(x), set(y))
        for la, lb in zip(left, right, strict=True)
        for x, y in zip(la, lb, strict=True)
    ]
    return {
        "kept": sum(len(x) for x, _ in heads),
        "symmetric_difference": sum(len(x ^ y) for x, y in heads),
        "heads_differing": sum(x != y for x, y in heads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--method", default="evict-no-relay:kvzip@0.5")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--kept", default=None)
    parser.add_argument("--compare", nargs=2, default=None)
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(*args.compare)))
        return

    import torch

    import kvlab.integrations.kvzip as integration
    import kvlab.relay.kvzip_attention as kvzip
    import kvlab.relay.reconstruction as reconstruction
    from kvlab.evaluation.calibration import prepare_method
    from kvlab.evaluation.methods import parse_method
    from kvlab.evaluation.questions import compress_context
    from kvlab.evaluation.ruler_protocol import ruler_units
    from kvlab.integrations.relay_cache import RelayModelCache
    from kvlab.models.loading import checkpoint_sha256, load_model

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    unit, _, ids = ruler_units(
        tokenizer,
        tasks=["niah_single_1"],
        lengths=[args.length],
        samples=1,
        seed=0,
        haystack_text=None,
        chat=None,
        shared_prefill=True,
    )[0]
    context = torch.tensor(ids[: unit["context_tokens"]]).view(1, -1)
    method = parse_method(args.method, protocol="prefill-score")
    prepared = None
    if method.preparation:
        prepared = prepare_method(
            method,
            model,
            tokenizer,
            checkpoint_sha256=checkpoint_sha256(args.model),
            dtype="float32",
            cache_dir=None,
        )
    timers = {"attention_seconds": 0.0, "pass_seconds": 0.0, "evict_seconds": 0.0}
    attention = (
        kvzip.reconstruction_attention_reference
        if args.reference
        else kvzip.reconstruction_attention
    )
    reconstruction.reconstruction_attention = _timed(attention, timers, "attention_seconds")
    integration.compress = _timed(integration.compress, timers, "pass_seconds")
    RelayModelCache.evict_reconstructed = _timed(  # type: ignore[method-assign]
        RelayModelCache.evict_reconstructed, timers, "evict_seconds"
    )
    compressed = compress_context(model, context, method, prepared=prepared)
    print(
        json.dumps(
            {
                "model": args.model,
                "method": args.method,
                "context_tokens": int(context.shape[1]),
                "threads": torch.get_num_threads(),
                "reference": args.reference,
                "compress_seconds": round(compressed.seconds, 2),
                **{k: round(v, 2) for k, v in timers.items()},
            }
        )
    )
    if args.kept:
        kept = []
        for layer in compressed.cache.relay_layers():
            view = layer.store.padded([0])
            kept.append(
                [
                    sorted(view.original_positions[0, h][view.valid[0, h]].tolist())
                    for h in range(view.valid.shape[1])
                ]
            )
        with open(args.kept, "w") as f:
            json.dump(kept, f)


if __name__ == "__main__":
    main()
