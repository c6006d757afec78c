"""Where PN-Mix's error comes from on a model's full-attention layers (kvlab issue 19).

One prefill of ``P`` tokens, then ``S`` tokens scored in ONE forward (not one at a time, so
the figures are comparable between variants, not to ``kvlab eval``'s rows) against a cache
whose full-attention layers hold the PN-Mix-decoded keys and/or values
(``PNMixCache.dequantize``) and whose other layers are exact. Prints the mean KL(full ||
variant) for: keys only / values only / both, over all full-attention layers and one layer at
a time, for several PN-Mix codings; and per-layer key statistics (pre-RoPE channel absmax
spread, per-token key-norm spread, outlier channels).

    PYTHONPATH=src python experiments/window_model_pnmix_diagnosis.py MODEL TEXT [P] [S]

``--value-blocks`` (issue 40): instead of the codings, ``pn-mix`` as stored beside simulated
per-token 2-bit min-max values whose scale and zero (float16) cover blocks of 256 / 64 / 32
channels of the Hadamard frame (or a block-diagonal Hadamard of 64): what the value scalars'
density (bits per value channel, 2 + 32 / block) does to the KL at a head_dim of 256.
"""

from __future__ import annotations

import sys
import time

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvlab.data import load_text
from kvlab.evaluation.methods import PNMIX_METHODS
from kvlab.evaluation.methods.caches import pnmix_config
from kvlab.integrations.attention import use_attention
from kvlab.integrations.model_support import layer_rotary, plan_model
from kvlab.integrations.pnmix_cache import PNMixModelCache
from kvlab.models import load_model
from kvlab.rope import rotate_by_delta


