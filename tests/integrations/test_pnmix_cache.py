"""PNMixModelCache inside transformers models: exactness, closeness, beams, packed reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_checks import require_cpu_kernel
from transformers import DynamicCache

from kvlab.integrations import KVLAB_ATTENTION, PNMixModelCache, use_attention
from kvlab.pnmix import PNMixCache, PNMixConfig

SMALL = dict(sink_tokens=4, residual_tokens=8, group_tokens=16)
# the issue-8 coding (methods' ``pn-mix``) at the small layout
ISSUE8 = dict(key_coding="bit_alloc", key_outlier_fraction=0.02, value_coding="hadamard", **SMALL)
CONFIGS = {"seed": SMALL, "issue8": ISSUE8}


def _kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    ref = torch.log_softmax(reference_logits.double(), -1)
    out = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - out)).sum(-1)


def _score_one_at_a_time(model, ids, cache, prefill):
    """Prefill, then feed one token at a time; logits [B, T - prefill + 1, V] of the scored
    positions (prefill - 1 .. T - 1)."""
    out = [model(ids[:, :prefill], cache=cache).logits[:, -1:]]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache).logits)
    return torch.cat(out, 1)


def test_generate_matches_dynamic_cache_when_nothing_is_quantized(make_llama):
    model = make_llama(seed=3)
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    config = PNMixConfig(sink_tokens=32, residual_tokens=32, group_tokens=128)
    prompt = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.generate(
            prompt, max_new_tokens=24, do_sample=False, cache=DynamicCache(config=model.config)
        )
        cache = PNMixModelCache(model.config, config)
        with use_attention(model, KVLAB_ATTENTION):
            tokens = model.generate(prompt, max_new_tokens=24, do_sample=False, cache=cache)
    assert tokens.shape == (1, 48)
    assert torch.equal(tokens, reference)
    store = cache.layers[0].store
    assert store.quantized_tokens == 0  # sinks + residual cover all 47 cached tokens
    assert store.seq_length == 47


def test_logits_equal_to_float16_rounding_when_nothing_is_quantized(make_llama):
    model = make_llama(seed=4)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _score_one_at_a_time(model, ids, DynamicCache(config=model.config), 20)
        with use_attention(model, KVLAB_ATTENTION):
            out = _score_one_at_a_time(model, ids, PNMixModelCache(model.config), 20)
    # keys/values are stored in float16: the only difference is that rounding
    torch.testing.assert_close(out, reference, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "coding", ["mix", "cartesian", "per_token", "prerope_cartesian", "prerope_qmix", "bit_alloc"]
)
def test_quantized_logits_are_close_and_more_bits_are_closer(make_llama, coding):
    model = make_llama(seed=5)
    ids = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(2))
    kls = {}
    with torch.no_grad():
        reference = _score_one_at_a_time(model, ids, DynamicCache(config=model.config), 96)
        with use_attention(model, KVLAB_ATTENTION):
            for bits in (2, 4):
                cache = PNMixModelCache(
                    model.config, PNMixConfig(bits=bits, key_coding=coding, **SMALL)
                )
                out = _score_one_at_a_time(model, ids, cache, 96)
                assert cache.layers[0].store.quantized_tokens >= 128  # really quantized
                kls[bits] = float(_kl(reference, out).mean())
    # this random model's attention is flat: 2-bit KL is ~6e-5 nats, 4-bit ~2e-6
    assert 0.0 < kls[4] < kls[2] < 1e-3, kls


def test_decode_reads_packed_codes_never_dequantizes(make_llama, monkeypatch):
    model = make_llama(seed=6)
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(3))

    def forbidden(self):
        raise AssertionError("the cache was dequantized as a whole")

    monkeypatch.setattr(PNMixCache, "dequantize", forbidden)
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids[:, :64], cache=cache)  # exact prefill: no packed call yet
        assert cache.attention_calls() == 0
        for t in range(64, 80):
            model(ids[:, t : t + 1], cache=cache)
    layers = model.config.num_hidden_layers
    assert cache.attention_calls() == 16 * layers
    assert cache.layers[0].store.quantized_tokens == 64


def test_exact_prefill_off_reads_codes_in_the_prefill(make_llama):
    model = make_llama(seed=6)
    ids = torch.randint(3, 96, (1, 64), generator=torch.Generator().manual_seed(3))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL), exact_prefill=False)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    assert cache.attention_calls() == model.config.num_hidden_layers


def _buffers(store: PNMixCache) -> list[torch.Tensor]:
    tensors = [store.sink_keys, store.sink_values, store.residual_keys, store.residual_values]
    for group in store.groups:
        tensors.extend(group.tensors().values())
    if store.mix_mask is not None:
        tensors.append(store.mix_mask)
    return tensors


def test_beam_reorder_of_a_quantized_cache_is_bit_exact(make_llama):
    model = make_llama(seed=7)
    ids = torch.randint(3, 96, (3, 70), generator=torch.Generator().manual_seed(4))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
    assert cache.layers[0].store.quantized_tokens > 0
    before = [[t.clone() for t in _buffers(layer.store)] for layer in cache.layers]
    dequantized = [layer.store.dequantize() for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for layer, old, (old_k, old_v) in zip(cache.layers, before, dequantized, strict=True):
        new = _buffers(layer.store)
        assert len(new) == len(old)
        for a, b in zip(new, old, strict=True):
            assert torch.equal(a, b.index_select(0, beam_idx))  # bit-exact, codes permuted
        new_k, new_v = layer.store.dequantize()
        assert torch.equal(new_k, old_k[beam_idx]) and torch.equal(new_v, old_v[beam_idx])


def test_beam_search_generate_runs_on_a_quantized_cache(make_llama):
    model = make_llama(seed=8)
    prompt = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(5))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, num_beams=3, cache=cache)
    assert out.shape == (1, 68)
    assert cache.layers[0].store.batch_size == 3
    assert cache.layers[0].store.quantized_tokens > 0


def test_rotary_settings_follow_the_model(make_phi3_partial):
    model = make_phi3_partial()
    cache = PNMixModelCache(model.config)
    assert cache.pnmix_config.rotary_dim == 8
    assert cache.pnmix_config.rotary_layout == "half"


def test_issue8_coding_codes_prerope_keys_with_the_prefill_queries(make_phi3_partial, monkeypatch):
    """Partial rotary (Phi-3, rotary_dim 8 of 16): every layer gets the model's RoPE; the
    prefill's commit hands its queries to the table (computed once per layer, widths within
    budget); the stored codes are the codec's of the keys rotated back to position 0; decode
    steps read the packed codes; logits stay close to the exact model."""
    from kvlab.pnmix.cache import PNMixCache as Layer
    from kvlab.pnmix.prerope import to_prerope

    model = make_phi3_partial(seed=2)
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(3))
    seen: list[tuple[int, bool]] = []
    original = Layer.append

    def spy(self, keys, values, lengths=None, *, checks="eager", queries=None):
        seen.append((keys.shape[2], queries is not None))
        captured.append(keys)
        return original(self, keys, values, lengths, checks=checks, queries=queries)

    captured: list[torch.Tensor] = []
    monkeypatch.setattr(Layer, "append", spy)
    with torch.no_grad():
        reference = _score_one_at_a_time(model, ids, DynamicCache(config=model.config), 80)
        cache = PNMixModelCache(model.config, PNMixConfig(**ISSUE8))
        with use_attention(model, KVLAB_ATTENTION):
            out = _score_one_at_a_time(model, ids, cache, 80)
    assert seen[0] == (80, True) and seen[1] == (80, True)  # the prefill, both layers
    store = cache.layers[0].store
    assert store.rotary is not None and store.rotary.rotary_dim == 8
    assert store.saliency_computations == 1 and store.attention_calls == 120 - 80
    widths = store.pair_widths
    assert widths is not None and widths.sum(-1).tolist() == [[2 * 4] * 2]
    # group 0 of layer 0: its codes are the codec's of the pre-RoPE prefill keys
    keys0 = captured[0][:, :, 4:20]  # stream tokens 4..19 (after 4 sinks)
    pre = to_prerope(keys0.half(), torch.arange(4, 20), store.rotary, torch.float16)
    codec = store.codec
    coded = codec.encode_groups(pre.reshape(2, 16, 16), torch.float16, store.layout, widths[0])
    assert torch.equal(
        store.store.key_codes[0, :, 0], codec.pack(coded.codes, store.layout, widths[0])
    )
    assert torch.equal(store.store.key_payload[0, :, 0], coded.payload)
    kl = float(_kl(reference, out).mean())
    assert 0.0 < kl < 1e-3, kl


def test_nope_layers_code_their_own_frame():
    """A full-attention layer without RoPE (SmolLM3 ``no_rope_layers``) keeps the same coding
    in its keys' own frame (position 0 already); the RoPE layer gets the model's RoPE."""
    import transformers

    config = transformers.SmolLM3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layers=[1, 0],
    )
    cache = PNMixModelCache(config, PNMixConfig(**ISSUE8))
    rope_layer, nope_layer = cache.layers
    assert rope_layer.rotary is not None and rope_layer.config.key_codec.position_aware
    assert nope_layer.rotary is None and not nope_layer.config.key_codec.position_aware
    assert nope_layer.config.key_codec.outlier_fraction == 0.02


def test_crop_is_refused():
    from kvlab.integrations.pnmix_cache import PNMixLayer

    layer = PNMixLayer(PNMixConfig())
    layer.crop(0)
    with pytest.raises(NotImplementedError, match="cropped"):
        layer.crop(-1)


# ---------------------------------------------------------------- padded batches
def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


def _row_bytes(store: PNMixCache, b: int) -> list[torch.Tensor]:
    s = store.store
    ns, ng, nr = (int(a[b, 0]) for a in (s.sink_lengths, s.group_counts, s.residual_lengths))
    parts = [
        s.sink_keys[b, :, :ns],
        s.sink_values[b, :, :ns],
        s.key_codes[b, :, :ng],
        s.key_scalars[b, :, :ng],
        s.value_codes[b, :, :ng],
        s.value_scalars[b, :, :ng],
        s.key_payload[b, :, :ng],
        s.residual_keys[b, :, :nr],
        s.residual_values[b, :, :nr],
    ]
    if s.mask is not None:
        parts.append(s.mask[b])
    return [p.contiguous().view(torch.int16) if p.is_floating_point() else p for p in parts]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("exact_prefill", [True, False])
def test_left_padded_batch_rows_equal_rows_run_alone(make_llama, exact_prefill, config):
    """Each row of a left-padded batch (positions from the mask, as generate makes them):
    logits of its real tokens equal the row run alone to float32 rounding, padding query rows
    stay finite, and the row's layer-0 storage equals the row's alone byte for byte (deeper
    layers' keys depend on float32 attention outputs that may round differently in a batch;
    the store-level tests pin exact bytes for any input)."""
    model = make_llama(seed=11)
    gen = torch.Generator().manual_seed(12)
    rows = [torch.randint(3, 96, (n,), generator=gen) for n in (70, 45, 58)]
    ids, mask = _left_padded(rows)
    nxt = torch.randint(3, 96, (3, 6), generator=gen)
    settings = CONFIGS[config]
    cache = PNMixModelCache(model.config, PNMixConfig(**settings), exact_prefill=exact_prefill)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model(
            ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache
        )
        steps = []
        for t in range(6):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            positions = mask.sum(-1, keepdim=True) - 1
            steps.append(
                model(
                    nxt[:, t : t + 1], attention_mask=mask, position_ids=positions, cache=cache
                ).logits
            )
        assert bool(torch.isfinite(out.logits).all())
        assert cache.get_seq_length() == ids.shape[1] + 6
        for b, row in enumerate(rows):
            # "alone" runs the row as a batch of three copies: a projection's float32 bits may
            # depend on its number of rows (MKL takes another kernel for 1 row than for 3 on
            # AVX-512 machines), and this test is about the cache, not the BLAS
            alone = PNMixModelCache(
                model.config, PNMixConfig(**settings), exact_prefill=exact_prefill
            )
            ref = model(row[None].repeat(3, 1), cache=alone).logits[0]
            torch.testing.assert_close(
                out.logits[b, ids.shape[1] - len(row) :], ref, atol=1e-5, rtol=1e-5
            )
            for t in range(6):
                torch.testing.assert_close(
                    steps[t][b],
                    model(nxt[b : b + 1, t : t + 1].repeat(3, 1), cache=alone).logits[0],
                    atol=1e-5,
                    rtol=1e-5,
                )
            for layer_b, layer_a in zip(cache.layers, alone.layers, strict=True):
                assert (
                    layer_b.store.seq_lengths[b].tolist() == layer_a.store.seq_lengths[0].tolist()
                )
            assert alone.layers[0].store.quantized_tokens > 0  # groups were flushed
            for x, y in zip(
                _row_bytes(cache.layers[0].store, b),
                _row_bytes(alone.layers[0].store, 0),
                strict=True,
            ):
                assert torch.equal(x, y)


def test_left_padded_generate_equals_each_row_alone(make_llama):
    model = make_llama(seed=13)
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(14)
    rows = [torch.randint(3, 96, (n,), generator=gen) for n in (64, 41)]
    ids, mask = _left_padded(rows)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
        batch = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=cache
        )
        assert cache.layers[0].store.group_counts[:, 0].tolist() == [3, 2]
        cache.check_values()
        for b, row in enumerate(rows):
            alone = model.generate(
                row[None],
                max_new_tokens=10,
                do_sample=False,
                cache=PNMixModelCache(model.config, PNMixConfig(**SMALL)),
            )
            assert torch.equal(batch[b, -10:], alone[0, -10:])


# ---------------------------------------------------------------- multi-turn
@pytest.mark.parametrize("quantized", [False, True])
def test_a_second_generate_continues_the_same_cache(make_llama, quantized):
    """Multi-turn: generate, append a user turn, generate again with the same cache. The cache
    counts every token exactly once; with nothing quantized the tokens equal DynamicCache's."""
    model = make_llama(seed=15)
    model.generation_config.eos_token_id = None
    config = PNMixConfig(**SMALL) if quantized else PNMixConfig()
    gen = torch.Generator().manual_seed(16)
    prompt = torch.randint(3, 96, (1, 30), generator=gen)
    turn = torch.randint(3, 96, (1, 9), generator=gen)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = PNMixModelCache(model.config, config)
        first = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=cache)
        assert cache.get_seq_length() == first.shape[1] - 1  # the last token is not fed yet
        conversation = torch.cat([first, turn], 1)
        second = model.generate(conversation, max_new_tokens=8, do_sample=False, cache=cache)
        assert torch.equal(second[:, : conversation.shape[1]], conversation)
        assert cache.get_seq_length() == second.shape[1] - 1
        assert cache.layers[0].store.seq_length == second.shape[1] - 1
        if quantized:
            assert cache.layers[0].store.quantized_tokens > 0
            return
        reference = DynamicCache(config=model.config)
        ref_first = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=reference)
        ref_second = model.generate(
            torch.cat([ref_first, turn], 1), max_new_tokens=8, do_sample=False, cache=reference
        )
    assert torch.equal(first, ref_first) and torch.equal(second, ref_second)


