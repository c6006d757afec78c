"""Peak resident memory of one prompt's prefill per KV-cache method, each method in a fresh
process, and the longest context and largest batch each method fits in a fixed KV budget:

    python benchmarks/prefill_memory.py --model qwen2.5-coder-0.5b --tokens 16384 --chunk 1024 \\
        --methods full,pn-mix,kivi-2bit,relay:snapkv@0.5,relay:snapkv@0.5+pn-mix

Each method runs in its own subprocess (``python benchmarks/prefill_memory.py --child ...``):
load the model, build the prompt (the first ``--tokens`` tokens of kvlab's default text),
prepare the method (:func:`kvlab.prepare`; ``KVLAB_CALIBRATION_CACHE`` chooses the calibration
folder) and load its CPU kernels; then the *mark*: the resident set size (``VmRSS``) with the
peak reset (``/proc/self/clear_refs`` = 5, Linux; elsewhere the mark is ``ru_maxrss`` and
peaks below it read as 0); then the prefill (one forward, or ``--chunk``-token forwards); then
the high-water mark (``VmHWM``, else ``resource.getrusage`` ``ru_maxrss``). The children run
with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc; ``--glibc-default`` keeps its adaptive
threshold, under which freed blocks stay resident and the peaks move by 100 MiB from run to
run). Columns: ``mark``
(weights and runtime), ``peak over mark``, the cache's own count of the bytes it holds at the
end (``held``: :func:`kvlab.cache_storage`, its ``held_bytes``, else ``kv_bytes +
index_bytes``), and ``bound``: ``peak / (mark + held + one chunk's working set)``, the working
set being the ``--working-set`` row's peak over its held cache (default ``full`` fed one
``--chunk`` of tokens, or the whole prompt in one forward). The table after it divides the
``--budget-gib`` KV budget by the measured held bytes per prompt token (an eviction's per
token of context) into the longest context and the largest batch of ``--batch-tokens`` tokens.

Runtime: one prefill per method plus one for the working set, each with a model load (about
10 s). Qwen2.5-Coder-0.5B at 16,384 tokens: minutes per method on one thread; SmolLM2-135M at
8,192 tokens: under a minute each.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
GIB = 1 << 30
MIB = 1 << 20


def _status(field: str) -> int | None:
    """``/proc/self/status`` field ``field`` in bytes, or ``None`` off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the process's peak RSS (Linux ``clear_refs`` 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def child(args: argparse.Namespace) -> None:
    """One method's prefill in this process; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(SCRIPT.parent))
    from prefill_cost import Row, prefill, prompt_ids

    import kvlab

    loaded = kvlab.load_model(args.model)
    model = loaded.model.eval()
    ids = prompt_ids(loaded.tokenizer, args.tokens)
    row = Row(args.child, loaded)
    from kvlab.pnmix.kernels import cpu as pnmix_cpu
    from kvlab.relay.kernels import cpu as relay_cpu

    pnmix_cpu.load()
    relay_cpu.load()
    gc.collect()
    reset = _reset_peak()
    mark = _status("VmRSS") if reset else _max_rss()
    assert mark is not None
    start = time.process_time()
    _, cache = prefill(model, row, ids, args.chunk)
    seconds = time.process_time() - start
    peak = _status("VmHWM") if reset else _max_rss()
    assert peak is not None
    storage = kvlab.cache_storage(cache)
    held = storage.held_bytes
    if held is None:
        held = storage.kv_bytes + storage.index_bytes
    print(
        "RESULT "
        + json.dumps(
            {
                "method": args.child,
                "mark": mark,
                "peak": max(peak, mark),
                "held": held,
                "kv_bytes": storage.kv_bytes,
                "kv_bytes_16bit": storage.kv_bytes_16bit,
                "index_bytes": storage.index_bytes,
                "cpu_seconds": seconds,
                "peak_reset": reset,
            }
        ),
        flush=True,
    )


def run(args: argparse.Namespace, method: str, tokens: int) -> dict:
    command = [
        sys.executable,
        str(SCRIPT),
        "--child",
        method,
        "--model",
        args.model,
        "--tokens",
        str(tokens),
        "--chunk",
        str(args.chunk),
        "--threads",
        str(args.threads),
    ]
    env = dict(os.environ)
    if not args.glibc_default:
        # large blocks always mapped and unmapped (glibc's threshold otherwise rises with each
        # freed block, and freed heap memory stays resident): the peak is the live memory
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))
    out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{method}: no result\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--methods", default="full,pn-mix,kivi-2bit,relay:snapkv@0.5")
    parser.add_argument("--chunk", type=int, default=0, help="tokens per forward (0: one)")
    parser.add_argument("--working-set", default="full", help="the method fed one chunk alone")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="keep glibc's malloc thresholds (default: MALLOC_MMAP_THRESHOLD_=131072)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return

    load_before = os.getloadavg()
    one = args.chunk if 0 < args.chunk < args.tokens else args.tokens
    base = run(args, args.working_set, one)
    working = max(0, base["peak"] - base["mark"] - base["held"])
    # fed in one forward, the working-set run is the working-set method's row: not run twice
    rows = [
        base if (m == args.working_set and one == args.tokens) else run(args, m, args.tokens)
        for m in args.methods.split(",")
        if m
    ]
    load_after = os.getloadavg()

    fed = "one forward" if args.chunk <= 0 else f"chunks of {args.chunk}"
    print(
        f"{args.model}, {args.tokens} tokens in {fed}, {args.threads} thread(s); one chunk's "
        f"working set ({args.working_set}, {one} tokens): {working / MIB:.0f} MiB; load "
        f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print()
    print("| method | mark MiB | peak over mark MiB | held cache MiB | bound | CPU s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        bound = r["peak"] / (r["mark"] + r["held"] + working)
        print(
            f"| {r['method']} | {r['mark'] / MIB:.0f} | {(r['peak'] - r['mark']) / MIB:.0f} | "
            f"{r['held'] / MIB:.1f} | {bound:.2f}× | {r['cpu_seconds']:.1f} |"
        )
    print()
    budget = args.budget_gib * GIB
    print(
        f"KV budget {args.budget_gib:g} GiB, from the held bytes per prompt token measured at "
        f"{args.tokens} tokens:"
    )
    print()
    print(f"| method | bytes / token | longest context | largest batch at {args.batch_tokens} |")
    print("|---|---|---|---|")
    for r in rows:
        per_token = r["held"] / args.tokens
        print(
            f"| {r['method']} | {per_token:,.0f} | {int(budget // per_token):,} | "
            f"{int(budget // (per_token * args.batch_tokens)):,} |"
        )


if __name__ == "__main__":
    main()
