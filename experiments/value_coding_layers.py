"""Values-only KL of min-max against squared-error Hadamard value ranges, one layer at a time
and all layers together (kvlab issue 19): does a coding that wins in every layer alone also
win in all of them at once?

One prefill of ``P`` tokens (from token ``START``), then ``S`` tokens scored in ONE forward
against a cache whose compressed layers hold exact keys and the values PN-Mix (``pn-mix``, or
``pn-mix`` with ``value_coding="hadamard_mse"``) decodes (``PNMixCache.dequantize``): the KL
of ``experiments/window_model_pnmix_diagnosis.py``, not ``kvlab eval``'s.

    PYTHONPATH=src python experiments/value_coding_layers.py MODEL TEXT [P] [S] [START]
"""

from __future__ import annotations

import sys

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvlab.data import load_text
from kvlab.evaluation.methods import PNMIX_METHODS
from kvlab.evaluation.methods.caches import pnmix_config
from kvlab.integrations.attention import use_attention
from kvlab.integrations.model_support import plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.models import load_model


def main() -> None:
    spec, text_path = sys.argv[1], sys.argv[2]
    prefill = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    score = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    start = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    loaded = load_model(spec)
    model, tok = loaded.model, loaded.tokenizer
    text = load_text(text_path).data.decode("utf-8")
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)[
        start : start + prefill + score
    ]
    head, tail = ids[None, :prefill], ids[None, prefill:]
    positions = torch.arange(prefill, prefill + score)[None]
    plan = plan_model(model.config.get_text_config(decoder=True))
    full = plan.full_layers
    windows = {i: plan.layers[i].window for i in plan.window_layers}
    with torch.no_grad(), use_attention(model, "kvlab"):
        reference = Cache(layers=[DynamicLayer() for _ in plan.layers])
        model(head, cache=reference, use_cache=True, logits_to_keep=1)
        exact_kv = [(layer.keys, layer.values) for layer in reference.layers]

        def logprobs(replace: dict[int, torch.Tensor]) -> torch.Tensor:
            layers = []
            for i, (k, v) in enumerate(exact_kv):
                v = replace.get(i, v)
                layer = (
                    DynamicLayer() if i not in windows else DynamicSlidingWindowLayer(windows[i])
                )
                layer.update(k, v.to(k.dtype))
                layers.append(layer)
            out = model(tail, cache=Cache(layers=layers), position_ids=positions, use_cache=True)
            return torch.log_softmax(out.logits[0].double(), -1)

        exact = logprobs({})
        p = exact.exp()

        def kl(replace: dict[int, torch.Tensor]) -> float:
            return float((p * (exact - logprobs(replace))).sum(-1).clamp_min(0).mean())

        decoded = {}
        for coding in ("hadamard", "hadamard_mse"):
            cfg = pnmix_config({**PNMIX_METHODS["pn-mix"], "value_coding": coding})
            cache = PNMixModelCache(model.config, cfg)
            model(head, cache=cache, use_cache=True, logits_to_keep=1)
            decoded[coding] = {i: cache.layers[i].store.dequantize()[1] for i in full}
        both = {c: kl(decoded[c]) for c in decoded}
        print(
            f"{spec}, tokens {start}..{start + prefill + score}, values only, all {len(full)} "
            f"layers: min-max {both['hadamard']:.5f}, mse {both['hadamard_mse']:.5f}"
        )
        wins = 0
        total = {"hadamard": 0.0, "hadamard_mse": 0.0}
        for i in full:
            one = {c: kl({i: decoded[c][i]}) for c in decoded}
            wins += one["hadamard_mse"] < one["hadamard"]
            for c in one:
                total[c] += one[c]
            print(
                f"L{i:<3d} min-max {one['hadamard']:.5f}  mse {one['hadamard_mse']:.5f}", flush=True
            )
        print(
            f"one layer at a time: mse lower in {wins} of {len(full)} layers; sums min-max "
            f"{total['hadamard']:.5f}, mse {total['hadamard_mse']:.5f}"
        )


if __name__ == "__main__":
    main()
