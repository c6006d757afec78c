"""Tests for kvlab.rope: conventions, HF parity, scaling, precision, composition."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    GlmConfig,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    PhiConfig,
    StableLmConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gptj.modeling_gptj import (
    apply_rotary_pos_emb as gptj_apply_rotary_pos_emb,
)
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from kvlab.rope import ROTATION_ERROR_BOUND, RotaryConfig, apply_rotary, rotate_by_delta

HYPOTHESIS = settings(max_examples=40, deadline=None)
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": LLAMA3,
    "yarn": YARN,
}


# ------------------------------------------------------------------------------------------
# Independent float64 reference: rotate pairs given by explicit channel indices.
# ------------------------------------------------------------------------------------------


def reference_rotation(x: torch.Tensor, positions, cfg: RotaryConfig, factor: float = 1.0):
    """Float64 rotation written independently of kvlab: loops over pairs with index_select."""
    x64 = x.to(torch.float64)
    pos = torch.as_tensor(positions, dtype=torch.float64).expand(x.shape[:-1])
    exponents = torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim
    out = x64.clone()
    inv_freq = cfg.inv_freq()
    if cfg.scaling is None:
        torch.testing.assert_close(inv_freq, cfg.base ** (-exponents), rtol=1e-15, atol=0)
    half = cfg.rotary_dim // 2
    for i in range(half):
        a, b = (i, i + half) if cfg.layout == "half" else (2 * i, 2 * i + 1)
        angle = pos * inv_freq[i]
        c, s = torch.cos(angle) * factor, torch.sin(angle) * factor
        out[..., a] = x64[..., a] * c - x64[..., b] * s
        out[..., b] = x64[..., a] * s + x64[..., b] * c
    return out


def pair_norms(x: torch.Tensor, cfg: RotaryConfig) -> torch.Tensor:
    first, second = cfg.pair_indices()
    x64 = x.to(torch.float64)
    return torch.sqrt(x64[..., first] ** 2 + x64[..., second] ** 2)


def per_channel_pair_norm(x: torch.Tensor, cfg: RotaryConfig) -> torch.Tensor:
    """[..., rotary_dim]: each rotary channel's pair norm (for per-component error bounds)."""
    norms = pair_norms(x, cfg)
    out = torch.empty(*x.shape[:-1], cfg.rotary_dim, dtype=torch.float64)
    first, second = cfg.pair_indices()
    out[..., first] = norms
    out[..., second] = norms
    return out


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