# ---------------------------------------------------------------- atomic failure
def _snapshot(cache: PNMixModelCache) -> list:
    out = []
    for layer in cache.layers:
        store = layer.store
        counts = None if store is None else store.seq_lengths.tolist()
        data = (
            None
            if store is None
            else [t.clone() for b in range(store.batch_size) for t in _row_bytes(store, b)]
        )
        out.append((layer.get_seq_length(), counts, layer.nbytes(), data))
    return out


def _same(a: list, b: list) -> bool:
    for (la, ca, na, da), (lb, cb, nb, db) in zip(a, b, strict=True):
        if (la, ca, na) != (lb, cb, nb):
            return False
        if da is not None and not all(torch.equal(x, y) for x, y in zip(da, db, strict=True)):
            return False
    return True


def test_every_input_error_changes_no_layer(make_llama):
    model = make_llama(seed=17)
    gen = torch.Generator().manual_seed(18)
    ids, mask = _left_padded([torch.randint(3, 96, (n,), generator=gen) for n in (40, 33)])
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    step = torch.randint(3, 96, (2, 3), generator=gen)
    ones = torch.ones(2, 3, dtype=torch.long)
    bad_inputs = [
        (
            dict(
                input_ids=step,
                attention_mask=torch.cat([mask, torch.tensor([[1, 1, 0], [1, 1, 1]])], 1),
            ),
            "left padding",
        ),
        (dict(input_ids=step, attention_mask=torch.cat([mask, ones], 1)[:, 1:]), "columns"),
        (dict(input_ids=step, attention_mask=torch.cat([mask, ones], 1).repeat(2, 1)), "rows"),
        (
            dict(input_ids=step, attention_mask=torch.cat([torch.ones_like(mask), ones], 1)),
            "past tokens",
        ),
        (
            dict(
                input_ids=step,
                attention_mask=torch.ones(2, 1, 3, ids.shape[1] + 3, dtype=torch.bool),
            ),
            "2-D",
        ),
        (dict(input_ids=torch.randint(3, 96, (3, 2), generator=gen)), "do not fit"),
    ]
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, attention_mask=mask, cache=cache)
        before = _snapshot(cache)
        for kwargs, match in bad_inputs:
            with pytest.raises(ValueError, match=match):
                model(**kwargs, cache=cache)
            assert _same(before, _snapshot(cache)), match
        # the cache still works: the valid continuation
        model(step, attention_mask=torch.cat([mask, ones], 1), cache=cache)
    assert cache.get_seq_length() == ids.shape[1] + 3