def clipped_values(values: torch.Tensor, bits: int, hadamard: bool) -> torch.Tensor:
    """Per-token min-max values (``[..., T, Dv]``) with the range shrunk around its centre by
    the ratio in 1.0 .. 0.3 that minimizes the token's squared error (a grid search: the same
    stored format, scale and zero per token, chosen by error instead of by the extremes);
    in the Hadamard frame when ``hadamard``. Simulation, float64."""
    from kvlab.pnmix.hadamard import hadamard_signs

    x = values.double()
    n = x.shape[-1]
    signs = hadamard_signs(n).double() / n**0.5 if hadamard else None
    if signs is not None:
        x = x @ signs
    levels = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best, best_err = x, torch.full_like(lo, float("inf"))
    for r in torch.linspace(1.0, 0.3, 29).tolist():
        a, b = mid - r * half, mid + r * half
        step = ((b - a) / levels).clamp_min(1e-30)
        q = ((x - a) / step).round().clamp(0, levels) * step + a
        err = ((q - x) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best = torch.where(better, q, best)
        best_err = torch.where(better, err, best_err)
    return best @ signs.T if signs is not None else best


def block_minmax(values: torch.Tensor, bits: int, block: int, hadamard_size: int) -> torch.Tensor:
    """Per-token min-max ``bits``-bit values ``[..., Dv]`` with one float16 min and max per
    ``block`` channels of the frame of a block-diagonal Hadamard of ``hadamard_size`` (``Dv``:
    the full one, as PN-Mix's values). Simulation, float64 arithmetic."""
    from kvlab.pnmix.hadamard import hadamard_signs

    x = values.double()
    n = x.shape[-1]
    h = hadamard_signs(hadamard_size).double() / hadamard_size**0.5
    xs = (x.reshape(*x.shape[:-1], n // hadamard_size, hadamard_size) @ h).reshape(
        *x.shape[:-1], n // block, block
    )
    lo = xs.amin(-1, keepdim=True).half().double()
    hi = xs.amax(-1, keepdim=True).half().double()
    levels = 2**bits - 1
    step = ((hi - lo) / levels).clamp_min(1e-30)
    q = ((xs - lo) / step).round().clamp(0, levels) * step + lo
    return (q.reshape(*x.shape[:-1], n // hadamard_size, hadamard_size) @ h.T).reshape(x.shape)


def in_groups(store, cfg, values: torch.Tensor, code) -> torch.Tensor:
    """``values`` ``[1, H, P, Dv]`` with the tokens of ``store``'s quantized groups replaced by
    ``code`` of their storage-rounded values (float32); sinks and residual left exact."""
    first = store.sink_length
    last = first + store.num_groups * cfg.group_tokens
    where = torch.arange(values.shape[2])
    quantized = ((where >= first) & (where < last)).view(1, 1, -1, 1)
    coded = code(values.to(cfg.storage_dtype).float())
    return torch.where(quantized, coded.float(), values.float())


CODINGS = ("pn-mix", "pn-mix-alloc", "kivi-2bit", "kivi-2bit-hadamard", "pn-mix-4bit")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--value-blocks"]
    value_blocks = len(args) < len(sys.argv) - 1
    spec, text_path = args[0], args[1]
    prefill = int(args[2]) if len(args) > 2 else 512
    score = int(args[3]) if len(args) > 3 else 128
    began = time.perf_counter()
    loaded = load_model(spec)
    model, tok = loaded.model, loaded.tokenizer
    print(f"loaded {spec} in {time.perf_counter() - began:.0f} s", flush=True)
    text = load_text(text_path).data.decode("utf-8")
    ids = torch.tensor(tok(text[:40000], add_special_tokens=False).input_ids[: prefill + score])
    head, tail = ids[None, :prefill], ids[None, prefill:]
    positions = torch.arange(prefill, prefill + score)[None]
    config = model.config.get_text_config(decoder=True)
    plan = plan_model(config)
    full = plan.full_layers
    windows = {i: plan.layers[i].window for i in plan.window_layers}
    with torch.no_grad(), use_attention(model, "kvlab"):
        reference = Cache(layers=[DynamicLayer() for _ in plan.layers])
        model(head, cache=reference, use_cache=True, logits_to_keep=1)
        exact_kv = [(layer.keys, layer.values) for layer in reference.layers]

        def logprobs(replace: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            layers = []
            for i, (k, v) in enumerate(exact_kv):
                k, v = replace.get(i, (k, v))
                layer = (
                    DynamicLayer() if i not in windows else DynamicSlidingWindowLayer(windows[i])
                )
                layer.update(k.to(exact_kv[i][0].dtype), v.to(exact_kv[i][1].dtype))
                layers.append(layer)
            out = model(tail, cache=Cache(layers=layers), position_ids=positions, use_cache=True)
            return torch.log_softmax(out.logits[0].double(), -1)

        exact = logprobs({})
        p = exact.exp()

        def kl(replace: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
            return float((p * (exact - logprobs(replace))).sum(-1).clamp_min(0).mean())

        rotary = layer_rotary(config)
        print(f"{len(full)} full-attention layers {list(full)} of {len(plan.layers)}")
        for i in full:
            k = exact_kv[i][0][0].float()  # [H, P, D], post-RoPE
            pre = rotate_by_delta(k, -torch.arange(prefill).view(1, -1), rotary)
            absmax = pre.abs().amax(1)  # [H, D]
            norms = k.norm(dim=-1)  # [H, P]
            v = exact_kv[i][1][0].float()
            spread = float(absmax.max() / absmax.median())
            print(
                f"layer {i}: key channel absmax max/median {spread:.1f}"
                f", token-norm cv {float(norms.std() / norms.mean()):.3f}"
                f", value channel absmax max/median "
                f"{float(v.abs().amax(1).max() / v.abs().amax(1).median()):.1f}"
                f", heads {k.shape[0]}, head_dim {k.shape[-1]}",
                flush=True,
            )
        if value_blocks:
            cfg = pnmix_config(PNMIX_METHODS["pn-mix"])
            cache = PNMixModelCache(model.config, cfg)
            model(head, cache=cache, use_cache=True, logits_to_keep=1)
            decoded = {i: cache.layers[i].store.dequantize() for i in full}
            print(
                f"pn-mix as stored: both {kl(decoded):.5f}"
                f"  keys {kl({i: (decoded[i][0], exact_kv[i][1]) for i in full}):.5f}"
                f"  values {kl({i: (exact_kv[i][0], decoded[i][1]) for i in full}):.5f}",
                flush=True,
            )
            dv = exact_kv[full[0]][1].shape[-1]
            for block, size in sorted({(dv, dv), (64, dv), (64, 64), (32, dv)}, reverse=True):
                sim = {
                    i: in_groups(
                        cache.layers[i].store,
                        cfg,
                        exact_kv[i][1],
                        lambda v, block=block, size=size: block_minmax(v, cfg.bits, block, size),
                    )
                    for i in full
                }
                print(
                    f"values min-max per {block} channels, Hadamard {size}"
                    f" ({cfg.bits + 32 / block:.3f} bits a channel):"
                    f" values {kl({i: (exact_kv[i][0], sim[i]) for i in full}):.5f}"
                    f"  both {kl({i: (decoded[i][0], sim[i]) for i in full}):.5f}",
                    flush=True,
                )
            print(f"total {time.perf_counter() - began:.0f} s")
            return
        for name in CODINGS:
            cfg = pnmix_config(PNMIX_METHODS[name])
            cache = PNMixModelCache(model.config, cfg)
            model(head, cache=cache, use_cache=True, logits_to_keep=1)
            decoded = {i: cache.layers[i].store.dequantize() for i in full}
            both = {i: decoded[i] for i in full}
            keys = {i: (decoded[i][0], exact_kv[i][1]) for i in full}
            values = {i: (exact_kv[i][0], decoded[i][1]) for i in full}
            row = f"{name:20s} both {kl(both):.5f}  keys {kl(keys):.5f}  values {kl(values):.5f}"
            per_layer = "  ".join(f"L{i} {kl({i: decoded[i]}):.5f}" for i in full[:6])
            print(row + "  | one layer (both): " + per_layer, flush=True)
            if name in ("pn-mix", "kivi-2bit"):
                hadamard = cfg.value_coding == "hadamard"
                clip = {
                    i: in_groups(
                        cache.layers[i].store,
                        cfg,
                        exact_kv[i][1],
                        lambda v, h=hadamard, bits=cfg.bits: clipped_values(v, bits, h),
                    )
                    for i in full
                }
                vmse = sum(
                    float(((decoded[i][1] - exact_kv[i][1]) ** 2).sum()) for i in full
                ) / sum(float(((clip[i] - exact_kv[i][1]) ** 2).sum()) for i in full)
                only = kl({i: (exact_kv[i][0], clip[i]) for i in full})
                print(
                    f"{name:20s} clipped values: values {only:.5f}"
                    f"  both {kl({i: (decoded[i][0], clip[i]) for i in full}):.5f}"
                    f"  (value squared error: min-max / clipped = {vmse:.2f})",
                    flush=True,
                )
    print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