def test_defaults_and_immutability():
    cfg = RotaryConfig(head_dim=64)
    assert cfg.rotary_dim == 64 and cfg.base == 10000.0 and cfg.layout == "half"
    assert cfg.scaling is None and cfg.rope_type == "default" and cfg.attention_scaling == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.base = 2.0  # type: ignore[misc]
    scaled = RotaryConfig(16, scaling={"type": "linear", "factor": 2.0})
    assert scaled.scaling == {"rope_type": "linear", "factor": 2.0}
    assert scaled == RotaryConfig(16, scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(TypeError):
        scaled.scaling["factor"] = 3.0  # type: ignore[index]
    assert RotaryConfig(16, scaling={"rope_type": "default"}) == RotaryConfig(16)
    assert RotaryConfig(16, scaling={"rope_type": "default"}).scaling is None
    for obj in (cfg, scaled, RotaryConfig(16, 8, scaling=YARN)):
        assert pickle.loads(pickle.dumps(obj)) == obj
        assert copy.deepcopy(obj) == obj
        assert hash(copy.deepcopy(obj)) == hash(obj)
        assert len({obj, copy.deepcopy(obj)}) == 1


def test_scaling_dict_is_copied():
    params = {"rope_type": "linear", "factor": 2.0}
    cfg = RotaryConfig(16, scaling=params)
    params["factor"] = 4.0
    assert cfg.scaling["factor"] == 2.0
    assert params == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 0}, "head_dim must be a positive int"),
        ({"head_dim": 8.0}, "head_dim must be a positive int"),
        ({"head_dim": 8, "rotary_dim": 3}, "rotary_dim must be even"),
        ({"head_dim": 8, "rotary_dim": 10}, "0 < rotary_dim <= head_dim=8"),
        ({"head_dim": 8, "rotary_dim": 0}, "0 < rotary_dim <= head_dim=8"),
        ({"head_dim": 7}, "rotary_dim must be even"),
        ({"head_dim": 8, "base": 0.0}, "base must be a finite number > 0"),
        ({"head_dim": 8, "base": -2.0}, "base must be a finite number > 0"),
        ({"head_dim": 8, "base": math.inf}, "base must be a finite number > 0"),
        ({"head_dim": 8, "layout": "neox"}, "layout must be one of"),
        ({"head_dim": 8, "scaling": {"rope_type": "ntk-by-parts"}}, "unknown RoPE scaling"),
        ({"head_dim": 8, "scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported"),
        ({"head_dim": 8, "scaling": {"rope_type": "longrope"}}, "unsupported"),
        (
            {"head_dim": 8, "scaling": {"rope_type": "linear"}},
            r"missing required keys \['factor'\]",
        ),
        ({"head_dim": 8, "scaling": {"rope_type": "linear", "factor": 0.0}}, "'factor'.*> 0"),
        ({"head_dim": 8, "scaling": {"rope_type": "linear", "factor": 2, "fator": 1}}, "unknown"),
        ({"head_dim": 8, "scaling": {"rope_type": "yarn", "factor": 2.0}}, "from_hf_config"),
        ({"head_dim": 8, "scaling": {**YARN, "truncate": 1}}, "truncate"),
        ({"head_dim": 8, "scaling": {**YARN, "attention_factor": -1.0}}, "attention_factor"),
        ({"head_dim": 8, "scaling": {**YARN, "beta_fast": "x"}}, "beta_fast"),
        ({"head_dim": 8, "scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor >"),
        ({"head_dim": 8, "scaling": {"type": "linear", "rope_type": "yarn"}}, "conflicting"),
        (
            {"head_dim": 8, "scaling": {"rope_type": "linear", "factor": 2, "rope_theta": 5.0}},
            "base",
        ),
        (
            {"head_dim": 8, "rotary_dim": 4, "scaling": {"partial_rotary_factor": 1.0}},
            "partial_rotary_factor",
        ),
        ({"head_dim": 8, "scaling": [("rope_type", "linear")]}, "mapping"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryConfig(**kwargs)


def test_consistent_carried_keys_are_accepted():
    cfg = RotaryConfig(
        8,
        4,
        base=500.0,
        scaling={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    )
    assert cfg == RotaryConfig(8, 4, base=500.0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_pair_indices_match_rotation(layout):
    cfg = RotaryConfig(head_dim=12, rotary_dim=8, layout=layout)
    first, second = cfg.pair_indices()
    assert first.dtype == second.dtype == torch.int64
    expected = ([0, 1, 2, 3], [4, 5, 6, 7]) if layout == "half" else ([0, 2, 4, 6], [1, 3, 5, 7])
    assert first.tolist() == expected[0] and second.tolist() == expected[1]
    # A unit vector on pair i's first channel rotates into exactly that pair.
    position = 3.0
    inv_freq = cfg.inv_freq()
    for i in range(cfg.num_pairs):
        x = torch.zeros(12, dtype=torch.float64)
        x[first[i]] = 1.0
        y = apply_rotary(x.unsqueeze(0), position, cfg)[0]
        expect = torch.zeros(12, dtype=torch.float64)
        expect[first[i]] = math.cos(position * inv_freq[i].item())
        expect[second[i]] = math.sin(position * inv_freq[i].item())
        torch.testing.assert_close(y, expect, rtol=0, atol=1e-15)


def test_inv_freq_default_formula_and_copy():
    cfg = RotaryConfig(head_dim=64, rotary_dim=48, base=500000.0)
    inv_freq = cfg.inv_freq()
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == (24,)
    expected = torch.tensor([500000.0 ** (-2 * i / 48) for i in range(24)], dtype=torch.float64)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-15, atol=0)
    inv_freq.zero_()
    assert cfg.inv_freq()[0].item() == 1.0
    assert cfg.inv_freq(device="meta").device.type == "meta"


# ------------------------------------------------------------------------------------------
# Parity with Hugging Face transformers
# ------------------------------------------------------------------------------------------


def llama_config(rope_parameters: dict, **kwargs) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=kwargs.pop("head_dim", 16),
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=kwargs.pop("max_position_embeddings", 1024),
        rope_parameters=dict(rope_parameters),
        **kwargs,
    )


HF_SCALINGS = [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    {**LLAMA3, "rope_theta": 500000.0},
    {**LLAMA3, "rope_theta": 10000.0, "original_max_position_embeddings": 256},
    {**YARN, "rope_theta": 10000.0},
    {**YARN, "rope_theta": 1e6, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {**YARN, "rope_theta": 10000.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    {**YARN, "rope_theta": 10000.0, "attention_factor": 1.25, "factor": 16.0},
]


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("params", HF_SCALINGS, ids=lambda p: p["rope_type"])
def test_inv_freq_matches_transformers(params, head_dim):
    hf_config = llama_config(params, head_dim=head_dim, max_position_embeddings=4096)
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config)
    cfg = RotaryConfig.from_hf_config(hf_config)
    assert cfg.rope_type == params["rope_type"] and cfg.rotary_dim == head_dim
    # HF computes in float32; ours is float64.
    torch.testing.assert_close(cfg.inv_freq().float(), hf_inv_freq, rtol=2e-6, atol=0)
    assert cfg.attention_scaling == pytest.approx(hf_attention, rel=1e-15)
    if params["rope_type"] == "yarn" and "attention_factor" not in params:
        assert cfg.attention_scaling != 1.0
    # Direct construction with the same dict (minus rope_theta) gives the same config.
    direct = {k: v for k, v in params.items() if k != "rope_theta"}
    assert RotaryConfig(head_dim, base=params["rope_theta"], scaling=direct) == cfg


@pytest.mark.parametrize(
    "params",
    [{"rope_type": "default", "rope_theta": 10000.0}, *HF_SCALINGS],
    ids=lambda p: p["rope_type"],
)
def test_apply_rotary_matches_transformers_llama(params):
    hf_config = llama_config(params, max_position_embeddings=4096)
    rotary = LlamaRotaryEmbedding(hf_config)
    gen = torch.Generator().manual_seed(0)
    batch, heads, seq = 2, 4, 24
    q = torch.randn(batch, heads, seq, 16, generator=gen)
    k = torch.randn(batch, heads, seq, 16, generator=gen)
    position_ids = torch.stack([torch.arange(seq), torch.arange(100, 100 + seq)])  # [B, S]
    cos, sin = rotary(q, position_ids)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    cfg = RotaryConfig.from_hf_config(hf_config)
    ours_q = apply_rotary(q, position_ids[:, None, :], cfg, attention_scaling=True)
    ours_k = apply_rotary(k, position_ids[:, None, :], cfg, attention_scaling=True)
    # HF forms angles in float32 (positions < 124: <= ~1e-5 rad of angle error).
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=3e-5)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=3e-5)
    if cfg.attention_scaling != 1.0:
        pure = apply_rotary(q, position_ids[:, None, :], cfg)
        torch.testing.assert_close(pure * cfg.attention_scaling, ours_q, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(pure, hf_q, atol=1e-3)


def test_phi_partial_rotary_matches_transformers():
    hf_config = PhiConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
    )
    cfg = RotaryConfig.from_hf_config(hf_config)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.layout) == (16, 8, "half")
    rotary = PhiRotaryEmbedding(hf_config)
    torch.testing.assert_close(cfg.inv_freq().float(), rotary.inv_freq, rtol=1e-6, atol=0)
    x = torch.randn(1, 2, 5, 16)
    position_ids = torch.arange(5)[None]
    cos, sin = rotary(x, position_ids)
    hf_rot, _ = apply_rotary_pos_emb(x[..., :8], x[..., :8], cos, sin)
    ours = apply_rotary(x, position_ids, cfg)
    torch.testing.assert_close(ours[..., :8], hf_rot, rtol=0, atol=1e-6)
    assert torch.equal(ours[..., 8:], x[..., 8:])


def test_gptj_interleaved_matches_transformers():
    hf_config = GPTJConfig(n_embd=64, n_head=4, rotary_dim=8, n_layer=1, vocab_size=32)
    cfg = RotaryConfig.from_hf_config(hf_config)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.layout, cfg.base) == (16, 8, "interleaved", 1e4)
    x = torch.randn(2, 7, 4, 16)  # GPT-J layout [B, S, H, D]
    position_ids = torch.stack([torch.arange(7), torch.arange(30, 37)])
    sincos = create_sinusoidal_positions(64, 8)[position_ids]
    sin, cos = torch.split(sincos, 4, dim=-1)
    hf_rot = gptj_apply_rotary_pos_emb(x[..., :8], sin, cos)
    ours = apply_rotary(x, position_ids[..., None], cfg)
    torch.testing.assert_close(ours[..., :8], hf_rot, rtol=0, atol=1e-5)
    assert torch.equal(ours[..., 8:], x[..., 8:])


