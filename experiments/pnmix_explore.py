"""Issue 8 exploration: end-to-end KL / ΔPPL of 2-bit PN-Mix codings with the simulated cache.

Subcommands (all on SmolLM2-135M, CPU, prefill-score windows as ``kvlab eval`` picks them):

* ``check`` — the simulated cache against the real ``PNMixModelCache`` (``kivi-2bit`` and
  ``pn-mix-uniform`` methods of ``kvlab eval``, scored one token at a time): KL and ΔPPL of
  both, and the simulated byte count against the real cache's ``nbytes``.
* ``run`` — named configurations (``--config``, repeatable; ``list`` prints them): bytes at the
  final length (1,023 tokens for P = S = 512; float16 everywhere, so stored = 16-bit
  normalized), pooled KL, ΔPPL, per-window KL. Rows are appended to ``--log`` as JSON lines.

    python experiments/pnmix_explore.py check --windows 1 --score 128
    python experiments/pnmix_explore.py run --windows 4 --score 512 --config kivi-2bit
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from pnmix_codecs import (
    BitAllocKeys,
    CartesianKeys,
    MixKeys,
    PackageBitAllocKeys,
    PhaseNormKeys,
    TokenValues,
)
from pnmix_sim import (
    LayerPlan,
    Timer,
    eval_windows,
    full_reference,
    load,
    plan_bytes,
    simulate,
    summarize,
    text_ids,
)

HAMLET = "/work/shared/data/hamlet.txt"
N_LAYERS, HEADS, DIM = 30, 3, 64

#: kvlab eval's calibrated allocations (docs/archive/results-history.md, run of commit 5bece64):
#: pn-mix's.
PNMIX_GROUPS = (128, 32, 32, 64, 64, 128, 64, 64, 64, 64, 64, 32, 16, 128, 32, 32, 32, 16, 8, 32,
                8, 64, 32, 16, 32, 32, 64, 128, 128, 128)  # fmt: skip

ALLOCATIONS: dict[str, tuple[int, ...]] = {"pnmix": PNMIX_GROUPS}


MOMENTS = "/tmp/pnmix-research/moments_kjv.pt"


def _static_moments():
    """Query second moments calibrated on the King James text (``pnmix_calibrate.py
    moments``), float64 ``[L, H_kv, D, D]``."""
    return torch.load(MOMENTS)


def uniform(key: Callable[[], object], value: Callable[[], object], g: int = 32):
    return lambda: [LayerPlan(g, key(), value()) for _ in range(N_LAYERS)]


def per_layer(groups, key, value):
    return lambda: [LayerPlan(g, key(), value()) for g in groups]


def configs() -> dict[str, Callable[[], list[LayerPlan]]]:
    val = TokenValues
    pre = lambda **kw: CartesianKeys(prerope=True, **kw)  # noqa: E731
    c: dict[str, Callable[[], list[LayerPlan]]] = {
        "kivi-2bit": uniform(CartesianKeys, val),
        "pn-mix-uniform": uniform(
            lambda: MixKeys(CartesianKeys(), PhaseNormKeys(), "saliency"), val
        ),
        "pn-mix": per_layer(
            PNMIX_GROUPS, lambda: MixKeys(CartesianKeys(), PhaseNormKeys(), "saliency"), val
        ),
        "cart-rot@pnmix-groups": per_layer(PNMIX_GROUPS, CartesianKeys, val),
        "pre": uniform(pre, val),
        "pre+mixq": uniform(lambda: MixKeys(pre(), PhaseNormKeys(prerope=True), "query"), val),
        "pre+out1%": uniform(lambda: pre(outliers=0.01), val),
        "pre+clip": uniform(lambda: pre(clip=7), val),
        "pre+alloc": uniform(BitAllocKeys, val),
        "rot+alloc": uniform(lambda: BitAllocKeys(prerope=False), val),
        "pre+alloc+out1%": uniform(lambda: BitAllocKeys(outliers=0.01), val),
        "pre+alloc-keyerr": uniform(lambda: BitAllocKeys(criterion="key"), val),
        "pre+alloc+valhad": uniform(BitAllocKeys, lambda: TokenValues(hadamard=True)),
        "pre+alloc+out1%+valhad": uniform(
            lambda: BitAllocKeys(outliers=0.01), lambda: TokenValues(hadamard=True)
        ),
        "kivi+valhad": uniform(CartesianKeys, lambda: TokenValues(hadamard=True)),
        "pkg-pre+alloc": uniform(PackageBitAllocKeys, val),
        "pkg-pre+alloc+out1%": uniform(lambda: PackageBitAllocKeys(outliers=0.01), val),
        "pkg-pre+alloc+out1%+valhad": uniform(
            lambda: PackageBitAllocKeys(outliers=0.01), lambda: TokenValues(hadamard=True)
        ),
        "pkg-pre+alloc+valhad": uniform(PackageBitAllocKeys, lambda: TokenValues(hadamard=True)),
        "pkg-pre+alloc-pergroup": uniform(lambda: PackageBitAllocKeys(per_group=True), val),
        "pkg-pre+alloc-pergroup-static": uniform(
            lambda: PackageBitAllocKeys(per_group=True, moments=_static_moments()), val
        ),
        "pkg-pre+alloc-static": uniform(
            lambda: PackageBitAllocKeys(moments=_static_moments()), val
        ),
        "pkg-pre+alloc-pergroup+out1%": uniform(
            lambda: PackageBitAllocKeys(per_group=True, outliers=0.01), val
        ),
        # one width budget per kv head (the product's BitAllocCodec layout)
        "pkg-pre+alloc-perhead": uniform(lambda: PackageBitAllocKeys(per_head=True), val),
        "pkg-pre+alloc+out1%-perhead": uniform(
            lambda: PackageBitAllocKeys(outliers=0.01, per_head=True), val
        ),
        "pkg-pre+alloc+out1%+valhad-perhead": uniform(
            lambda: PackageBitAllocKeys(outliers=0.01, per_head=True),
            lambda: TokenValues(hadamard=True),
        ),
        # the same with the product's arithmetic (float64 error rotation, exact Hadamard frame)
        "pkg-pre+alloc+out1%+valhad-perhead-exact": uniform(
            lambda: PackageBitAllocKeys(outliers=0.01, per_head=True, exact=True),
            lambda: TokenValues(hadamard=True, exact=True),
        ),
    }
    return c


#: ``kvlab eval`` methods and the simulated configuration that codes like them (``check``).
METHOD_SIM: dict[str, str] = {
    "kivi-2bit": "kivi-2bit",
    "pn-mix-uniform": "pn-mix-uniform",
    "pn-mix-prerope": "pre",
    "pn-mix-alloc": "pkg-pre+alloc-perhead",
    "pn-mix-alloc-outliers": "pkg-pre+alloc+out1%-perhead",
    "pn-mix": "pkg-pre+alloc+out1%+valhad-perhead-exact",
    "kivi-2bit-hadamard": "kivi+valhad",
}


#: key codec factories (outlier fraction -> codec) for allocations read from a JSON file
KEY_FACTORIES: dict[str, Callable[[float], object]] = {
    "cart-rot": lambda f: CartesianKeys(outliers=f),
    "pre": lambda f: CartesianKeys(prerope=True, outliers=f),
    "pre+alloc": lambda f: BitAllocKeys(outliers=f),
    "pkg-pre+alloc": lambda f: PackageBitAllocKeys(outliers=f),
}
VALUE_FACTORIES: dict[str, Callable[[], object]] = {
    "val": TokenValues,
    "valhad": lambda: TokenValues(hadamard=True),
}


def from_file(spec: str) -> Callable[[], list[LayerPlan]]:
    """``KEYS[+VALUES]@FILE``: per-layer groups (``layer_group_tokens``) and outlier fractions
    (``layer_outliers``, default 0) from a JSON file (``pnmix_calibrate.py``)."""
    name, path = spec.split("@", 1)
    keys, _, values = name.partition(",")
    with open(path) as fh:
        alloc = json.load(fh)
    groups = alloc["layer_group_tokens"]
    fracs = alloc.get("layer_outliers", [0.0] * len(groups))
    vf = VALUE_FACTORIES[values or "val"]
    return lambda: [
        LayerPlan(g, KEY_FACTORIES[keys](f), vf()) for g, f in zip(groups, fracs, strict=True)
    ]


@torch.no_grad()
def _real_check(model, windows, prefill, score, reference, methods) -> list[dict]:
    """Each check method through the real cache, one token at a time (as
    ``kvlab.evaluation.protocols.score_window``), keeping the cache to compare its stored
    keys/values with the simulation's."""
    from kvlab.evaluation.methods import parse_method
    from kvlab.integrations.attention import use_attention

    rows = []
    for name in methods:
        method = parse_method(name)
        kls, nlls, caches = [], [], []
        for w, ref in zip(windows, reference, strict=True):
            cache = method.make_cache(model.config)
            logits = []
            with use_attention(model, "kvlab"):
                out = model(w[:prefill].view(1, -1), cache=cache, use_cache=True)
                logits.append(out.logits[0, -1])
                for j in range(1, score):
                    out = model(w[prefill + j - 1].view(1, 1), cache=cache, use_cache=True)
                    logits.append(out.logits[0, -1])
            logp = torch.log_softmax(torch.stack(logits).double(), -1)
            nlls.append(-logp.gather(-1, w[prefill:].view(-1, 1)).squeeze(-1))
            rl = ref.logp
            kls.append((rl.exp() * (rl - logp)).sum(-1).clamp_min(0.0))
            caches.append(cache)
        nll = torch.cat(nlls)
        ref_nll = torch.cat([r.nll for r in reference])
        rows.append(
            {
                "method": name,
                "kl": float(torch.cat(kls).mean()),
                "dppl": 100 * (float(nll.mean().exp() / ref_nll.mean().exp()) - 1),
                "bytes": caches[0].nbytes(),
                "caches": caches,
            }
        )
    return rows


