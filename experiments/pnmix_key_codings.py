"""Issue 8 probe: attention KL of 2-bit key codings on captured SmolLM2-135M keys.

One exact forward over a window of ``--length`` tokens captures every layer's rotated queries,
keys and values. Per layer, the keys of tokens ``32 .. length - 33`` are coded in groups of
``--group`` tokens (sinks 32 and residual 32 exact, float16), values stay exact, and the
attention distribution of each of the window's last ``--queries`` queries (all query heads) is
compared with the exact one: ``KL(p_exact || p_coded)``, averaged over heads and queries,
summed over the 30 layers. Codings: see ``CODINGS`` (4 bits per rotary pair, float16 scalars
per group; "per-pair best" chooses per (kv head, pair) by the query-weighted error
``E_t[(q_t · (k - k_hat))^2]`` over the window's queries).

    python experiments/pnmix_key_codings.py --text /work/shared/data/hamlet.txt --start 0
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from pnmix_codecs import BitAllocKeys, CartesianKeys, MixKeys, PhaseNormKeys
from pnmix_sim import LayerContext, capture_qkv, load, rotary_of, round16, text_ids

SINKS = RESIDUAL = 32


def codings() -> dict[str, object]:
    pre = CartesianKeys(prerope=True)
    pn_pre = PhaseNormKeys(prerope=True)
    return {
        "cartesian, rotated (kivi-2bit)": CartesianKeys(),
        "phase-norm 2+2, rotated": PhaseNormKeys(),
        "phase-norm 2+2, phase at position 0": pn_pre,
        "phase-norm 1+3, rotated": PhaseNormKeys(norm_bits=1, phase_bits=3),
        "phase-norm 0+4, rotated": PhaseNormKeys(norm_bits=0, phase_bits=4),
        "cartesian, pre-RoPE": pre,
        "per-pair best of pre-RoPE cartesian / phase-norm (query-weighted)": MixKeys(
            pre, pn_pre, "query"
        ),
        "cartesian, pre-RoPE, 1% outliers": CartesianKeys(prerope=True, outliers=0.01),
        "cartesian, rotated, 1% outliers": CartesianKeys(outliers=0.01),
        "cartesian, pre-RoPE, clip search": CartesianKeys(prerope=True, clip=7),
        "pre-RoPE, 0-4 bits per pair by query-weighted error (avg 2)": BitAllocKeys(),
        "pre-RoPE, 0-4 bits per pair by key error (avg 2)": BitAllocKeys(criterion="key"),
        "rotated, 0-4 bits per pair by query-weighted error (avg 2)": BitAllocKeys(prerope=False),
        "pre-RoPE, 0-4 bits per pair, 1% outliers": BitAllocKeys(outliers=0.01),
    }


def attention_kl(q, k_exact, k_coded, n_queries: int) -> float:
    """Mean over query heads and the last ``n_queries`` queries of KL(p_exact || p_coded)."""
    _, hq, n, d = q.shape
    rep = hq // k_exact.shape[1]
    qs = q[:, :, n - n_queries :].double()
    scale = d**-0.5
    ke = k_exact.repeat_interleave(rep, 1).double()
    kc = k_coded.repeat_interleave(rep, 1).double()
    rows = torch.arange(n - n_queries, n)[:, None]
    mask = torch.arange(n)[None, :] > rows
    le = (qs @ ke.transpose(-1, -2) * scale).masked_fill(mask, -math.inf)
    lc = (qs @ kc.transpose(-1, -2) * scale).masked_fill(mask, -math.inf)
    pe, lpe, lpc = le.softmax(-1), le.log_softmax(-1), lc.log_softmax(-1)
    kl = (pe * (lpe - lpc)).nan_to_num(0.0).sum(-1)
    return float(kl.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default="/work/shared/data/hamlet.txt")
    ap.add_argument("--start", type=int, default=0, help="first token of the window")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings of coding names")
    args = ap.parse_args()
    model, tok = load()
    ids = text_ids(tok, args.text)[args.start : args.start + args.length]
    captured = capture_qkv(model, ids)
    rotary = rotary_of(model)
    n = ids.numel()
    g = args.group
    n_groups = (n - SINKS - RESIDUAL) // g
    end = SINKS + n_groups * g
    positions = torch.arange(n)
    table = {}
    only = args.only.split(",") if args.only else None
    for name, codec in codings().items():
        if only and not any(o in name for o in only):
            continue
        total = 0.0
        shares = []
        hists = []
        for idx, (q, k, _v) in enumerate(captured):
            kr = round16(k)
            b, hkv, _, d = k.shape
            rep = q.shape[1] // hkv
            qq = q.double().reshape(b, hkv, rep, n, d)
            cov = torch.einsum("bhrtd,bhrte->hde", qq, qq) / (rep * n)
            from pnmix_sim import _derotate

            qpre = _derotate(q.double(), positions, rotary).reshape(b, hkv, rep, n, d)
            cov_pre = torch.einsum("bhrtd,bhrte->hde", qpre, qpre) / (rep * n)
            ctx = LayerContext(
                layer_idx=idx,
                rotary=rotary,
                query_cov=cov,
                query_cov_pre=cov_pre,
                prefill_keys=kr[:, :, SINKS:end],
                prefill_positions=positions[SINKS:end],
            )
            ctx.state["group_tokens"] = g
            codec.prepare(ctx)
            coded = kr.clone()
            for j in range(n_groups):
                sl = slice(SINKS + j * g, SINKS + (j + 1) * g)
                coded[:, :, sl] = codec.decode(kr[:, :, sl], positions[sl], ctx)
            total += attention_kl(q, k, coded, args.queries)
            shares += ctx.state.get("mix_share", [])
            hists += ctx.state.get("bit_hist", [])
        table[name] = total
        extra = f"  (codec b in {100 * sum(shares) / len(shares):.1f} % of pairs)" if shares else ""
        if hists:
            extra += f"  (pairs at 0..4 bits: {torch.tensor(hists).sum(0).tolist()})"
        print(f"| {name} | {total:.3f} |{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summed_kl": table}, f, indent=1)


if __name__ == "__main__":
    main()
