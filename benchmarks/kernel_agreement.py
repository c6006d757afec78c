"""How far the compiled packed-attention backends are from the torch reference.

Every codec (mix, cartesian, phase_norm, per_token) × bits (2, 3, 4) × four small stores (sinks,
residual and group sizes of ``tests/pnmix/test_attention.py``), a padded batch built by a prefill
plus single-token appends, queries Q = 1 and 3 with and without a soft-cap, learned sinks, and
non-causal: prints the largest absolute difference of each backend from ``backend="torch"``
(keys and values ~N(0, 1), outputs of order 1).

    OMP_NUM_THREADS=1 python benchmarks/kernel_agreement.py --backends cpu
    TRITON_INTERPRET=1 python benchmarks/kernel_agreement.py --backends triton   # slow on CPU
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

CODINGS = ("mix", "cartesian", "phase_norm", "per_token")
STORES = ((0, 0, 4), (2, 3, 4), (1, 0, 3), (0, 2, 5))  # (sinks, residual, group tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cpu")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",")]
    worst = dict.fromkeys(backends, 0.0)
    gen = torch.Generator().manual_seed(0)
    for coding, bits, (sink, residual, group) in itertools.product(CODINGS, (2, 3, 4), STORES):
        cfg = PNMixConfig(
            bits=bits,
            sink_tokens=sink,
            residual_tokens=residual,
            group_tokens=group,
            key_coding=coding,  # type: ignore[arg-type]
            rotary_dim=8,
        )
        keys = torch.randn(2, 2, 41, 10, generator=gen)
        values = torch.randn(2, 2, 41, 6, generator=gen)
        cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=10, value_head_dim=6)
        cache.append(keys[:, :, :15], values[:, :, :15], [15, 9])
        for i in range(15, 41):
            cache.append(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        for nq in (1, 3):
            query = torch.randn(2, 6, nq, 10, generator=gen)
            for extra in (
                {},
                {"logit_softcap": 2.0},
                {"sink_logits": torch.randn(6, generator=gen)},
                {"causal": False},
            ):
                ref = pnmix_attention(query, cache, backend="torch", **extra)  # type: ignore[arg-type]
                for backend in backends:
                    out = pnmix_attention(query, cache, backend=backend, **extra)  # type: ignore[arg-type]
                    worst[backend] = max(worst[backend], float((out - ref).abs().max()))
    calls = len(CODINGS) * 3 * len(STORES) * 8
    for backend, err in worst.items():
        print(f"{backend}: largest |{backend} - torch| = {err:.3e} over {calls} calls")


if __name__ == "__main__":
    main()
