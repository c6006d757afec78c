"""A fixed orthonormal channel rotation for per-token value codes (issue 8 research result).

Per-token min-max codes of values (KIVI) spend their range on each token's largest channels.
Rotating the channels by an orthonormal Hadamard matrix ``H`` first spreads those outliers
over all channels (incoherence processing: QuaRot, Ashkboos et al. 2024, arXiv:2404.00456;
QuIP#, Tseng et al. 2024), so a value codec stores the codes of ``v H`` and decodes
``(v H)_hat H^T`` — or, in packed attention, multiplies the attention output by ``H^T`` once
(``Σ_t p_t (v_t H)_hat H^T = (Σ_t p_t (v_t H)_hat) H^T``). No byte is added.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["hadamard_matrix", "hadamard_signs"]


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The orthonormal Sylvester–Hadamard matrix of order ``n``.

    Args:
        n: order, a power of two (``1, 2, 4, ...``).
        dtype: floating dtype of the result.

    Returns:
        ``[n, n]`` with entries ``±1 / sqrt(n)`` (built in float64, then cast), symmetric,
        ``H @ H.T == I`` up to the dtype's rounding; ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)``.

    Raises:
        ValueError: ``n`` not a positive power of two, or ``dtype`` not floating.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating, got {dtype}")
    return (hadamard_signs(n) / math.sqrt(n)).to(dtype)


def hadamard_signs(n: int) -> Tensor:
    """The unnormalized Sylvester–Hadamard matrix of order ``n``: float64 ``[n, n]`` of exact
    ``±1`` (``(-1)^popcount(i & j)``); ``hadamard_matrix(n) = hadamard_signs(n) / sqrt(n)``.

    Raises:
        ValueError: ``n`` not a positive power of two.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n must be a positive power of two, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
