"""Where a CUDA run of the PN-Mix diagnostic parts from the CPU's (needs a CUDA device).

The v1 validation record of ``kvlab reproduce --paper pn-mix --device cuda`` compares each
seed's metrics with a CPU rerun. This runs the diagnostic's protocol
(:func:`kvlab.diagnostics.pn_mix.run_protocol`) for each seed on the CPU (torch reference) and
on CUDA with the torch reference and with the Triton kernel, and prints, per seed: the
``online_vs_final_cache_attention_max_delta`` and ``key_mse`` of each, the largest differences
of the projected keys and queries (CUDA vs CPU), of the final outputs, of the dequantized
caches, and whether the Phase–Norm masks are equal — enough to tell the model's projections,
the codes and the attention backend apart.

    python benchmarks/pnmix_cpu_cuda_agreement.py --seeds 42,43
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kvlab.data import default_text
from kvlab.diagnostics import pn_mix as pm
from kvlab.models.byte_rope_gqa import ByteRopeGQA


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="42,43")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pnmix_cpu_cuda_agreement.py needs a CUDA device")
    ids = torch.tensor(list(default_text().data[: pm.TEXT_BYTES]), dtype=torch.int64)
    for seed in (int(s) for s in args.seeds.split(",")):
        runs = {}
        for device, backend in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
            os.environ["KVLAB_PNMIX_BACKEND"] = backend
            model = ByteRopeGQA.from_seed(seed, device)
            result = pm.run_protocol(model, ids.to(device), pm.CACHE)
            runs[(device, backend)] = (result, model.project(ids.to(device)))
            metrics = result["metrics"]
            print(
                f"seed {seed} {device}/{backend}: online_delta "
                f"{metrics['online_vs_final_cache_attention_max_delta']!r} "
                f"key_mse {metrics['key_mse']!r}",
                flush=True,
            )
        (cpu, cpu_proj), (cuda, cuda_proj), (triton, _) = runs.values()
        k_cpu, v_cpu = cpu["cache"].dequantize()
        k_cuda, v_cuda = cuda["cache"].dequantize()
        masks = cpu["cache"].mix_mask, cuda["cache"].mix_mask
        print(
            f"seed {seed}: |k cuda-cpu| {max_diff(cuda_proj.keys, cpu_proj.keys):.3e} "
            f"|q cuda-cpu| {max_diff(cuda_proj.queries, cpu_proj.queries):.3e} "
            f"final cuda/torch-cpu {max_diff(cuda['final_output'], cpu['final_output']):.3e} "
            f"final triton-torch {max_diff(triton['final_output'], cuda['final_output']):.3e} "
            f"dequantized keys {max_diff(k_cuda, k_cpu):.3e} values {max_diff(v_cuda, v_cpu):.3e} "
            f"masks equal {None if masks[0] is None else torch.equal(masks[0], masks[1].cpu())}"
        )


if __name__ == "__main__":
    main()