# ---------------------------------------------------------------- host syncs and deferred checks
@pytest.mark.parametrize("config", list(CONFIGS))
def test_decode_forwards_read_the_mask_once_and_nothing_else(make_llama, monkeypatch, config):
    """Single-token forwards of a padded batch (groups flushing among them) through the
    model: a forward with an attention mask reads that mask once (one host read for every
    layer: a hole in a past position is refused before anything is stored); a forward without
    a mask reads nothing back from the device; the value checks run later."""
    model = make_llama(seed=19)
    gen = torch.Generator().manual_seed(20)
    ids, mask = _left_padded([torch.randint(3, 96, (n,), generator=gen) for n in (40, 35)])
    steps = torch.randint(3, 96, (2, 30), generator=gen)
    cache = PNMixModelCache(model.config, PNMixConfig(**CONFIGS[config]))
    reads: list[tuple[int, ...]] = []
    tolist = torch.Tensor.tolist

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync: a tensor value was read by Python")

    def counted(self, *args, **kwargs):
        reads.append(tuple(self.shape))
        return tolist(self, *args, **kwargs)

    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, attention_mask=mask, cache=cache)
        before = cache.layers[0].store.group_counts
        masks = [torch.cat([mask, torch.ones(2, t + 1, dtype=torch.long)], 1) for t in range(30)]
        for name in ("item", "__bool__", "__int__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        for t in range(30):
            model(steps[:, t : t + 1], attention_mask=masks[t], cache=cache)
        assert reads == [tuple(m.shape) for m in masks]  # the mask, once per forward
        monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
        model(steps[:, :1], cache=cache)  # and without a mask: nothing
        monkeypatch.undo()
    assert (cache.layers[0].store.group_counts - before).min() >= 1
    cache.check_values()


def test_deferred_checks_of_decode_forwards(make_llama):
    model = make_llama(seed=21)
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(22))
    cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
        # a single-token forward whose mask calls its new token padding: refused, not stored
        pad_column = torch.cat([torch.ones(2, 30, dtype=torch.long), torch.tensor([[1], [0]])], 1)
        with pytest.raises(ValueError, match="padding"):
            model(ids[:, :1], attention_mask=pad_column, cache=cache)
        assert cache.get_seq_length() == 30
        assert [layer.store.seq_lengths[:, 0].tolist() for layer in cache.layers] == [[30, 30]] * 2
        cache.check_values()  # nothing pending
        # keys beyond float16 in a decode step: stored, reported by check_values
        model.model.layers[1].self_attn.k_proj.weight.data.mul_(1e7)
        model(ids[:, :1], cache=cache)
        with pytest.raises(ValueError, match="layer 1"):
            cache.check_values()


