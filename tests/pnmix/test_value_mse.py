"""MSEHadamardValueCodec ("hadamard_mse"): the Hadamard codec's frame and stored format, each
token's range chosen by squared error (kvlab issue 19)."""

from __future__ import annotations

import pytest
import torch

from kvlab.pnmix import PNMixConfig
from kvlab.pnmix.values import HadamardValueCodec, MSEHadamardValueCodec, value_codec_from_name


def _error(codec, values):
    codes, scalars = codec.encode(values, torch.float16)
    decoded = codec.output_transform(codec.decode(codes, scalars))
    return codes, scalars, ((decoded - values.float()) ** 2).sum(-1)


@pytest.mark.parametrize("dim", [16, 64, 256])
def test_no_token_codes_worse_than_min_max(dim):
    gen = torch.Generator().manual_seed(dim)
    values = (torch.randn(6, 32, dim, generator=gen) * 3).half()
    codes, scalars, mse = _error(MSEHadamardValueCodec(2), values)
    _, ref_scalars, ref = _error(HadamardValueCodec(2), values)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3
    assert scalars.shape == ref_scalars.shape == (6, 64) and scalars.dtype == torch.float16
    # the coded frame is orthonormal: a token's error is its error in the frame; ratio 1.0 is
    # min-max itself, so no token is worse (up to float32 decode rounding)
    assert bool((mse <= ref * (1 + 1e-4) + 1e-6).all())


def test_gaussian_error_matches_the_clipped_quantizer():
    """Per element, 2 bits, N(0, 1) channels: min-max ~0.30 at 256 channels and ~0.20 at 64;
    the best clipped 4-level uniform quantizer of a Gaussian ~0.12 (Max 1960)."""
    gen = torch.Generator().manual_seed(0)
    for dim, minmax_low, mse_high in ((256, 0.28, 0.13), (64, 0.19, 0.12)):
        values = torch.randn(40, 32, dim, generator=gen).half()
        _, _, ref = _error(HadamardValueCodec(2), values)
        _, _, mse = _error(MSEHadamardValueCodec(2), values)
        assert float(ref.mean()) / dim > minmax_low
        assert float(mse.mean()) / dim < mse_high


def test_named_and_configured():
    codec = value_codec_from_name("hadamard_mse", 2)
    assert isinstance(codec, MSEHadamardValueCodec) and codec.transforms_output
    assert PNMixConfig(bits=2, value_coding="hadamard_mse").value_codec == codec
    with pytest.raises(ValueError, match="power-of-two"):
        codec.check_head_dim(48)
