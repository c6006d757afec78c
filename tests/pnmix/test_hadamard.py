"""The orthonormal Hadamard matrix: exact entries, orthonormality, errors."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.pnmix.hadamard import hadamard_matrix


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_entries_and_orthonormality(n: int) -> None:
    h = hadamard_matrix(n, torch.float64)
    assert h.shape == (n, n) and h.dtype == torch.float64
    for i in range(n):
        for j in range(n):
            sign = -1.0 if bin(i & j).count("1") % 2 else 1.0
            assert float(h[i, j]) == sign / math.sqrt(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, h.T)


def test_float32_rotation_round_trips() -> None:
    h = hadamard_matrix(64)
    assert h.dtype == torch.float32
    v = torch.randn(3, 5, 64)
    torch.testing.assert_close((v @ h) @ h.T, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [0, 3, 6, -4, 2.0, True])
def test_rejects_bad_order(n) -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(n)


def test_rejects_integer_dtype() -> None:
    with pytest.raises(ValueError, match="floating"):
        hadamard_matrix(4, torch.int64)
