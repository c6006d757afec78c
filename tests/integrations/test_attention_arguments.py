"""Every argument transformers passes to an attention function is honoured or refused.

Float64 references for the sliding window, logit soft-capping and learned sinks (plain tensors
and PN-Mix packed attention), transformers' own mask convention, the ``"kvlab"`` mask for
non-causal patterns, one clear error for anything unknown, the views' feature handshake,
:class:`WindowLayer` and :func:`plan_model`.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from kvlab.integrations import KVLAB_ATTENTION, use_attention
from kvlab.integrations.attention import (
    HARMLESS_KWARGS,
    CacheView,
    dense_causal_attention,
    kvlab_attention_forward,
    kvlab_mask,
)
from kvlab.integrations.model_support import WindowLayer, layer_rotary, plan_model
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.rope import RotaryConfig, apply_rotary


def reference(q, k, v, *, scaling, window=None, softcap=None, sinks=None, causal=True):
    """float64: GQA by repetition, logits * scaling, soft-cap, bottom-right causal mask and
    window (key j visible to query i iff j <= i + off and j > i + off - window), softmax with
    an extra per-head sink column that is dropped."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    logits = q.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    nq, nk = q.shape[2], k.shape[2]
    i = torch.arange(nq).view(-1, 1) + (nk - nq)
    j = torch.arange(nk).view(1, -1)
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return probs @ v


class _Module(torch.nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.layer_idx = 0
        self.is_causal = True
        self.eval()


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 6),
    past=st.integers(0, 9),
    groups=st.sampled_from([1, 2, 3]),
    window=st.one_of(st.none(), st.integers(1, 8)),
    softcap=st.one_of(st.none(), st.sampled_from([0.3, 2.0, 30.0])),
    sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dense_attention_matches_float64_reference(
    q_len, past, groups, window, softcap, sinks, seed
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * groups, q_len, 8, generator=gen)
    k = torch.randn(2, 2, past + q_len, 8, generator=gen)
    v = torch.randn(2, 2, past + q_len, 5, generator=gen)
    s_aux = torch.randn(2 * groups, generator=gen) if sinks else None
    out = dense_causal_attention(
        q, k, v, scaling=0.4, sliding_window=window, softcap=softcap, s_aux=s_aux
    )
    ref = reference(q, k, v, scaling=0.4, window=window, softcap=softcap, sinks=s_aux)
    assert out.shape == (2, 2 * groups, q_len, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_not_causal_sees_every_key():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 4, 8, generator=gen), torch.randn(1, 2, 4, 8, generator=gen)
    v = torch.randn(1, 2, 4, 3, generator=gen)
    out = dense_causal_attention(q, k, v, scaling=0.3, is_causal=False)
    torch.testing.assert_close(out.double(), reference(q, k, v, scaling=0.3, causal=False))


@pytest.mark.parametrize(("q_len", "kv_len", "window"), [(7, 7, 3), (1, 5, 6), (2, 9, 4)])
def test_window_convention_is_transformers_own(q_len, kv_len, window):
    """Same result as transformers' SDPA attention under its own sliding-window mask (keys
    ``kv_idx > q_idx - sliding_window``), queries bottom-right aligned."""
    gen = torch.Generator().manual_seed(q_len + kv_len)
    q = torch.randn(1, 4, q_len, 8, generator=gen)
    k = torch.randn(1, 2, kv_len, 8, generator=gen)
    v = torch.randn(1, 2, kv_len, 8, generator=gen)
    mask = sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=kv_len - q_len,
        mask_function=sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False,
    )
    theirs, _ = sdpa_attention_forward(_Module(groups=2), q, k, v, mask, scaling=0.3)
    ours = dense_causal_attention(q, k, v, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=1e-6, rtol=1e-5)


def test_kvlab_mask_materializes_non_causal_patterns_like_sdpa():
    common = dict(batch_size=2, q_length=3, kv_length=8, q_offset=5, kv_offset=0)
    padding = torch.tensor([[1] * 8, [0, 0] + [1] * 6]).bool()
    sliding = sliding_window_causal_mask_function(4)
    for attention_mask in (None, padding):
        ours = kvlab_mask(**common, mask_function=sliding, attention_mask=attention_mask)
        theirs = sdpa_mask(
            **common,
            mask_function=sliding,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
        )
        assert ours.shape == (2, 1, 3, 8) and torch.equal(ours, theirs)
    # the plain causal mask: None without padding, the 2-D keep mask with it
    assert kvlab_mask(**common, mask_function=causal_mask_function) is None
    assert torch.equal(
        kvlab_mask(**common, mask_function=causal_mask_function, attention_mask=padding), padding
    )


