"""CPU time of an eviction's observation window (:func:`kvlab.relay.observation.window_attention`)
at a prefill, against the model's own causal SDPA of the same layer and the bare matrix product
of the window's logits — what the scoring of ``relay:snapkv`` / ``evict-no-relay:snapkv`` adds to
a one-forward prefill, and how much of it no reorganisation of the softmax can remove:

    OMP_NUM_THREADS=1 python benchmarks/observation_window.py --tokens 4096,8192 \\
        --heads 9 --kv-heads 3 --head-dim 64 --window-share 0.375

Random float32 queries, keys and values of one layer (``[1, H_q, S, D]``, ``[1, H_kv, S, D]``);
the window is ``round(window_share * S)`` queries (the default policy's observation window at
``@0.5``: 3/4 of the per-head budget, docs/design.md "RoPE-Relay: Eviction policy"). Columns,
process CPU time per layer, best of ``--rounds``: ``sdpa`` (causal, GQA), ``window`` (the
function, every reduction the scorers read), ``window QK`` (only the logits' matrix product
``q_w @ K^T`` of the window's queries over every key, in the function's chunks), and
``window / sdpa``: with ``L`` layers the window adds about that share of the attention's time to
a prefill (the linear layers' time comes on top of both).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kvlab.relay import observation
from kvlab.relay.observation import window_attention


def best_of(fn, rounds: int) -> float:
    """Smallest process CPU seconds of ``rounds`` calls of ``fn`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window-share", type=float, default=0.375)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hq, hk, d = args.heads, args.kv_heads, args.head_dim
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| S | window | sdpa ms | window ms | window QK ms | window / sdpa | QK / sdpa |")
    print("|---|---|---|---|---|---|---|")
    for s in (int(t) for t in args.tokens.split(",")):
        w = max(1, round(args.window_share * s))
        q = torch.randn(1, hq, s, d, generator=gen)
        k = torch.randn(1, hk, s, d, generator=gen)
        v = torch.randn(1, hk, s, d, generator=gen)
        valid = torch.ones(1, hk, s, dtype=torch.bool)
        scale = d**-0.5

        def sdpa(q=q, k=k, v=v, scale=scale):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        def window(q=q, k=k, valid=valid, w=w, scale=scale):
            window_attention(q, scale, k, valid, w)

        qw = q[:, :, s - w :].reshape(1, hk, (hq // hk) * w, d)
        keys_t = k.transpose(-1, -2)
        per_query = hq * s
        step = (
            w
            if per_query * w <= observation.ONE_PIECE_LOGITS
            else max(1, observation.CHUNK_LOGITS // per_query)
        )

        def qk(qw=qw, keys_t=keys_t, w=w, step=step, g=hq // hk):
            view = qw.view(1, hk, g, w, d)
            for j0 in range(0, w, step):
                part = view[:, :, :, j0 : j0 + step].reshape(1, hk, -1, d)
                torch.matmul(part, keys_t)

        t_sdpa, t_window, t_qk = (best_of(f, args.rounds) for f in (sdpa, window, qk))
        print(
            f"| {s} | {w} | {t_sdpa * 1e3:.0f} | {t_window * 1e3:.0f} | {t_qk * 1e3:.0f} | "
            f"{t_window / t_sdpa:.2f}× | {t_qk / t_sdpa:.2f}× |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
