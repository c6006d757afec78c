"""Query-aware bit allocation across the rotary pairs of 2-bit keys (issue 8 research result).

At an average of ``b`` bits per key element, the pairs of a kv head need not all get ``b``
bits: the logit error a pair causes is ``q_pair · e_pair`` (``e`` the key's quantization
error, both RoPE-rotated), and its expected square over the queries,
``e_pair^T M_pair e_pair`` with ``M = E[q q^T]`` the second moment of the rotated queries, varies
by orders of magnitude between pairs (low-frequency pairs carry most of the query energy on
SmolLM2-135M). Spending the same code bits where the queries look — some pairs at 3–4 bits,
others at 0 (the group's mean only) — is reverse water-filling (Gersho & Gray, *Vector
Quantization and Signal Compression*, 1992, §8.3, greedy marginal-return allocation); the
error measure is the one issue 8 names for the query-aware mix.

Functions (all pure, float64 arithmetic where errors are compared):

* :func:`query_second_moment` — ``M`` per kv head from the prefill's rotated queries (GQA folded);
* :func:`pair_logit_error` — ``Σ_t e_t,pair^T M_pair e_t,pair`` per rotary pair;
* :func:`allocate_pair_bits` — greedy allocation of widths per pair under a bit budget;
* :func:`mixed_bits_quantize` — per-channel min-max with a width per channel (0 bits: the
  channel's mean as zero point, scale 0, so :func:`kvlab.pnmix.quantizers.minmax_dequantize`
  decodes every width);
* :func:`mixed_bits_code_bytes` — packed code bytes of such a group.

Widths of 1 bit are excluded by default: a 1-bit min-max code (the two extremes) has a larger
squared error than the mean for most key channels, so it is never a useful step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.quantizers import STORAGE_DTYPES, MinMaxCodes, minmax_quantize

__all__ = [
    "DEFAULT_PAIR_WIDTHS",
    "allocate_pair_bits",
    "greedy_pair_bits",
    "mixed_bits_code_bytes",
    "mixed_bits_quantize",
    "pair_logit_error",
    "pair_logit_error_unchecked",
    "pair_moment_entries",
    "pair_moment_logit_error",
    "query_second_moment",
]

#: Allowed code widths per rotary pair (bits per channel) when averaging 2 bits.
DEFAULT_PAIR_WIDTHS: tuple[int, ...] = (0, 2, 3, 4)


def query_second_moment(queries: Tensor, num_key_value_heads: int) -> Tensor:
    """Second moment ``E[q q^T]`` of rotated queries per kv head (GQA groups folded).

    Args:
        queries: ``[B, H_q, T, D]`` RoPE-rotated queries (any floating dtype), ``T >= 1``.
        num_key_value_heads: ``H_kv``; query head ``i`` belongs to kv head
            ``i // (H_q / H_kv)`` (the ``transformers`` GQA convention).

    Returns:
        float64 ``[B, H_kv, D, D]``: the mean over the ``T`` queries and the group's
        ``H_q / H_kv`` heads of ``q q^T``.

    Raises:
        ValueError: not 4-D floating, ``T == 0``, or ``H_q`` not a multiple of ``H_kv``.
    """
    if not isinstance(queries, Tensor) or queries.dim() != 4 or not queries.is_floating_point():
        raise ValueError("queries must be a floating tensor [B, H_q, T, D]")
    b, hq, t, d = queries.shape
    if t == 0:
        raise ValueError("queries must hold at least one query (T >= 1)")
    if (
        isinstance(num_key_value_heads, bool)
        or not isinstance(num_key_value_heads, int)
        or num_key_value_heads < 1
        or hq % num_key_value_heads
    ):
        raise ValueError(
            f"num_key_value_heads must be a positive divisor of H_q={hq}, "
            f"got {num_key_value_heads!r}"
        )
    rep = hq // num_key_value_heads
    q = queries.double().reshape(b, num_key_value_heads, rep * t, d)
    return q.transpose(-1, -2) @ q / (rep * t)


def _check_pairs(first: Tensor, second: Tensor, dim: int) -> None:
    if first.shape != second.shape or first.dim() != 1:
        raise ValueError("first and second must be 1-D index tensors of equal length")
    if first.numel() and (int(torch.cat([first, second]).max()) >= dim):
        raise ValueError(f"pair indices must be < head_dim={dim}")


def pair_logit_error(errors: Tensor, moment: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """Expected squared logit error per rotary pair, summed over tokens.

    ``Σ_t [e_a e_b] M_pair [e_a e_b]^T`` with ``M_pair = [[M_aa, M_ab], [M_ab, M_bb]]``, i.e.
    ``Σ_t E_q[(q_a e_a + q_b e_b)^2]`` when ``M = E[q q^T]``.

    Args:
        errors: ``[B, H_kv, T, D]`` key errors ``k_hat - k`` in the rotated frame (the frame
            the queries of ``moment`` live in).
        moment: ``[B, H_kv, D, D]`` (or broadcastable, e.g. ``[H_kv, D, D]``) query second
            moment, e.g. :func:`query_second_moment`.
        first, second: int64 ``[P]`` channel indices of the rotary pairs
            (:meth:`kvlab.rope.RotaryConfig.pair_indices`).

    Returns:
        float64 ``[B, H_kv, P]``.

    Raises:
        ValueError: ranks or sizes that do not match.
    """
    if errors.dim() != 4:
        raise ValueError(f"errors must be [B, H_kv, T, D], got shape {tuple(errors.shape)}")
    d = errors.shape[-1]
    if moment.shape[-2:] != (d, d):
        raise ValueError(f"moment must end in [{d}, {d}], got shape {tuple(moment.shape)}")
    _check_pairs(first, second, d)
    return pair_logit_error_unchecked(errors, moment, first, second)


def pair_logit_error_unchecked(
    errors: Tensor, moment: Tensor | None, first: Tensor, second: Tensor
) -> Tensor:
    """:func:`pair_logit_error` without input checks and without any device-to-host read (the
    cache's decode path, docs/design.md "Host syncs"); ``moment=None`` is the identity (the
    pair's plain squared key error ``Σ_t e_a² + e_b²``)."""
    entries = None if moment is None else pair_moment_entries(moment, first, second)
    return pair_moment_logit_error(errors, entries, first, second)


def pair_moment_entries(moment: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """float64 ``[..., 3, P]``: the entries of a moment ``[..., D, D]`` a pair's logit error
    reads — ``M_aa``, ``M_bb``, ``M_ab`` of every rotary pair ``(a, b) = (first[p],
    second[p])`` — exactly (no arithmetic)."""
    first, second = first.to(moment.device), second.to(moment.device)
    m = moment.double()
    return torch.stack([m[..., first, first], m[..., second, second], m[..., first, second]], -2)


def pair_moment_logit_error(
    errors: Tensor, pair_moment: Tensor | None, first: Tensor, second: Tensor
) -> Tensor:
    """:func:`pair_logit_error_unchecked` with the moment given by its pair entries
    ``pair_moment [..., 3, P]`` (:func:`pair_moment_entries`; broadcastable to the errors'
    leading dims; ``None``: the identity): float64 ``[..., P]``, ``Σ_t (M_aa e_a) e_a + (M_bb
    e_b) e_b + ((2 M_ab) e_a) e_b`` in that order of operations. No device read."""
    first, second = first.to(errors.device), second.to(errors.device)
    ea, eb = errors[..., first].double(), errors[..., second].double()
    if pair_moment is None:
        return (ea * ea + eb * eb).sum(-2)
    m = pair_moment.double().to(errors.device)
    maa = m[..., 0, :].unsqueeze(-2)
    mbb = m[..., 1, :].unsqueeze(-2)
    mab = m[..., 2, :].unsqueeze(-2)
    return (maa * ea * ea + mbb * eb * eb + 2.0 * mab * ea * eb).sum(-2)


def allocate_pair_bits(distortion: Tensor, widths: Sequence[int], average_bits: int) -> Tensor:
    """Greedy bit widths per rotary pair under a total bit budget, per sequence.

    Every pair starts at ``widths[0]``; each step moves the pair with the largest distortion
    decrease per added bit to its next width, as long as that step fits in the remaining
    budget (ties: the lowest flat (kv head, pair) index). The budget is
    ``average_bits * H_kv * P`` bits of pair width per sequence — each channel of a pair gets
    the pair's width, so the codes cost ``average_bits`` per key element on average. The total
    equals the budget unless no remaining step fits (then it is smaller).

    Args:
        distortion: float ``[len(widths), B, H_kv, P]``: each pair's error at each width
            (e.g. :func:`pair_logit_error` summed over calibration groups).
        widths: strictly increasing code widths in bits (``0`` allowed), e.g.
            :data:`DEFAULT_PAIR_WIDTHS`; ``widths[0] <= average_bits <= widths[-1]``.
        average_bits: the average width to spend.

    Returns:
        int64 ``[B, H_kv, P]`` widths (values from ``widths``).

    Raises:
        ValueError: bad widths, a budget outside their range, a distortion of the wrong
            shape, or a non-finite distortion.
    """
    w = list(widths)
    if (
        len(w) < 1
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > 8 for x in w)
        or any(b <= a for a, b in itertools.pairwise(w))
    ):
        raise ValueError(f"widths must be strictly increasing ints in 0..8, got {widths!r}")
    if isinstance(average_bits, bool) or not isinstance(average_bits, int):
        raise ValueError(f"average_bits must be an int, got {average_bits!r}")
    if not w[0] <= average_bits <= w[-1]:
        raise ValueError(f"average_bits={average_bits} lies outside the widths {w[0]}..{w[-1]}")
    if distortion.dim() != 4 or distortion.shape[0] != len(w):
        raise ValueError(
            f"distortion must be [len(widths)={len(w)}, B, H_kv, P], "
            f"got shape {tuple(distortion.shape)}"
        )
    if not torch.isfinite(distortion).all():
        raise ValueError("distortion must be finite")
    return greedy_pair_bits(distortion, w, average_bits)


def greedy_pair_bits(
    distortion: Tensor, widths: Sequence[int], average_bits: int, *, on_host: bool | None = None
) -> Tensor:
    """The greedy of :func:`allocate_pair_bits` without input checks, on the distortion's
    device and without any device-to-host read (a fixed number of vectorized steps; the
    cache's decode path, docs/design.md "Host syncs"). Same result as
    :func:`allocate_pair_bits` for valid input; a non-finite distortion gives some valid
    allocation (callers flag such input separately).

    Args:
        distortion: float ``[len(widths), B, H_kv, P]``.
        widths: strictly increasing widths (bits).
        average_bits: the average width, ``widths[0] <= average_bits <= widths[-1]``.
        on_host: run the steps in numpy on the host (the same IEEE operations, the same
            widths; ``None``: for a CPU distortion) or as torch ops on the distortion's device
            (False).

    Returns:
        int64 ``[B, H_kv, P]`` widths, on the distortion's device.
    """
    w = list(widths)
    dev = distortion.device
    lv = torch.tensor(w, dtype=torch.int64, device=dev)
    top = len(w) - 1
    _, batch, heads, pairs = distortion.shape
    if on_host is None:
        on_host = dev.type == "cpu"  # no per-op torch overhead there
    if on_host:
        host = _greedy_host(distortion.detach().double().cpu().numpy(), w, average_bits)
        return torch.from_numpy(host).reshape(batch, heads, pairs).to(dev)
    index = torch.zeros(batch, heads * pairs, dtype=torch.int64, device=dev)
    if top == 0 or heads * pairs == 0:
        return lv[index].reshape(batch, heads, pairs)
    step = (lv[1:] - lv[:-1]).double()
    d = distortion.double().reshape(len(w), batch, heads * pairs)
    gain = (d[:-1] - d[1:]) / step[:, None, None]  # [top, B, HP]
    left = torch.full((batch,), float((average_bits - w[0]) * heads * pairs), device=dev)
    left = left.double()
    rows = torch.arange(batch, device=dev)
    # every step raises one pair by one width: at most top * H * P steps; a step with no
    # affordable pair changes nothing (same result as stopping there)
    for _ in range(top * heads * pairs):
        nxt = index.clamp(max=top - 1)
        cost = step[nxt]  # [B, HP]
        ok = (index < top) & (cost <= left[:, None])
        cur = torch.gather(gain.permute(1, 2, 0), 2, nxt.unsqueeze(-1)).squeeze(-1)  # [B, HP]
        cur = torch.where(ok, cur, torch.full_like(cur, -math.inf))
        flat = cur.argmax(dim=-1)  # ties: the lowest flat index
        take = ok.any(dim=-1)
        index[rows, flat] += take.long()
        left = left - torch.where(take, cost[rows, flat], torch.zeros_like(left))
    return lv[index].reshape(batch, heads, pairs)


def _greedy_host(distortion: np.ndarray, widths: list[int], average_bits: int) -> np.ndarray:
    """:func:`greedy_pair_bits` on a host float64 ``[W, B, H, P]`` array: the same IEEE
    float64 operations (gains, costs, what is left of the budget) and the same argmax (the
    first maximum; a NaN counts as the largest, as in torch), so the same widths; it stops
    at the first step where no row can take a step (every later step would change nothing).
    Returns int64 ``[B, H * P]``."""
    lv = np.asarray(widths, dtype=np.int64)
    top = len(widths) - 1
    _, batch, heads, pairs = distortion.shape
    index = np.zeros((batch, heads * pairs), dtype=np.int64)
    if top == 0 or heads * pairs == 0:
        return lv[index]
    step = (lv[1:] - lv[:-1]).astype(np.float64)
    d = distortion.reshape(len(widths), batch, heads * pairs)
    gain = np.ascontiguousarray(((d[:-1] - d[1:]) / step[:, None, None]).transpose(1, 2, 0))
    left = np.full(batch, float((average_bits - widths[0]) * heads * pairs), dtype=np.float64)
    rows = np.arange(batch)
    for _ in range(top * heads * pairs):
        nxt = np.minimum(index, top - 1)
        cost = step[nxt]  # [B, HP]
        ok = (index < top) & (cost <= left[:, None])
        take = ok.any(axis=-1)
        if not take.any():
            break
        cur = np.take_along_axis(gain, nxt[..., None], axis=2)[..., 0]  # [B, HP]
        cur = np.where(ok, cur, -np.inf)
        flat = cur.argmax(axis=-1)  # ties: the lowest flat index
        index[rows, flat] += take
        left = left - np.where(take, cost[rows, flat], 0.0)
    return lv[index]


def mixed_bits_quantize(
    x: Tensor, bits: Tensor, dim: int = -2, storage_dtype: torch.dtype = torch.float16
) -> MinMaxCodes:
    """Per-channel min-max quantization with a code width per channel.

    Channels of width ``b >= 1`` are coded exactly as :func:`kvlab.pnmix.quantizers.
    minmax_quantize` codes them at ``b`` bits (bit-identical codes and scalars). A channel of
    width 0 stores no codes: its zero point is the channel's mean over ``dim`` (computed in
    float64, rounded to the storage dtype), its scale 0, its codes 0 — so
    :func:`kvlab.pnmix.quantizers.minmax_dequantize` decodes every width.

    Args:
        x: storage-rounded ``[..., T, D]`` (``dim`` the token dimension, ``-2``).
        bits: int ``[..., D]`` widths in ``0..8`` (broadcastable to ``x`` without ``dim``).
        dim: the token dimension reduced by min/max; must be ``-2`` (or its positive index).
        storage_dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        :class:`~kvlab.pnmix.quantizers.MinMaxCodes` (codes uint8 of ``x``'s shape; scale and
        zero of ``x``'s shape without ``dim``).

    Raises:
        ValueError: ``dim`` not the second-to-last, widths outside 0..8 or of a shape that does
            not broadcast, a bad storage dtype.
    """
    if x.dim() < 2 or dim not in (-2, x.dim() - 2):
        raise ValueError("mixed_bits_quantize codes along the token dimension (dim=-2)")
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be float16 or bfloat16, got {storage_dtype!r}")
    if bits.is_floating_point() or bits.dtype == torch.bool:
        raise ValueError(f"bits must be an integer tensor, got {bits.dtype}")
    reduced = x.shape[:-2] + x.shape[-1:]
    try:
        widths = torch.broadcast_to(bits.to(x.device), reduced)
    except RuntimeError as exc:
        raise ValueError(
            f"bits of shape {tuple(bits.shape)} does not broadcast to {tuple(reduced)}"
        ) from exc
    if widths.numel() and (int(widths.min()) < 0 or int(widths.max()) > 8):
        raise ValueError("bits must lie in 0..8")
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(reduced, dtype=storage_dtype, device=x.device)
    zero = x.double().mean(dim=-2).to(storage_dtype)
    for b in widths.unique().tolist():
        if b == 0:
            continue
        sel = widths == b
        q = minmax_quantize(x, int(b), -2, storage_dtype)
        codes = torch.where(sel.unsqueeze(-2), q.codes, codes)
        scale = torch.where(sel, q.scale, scale)
        zero = torch.where(sel, q.zero, zero)
    return MinMaxCodes(codes, scale, zero)


def mixed_bits_code_bytes(bits: Tensor, tokens: int) -> int:
    """Packed code bytes of one group of ``tokens`` tokens whose channels have widths ``bits``
    ``[..., D]``: per leading index (sequence, kv head) ``ceil(tokens * Σ_d bits / 8)``."""
    per_slab = bits.reshape(-1, bits.shape[-1]).sum(-1)
    return int(sum(math.ceil(tokens * int(s) / 8) for s in per_slab.tolist()))