def test_sliding_window_padded_batch_with_dynamic_cache_equals_sdpa():
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 96, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        reference_logits = model(ids, attention_mask=mask).logits
        with use_attention(model, KVLAB_ATTENTION):
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits
            second = model(ids[:, 9:], attention_mask=mask, cache=cache).logits
    out = torch.cat([first, second], 1)
    torch.testing.assert_close(out[0], reference_logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1, 3:], reference_logits[1, 3:], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- PN-Mix
@pytest.mark.parametrize("coding", ["mix", "cartesian", "per_token"])
def test_pnmix_softcap_and_sinks_match_dequantized_reference(coding):
    gen = torch.Generator().manual_seed(3)
    cfg = PNMixConfig(
        sink_tokens=2, residual_tokens=3, group_tokens=4, key_coding=coding, rotary_dim=8
    )
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8, value_head_dim=5)
    keys, values = torch.randn(2, 2, 21, 8, generator=gen), torch.randn(2, 2, 21, 5, generator=gen)
    cache.append(keys[:, :, :17], values[:, :, :17])
    for t in range(17, 21):
        cache.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert cache.num_groups >= 2
    dk, dv = cache.dequantize()
    for q_len in (1, 3):
        q = torch.randn(2, 6, q_len, 8, generator=gen)
        s_aux = torch.randn(6, generator=gen)
        out = pnmix_attention(q, cache, scale=0.5, logit_softcap=0.7, sink_logits=s_aux)
        ref = reference(q, dk, dv, scaling=0.5, softcap=0.7, sinks=s_aux)
        tol = 1e-5 * float(ref.abs().max())
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-5)
    with pytest.raises(ValueError, match="sink_logits"):
        pnmix_attention(q, cache, sink_logits=torch.zeros(3))


# --------------------------------------------------------------------------- kwargs
def _qkv():
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 2, 3, 8, generator=gen),
        torch.randn(1, 2, 3, 8, generator=gen),
        torch.randn(1, 2, 3, 8, generator=gen),
    )


def test_unknown_attention_arguments_raise_one_error_naming_them():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\['indices', 'position_bias'\]"):
        kvlab_attention_forward(
            _Module(), q, k, v, None, position_bias=torch.zeros(1), indices=torch.zeros(1)
        )
    with pytest.raises(ValueError, match="attention weights"):
        kvlab_attention_forward(_Module(), q, k, v, None, output_attentions=True)


def test_inactive_and_harmless_arguments_are_accepted():
    q, k, v = _qkv()
    harmless = {name: False for name in HARMLESS_KWARGS}
    harmless["position_ids"] = torch.arange(3).unsqueeze(0)
    out, weights = kvlab_attention_forward(
        _Module(), q, k, v, None, scaling=0.3, position_bias=None, sinks=None, **harmless
    )
    assert weights is None
    torch.testing.assert_close(out.transpose(1, 2).double(), reference(q, k, v, scaling=0.3))


def test_dropout_is_applied_in_training_mode_only():
    q, k, v = _qkv()
    module = _Module()
    eval_out, _ = kvlab_attention_forward(module, q, k, v, None, dropout=0.5, scaling=0.3)
    torch.testing.assert_close(eval_out.transpose(1, 2).double(), reference(q, k, v, scaling=0.3))
    module.train()
    torch.manual_seed(0)
    train_out, _ = kvlab_attention_forward(module, q, k, v, None, dropout=0.5, scaling=0.3)
    assert not torch.allclose(train_out, eval_out)


class _RecordingView(CacheView):
    supported_features = frozenset({"softcap"})

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def attend(self, module, query, *, scaling, attention_mask, kwargs):
        self.calls.append(dict(kwargs))
        return query


def test_views_get_their_features_and_refuse_the_rest_before_attending():
    view = _RecordingView()
    q = torch.randn(1, 2, 3, 8)
    kvlab_attention_forward(_Module(), q, view, view, None, softcap=5.0, position_ids=None)
    assert view.calls == [
        {"position_ids": None, "softcap": 5.0, "s_aux": None, "sliding_window": None}
    ]
    module = _Module()
    for kwargs, phrase in [
        (dict(s_aux=torch.zeros(2)), r"\['s_aux'\]"),
        (dict(sliding_window=4, s_aux=torch.zeros(2)), r"\['s_aux', 'sliding_window'\]"),
        (dict(is_causal=False), "causally"),
        (dict(attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool)), "4-D"),
    ]:
        mask = kwargs.pop("attention_mask", None)
        with pytest.raises(ValueError, match=phrase):
            kvlab_attention_forward(module, q, view, view, mask, **kwargs)
    module.train()
    with pytest.raises(ValueError, match="dropout"):
        kvlab_attention_forward(module, q, view, view, None, dropout=0.1)
    assert len(view.calls) == 1  # nothing refused reached attend