def test_from_hf_config_variants():
    legacy = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    before = dict(legacy.rope_parameters)
    cfg = RotaryConfig.from_hf_config(legacy)
    assert legacy.rope_parameters == before  # not modified
    assert cfg == RotaryConfig(16, base=5e5, scaling={"rope_type": "linear", "factor": 2.0})

    stablelm = RotaryConfig.from_hf_config(StableLmConfig(hidden_size=64, num_attention_heads=4))
    assert (stablelm.head_dim, stablelm.rotary_dim, stablelm.layout) == (16, 4, "half")
    neox = RotaryConfig.from_hf_config(
        GPTNeoXConfig(
            hidden_size=128, num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=20000
        )
    )
    assert (neox.head_dim, neox.rotary_dim, neox.base) == (32, 8, 20000.0)
    glm = RotaryConfig.from_hf_config(GlmConfig(hidden_size=64, num_attention_heads=4, head_dim=16))
    assert (glm.rotary_dim, glm.layout) == (8, "interleaved")
    assert RotaryConfig.from_hf_config(legacy, layout="interleaved").layout == "interleaved"

    # A yarn factor left to HF's default is max_position_embeddings / original.
    yarn = llama_config(
        {
            "rope_type": "yarn",
            "factor": None,
            "rope_theta": 1e4,
            "original_max_position_embeddings": 512,
        },
        max_position_embeddings=2048,
    )
    assert RotaryConfig.from_hf_config(yarn).scaling["factor"] == 4.0

    # Keys HF ignores for a rope_type are dropped with a warning.
    extra = llama_config(
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "finetuned": True}
    )
    with pytest.warns(UserWarning, match="finetuned"):
        assert RotaryConfig.from_hf_config(extra).scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_config_errors():
    from transformers import Gemma3TextConfig, GPT2Config

    with pytest.raises(ValueError, match="no RoPE parameters"):
        RotaryConfig.from_hf_config(GPT2Config(n_embd=64, n_head=4))
    gemma = Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=1,
        intermediate_size=64,
        num_hidden_layers=2,
    )
    with pytest.raises(ValueError, match="nested per layer type"):
        RotaryConfig.from_hf_config(gemma)
    full = RotaryConfig.from_hf_config(gemma, layer_type="full_attention")
    local = RotaryConfig.from_hf_config(gemma, layer_type="sliding_attention")
    assert full.base == gemma.rope_parameters["full_attention"]["rope_theta"]
    assert local.base == gemma.rope_parameters["sliding_attention"]["rope_theta"]
    with pytest.raises(ValueError, match="not nested"):
        RotaryConfig.from_hf_config(llama_config({"rope_type": "default"}), layer_type="x")
    with pytest.raises(ValueError, match="unsupported"):
        RotaryConfig.from_hf_config(llama_config({"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryConfig.from_hf_config(
            llama_config({"rope_type": "default", "mrope_section": [2, 3, 3]})
        )


# ------------------------------------------------------------------------------------------
# Rotation: shapes, tails, errors, autograd
# ------------------------------------------------------------------------------------------


@st.composite
def rotary_cases(draw, dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16)):
    pairs = draw(st.integers(1, 12))
    rotary_dim = 2 * pairs
    head_dim = rotary_dim + draw(st.integers(0, 6))
    layout = draw(st.sampled_from(["half", "interleaved"]))
    scaling = draw(st.sampled_from(list(SCALINGS.values())))
    base = draw(st.sampled_from([100.0, 10000.0, 500000.0]))
    cfg = RotaryConfig(head_dim, rotary_dim, base=base, layout=layout, scaling=scaling)
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    seq = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    return cfg, (*lead, seq, head_dim), dtype, seed


@HYPOTHESIS
@given(case=rotary_cases(), max_position=st.sampled_from([10, 4096, 10**6]))
def test_composition_identity(case, max_position):
    """rotate_by_delta(apply_rotary(k, p), p2 - p) == apply_rotary(k, p2), vs float64."""
    cfg, shape, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(shape, generator=gen) * 2).to(dtype)
    p = torch.randint(0, max_position, shape[:-1], generator=gen)
    p2 = torch.randint(0, max_position, shape[-2:-1], generator=gen)  # broadcast [S]
    k_before = k.clone()
    relayed = rotate_by_delta(apply_rotary(k, p, cfg), p2 - p, cfg)
    direct = apply_rotary(k, p2, cfg)
    assert torch.equal(k, k_before)
    assert relayed.dtype == direct.dtype == dtype and relayed.shape == shape
    reference = reference_rotation(k, p2, cfg)
    scale = per_channel_pair_norm(k, cfg)
    r = cfg.rotary_dim
    u = UNIT_ROUNDOFF.get(dtype, 0.0)
    # float64: angle rounding dominates, about |angle| * 2**-53 per rounded angle.
    bound = 8 * 2.0**-53 * max_position if dtype == torch.float64 else ROTATION_ERROR_BOUND
    # direct: one rotation + one output rounding per component. relayed: the first rotation's
    # pair error (norm <= sqrt(2) * that) is rotated, then a second rotation adds its own.
    err_direct = (direct[..., :r].double() - reference[..., :r]).abs()
    err_relayed = (relayed[..., :r].double() - reference[..., :r]).abs()
    assert (err_direct <= (bound + u) * scale + 1e-300).all()
    assert (err_relayed <= (1 + math.sqrt(2)) * (bound + u) * (1 + u) * scale + 1e-300).all()
    assert torch.equal(direct[..., r:], k[..., r:])
    assert torch.equal(relayed[..., r:], k[..., r:])


