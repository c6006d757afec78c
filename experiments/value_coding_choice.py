"""Which value coding ``"hadamard_auto"`` picks per layer, and why (kvlab issue 19).

One prefill of ``P`` tokens starting at token ``START`` of the text into a ``pn-mix`` cache with
``value_coding="hadamard_auto"``; per compressed layer and kv head it prints the choice, the
attention-weighted output errors it compared (:attr:`PNMixCache.value_choice_errors`,
min-max / squared-error ranges), the plain squared errors of the two codings over the
quantized tokens, and their *coherence*: ``T ||mean_t e_t||² / mean_t ||e_t||²`` for the
per-token errors ``e_t`` (about 1 for independent zero-mean errors; large when the tokens'
errors share a direction, which an attention-weighted sum does not average out).

    PYTHONPATH=src python experiments/value_coding_choice.py MODEL TEXT [P] [START]
"""

from __future__ import annotations

import sys

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.data import load_text
from kvlab.evaluation.methods import PNMIX_METHODS
from kvlab.evaluation.methods.caches import pnmix_config
from kvlab.integrations.attention import use_attention
from kvlab.integrations.model_support import plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.models import load_model
from kvlab.pnmix.values import AutoHadamardValueCodec


def coherence(error: torch.Tensor) -> float:
    """``T ||mean_t e_t||² / mean_t ||e_t||²`` of errors ``[T, Dv]``."""
    t = error.shape[0]
    return float(t * error.mean(0).pow(2).sum() / error.pow(2).sum(-1).mean())


def main() -> None:
    spec, text_path = sys.argv[1], sys.argv[2]
    prefill = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    start = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    loaded = load_model(spec)
    model, tok = loaded.model, loaded.tokenizer
    text = load_text(text_path).data.decode("utf-8")
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)
    head = ids[None, start : start + prefill]
    plan = plan_model(model.config.get_text_config(decoder=True))
    cfg = pnmix_config({**PNMIX_METHODS["pn-mix"], "value_coding": "hadamard_auto"})
    codec = cfg.value_codec
    assert isinstance(codec, AutoHadamardValueCodec)
    dt = cfg.storage_dtype
    with torch.no_grad(), use_attention(model, "kvlab"):
        reference = Cache(layers=[DynamicLayer() for _ in plan.layers])
        model(head, cache=reference, use_cache=True, logits_to_keep=1)
        cache = PNMixModelCache(model.config, cfg)
        model(head, cache=cache, use_cache=True, logits_to_keep=1)
    print(
        f"{spec}, tokens {start}..{start + prefill}: layer head choice | attention-weighted "
        "error min-max / mse (ratio) | squared error ratio mse/min-max | coherence min-max, mse"
    )
    for i in plan.full_layers:
        store = cache.layers[i].store
        choice = store.value_mse_rows
        errors = store.value_choice_errors[0].cpu()
        v = reference.layers[i].values[0]  # [H, P, Dv]
        first = int(store.sink_lengths[0, 0])
        last = first + int(store.group_counts[0, 0]) * cfg.group_tokens
        for h in range(v.shape[0]):
            x = v[h, first:last][None]
            frame = codec.minmax.frame(x, dt).double()[0]
            e_min = codec.decode(*codec.minmax.encode(x, dt)).double()[0] - frame
            e_mse = codec.decode(*codec.mse.encode(x, dt)).double()[0] - frame
            a_min, a_mse = float(errors[h, 0]), float(errors[h, 1])
            print(
                f"L{i:<3d} h{h} {'mse    ' if choice[0, h] else 'min-max'} | "
                f"{a_min:.3e} / {a_mse:.3e} ({a_mse / a_min:.2f}) | "
                f"{float(e_mse.pow(2).sum() / e_min.pow(2).sum()):.2f} | "
                f"{coherence(e_min):.1f}, {coherence(e_mse):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
