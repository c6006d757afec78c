"""Decode attention over ragged relay storage: which one-call form is faster on CPU?

SmolLM2-135M shapes (9 query heads, 3 kv heads, head_dim 64, batch 1, one query token), kv
heads holding unequal counts (``n, 3n/4, n/2``, as after an adaptive eviction) in one flat
``[N, D]`` buffer with headroom between segments. Rows (median of ``blocked_autorange``):

* ``per_head_sdpa``  — one SDPA per kv head over its contiguous segment (the old layout);
* ``gather_sdpa``    — gather every segment into a padded ``[H_kv, G, S, D]`` view (group
  axis a stride-0 broadcast) and ONE SDPA with a key-padding mask (what
  :func:`kvlab.relay.attention.ragged_attention` does);
* ``segment_softmax`` — logits of every stored token against its segment's queries, a
  segment softmax with ``scatter_reduce``/``index_add``, values summed with one matmul.

``bits`` says whether ``gather_sdpa`` returns the same bits as ``per_head_sdpa``.

    OMP_NUM_THREADS=1 python benchmarks/relay_attention_layouts.py --tokens 256,512,1024,2048
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils import benchmark

HQ, HKV, D = 9, 3, 64
G = HQ // HKV


def _layout(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    caps = [n + n // 4 + 16 for n in lengths]
    offsets = [sum(caps[:s]) for s in range(len(caps))]
    keys, values = torch.randn(sum(caps), D), torch.randn(sum(caps), D)
    segment = torch.full((sum(caps),), len(lengths), dtype=torch.int64)  # headroom: no segment
    for s, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        segment[o : o + n] = s
    return keys, values, offsets, segment


def per_head_sdpa(q, keys, values, offsets, lengths):
    outs = []
    for h, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        k = keys[o : o + n].view(1, 1, n, D).expand(1, G, n, D)
        v = values[o : o + n].view(1, 1, n, D).expand(1, G, n, D)
        outs.append(F.scaled_dot_product_attention(q[:, h * G : (h + 1) * G], k, v))
    return torch.cat(outs, 1)


def gather_sdpa(q, keys, values, offsets, lengths):
    longest = max(lengths)
    n = torch.tensor(lengths)
    slot = torch.arange(longest)
    index = (torch.tensor(offsets).view(-1, 1) + torch.minimum(slot, (n - 1).view(-1, 1))).view(-1)
    k = keys.index_select(0, index).view(HKV, 1, longest, D).expand(-1, G, -1, -1)
    v = values.index_select(0, index).view(HKV, 1, longest, D).expand(-1, G, -1, -1)
    mask = (slot.view(1, -1) < n.view(-1, 1)).view(HKV, 1, 1, longest)
    out = F.scaled_dot_product_attention(q.view(HKV, G, 1, D), k, v, attn_mask=mask)
    return out.view(1, HQ, 1, D)


def segment_softmax(q, keys, values, segment):
    segments = HKV
    logits_all = keys @ q.view(segments * G, D).T * D**-0.5  # [N, H_kv * G]
    col = segment.clamp(max=segments - 1).view(-1, 1) * G + torch.arange(G).view(1, -1)
    logits = logits_all.gather(1, col).masked_fill((segment == segments).view(-1, 1), -torch.inf)
    seg = segment.view(-1, 1).expand(-1, G)
    peak = torch.full((segments + 1, G), -torch.inf).scatter_reduce(0, seg, logits, "amax")
    weights = torch.exp(logits - peak[segment]).nan_to_num(0.0)
    total = torch.zeros(segments + 1, G).index_add_(0, segment, weights)
    spread = torch.zeros(keys.shape[0], (segments + 1) * G).scatter_(
        1, segment.view(-1, 1) * G + torch.arange(G).view(1, -1), weights
    )
    out = (spread.T @ values)[: segments * G] / total[:segments].reshape(-1, 1)
    return out.view(1, HQ, 1, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,512,1024,2048", help="longest head, tokens")
    parser.add_argument("--min-run-time", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; microseconds (median)")
    for n in [int(t) for t in args.tokens.split(",")]:
        lengths = [n, 3 * n // 4, n // 2]
        keys, values, offsets, segment = _layout(lengths)
        q = torch.randn(1, HQ, 1, D)
        reference = per_head_sdpa(q, keys, values, offsets, lengths)
        case = (q, keys, values, offsets, lengths)
        rows = {
            "per_head_sdpa": lambda case=case: per_head_sdpa(*case),
            "gather_sdpa": lambda case=case: gather_sdpa(*case),
            "segment_softmax": lambda q=q, kv=(keys, values), s=segment: segment_softmax(q, *kv, s),
        }
        torch.testing.assert_close(rows["segment_softmax"](), reference, atol=1e-5, rtol=1e-5)
        bits = torch.equal(rows["gather_sdpa"](), reference)
        times = {
            name: benchmark.Timer(stmt="fn()", globals={"fn": fn})
            .blocked_autorange(min_run_time=args.min_run_time)
            .median
            * 1e6
            for name, fn in rows.items()
        }
        cells = "  ".join(f"{name} {t:7.0f}" for name, t in times.items())
        print(f"tokens per head {lengths}: {cells}  bits(gather == per-head) {bits}")


if __name__ == "__main__":
    main()
