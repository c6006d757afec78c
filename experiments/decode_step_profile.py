"""Where one whole-model decode step of a PN-Mix (or any) cache spends its time (issue 37):
a py-spy sample of single-token forwards over a synthetic cache built exactly as
benchmarks/decode_speed.py builds it (a real 1,024-token prefill's keys and values, tiled to
``P`` tokens per sequence, ``B`` sequences)::

    OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python experiments/decode_step_profile.py \\
        --method pn-mix --context 8192 --batch 1 --steps 120 &
    py-spy record -p $! -d 15 -f raw -o pnmix.raw --native   # once it prints START
    python experiments/decode_step_profile.py --summarize pnmix.raw

``--summarize`` prints the share of samples whose innermost frame is each function (self), and
the share under each kvlab / kernel frame (inclusive). Results: docs/benchmarks.md, "Decode on
the CPU against the bytes limit".
"""

from __future__ import annotations

import argparse
import time
from collections import Counter


def summarize(path: str, top: int = 15) -> None:
    """Self and inclusive shares of a py-spy ``--format raw`` file."""
    total = 0
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    with open(path, encoding="utf-8") as lines:
        rows = [line.rsplit(" ", 1) for line in lines if line.strip()]
    for stack, count in rows:
        n = int(count)
        total += n
        frames = [f[:110] for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            under[frame] += n
    print(f"samples: {total}")
    for frame, n in own.most_common(top):
        print(f"{100 * n / total:5.1f}% self {frame}")
    keys = ("pnmix", "kvlab", "attention", "kernel", "decode", "packed", "dense")
    for frame, n in under.most_common(80):
        if any(k in frame for k in keys):
            print(f"{100 * n / total:5.1f}% incl {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="pn-mix")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--summarize", help="a py-spy raw file to summarize instead")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    import torch
    from decode_speed import entries, fill, layer_states

    import kvlab
    from kvlab.data import default_text
    from kvlab.integrations.attention import use_attention

    torch.set_num_threads(1)
    loaded = kvlab.load_model(args.model)
    model = loaded.model
    ids = loaded.tokenizer(default_text().data.decode()[:40000], return_tensors="pt").input_ids[0]
    states = layer_states(model, ids[:1024])
    entry = entries([args.method], loaded)[0]
    cache = fill(model, entry, states, args.context, args.batch)
    print("START", flush=True)
    with torch.no_grad(), use_attention(model, entry.attention):
        start = time.process_time()
        for j in range(args.steps):
            token = ids[1101 + j].view(1, 1).expand(args.batch, 1)
            model(token, use_cache=True, logits_to_keep=1, cache=cache)
        print(f"{entry.name}: {(time.process_time() - start) / args.steps:.4f} CPU s per step")


if __name__ == "__main__":
    main()
