"""Issue 8: per-layer group size and outlier fraction, calibrated on the package's King James
text (never the evaluation text), by a FAST proxy — one forward capturing every layer, then
per-layer measurements on the captured tensors — or by kvlab's end-to-end calibration.

* ``end-to-end`` — :func:`kvlab.integrations.pnmix_calibration.calibrate_group_tokens` for a
  PN-Mix key coding (today's procedure: the KL one quantized layer causes, per layer and group
  size, then a knapsack on scalar bytes). Prints the groups and the wall time.
* ``proxy`` — capture q/k/v of one calibration window (tokens 10,000 .. 10,000 + 2P - 1 of the
  King James text, P = 512), code each layer's keys with a research codec at each candidate
  (group size, outlier fraction) — the flush rule at the window's final length, codec
  preparation (bit allocation) from the first P tokens as at prefill — and measure the
  attention KL of the last P queries (mean over heads and queries, keys coded, values exact).
  A multiple-choice knapsack then picks one candidate per layer minimizing the summed KL under
  a budget of scalar + outlier bytes per quantized token: ``--budget-group`` tokens per group
  and ``--budget-outliers`` outliers everywhere.

    python experiments/pnmix_calibrate.py proxy --codec pre+alloc --out alloc.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from pnmix_codecs import BitAllocKeys, CartesianKeys
from pnmix_key_codings import attention_kl
from pnmix_sim import (
    SINKS,
    LayerContext,
    Timer,
    _derotate,
    capture_qkv,
    flushed_groups,
    load,
    rotary_of,
    round16,
    text_ids,
)

CALIBRATION_START = 10_000
HEADS, DIM = 3, 64


def make_codec(name: str, outliers: float):
    if name == "cart-rot":
        return CartesianKeys(outliers=outliers)
    if name == "pre":
        return CartesianKeys(prerope=True, outliers=outliers)
    if name == "pre+alloc":
        return BitAllocKeys(outliers=outliers)
    raise ValueError(name)


def cost_per_token(g: int, f: float) -> float:
    """Scalar + outlier bytes per quantized token of one layer (3 kv heads x 64 channels):
    2 float16 scalars per channel per group, 4 bytes per outlier."""
    return HEADS * DIM * 2 * 2 / g + f * HEADS * DIM * 4


def knapsack(sens: list[dict], budget: float, unit: float = 0.12) -> list:
    """One candidate per layer minimizing Σ sensitivity with Σ_layers cost <= L * budget
    (``budget``: bytes per quantized token of one layer; exact DP on costs in units of
    ``unit`` bytes per token; ties: cheaper)."""
    cands = list(sens[0])
    costs = {c: round(cost_per_token(*c) / unit) for c in cands}
    cap = math.floor(len(sens) * budget / unit + 1e-9)
    best = {0: (0.0, [])}
    for s in sens:
        nxt: dict = {}
        for used, (tot, ch) in best.items():
            for c in cands:
                u = used + costs[c]
                if u > cap:
                    continue
                v = (tot + s[c], [*ch, c])
                if u not in nxt or v[0] < nxt[u][0]:
                    nxt[u] = v
        best = nxt
    return min(best.items(), key=lambda it: (it[1][0], it[0]))[1][1]


def proxy(args) -> None:
    timer = Timer()
    model, tok = load()
    ids = text_ids(tok, None)
    p = args.prefill
    window = ids[CALIBRATION_START : CALIBRATION_START + 2 * p - 1]
    captured = capture_qkv(model, window)
    rotary = rotary_of(model)
    n = window.numel()
    positions = torch.arange(n)
    groups = [int(g) for g in args.groups.split(",")]
    fracs = [float(f) for f in args.outliers.split(",")]
    sens = []
    for idx, (q, k, _v) in enumerate(captured):
        kr = round16(k)
        b, hkv, _, d = k.shape
        rep = q.shape[1] // hkv
        qp = q[:, :, :p].double()
        cov = torch.einsum(
            "bhrtd,bhrte->hde", qp.reshape(b, hkv, rep, p, d), qp.reshape(b, hkv, rep, p, d)
        ) / (rep * p)
        qpre = _derotate(qp, positions[:p], rotary).reshape(b, hkv, rep, p, d)
        cov_pre = torch.einsum("bhrtd,bhrte->hde", qpre, qpre) / (rep * p)
        row = {}
        for g in groups:
            g_pre = flushed_groups(p, g)
            g_all = flushed_groups(n, g)
            for f in fracs:
                codec = make_codec(args.codec, f)
                ctx = LayerContext(
                    idx,
                    rotary,
                    query_cov=cov,
                    query_cov_pre=cov_pre,
                    prefill_keys=kr[:, :, SINKS : SINKS + g_pre * g],
                    prefill_positions=positions[SINKS : SINKS + g_pre * g],
                )
                ctx.state["group_tokens"] = g
                codec.prepare(ctx)
                coded = kr.clone()
                for j in range(g_all):
                    sl = slice(SINKS + j * g, SINKS + (j + 1) * g)
                    coded[:, :, sl] = codec.decode(kr[:, :, sl], positions[sl], ctx)
                row[(g, f)] = attention_kl(q, k, coded, n - p)
        sens.append(row)
        print(f"layer {idx}: " + ", ".join(f"{c}: {v:.4f}" for c, v in row.items()), flush=True)
    if args.out:
        with open(args.out + ".sens.json", "w") as fh:
            json.dump([{f"{g}/{f}": v for (g, f), v in s.items()} for s in sens], fh)
    budget = cost_per_token(args.budget_group, args.budget_outliers)
    alloc = knapsack(sens, budget)
    result = {
        "codec": args.codec,
        "budget_bytes_per_token": budget,
        "layer_group_tokens": [c[0] for c in alloc],
        "layer_outliers": [c[1] for c in alloc],
        "seconds": timer(),
        "sensitivity": [{f"{g}/{f}": v for (g, f), v in s.items()} for s in sens],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "sensitivity"}))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


def end_to_end(args) -> None:
    import dataclasses

    from kvlab.integrations.pnmix_calibration import calibrate_group_tokens
    from kvlab.pnmix import PNMixConfig

    model, tok = load()
    cfg = dataclasses.replace(PNMixConfig(), bits=2, key_coding=args.coding, group_tokens=32)
    alloc = calibrate_group_tokens(model, tok, cfg, budget_group_tokens=32)
    out = {
        "coding": args.coding,
        "layer_group_tokens": list(alloc.layer_group_tokens),
        "seconds": round(alloc.seconds, 1),
        "sensitivity": [{str(g): v for g, v in s.items()} for s in alloc.sensitivities],
    }
    print(json.dumps({k: v for k, v in out.items() if k != "sensitivity"}))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


def moments(args) -> None:
    """Static query second moments per (layer, kv head) from the calibration window's first P
    queries: float64 ``[L, H_kv, D, D]`` saved with ``torch.save``."""
    from kvlab.pnmix.bitalloc import query_second_moment

    timer = Timer()
    model, tok = load()
    ids = text_ids(tok, None)
    window = ids[CALIBRATION_START : CALIBRATION_START + args.prefill]
    captured = capture_qkv(model, window)
    m = torch.stack([query_second_moment(q, k.shape[1])[0] for q, k, _ in captured])
    torch.save(m, args.out)
    print(f"moments {tuple(m.shape)} -> {args.out} ({timer()} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["proxy", "end-to-end", "moments"])
    ap.add_argument("--codec", default="pre+alloc")
    ap.add_argument("--coding", default="cartesian", help="end-to-end: PN-Mix key_coding")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--groups", default="16,32,64,128")
    ap.add_argument("--outliers", default="0")
    ap.add_argument("--budget-group", type=int, default=32)
    ap.add_argument("--budget-outliers", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    {"proxy": proxy, "end-to-end": end_to_end, "moments": moments}[args.command](args)


if __name__ == "__main__":
    main()
