"""Pieces the Triton decode kernels share (docs/design.md, "Kernels"): the soft-capping of a
logit tile, one online-softmax step, the kernel that merges a row's split partials (and the
learned sink logit) by log-sum-exp, and two host helpers (a device pointer of a tensor, a power
of two). :mod:`kvlab.pnmix.kernels.triton_decode` (the per-split kernel) and
:mod:`kvlab.pnmix.kernels.triton_splitk` (the split-K GQA kernel) use them.

Importing this module requires ``triton``; under ``TRITON_INTERPRET=1`` it runs on the CPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["merge_kernel", "merge_launch", "online", "pointer", "pow2", "softcap_tile"]


@triton.jit
def softcap_tile(x, qmu, cap):
    """``cap · tanh((x + q·mu) / cap)`` (Gemma 2), tanh as ``1 − 2 / (exp(2y) + 1)`` with ``y``
    clamped to ±15 (tanh is 1 to float32 precision there; no overflow)."""
    y = tl.minimum(tl.maximum((x + qmu) / cap, -15.0), 15.0)
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def online(s, m_run, l_run, acc, accz):
    """Online-softmax step: logits ``s [BM, BT]`` (``-inf`` = masked) into the running state;
    returns the new state, the weights ``p`` and the rescale factor of the old state."""
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_run - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_new = l_run * alpha + tl.sum(p, axis=1)
    return m_new, l_new, acc * alpha[:, None], accz * alpha, p


@triton.jit
def merge_kernel(
    part_m,
    part_l,
    part_acc,
    q_ptr,
    mu_ptr,
    sinks_ptr,
    h_ptr,
    out_ptr,
    M,
    Q,
    H,
    rep,
    NS,
    D: tl.constexpr,
    DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HADAMARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    mblk = tl.program_id(1)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    dv_ok = offs_dv < DV
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # quantized splits (coded frame)
    acc_e = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # the exact tokens' split
    for sp in range(0, NS + 1):
        base = (row * (NS + 1) + sp) * M + offs_m
        sm = tl.load(part_m + base, mask=m_ok, other=float("-inf"))
        sl = tl.load(part_l + base, mask=m_ok, other=0.0)
        sa = tl.load(
            part_acc + base[:, None] * DV + offs_dv[None, :],
            mask=m_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        top = tl.maximum(m_run, sm)
        safe = tl.where(top == float("-inf"), 0.0, top)
        a = tl.exp(m_run - safe)
        b = tl.exp(sm - safe)
        l_run = l_run * a + sl * b
        exact = sp == NS
        acc = acc * a[:, None] + tl.where(exact, 0.0, sa * b[:, None])
        acc_e = acc_e * a[:, None] + tl.where(exact, sa * b[:, None], 0.0)
        m_run = top
    if HAS_SINKS:
        h = row % H
        sink = tl.load(sinks_ptr + h * rep + offs_m // Q, mask=m_ok, other=0.0)
        if not SOFTCAP:  # into the centred logits' frame: minus q . mu
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            q = tl.load(
                q_ptr + (row * M + offs_m[:, None]) * D + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            mu = tl.load(mu_ptr + row * D + offs_d, mask=d_ok, other=0.0)
            sink = sink - tl.sum(q * mu[None, :], axis=1)
        top = tl.maximum(m_run, sink)
        a = tl.exp(m_run - top)
        l_run = l_run * a + tl.exp(sink - top)
        acc = acc * a[:, None]
        acc_e = acc_e * a[:, None]
    if HADAMARD:  # acc @ H (H symmetric): the value codec's output transform
        offs_j = tl.arange(0, BLOCK_DV)
        h = tl.load(
            h_ptr + offs_j[:, None] * DV + offs_dv[None, :],
            mask=(offs_j < DV)[:, None] & dv_ok[None, :],
            other=0.0,
        )
        acc = tl.sum(acc[:, :, None] * h[None, :, :], axis=1)
    out = (acc + acc_e) / tl.maximum(l_run, 1.1754943508222875e-38)[:, None]
    tl.store(
        out_ptr + (row * M + offs_m[:, None]) * DV + offs_dv[None, :],
        out,
        mask=m_ok[:, None] & dv_ok[None, :],
    )


def pointer(t: Tensor, device: torch.device | None = None) -> Tensor:
    """``t``, or a one-element tensor of its dtype on ``device`` (default: ``t``'s) when ``t``
    is empty (a zero-size buffer, e.g. no sink slots, or an unused table: kernels never load
    from it, but a launch needs a valid pointer on the kernel's device)."""
    if t.numel():
        return t
    return torch.zeros(1, dtype=t.dtype, device=t.device if device is None else device)


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def merge_launch(
    parts: tuple[Tensor, Tensor, Tensor],
    q: Tensor,
    mu_rows: Tensor,
    sink_logits: Tensor | None,
    hadamard: Tensor,
    out: Tensor,
    shape: tuple[int, int, int, int, int],
    *,
    d: int,
    dv: int,
    block_m: int,
    block_d: int,
    block_dv: int,
    softcap: bool,
    value_hadamard: bool,
    extra: dict[str, object],
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The arguments and meta-parameters of :func:`merge_kernel` shared by both decode
    launchers: ``parts`` the split partials ``(m, l, acc)``, ``shape`` ``(m_rows, nq, hkv, rep,
    ns)``; ``sink_logits`` ``[H_q]`` or ``None`` (then ``out`` stands in as an unread
    pointer)."""
    dev = out.device
    sinks = (
        sink_logits.detach().to(device=dev, dtype=torch.float32).contiguous()
        if sink_logits is not None
        else out
    )
    args = (*parts, q, mu_rows, sinks, pointer(hadamard, dev), out, *shape)
    meta = dict(
        D=d,
        DV=dv,
        HAS_SINKS=sink_logits is not None,
        SOFTCAP=softcap,
        HADAMARD=value_hadamard,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        **extra,
    )
    return args, meta