def _compare_storage(real_cache, sim_cache) -> str:
    """Elements of the decoded keys / values (all layers, all tokens) where the real cache's
    storage and the simulation differ by more than 1e-3 of the layer's key/value range."""
    diff_k = diff_v = total = 0
    for idx, layer in enumerate(real_cache.layers):
        rk, rv = layer.store.dequantize()
        sk, sv = sim_cache.decoded[idx]
        n = rk.shape[2]
        sk, sv = sk[:, :, :n], sv[:, :, :n]
        tol_k = 1e-3 * float(rk.abs().max())
        tol_v = 1e-3 * float(rv.abs().max())
        diff_k += int(((rk - sk).abs() > tol_k).sum())
        diff_v += int(((rv - sv).abs() > tol_v).sum())
        total += rk.numel()
    return f"stored elements differing: keys {diff_k}/{total}, values {diff_v}/{total}"


@torch.no_grad()
def _same_input_check(model, window, prefill, score, methods) -> str:
    """Identical inputs: every layer's captured queries/keys/values appended to a real
    ``PNMixCache`` configured as ``kvlab eval``'s method (prefill at once, with its queries,
    then one token at a time) and decoded by the simulation's codecs. Returns how many layers
    store bit-identical decoded keys/values, and whether the real cache's quantized-token
    count after every append equals the simulation's flush rule."""
    from pnmix_sim import SINKS, LayerContext, capture_qkv, flushed_groups, rotary_of, round16

    from kvlab.evaluation.methods import parse_method
    from kvlab.evaluation.methods.caches import pnmix_config
    from kvlab.integrations.model_support import layer_rotary
    from kvlab.integrations.pnmix_cache import pnmix_config_for_model
    from kvlab.pnmix import PNMixCache

    n = prefill + score - 1
    captured = capture_qkv(model, window[:n])
    rotary = rotary_of(model)
    lines = []
    for name in methods:
        cfg = pnmix_config_for_model(model.config, pnmix_config(parse_method(name).params))
        layer_rope = layer_rotary(model.config) if cfg.key_codec.position_aware else None
        plan = configs()[METHOD_SIM[name]]()[0]
        same, schedule_ok = 0, True
        for idx, (q, k, v) in enumerate(captured):
            store = PNMixCache(
                cfg,
                batch_size=1,
                num_key_value_heads=k.shape[1],
                head_dim=k.shape[3],
                rotary=layer_rope,
            )
            store.append(k[:, :, :prefill], v[:, :, :prefill], queries=q[:, :, :prefill])
            for t in range(prefill, n):
                store.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
                if store.quantized_tokens != flushed_groups(t + 1, 32) * 32:
                    schedule_ok = False
            rk, rv = store.dequantize()
            kr, vr = round16(k), round16(v)
            g_pre = flushed_groups(prefill, 32)
            hkv, rep = k.shape[1], q.shape[1] // k.shape[1]
            qp = q[:, :, :prefill].double().reshape(1, hkv, rep, prefill, -1)
            cov = torch.einsum("bhrtd,bhrte->hde", qp, qp) / (rep * prefill)
            ctx = LayerContext(
                idx,
                rotary,
                query_cov=cov,
                prefill_keys=kr[:, :, SINKS : SINKS + 32 * g_pre],
                prefill_positions=torch.arange(SINKS, SINKS + 32 * g_pre),
            )
            ctx.state["group_tokens"] = 32
            plan.key.prepare(ctx)
            sk, sv = kr.clone(), vr.clone()
            for j in range(flushed_groups(n, 32)):
                sl = slice(SINKS + 32 * j, SINKS + 32 * (j + 1))
                pos = torch.arange(sl.start, sl.stop)
                sk[:, :, sl] = plan.key.decode(kr[:, :, sl], pos, ctx)
                sv[:, :, sl] = plan.value.decode(vr[:, :, sl], pos, ctx)
            same += int(torch.equal(rk, sk) and torch.equal(rv, sv))
        lines.append(
            f"identical inputs, {name}: {same}/{len(captured)} layer caches bit-identical; "
            f"flush schedule matches at every length: {schedule_ok}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["check", "run", "list"])
    ap.add_argument("--text", default=HAMLET, help="eval text ('kjv' = the package's text)")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--score", type=int, default=128)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--log", default="/tmp/pnmix-research/explore.jsonl")
    ap.add_argument("--keys-only", action="store_true", help="values stay exact (float16)")
    ap.add_argument("--values-only", action="store_true", help="keys stay exact (float16)")
    ap.add_argument(
        "--methods",
        default="kivi-2bit,pn-mix-uniform",
        help=f"check: kvlab methods compared with their simulation ({', '.join(METHOD_SIM)})",
    )
    ap.add_argument(
        "--skip-same-input", action="store_true", help="check: skip the identical-input check"
    )
    args = ap.parse_args()
    table = configs()
    if args.command == "list":
        print("\n".join(table))
        return
    model, tok = load()
    ids = text_ids(tok, None if args.text == "kjv" else args.text)
    windows = eval_windows(ids, args.prefill, args.score, args.windows)
    final_len = args.prefill + args.score - 1
    timer = Timer()
    reference = full_reference(model, windows, args.prefill)
    if args.command == "check":
        if not args.skip_same_input:
            methods = args.methods.split(",")
            print(
                _same_input_check(model, windows[0], args.prefill, args.score, methods),
                flush=True,
            )
        methods = args.methods.split(",")
        real = _real_check(model, windows, args.prefill, args.score, reference, methods)
        for row in real:
            sim_caches: list = []
            plans = table[METHOD_SIM[row["method"]]]()
            sim = simulate(model, windows, args.prefill, plans, reference, caches=sim_caches)
            s = summarize(sim, reference)
            b = plan_bytes(table[METHOD_SIM[row["method"]]](), final_len, HEADS, DIM)
            print(
                f"{row['method']}: real KL {row['kl']:.7f} ΔPPL {row['dppl']:+.4f}% bytes "
                f"{row['bytes']} | sim KL {s['kl']:.7f} ΔPPL {s['dppl']:+.4f}% bytes {b} | "
                f"|ΔKL| {abs(row['kl'] - s['kl']):.2e}; "
                + _compare_storage(row["caches"][0], sim_caches[0]),
                flush=True,
            )
        return
    flags = {"quantize_keys": not args.values_only, "quantize_values": not args.keys_only}
    for name in args.config:
        plans = (from_file(name) if "@" in name else table[name])()
        caches: list = []
        res = simulate(model, windows, args.prefill, plans, reference, caches=caches, **flags)
        shares = [x for c in caches for ctx in c.contexts for x in ctx.state.get("mix_share", [])]
        hists = [h for c in caches for ctx in c.contexts for h in ctx.state.get("bit_hist", [])]
        s = summarize(res, reference)
        b = plan_bytes(plans, final_len, HEADS, DIM)
        row = {
            "config": name,
            "bytes": b,
            **s,
            "windows": args.windows,
            "score": args.score,
            "text": args.text,
            "seconds": timer(),
            "keys_only": args.keys_only,
            "values_only": args.values_only,
            "mix_share_b": sum(shares) / len(shares) if shares else None,
            "pair_width_hist_0_4": torch.tensor(hists).sum(0).tolist() if hists else None,
        }
        extra = ""
        if row["mix_share_b"] is not None:
            extra += f" mix: codec b in {100 * row['mix_share_b']:.1f} % of pairs;"
        if row["pair_width_hist_0_4"] is not None:
            extra += f" pairs at 0..4 bits (all windows): {row['pair_width_hist_0_4']}"
        print(
            f"| {name} | {b:,} | {s['kl']:.5f} | {s['dppl']:+.2f} | {s['kl_windows']} |{extra}",
            flush=True,
        )
        per_layer: dict[int, list[int]] = {}
        for c in caches:
            for ctx in c.contexts:
                for h in ctx.state.get("bit_hist", []):
                    acc = per_layer.setdefault(ctx.layer_idx, [0] * len(h))
                    per_layer[ctx.layer_idx] = [a + x for a, x in zip(acc, h, strict=True)]
        row["pair_width_hist_per_layer"] = [per_layer[i] for i in sorted(per_layer)] or None
        with open(args.log, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