@HYPOTHESIS
@given(case=rotary_cases(dtypes=(torch.float64, torch.float32)))
def test_pair_norms_preserved(case):
    cfg, shape, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    delta = torch.randint(-(10**6), 10**6, shape[:-1], generator=gen)
    y = rotate_by_delta(x, delta, cfg)
    tol = 1e-13 if dtype == torch.float64 else 4 * ROTATION_ERROR_BOUND
    before, after = pair_norms(x, cfg), pair_norms(y, cfg)
    assert ((after - before).abs() <= tol * before + 1e-300).all()
    scaled = apply_rotary(x, delta, cfg, attention_scaling=True)
    torch.testing.assert_close(
        pair_norms(scaled, cfg), before * cfg.attention_scaling, rtol=tol * 2, atol=0
    )


def test_partial_rotary_tail_bit_identical():
    cfg = RotaryConfig(head_dim=80, rotary_dim=32)
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(2, 3, 9, 80).to(dtype)
        positions = torch.arange(1000, 1009)
        y = apply_rotary(x, positions, cfg)
        z = rotate_by_delta(y, torch.full((9,), -77), cfg)
        assert y.dtype == z.dtype == dtype
        assert torch.equal(y[..., 32:], x[..., 32:]) and torch.equal(z[..., 32:], x[..., 32:])
        assert not torch.equal(y[..., :32], x[..., :32])


