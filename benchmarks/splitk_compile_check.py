"""Compile the split-K decode kernels for a CUDA target without a GPU (docs/benchmarks.md,
"Decode bytes model and the split-K kernel").

The Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests) runs the kernels as numpy and
never type-checks them as the compiler does; this script builds tiny CPU caches of each coding
at the benchmarked head sizes, prepares the launches (:func:`~kvlab.pnmix.kernels.
triton_splitk.splitk_launches`) and compiles each kernel with ``triton.compile`` for
``--arch`` (default 90: Hopper) down to a cubin with Triton's bundled ``ptxas``. It needs
``triton`` but no device, and must run without ``TRITON_INTERPRET``.

    python benchmarks/splitk_compile_check.py            # exit status 1 if any compile fails
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}


def signature(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple[dict, dict]:
    """Triton's (signature, constexprs) of one launch."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    names = kernel.arg_names
    for name, arg in zip(names, args, strict=False):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
        elif isinstance(arg, bool):
            sig[name] = "i1"
        elif isinstance(arg, int):
            sig[name] = "i64" if abs(arg) >= 2**31 else "i32"
        else:
            sig[name] = "fp32"
    for name in names[len(args) :]:
        sig[name] = "constexpr"
        consts[name] = meta[name]
    return sig, consts


def resources(cubin: bytes) -> str:
    """Registers, spills and shared memory of a cubin (Triton's bundled ``cuobjdump``)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run(
                [str(tool), "--dump-resource-usage", f.name],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return f"({len(cubin)} B cubin)"
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not found:
        return f"({len(cubin)} B cubin)"
    reg, stack, shared, local = found.groups()
    return f"(regs {reg}, stack {stack} B, local {local} B, shared {shared} B)"


def cache_for(coding: str, hkv: int, hq: int, d: int) -> Any:
    from kvlab.evaluation.methods import PNMIX_METHODS
    from kvlab.pnmix import PNMixCache, PNMixConfig
    from kvlab.rope import RotaryConfig, apply_rotary

    cfg = PNMixConfig() if coding == "seed" else PNMixConfig(**PNMIX_METHODS[coding])
    rotary = RotaryConfig(head_dim=d, base=100000.0)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=hkv, head_dim=d, rotary=rotary)
    n = cfg.sink_tokens + cfg.residual_tokens + 3 * cfg.group_tokens + 5
    gen = torch.Generator().manual_seed(0)
    keys = apply_rotary(torch.randn(2, hkv, n, d, generator=gen), torch.arange(n), rotary)
    values = torch.randn(2, hkv, n, d, generator=gen)
    cache.append(keys, values, queries=torch.randn(2, hq, n, d, generator=gen))
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--codings", default="seed,pn-mix,kivi-2bit")
    parser.add_argument(
        "--variants",
        default="default",
        help="'default' (the sweep's kinds) or 'tiles' (warps 4/8 x block_t 16/32/64)",
    )
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlab.pnmix.attention import packed_kv
    from kvlab.pnmix.kernels.bytes_model import MODEL_SHAPES
    from kvlab.pnmix.kernels.triton_splitk import splitk_launches
    from kvlab.pnmix.reference import reference_keys

    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    variants: list[dict[str, Any]] = [
        {},
        {"precision": "tf32x3"},
        {"precision": "bf16x6"},
        {"dot": False, "block_t": 16},
        {"dot": False, "block_t": 16, "num_warps": 8},
    ]
    if args.variants == "tiles":
        variants = [{"num_warps": w, "block_t": t} for w in (4, 8) for t in (16, 32, 64)]
    for shape, (hq, hkv, d) in MODEL_SHAPES.items():
        for coding in args.codings.split(","):
            cache = cache_for(coding, hkv, hq, d)
            kv = packed_kv(cache)
            query = torch.randn(2, hq, 1, d)
            for opts in variants:
                if opts.get("block_t", 0) > cache.config.group_tokens:
                    continue
                launches, _ = splitk_launches(
                    query,
                    kv,
                    cache.kernel_decode,
                    reference_keys(kv),
                    scale=d**-0.5,
                    causal=False,
                    logit_softcap=None,
                    sink_logits=None,
                    splits=2,
                    **opts,
                )
                for launch in launches:
                    sig, consts = signature(launch.kernel, launch.args, launch.meta)
                    warps = launch.meta.get("num_warps", 4)
                    options = {"num_warps": warps, "enable_fp_fusion": False}
                    t0 = time.monotonic()
                    try:
                        src = ASTSource(launch.kernel, sig, consts)
                        compiled = triton.compile(src, target=target, options=options)
                        status = "ok " + resources(compiled.asm["cubin"])
                    except Exception as exc:  # report every failure, then exit 1
                        failures += 1
                        status = f"FAILED: {type(exc).__name__}: {str(exc)[:400]}"
                    name = launch.kernel.__name__
                    print(
                        f"{shape} {coding} {opts} {name}: {status} [{time.monotonic() - t0:.1f} s]",
                        flush=True,
                    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