# --------------------------------------------------------------------------- WindowLayer
def test_window_layer_without_rotary_is_transformers_sliding_layer():
    gen = torch.Generator().manual_seed(0)
    ours, theirs = WindowLayer(4), DynamicSlidingWindowLayer(4)
    for t in (6, 1, 3, 1):
        k, v = torch.randn(2, 2, t, 8, generator=gen), torch.randn(2, 2, t, 5, generator=gen)
        a, b = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
    assert ours.get_seq_length() == 11 and ours.keys.shape[-2] == 3
    assert ours.nbytes() == 2 * 2 * 3 * (8 + 5) * 4 and ours.numel() == 2 * 2 * 3 * 13
    with pytest.raises(ValueError, match="sliding_window"):
        WindowLayer(0)


def test_window_layer_follows_moved_positions_by_rotation():
    """Keys stored in the first frame; after the model's positions jump back by 7 (a relay's
    synchronized endpoint), the returned keys are the raw keys rotated at their true positions
    minus 7, so query-key distances stay the true ones."""
    rotary = RotaryConfig(head_dim=8, rotary_dim=6, base=100.0)
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(1, 2, 14, 8, generator=gen)
    layer = WindowLayer(5, rotary=rotary)
    positions = torch.arange(14)

    def feed(lo: int, hi: int, offset: int):
        pos = positions[lo:hi] + offset
        rotated = apply_rotary(raw[:, :, lo:hi], pos.view(1, 1, -1), rotary)
        return layer.update(rotated, raw[:, :, lo:hi], kwargs={"position_ids": pos.view(1, -1)})

    feed(0, 9, 0)
    keys, _ = feed(9, 10, 0)
    torch.testing.assert_close(keys, apply_rotary(raw[:, :, 5:10], positions[5:10], rotary))
    for t in range(10, 14):
        keys, values = feed(t, t + 1, -7)
        expected = apply_rotary(raw[:, :, t - 4 : t + 1], positions[t - 4 : t + 1] - 7, rotary)
        torch.testing.assert_close(keys, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(values, raw[:, :, t - 4 : t + 1])
    # constant per-row offsets (left padding) never rotate: first frame kept
    padded = WindowLayer(5, rotary=rotary)
    k = torch.randn(2, 2, 6, 8, generator=gen)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    padded.update(k, k, kwargs={"position_ids": ids})
    step = torch.randn(2, 2, 1, 8, generator=gen)
    out, _ = padded.update(step, step, kwargs={"position_ids": torch.tensor([[6], [4]])})
    assert torch.equal(out[:, :, -1:], step)


# --------------------------------------------------------------------------- plan_model
def test_plan_model_reads_layer_types_windows_and_rope():
    common = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    mistral = plan_model(
        transformers.MistralConfig(**common, num_hidden_layers=2, sliding_window=7)
    )
    assert [(p.layer_type, p.window) for p in mistral.layers] == [("sliding_attention", 7)] * 2
    assert mistral.full_layers == () and mistral.window_layers == (0, 1)
    qwen2 = plan_model(
        transformers.Qwen2Config(
            **common,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=9,
            max_window_layers=2,
        )
    )
    assert [p.window for p in qwen2.layers] == [None, None, 9]
    llama4 = plan_model(
        transformers.Llama4TextConfig(**common, num_hidden_layers=4, attention_chunk_size=16)
    )
    assert [p.layer_type for p in llama4.layers][-1] == "full_attention"
    assert llama4.window_layers == (0, 1, 2) and llama4.layers[0].window == 16
    assert llama4.nope_full_layers == (3,)
    cohere2 = plan_model(
        transformers.Cohere2Config(
            **common, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]
        )
    )
    assert cohere2.nope_full_layers == (1,) and cohere2.layers[0].uses_rope
    cohere2.check("PNMixModelCache")  # NoPE is fine when keys are never rotated
    with pytest.raises(ValueError, match=r"^RelayModelCache cannot hold .*layers \[1\]"):
        cohere2.check("RelayModelCache", rotates_keys=True)
    assert plan_model(transformers.LlamaConfig(**common, num_hidden_layers=3)).unsupported == ()


def test_plan_refusal_names_every_reason_on_one_line():
    config = transformers.Qwen3NextConfig(num_hidden_layers=4, hidden_size=64)
    plan = plan_model(config)
    assert plan.layers[0].layer_type == "linear_attention"
    with pytest.raises(ValueError) as err:
        plan.check("RelayModelCache", rotates_keys=True)
    message = str(err.value)
    assert "\n" not in message and "linear_attention" in message


def test_layer_rotary_reads_nested_rope_per_layer_type():
    config = transformers.Gemma3TextConfig(num_hidden_layers=2, head_dim=16)
    full, local = layer_rotary(config), layer_rotary(config, "sliding_attention")
    assert full.base == config.rope_parameters["full_attention"]["rope_theta"]
    assert local.base == config.rope_parameters["sliding_attention"]["rope_theta"]
    assert not math.isclose(full.base, local.base)