# ---------------------------------------------------------------- backends
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_cpu_backend_decodes_like_the_reference_in_the_model(make_llama, monkeypatch, config):
    """Decode steps of a padded batch with the compiled CPU backend (single-token forwards
    through the fused decode step) against the torch reference, for the seed layout and the
    issue-8 ``pn-mix`` codecs (per-pair widths, outliers, pre-RoPE keys, Hadamard values):
    logits equal to float32 rounding; layer 0 (whose keys do not depend on any attention
    output) stores the same bytes (the fused append is exact)."""
    require_cpu_kernel()
    from kvlab.pnmix.kernels import cpu

    fused = []
    original = cpu.decode_step_cpu
    monkeypatch.setattr(
        cpu, "decode_step_cpu", lambda *a, **k: fused.append(1) or original(*a, **k)
    )
    model = make_llama(seed=23)
    gen = torch.Generator().manual_seed(24)
    ids, mask = _left_padded([torch.randint(3, 96, (n,), generator=gen) for n in (40, 33)])
    steps = torch.randint(3, 96, (2, 20), generator=gen)
    runs = {}
    for backend in ("torch", "cpu"):
        monkeypatch.setenv("KVLAB_PNMIX_BACKEND", backend)
        cache = PNMixModelCache(model.config, PNMixConfig(**CONFIGS[config]))
        logits = []
        with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
            model(ids, attention_mask=mask, cache=cache)
            for t in range(20):
                full = torch.cat([mask, torch.ones(2, t + 1, dtype=torch.long)], 1)
                out = model(steps[:, t : t + 1], attention_mask=full, cache=cache)
                logits.append(out.logits[:, -1])
        runs[backend] = (torch.stack(logits), cache)
    (ref, ref_cache), (got, got_cache) = runs["torch"], runs["cpu"]
    assert not isinstance(got_cache.layers[0].store.kernel_decode, str)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    layers = len(ref_cache.layers)
    # the fused step ran in the cpu run (not in "torch"): every step but a row's flush (each
    # row flushes at most twice in 20 steps of groups of 16)
    assert len(fused) >= 16 * layers
    for a, b in zip(ref_cache.layers, got_cache.layers, strict=True):
        assert np.array_equal(a.store.store.counts, b.store.store.counts)
    a, b = ref_cache.layers[0].store.store, got_cache.layers[0].store.store
    for name in ("key_codes", "key_scalars", "key_payload", "value_codes", "residual_keys"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.sink_keys, b.sink_keys)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_deepcopy_decodes_like_the_original(make_llama, monkeypatch, backend):
    """A ``copy.deepcopy`` of a quantized cache decodes one token at a time (the CPU kernel's
    fused decode step writes the counts in place) exactly as the cache it was copied from,
    and leaves the original untouched."""
    import copy

    if backend == "cpu":
        require_cpu_kernel()
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", backend)
    model = make_llama(seed=17)
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = PNMixModelCache(model.config, PNMixConfig(**SMALL))
        model(ids[:, :40], cache=cache)
        twin = copy.deepcopy(cache)
        copied = _score_one_at_a_time(model, ids[:, 39:], twin, 1)
        original = _score_one_at_a_time(model, ids[:, 39:], cache, 1)
    assert cache.layers[0].store.quantized_tokens > 0
    assert torch.equal(copied, original)


def test_a_configuration_the_model_shape_refuses_fails_when_the_cache_is_built() -> None:
    """``value_group_channels`` that does not divide the model's head_dim (24 here) is refused
    by the model cache's constructor with PN-Mix's message, not inside the first forward;
    the composed cache does the same; a dividing group size is accepted."""
    from tiny_models import tiny_llama_config

    from kvlab.integrations import ComposedModelCache
    from kvlab.relay.config import EvictionConfig

    config = tiny_llama_config(head_dim=24)
    bad = PNMixConfig(value_group_channels=16, **SMALL)
    with pytest.raises(ValueError, match="does not divide the value head dim 24"):
        PNMixModelCache(config, bad)
    with pytest.raises(ValueError, match="does not divide the value head dim 24"):
        ComposedModelCache(config, EvictionConfig(ratio=0.5), pnmix=bad)
    PNMixModelCache(config, PNMixConfig(value_group_channels=8, **SMALL))
