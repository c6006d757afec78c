"""Does removing a per-head value mean before the Hadamard 2-bit coding cut the values-only KL?

Section 10 of docs/archive/results-history.md ends on a candidate fix for the clipped ranges'
coherent bias: subtract a per-(layer, kv head) mean ``mu`` [Dv] from the values before the
rotation and add it back after decoding. This probe measures it without touching the cache: for
each window of ``P = 512`` prefill tokens and ``S = 128`` scored tokens (the text's first window
and its last), the keys stay exact and every compressed layer's quantized values (the tokens
``pn-mix`` stores as codes, between its sinks and its recent window) are re-coded as
``decode(encode(v - mu)) + mu``; the score is the mean KL (nats per scored token) against the
exact cache. ``mu`` is zero (``none``: the plain coding), the mean of the first group of
``group_tokens`` quantized tokens (``first-group``: what a streaming cache knows when it
quantizes the first group), or of all quantized tokens (``all``: an upper bound), for min-max
ranges (:class:`kvlab.pnmix.values.HadamardValueCodec`) and squared-error ranges
(:class:`~kvlab.pnmix.values.MSEHadamardValueCodec`). ``hadamard(pn-mix)`` decodes ``pn-mix``'s
own stored values and must equal ``minmax-none`` (the check that the re-coding is the cache's).

    PYTHONPATH=src python experiments/value_mean_removal.py MODEL TEXT
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvlab.data import load_text
from kvlab.evaluation.methods import PNMIX_METHODS
from kvlab.evaluation.methods.caches import pnmix_config
from kvlab.integrations.attention import use_attention
from kvlab.integrations.model_support import plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.models import load_model
from kvlab.pnmix.config import PNMixConfig
from kvlab.pnmix.values import HadamardValueCodec, MSEHadamardValueCodec


def logprobs(
    model: torch.nn.Module,
    exact_kv: list[tuple[torch.Tensor, torch.Tensor]],
    windows: dict[int, int],
    tail: torch.Tensor,
    positions: torch.Tensor,
    replace: dict[int, torch.Tensor],
) -> torch.Tensor:
    """float64 log-probabilities [S, vocab] of ``tail`` on the exact prefill cache with the
    values of the layers in ``replace`` swapped for the given ones."""
    layers = []
    for i, (k, v) in enumerate(exact_kv):
        v = replace.get(i, v)
        layer = DynamicSlidingWindowLayer(windows[i]) if i in windows else DynamicLayer()
        layer.update(k, v.to(k.dtype))
        layers.append(layer)
    out = model(tail, cache=Cache(layers=layers), position_ids=positions, use_cache=True)
    return torch.log_softmax(out.logits[0].double(), -1)


def kl_nats(exact: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(exact || other), nats; log-probabilities [S, vocab]."""
    return float((exact.exp() * (exact - other)).sum(-1).clamp_min(0).mean())


def recoded_values(
    exact: torch.Tensor,
    stored: torch.Tensor,
    codec: HadamardValueCodec,
    mode: str,
    cfg: PNMixConfig,
) -> torch.Tensor:
    """``stored`` [B, H, N, Dv] with its quantized tokens re-coded from ``exact`` after
    removing the per-head mean of ``mode``."""
    dt = cfg.storage_dtype
    out = stored.clone().to(exact.dtype)
    # the quantized tokens [B, H, N]: where the stored value is not exact
    mask = (stored.to(exact.dtype) != exact.to(dt).to(exact.dtype)).any(-1)
    for b in range(exact.shape[0]):
        for h in range(exact.shape[1]):
            idx = mask[b, h].nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            x = exact[b, h, lo:hi].to(dt).float()
            if mode == "none":
                mu = torch.zeros(x.shape[-1])
            elif mode == "first-group":
                mu = x[: cfg.group_tokens].mean(0)
            else:
                mu = x.mean(0)
            mu = mu.to(dt).float()
            codes, scales = codec.encode((x - mu)[None], dt)
            out[b, h, lo:hi] = codec.output_transform(codec.decode(codes, scales))[0] + mu
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("text")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--score", type=int, default=128)
    args = parser.parse_args()
    prefill, score = args.prefill, args.score
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    text = load_text(args.text).data.decode("utf-8")
    all_ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)
    plan = plan_model(model.config.get_text_config(decoder=True))
    windows = {i: plan.layers[i].window for i in plan.window_layers}
    cfg = pnmix_config(dict(PNMIX_METHODS["pn-mix"]))
    codecs = (("minmax", HadamardValueCodec(2)), ("mse", MSEHadamardValueCodec(2)))
    for start in (0, len(all_ids) - prefill - score):
        ids = all_ids[start : start + prefill + score]
        head, tail = ids[None, :prefill], ids[None, prefill:]
        positions = torch.arange(prefill, prefill + score)[None]
        with torch.no_grad(), use_attention(model, "kvlab"):
            reference = Cache(layers=[DynamicLayer() for _ in plan.layers])
            model(head, cache=reference, use_cache=True, logits_to_keep=1)
            exact_kv = [(layer.keys, layer.values) for layer in reference.layers]
            logprobs_with = partial(logprobs, model, exact_kv, windows, tail, positions)
            exact = logprobs_with({})

            cache = PNMixModelCache(model.config, cfg)
            model(head, cache=cache, use_cache=True, logits_to_keep=1)
            base = {i: cache.layers[i].store.dequantize()[1] for i in plan.full_layers}
            res = {"hadamard(pn-mix)": kl_nats(exact, logprobs_with(base))}
            for cname, codec in codecs:
                for mode in ("none", "first-group", "all"):
                    rep = {
                        i: recoded_values(exact_kv[i][1], base[i], codec, mode, cfg)
                        for i in plan.full_layers
                    }
                    res[f"{cname}-{mode}"] = kl_nats(exact, logprobs_with(rep))
        print(args.model, "start", start, {k: round(v, 5) for k, v in res.items()}, flush=True)


if __name__ == "__main__":
    main()
