"""Value codecs with ``group_channels``: one scale and zero per token and per ``c`` channels of the
coded frame (KIVI's value group size; kvlab issue 40, Gemma 3's head_dim 256)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.pnmix import PNMixCache, PNMixConfig
from kvlab.pnmix.kernels import KernelKeyDecode, dispatch
from kvlab.pnmix.kernels.cpu import flush_unsupported
from kvlab.pnmix.kernels.spec import kernel_key_decode
from kvlab.pnmix.quantizers import minmax_quantize
from kvlab.pnmix.values import (
    AutoHadamardValueCodec,
    HadamardValueCodec,
    MSEHadamardValueCodec,
    PerTokenValueCodec,
    value_codec_from_name,
)

CODECS = [PerTokenValueCodec, HadamardValueCodec, MSEHadamardValueCodec]


@settings(max_examples=30, deadline=None)
@given(
    codec_class=st.sampled_from([PerTokenValueCodec, HadamardValueCodec]),
    n=st.integers(1, 3),
    t=st.integers(1, 9),
    log_dv=st.integers(1, 8),
    log_c=st.integers(0, 8),
    bits=st.sampled_from([2, 3, 4]),
    seed=st.integers(0, 10_000),
)
def test_each_channel_group_is_min_max_of_its_block(codec_class, n, t, log_dv, log_c, bits, seed):
    """Codes and scalars of group ``j`` are the per-token min-max of the frame's channels
    ``j*c .. (j+1)*c - 1``, laid out ``[scale(T, G) | zero(T, G)]``."""
    dv, c = 2**log_dv, 2 ** min(log_c, log_dv)
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, t, dv, generator=gen) * 4).half()
    codec = codec_class(bits, c)
    codes, scalars = codec.encode(values, torch.float16)
    g = dv // c
    assert codes.shape == (n, t, dv) and codes.dtype == torch.uint8
    assert scalars.shape == (n, codec.scalar_count(t, dv)) == (n, 2 * t * g)
    frame = codec.frame(values, torch.float16)
    scale, zero = scalars[:, : t * g].view(n, t, g), scalars[:, t * g :].view(n, t, g)
    for j in range(g):
        block = minmax_quantize(frame[..., j * c : (j + 1) * c], bits, -1, torch.float16)
        assert torch.equal(codes[..., j * c : (j + 1) * c], block.codes)
        assert torch.equal(scale[..., j], block.scale) and torch.equal(zero[..., j], block.zero)
    decoded = codec.decode(codes, scalars).double()
    # min-max rounding: within half a step of the frame's value, per channel's own group
    step = scale.double().repeat_interleave(c, dim=-1)
    assert bool(((decoded - frame.double()).abs() <= step / 2 + 1e-3 * step + 1e-6).all())


@pytest.mark.parametrize("codec_class", [*CODECS, AutoHadamardValueCodec])
def test_one_group_of_every_channel_is_the_per_token_coding(codec_class):
    values = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1)).half()
    whole = codec_class(2).encode(values, torch.float16)
    for channels in (64, 128):  # a group of at least the head's channels is one group
        grouped = codec_class(2, channels).encode(values, torch.float16)
        assert all(torch.equal(a, b) for a, b in zip(whole, grouped, strict=True))


def test_mse_ranges_per_group_beat_one_per_token():
    values = torch.randn(8, 32, 256, generator=torch.Generator().manual_seed(2)).half()

    def error(codec):
        codes, scalars = codec.encode(values, torch.float16)
        decoded = codec.output_transform(codec.decode(codes, scalars))
        return float(((decoded - values.float()) ** 2).mean())

    assert error(MSEHadamardValueCodec(2, 64)) < error(MSEHadamardValueCodec(2))
    assert error(HadamardValueCodec(2, 64)) < error(HadamardValueCodec(2))
    auto = AutoHadamardValueCodec(2, 64)
    assert auto.minmax == HadamardValueCodec(2, 64) and auto.mse == MSEHadamardValueCodec(2, 64)


def test_config_names_bytes_and_errors():
    cfg = PNMixConfig(value_coding="hadamard", value_group_channels=64)
    assert cfg.value_codec == value_codec_from_name("hadamard", 2, 64) == HadamardValueCodec(2, 64)
    assert str(cfg.value_codec) == "hadamard(group_channels=64)"
    for bad in (0, -64, True, 64.0, "64"):
        with pytest.raises(ValueError, match="value_group_channels"):
            PNMixConfig(value_group_channels=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="group_channels"):
            HadamardValueCodec(2, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="carries its own group_channels"):
        PNMixConfig(value_coding=HadamardValueCodec(2), value_group_channels=64)
    with pytest.raises(ValueError, match="does not divide the value head dim 96"):
        PNMixCache(
            PNMixConfig(value_group_channels=64),
            batch_size=1,
            num_key_value_heads=1,
            head_dim=64,
            value_head_dim=96,
        )


def test_cache_stores_one_pair_per_token_and_group():
    t, dv = 32, 256
    cfg = PNMixConfig(
        sink_tokens=4,
        residual_tokens=8,
        group_tokens=t,
        value_coding="hadamard",
        value_group_channels=64,
    )
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=3, head_dim=64, value_head_dim=dv)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 100, 64, generator=gen), torch.randn(2, 3, 100, dv, generator=gen)
    cache.append(k, v)
    groups = cache.num_groups
    assert groups == 2
    nbytes = cache.nbytes()
    assert nbytes["value_scales"] == 2 * 3 * groups * (2 * t * 4) * 2
    assert cache.groups[0].value_scale.shape == (2, 3, t * 4)
    # the stored group decodes to what the codec codes from the same storage-rounded values
    codes, scalars = HadamardValueCodec(2, 64).encode(v[:, :, 4 : 4 + t].half(), torch.float16)
    _, values = cache.dequantize()
    frame = HadamardValueCodec(2, 64)
    expected = frame.output_transform(frame.decode(codes, scalars.view(2, 3, -1)))
    torch.testing.assert_close(values[:, :, 4 : 4 + t].float(), expected, rtol=0, atol=2e-3)


def test_every_compiled_kernel_takes_grouped_value_scalars(monkeypatch):
    """The kernels read the group count from the scalars' width (``2·T·G``), so a grouped cache
    has the same kernel description as an ungrouped one and no backend declines it; the CPU
    attention kernel, the compiled flush and both Triton kernels are checked against the torch
    reference with channel groups in test_kernels*.py, test_flush_kernel.py and test_triton*.py."""
    cfg = PNMixConfig(key_coding="bit_alloc", value_coding="hadamard", value_group_channels=64)
    plain = PNMixConfig(key_coding="bit_alloc", value_coding="hadamard")
    decode = kernel_key_decode(cfg.key_codec, cfg.value_codec, 0)
    assert isinstance(decode, KernelKeyDecode)
    assert decode == kernel_key_decode(plain.key_codec, plain.value_codec, 0)
    for backend in ("cpu", "triton"):
        assert dispatch.unsupported(backend, decode) is None
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert dispatch.select_backend("auto", torch.device("cuda"), decode) == "triton"
    assert flush_unsupported(cfg.key_codec, cfg.value_codec, torch.float16, 32, 256) is None