def test_zero_delta_is_exact_identity():
    cfg = RotaryConfig(16, 12, layout="interleaved", scaling=YARN)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(3, 5, 16).to(dtype)
        assert torch.equal(rotate_by_delta(x, 0, cfg), x)
        assert torch.equal(rotate_by_delta(x, torch.zeros(5, dtype=torch.int64), cfg), x)


def test_positions_broadcasting_and_float_positions():
    cfg = RotaryConfig(8)
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    full = torch.arange(4).expand(2, 3, 4)
    expected = apply_rotary(x, full, cfg)
    for positions in (torch.arange(4), torch.arange(4).view(1, 1, 4), torch.arange(4)[None]):
        assert torch.equal(apply_rotary(x, positions, cfg), expected)
    torch.testing.assert_close(
        apply_rotary(x, torch.full((2, 3, 4), 7, dtype=torch.int32), cfg),
        apply_rotary(x, 7, cfg),
        rtol=0,
        atol=0,
    )
    half_steps = rotate_by_delta(apply_rotary(x, 1.0, cfg), torch.tensor(1.5), cfg)
    torch.testing.assert_close(half_steps, apply_rotary(x, 2.5, cfg), rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    ("x", "positions", "match"),
    [
        (torch.randn(2, 4, 6), torch.arange(4), "last dimension head_dim=8"),
        (torch.arange(8).view(1, 8), torch.arange(1), "floating-point"),
        (torch.randn(2, 4, 8), torch.arange(5), "does not broadcast"),
        (torch.randn(2, 4, 8), torch.zeros(3, 2, 4), "does not broadcast"),
        (torch.randn(2, 4, 8), torch.ones(4, dtype=torch.bool), "integer or real floating"),
        (torch.randn(2, 4, 8), torch.ones(4, dtype=torch.complex64), "integer or real floating"),
        (torch.randn(2, 4, 8), [0, 1, 2, 3], "tensor or a number"),
        (torch.randn(2, 4, 8), torch.arange(4, device="meta"), "is on meta"),
    ],
)
def test_apply_rotary_errors(x, positions, match):
    cfg = RotaryConfig(8)
    with pytest.raises(ValueError, match=match):
        apply_rotary(x, positions, cfg)
    with pytest.raises(ValueError, match=match.replace("positions", "delta")):
        rotate_by_delta(x, positions, cfg)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gradcheck(layout):
    cfg = RotaryConfig(10, 6, layout=layout, scaling=YARN)
    x = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([0.0, 5.0, 1e5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, p: apply_rotary(x, p, cfg, attention_scaling=True), (x, positions)
    )
    assert torch.autograd.gradcheck(lambda x: rotate_by_delta(x, torch.arange(3), cfg), (x,))


# ------------------------------------------------------------------------------------------
# Precision: large positions and repeated low-precision relays
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", list(SCALINGS), ids=str)
def test_large_positions_error_bound(layout, scaling):
    """float32 rotation at positions up to 2**24 stays within ROTATION_ERROR_BOUND * pair norm
    of the float64 rotation, for apply_rotary and rotate_by_delta."""
    cfg = RotaryConfig(64, layout=layout, scaling=SCALINGS[scaling], base=500000.0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, 64, generator=gen) * torch.logspace(-3, 3, 64)
    positions = torch.cat(
        [torch.tensor([0, 1, 10**6, 2**24]), torch.randint(0, 2**24, (252,), generator=gen)]
    )
    reference = reference_rotation(x, positions, cfg)
    scale = per_channel_pair_norm(x, cfg)
    for rotated in (apply_rotary(x, positions, cfg), rotate_by_delta(x, positions, cfg)):
        err = (rotated.double() - reference).abs()
        assert (err <= ROTATION_ERROR_BOUND * scale).all()
    negative = reference_rotation(x, -positions, cfg)
    assert (
        (rotate_by_delta(x, -positions, cfg).double() - negative).abs()
        <= ROTATION_ERROR_BOUND * scale
    ).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_repeated_relays_keep_dtype_and_accuracy(dtype, layout):
    """50 successive rotate_by_delta calls: dtype kept, error grows at most linearly."""
    cfg = RotaryConfig(32, 24, layout=layout, scaling=LLAMA3)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 16, 32, generator=gen) * 3).to(dtype)
    deltas = torch.randint(-50_000, 50_000, (50, 16), generator=gen)
    y = x
    for delta in deltas:
        y = rotate_by_delta(y, delta, cfg)
        assert y.dtype == dtype
    assert torch.equal(y[..., 24:], x[..., 24:])
    reference = reference_rotation(x, deltas.sum(0), cfg)
    err = pair_norms(y.double() - reference, cfg)
    # Each step adds at most sqrt(2) * (bound + unit roundoff) * pair norm to a pair's error.
    steps = len(deltas)
    bound = steps * math.sqrt(2) * (ROTATION_ERROR_BOUND + UNIT_ROUNDOFF[dtype]) * 1.05
    assert (err <= bound * pair_norms(x, cfg)).all()
    assert torch.isfinite(y).all()


def test_equal_configs_hash_equal() -> None:
    a = RotaryConfig(head_dim=8, scaling={"rope_type": "linear", "factor": 4})
    b = RotaryConfig(head_dim=8, scaling={"rope_type": "linear", "factor": 4.0})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


@pytest.mark.parametrize("model_type", ["cohere", "llama4_text"])
def test_interleaved_model_types_from_hf_config(model_type: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    assert RotaryConfig.from_hf_config(config).layout == "interleaved"
