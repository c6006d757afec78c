"""ComposedModelCache: eviction (RoPE-Relay or not) composed with PN-Mix, in tiny models."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from pnmix_bytes import row_bytes

from kvlab.evaluation.metrics import cache_storage
from kvlab.integrations import (
    KVLAB_ATTENTION,
    EvictionConfig,
    PNMixModelCache,
    RelayModelCache,
    use_attention,
)
from kvlab.integrations.composed_cache import ComposedLayer, ComposedModelCache
from kvlab.integrations.relay_cache import RelayLayer
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention
from kvlab.relay.scorers import SnapKVScorer
from kvlab.rope import rotate_by_delta

SMALL = dict(sink_tokens=4, residual_tokens=8, group_tokens=16)
# the methods' ``pn-mix`` coding at a layout small enough to quantize in a tiny prompt
ISSUE8 = dict(key_coding="bit_alloc", key_outlier_fraction=0.02, value_coding="hadamard", **SMALL)
# the default eviction policy's shape: SnapKV x value norm, 3/4 of the budget a protected
# window, adaptive heads, per-layer budgets (weights, as a calibration gives them)
POLICY = EvictionConfig(
    ratio=0.5,
    scorer=SnapKVScorer(7, value_norm=True),
    window_fraction=0.75,
    layer_budget=(3.0, 1.0),
    sink_tokens=2,
)
EVICTIONS = {
    "policy-relay": POLICY,
    "policy-norelay": dataclasses.replace(POLICY, relay=False),
    "keynorm-norelay": EvictionConfig(
        ratio=0.5, scorer="keynorm", relay=False, sink_tokens=2, window_tokens=8
    ),
}


def _rows(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen) for n in lengths]


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


def _kept(layer: ComposedLayer, row: int, head: int) -> torch.Tensor:
    positions, counts = layer.kept_positions
    return positions[row, head, : counts[row, head]]


def _packed(store: PNMixCache) -> list[torch.Tensor]:
    """Copies of every group's codes, scalars and payload, and of the per-pair table."""
    out = [t.clone() for group in store.groups for t in group.tensors().values()]
    return out + ([] if store.mask_packed is None else [store.mask_packed.clone()])


# ------------------------------------------------------------------ the same eviction


@pytest.mark.parametrize("relay", [True, False])
def test_with_sinks_covering_everything_it_equals_relay_model_cache(make_llama, monkeypatch, relay):
    """Nothing quantized (every kept token a PN-Mix sink, a position-aware codec set up with
    its offsets): the eviction is RelayModelCache's, the prefill logits are bit-identical, and
    decode logits equal RelayModelCache's with float16 storage (PN-Mix stores exact tokens in
    float16: the reference rounds what it stores the same way) to float32 rounding."""
    model = make_llama(seed=60)
    ids = torch.randint(3, 96, (2, 104), generator=torch.Generator().manual_seed(61))
    eviction = dataclasses.replace(POLICY, relay=relay)
    update = RelayLayer.update

    def float16_storage(self, keys, values, *args, **kwargs):
        return update(self, keys.half().float(), values.half().float(), *args, **kwargs)

    monkeypatch.setattr(RelayLayer, "update", float16_storage)  # both caches' layers
    config = PNMixConfig(**{**ISSUE8, "sink_tokens": 128})
    composed = ComposedModelCache(model.config, eviction, config)
    reference = RelayModelCache(model.config, eviction)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model(ids[:, :96], cache=composed).logits
        assert torch.equal(out, model(ids[:, :96], cache=reference).logits)
        for layer in reference.layers:  # the relayed keys, rounded as PN-Mix stores them
            layer.store.keys.copy_(layer.store.keys.half().float())
            layer.store.values.copy_(layer.store.values.half().float())
        for t in range(96, 104):
            out = model(ids[:, t : t + 1], cache=composed).logits
            want = model(ids[:, t : t + 1], cache=reference).logits
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    composed.check_values()
    assert composed.next_positions == reference.next_positions == [104, 104]
    for mine, theirs in zip(composed.layers, reference.layers, strict=True):
        pnmix = mine.pnmix
        assert pnmix.codec.position_aware and int(pnmix.group_counts.sum()) == 0
        for b in range(2):
            assert mine.tokens_per_head(b) == theirs.tokens_per_head(b)
            for h in range(2):
                seg = theirs.segment(b, h)
                n = len(seg.keys)
                kept = n - 8  # the kept prefill tokens: bit for bit (decode tokens of deeper
                # layers follow float32-rounded attention outputs: within float16 rounding)
                for got, want in ((pnmix.sink_keys, seg.keys), (pnmix.sink_values, seg.values)):
                    assert torch.equal(got[b, h, :kept], want[:kept].half())
                    torch.testing.assert_close(
                        got[b, h, kept:n].float(), want[kept:], atol=1e-4, rtol=1e-3
                    )
                # the PN-Mix positions are the reference's RoPE positions
                start = int(pnmix.position_offsets[b, h])
                if relay:
                    assert seg.rotary_positions.tolist() == list(range(start, start + n))
                else:  # the frame of the kept tail (protected window) is its true position
                    assert int(seg.rotary_positions[-1]) == start + n - 1


def test_with_ratio_zero_it_equals_pnmix_model_cache(make_llama):
    """Nothing evicted (the relay moves no token): the same packed bytes — tables from the
    same prefill queries — and the same logits as PNMixModelCache."""
    model = make_llama(seed=62)
    ids = torch.randint(3, 96, (2, 90), generator=torch.Generator().manual_seed(63))
    config = PNMixConfig(**ISSUE8)
    composed = ComposedModelCache(model.config, dataclasses.replace(POLICY, ratio=0.0), config)
    plain = PNMixModelCache(model.config, config)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model(ids[:, :70], cache=composed).logits
        torch.testing.assert_close(out, model(ids[:, :70], cache=plain).logits, atol=1e-5, rtol=0)
        for t in range(70, 90):
            out = model(ids[:, t : t + 1], cache=composed).logits
            want = model(ids[:, t : t + 1], cache=plain).logits
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    assert composed.nbytes() == plain.nbytes()
    for mine, theirs in zip(composed.layers, plain.layers, strict=True):
        assert mine.pnmix.group_counts.min() > 0 and mine.pnmix.pair_table is not None
        assert mine.pnmix.position_offsets.tolist() == [[0, 0], [0, 0]]
        for b in range(2):
            for x, y in zip(row_bytes(mine.pnmix, b), row_bytes(theirs.store, b), strict=True):
                assert torch.equal(x, y)


@pytest.mark.parametrize("name", list(EVICTIONS))
def test_kept_sets_and_prefill_logits_equal_relay_model_cache(make_llama, name):
    model = make_llama(seed=64)
    ids = torch.randint(3, 96, (2, 110), generator=torch.Generator().manual_seed(65))
    eviction = EVICTIONS[name]
    composed = ComposedModelCache(model.config, eviction, PNMixConfig(**ISSUE8), record_kept=True)
    reference = RelayModelCache(model.config, eviction)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model(ids[:, :100], cache=composed).logits
        assert torch.equal(out, model(ids[:, :100], cache=reference).logits)
        for t in range(100, 110):  # decoding changes no kept set
            model(ids[:, t : t + 1], cache=composed)
    assert [(e.layer_idx, e.row, e.tokens_after, e.endpoint) for e in composed.events()] == [
        (e.layer_idx, e.row, e.tokens_after, e.endpoint) for e in reference.events()
    ]
    differ = False
    for mine, theirs in zip(composed.layers, reference.layers, strict=True):
        for b in range(2):
            counts = theirs.tokens_per_head(b)
            differ |= len(set(counts)) > 1
            assert mine.tokens_per_head(b) == [n + 10 for n in counts]
            for h in range(2):
                assert torch.equal(_kept(mine, b, h), theirs.segment(b, h).original_positions)
    assert differ or name == "keynorm-norelay"  # adaptive heads keep different counts


# ------------------------------------------------------------------ bytes


def test_storage_is_the_pnmix_store_of_the_kept_keys_byte_for_byte(make_llama):
    """A position-aware codec without a table: every layer's store equals a PNMixCache
    filled with RelayModelCache's kept (relayed) keys at the same offsets, byte for byte; the
    cache's bytes are those stores' used bytes and nothing else (no per-token index)."""
    model = make_llama(seed=66)
    ids = torch.randint(3, 96, (2, 120), generator=torch.Generator().manual_seed(67))
    config = PNMixConfig(
        key_coding="prerope_cartesian", key_outlier_fraction=0.02, value_coding="hadamard", **SMALL
    )
    composed = ComposedModelCache(model.config, POLICY, config)
    reference = RelayModelCache(model.config, POLICY)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=composed)
        model(ids, cache=reference)
    total = 0
    for mine, theirs in zip(composed.layers, reference.layers, strict=True):
        counts = np.array([theirs.tokens_per_head(b) for b in range(2)])
        width = int(counts.max())
        keys = torch.zeros(2, 2, width, 16)
        values = torch.zeros(2, 2, width, 16)
        for b in range(2):
            for h in range(2):
                seg = theirs.segment(b, h)
                keys[b, h, width - len(seg.keys) :] = seg.keys
                values[b, h, width - len(seg.keys) :] = seg.values
        alone = PNMixCache(
            mine.pnmix_config,
            batch_size=2,
            num_key_value_heads=2,
            head_dim=16,
            rotary=mine.relay_layer.rotary,
        )
        alone.set_position_offsets(120 - counts)
        alone.append(keys, values, counts)
        assert mine.pnmix.nbytes() == alone.nbytes()
        assert int(alone.group_counts.min()) > 0
        for b in range(2):
            for x, y in zip(row_bytes(mine.pnmix, b), row_bytes(alone, b), strict=True):
                assert torch.equal(x, y)
        total += alone.persistent_bytes
    storage = cache_storage(composed)
    assert storage.kv_bytes == storage.kv_bytes_16bit == composed.nbytes() == total
    assert storage.index_bytes == composed.index_bytes() == 0


def _pnmix_bytes(counts: np.ndarray, d: int, heads: int) -> int:
    """Used bytes of ``ISSUE8`` streams of ``counts [B, H]`` tokens, from docs/design.md,
    "Byte accounting": sinks and residual 2 bytes per element; a group of T = 16 tokens
    ``T·D·2/8`` code bytes, ``2·D`` float16 key scalars, ``round(0.02·T·D)`` outliers of
    2 + 2 bytes, the same codes and ``2·T`` scalars for values; a 2-bit width per (head,
    pair) for each sequence with a group."""
    s, r, t = SMALL["sink_tokens"], SMALL["residual_tokens"], SMALL["group_tokens"]
    group = t * d * 2 // 8 + 2 * d * 2 + round(0.02 * t * d) * 4 + t * d * 2 // 8 + 2 * t * 2
    total = 0
    for row in counts:
        for n in row:
            sinks = min(int(n), s)
            rest = int(n) - sinks
            groups = (rest - r) // t if rest >= r else 0
            total += (sinks + rest - groups * t) * 2 * d * 2 + groups * group
        if any((n - s - r) // t > 0 for n in row):
            total += math.ceil(heads * (d // 2) * 2 / 8)
    return total


def test_bytes_follow_the_kept_counts_exactly(make_llama):
    model = make_llama(seed=68)
    rows = _rows([90, 57], seed=69)
    ids, mask = _left_pad(rows)
    composed = ComposedModelCache(model.config, POLICY, PNMixConfig(**ISSUE8))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, attention_mask=mask, cache=composed)
        expected = 0
        for layer in composed.layers:
            counts = np.array([layer.tokens_per_head(b) for b in range(2)])
            assert len(set(counts.ravel().tolist())) > 2  # rows and heads differ
            expected += _pnmix_bytes(counts, 16, 2)
        assert composed.nbytes() == expected
        assert sum(composed.storage_report().values()) == expected
        dense = sum(len(r) for r in rows) * 2 * 2 * 2 * 16 * 2  # layers, heads, k+v, D, fp16
        # half evicted, and the kept tokens beyond sinks and residual at ~2.5 bits
        assert composed.nbytes() < dense / 2


# ------------------------------------------------------------------ per-head counts


def test_heads_hold_different_counts_and_packed_attention_reads_each(make_llama):
    model = make_llama(seed=70)
    ids = torch.randint(3, 96, (2, 120), generator=torch.Generator().manual_seed(71))
    composed = ComposedModelCache(model.config, POLICY, PNMixConfig(**ISSUE8))
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=composed)
        pnmix = composed.layers[0].pnmix
        assert len(set(pnmix.seq_lengths.ravel().tolist())) > 1
        assert len(set(pnmix.residual_lengths.ravel().tolist())) > 1
        query = torch.randn(2, 4, 3, 16, generator=torch.Generator().manual_seed(72))
        out = pnmix_attention(query, pnmix, scale=0.25, causal=True)
        keys, values = (x.double() for x in pnmix.dequantize())
        for b in range(2):
            for hq in range(4):
                h, n = hq // 2, int(pnmix.seq_lengths[b, hq // 2])
                logits = query[b, hq].double() @ keys[b, h, :n].T * 0.25  # [3, n]
                seen = torch.arange(n).view(1, -1) <= torch.arange(n - 3, n).view(-1, 1)
                probs = torch.softmax(logits.masked_fill(~seen, -math.inf), -1)
                want = probs @ values[b, h, :n]
                torch.testing.assert_close(out[b, hq].double(), want, atol=1e-5, rtol=1e-5)
        calls = composed.attention_calls()
        logits = model(ids[:, :1], cache=composed).logits
        assert bool(torch.isfinite(logits).all())
        assert composed.attention_calls() == calls + 2


# ------------------------------------------------------------------ positions of packed keys


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("coding", ["prerope_cartesian", "bit_alloc"])
def test_packed_keys_stay_within_one_step_of_the_exact_kept_keys_and_a_relay_moves_positions_only(
    make_llama, relay, coding
):
    """The packed kept keys decode, at their RoPE positions, to within one quantization step
    (per rotary pair: the norm of the pair's two channel steps) of RelayModelCache's exact
    kept keys — relayed, or (no relay) at their original positions through the frame offsets.
    A further relay of the packed tokens (``set_position_offsets``) touches no code, scalar,
    payload or table: decoded keys are the old ones rotated by the move, and stay within one
    step of the exact keys relayed the same way."""
    model = make_llama(seed=73)
    ids = torch.randint(3, 96, (2, 120), generator=torch.Generator().manual_seed(74))
    eviction = dataclasses.replace(POLICY, relay=relay)
    config = PNMixConfig(key_coding=coding, **SMALL)
    composed = ComposedModelCache(model.config, eviction, config)
    reference = RelayModelCache(model.config, eviction)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=composed)
        model(ids, cache=reference)
    for mine, theirs in zip(composed.layers, reference.layers, strict=True):
        pnmix = mine.pnmix
        groups = int(pnmix.group_counts.max())
        assert groups > 0
        exact = torch.zeros(2, 2, pnmix.seq_lengths.max(), 16)
        for b in range(2):
            for h in range(2):
                seg = theirs.segment(b, h)
                exact[b, h, : len(seg.keys)] = seg.keys
        decoded = pnmix.dequantize()[0]
        buffers = _packed(pnmix)
        delta = torch.tensor([[5, -3], [17, 2]])
        pnmix.set_position_offsets(pnmix.position_offsets + delta.numpy())
        moved = pnmix.dequantize()[0]
        assert all(torch.equal(a, c) for a, c in zip(buffers, _packed(pnmix), strict=True))
        shift = delta.view(2, 2, 1)
        relayed = rotate_by_delta(exact, shift, mine.relay_layer.rotary)
        for b in range(2):
            for h in range(2):
                n, ns = int(pnmix.seq_lengths[b, h]), int(pnmix.sink_lengths[b, h])
                nq = int(pnmix.group_counts[b, h]) * SMALL["group_tokens"]
                quantized = slice(ns, ns + nq)
                # packed tokens: moved = the decoded ones rotated by the move (codes untouched)
                torch.testing.assert_close(
                    moved[b, h, quantized],
                    rotate_by_delta(decoded[b, h, quantized], delta[b, h], mine.relay_layer.rotary),
                    atol=1e-5,
                    rtol=1e-5,
                )
                # exact tokens: the stored float16 keys, rotated once and rounded once
                for part in (slice(0, ns), slice(ns + nq, n)):
                    assert torch.equal(decoded[b, h, part], exact[b, h, part].half().float())
                    want = rotate_by_delta(
                        decoded[b, h, part], delta[b, h], mine.relay_layer.rotary
                    )
                    assert torch.equal(moved[b, h, part], want.half().float())
                if coding != "prerope_cartesian" or nq == 0:
                    continue
                # one step: the group's per-channel scales, as a per-pair norm
                scales = pnmix.store.key_scalars[b, h, : nq // 16, :16].float()
                step = scales.repeat_interleave(16, 0)  # [nq, D]
                first, second = pnmix.pair_indices
                pair_step = step[:, first].hypot(step[:, second])
                for got, want in ((decoded, exact), (moved, relayed)):
                    err = got[b, h, quantized] - want[b, h, quantized]
                    pair_err = err[:, first].hypot(err[:, second])
                    assert bool((pair_err <= pair_step + 1e-4).all())
                    assert float(pair_err.max()) > 0


# ------------------------------------------------------------------ padded batches


@pytest.mark.parametrize("name", ["policy-relay", "keynorm-norelay"])
@pytest.mark.parametrize("explicit_positions", [False, True])
def test_each_row_of_a_padded_batch_equals_the_row_run_alone(make_llama, name, explicit_positions):
    model = make_llama(seed=75)
    rows = _rows([77, 52, 64], seed=76)
    ids, mask = _left_pad(rows)
    steps = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(77))
    eviction = EVICTIONS[name]
    config = PNMixConfig(**ISSUE8)
    batched = ComposedModelCache(model.config, eviction, config, record_kept=True)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        extra = {}
        if explicit_positions:  # what generate passes: each row's own positions, pads at 0
            extra = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
        logits = [model(ids, attention_mask=mask, cache=batched, **extra).logits]
        packed = [row_bytes(batched.layers[0].pnmix, b) for b in range(3)]  # after the prefill
        for j in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            if explicit_positions:
                extra = {"position_ids": mask.sum(-1, keepdim=True) - 1}
            logits.append(
                model(steps[:, j : j + 1], attention_mask=mask, cache=batched, **extra).logits
            )
        batched.check_values()
        assert bool(torch.isfinite(logits[0]).all())
        for b, row in enumerate(rows):
            alone = ComposedModelCache(model.config, eviction, config, record_kept=True)
            expected = [model(row.view(1, -1), cache=alone).logits]
            packed_alone = row_bytes(alone.layers[0].pnmix, 0)
            expected += [model(steps[b : b + 1, j : j + 1], cache=alone).logits for j in range(6)]
            pad = ids.shape[1] - len(row)
            torch.testing.assert_close(logits[0][b : b + 1, pad:], expected[0], atol=2e-5, rtol=0)
            for got, want in zip(logits[1:], expected[1:], strict=True):
                torch.testing.assert_close(got[b : b + 1], want, atol=2e-5, rtol=0)
            assert batched.next_positions[b] == alone.next_position == len(row) + 6
            for layer_b, layer_a in zip(batched.layers, alone.layers, strict=True):
                assert layer_b.tokens_per_head(b) == layer_a.tokens_per_head(0)
                assert layer_b.pnmix.position_offsets[b].tolist() == (
                    layer_a.pnmix.position_offsets[0].tolist()
                )
                for h in range(2):  # the same kept tokens, no pad among them
                    assert torch.equal(_kept(layer_b, b, h), _kept(layer_a, 0, h))
            assert alone.layers[0].pnmix.group_counts.min() > 0
            if not explicit_positions:
                continue  # the cache re-rotated the row's keys (float rounding): no byte check
            # after the prefill, layer 0's keys are the same floats: the same bytes (deeper
            # layers' keys follow float32 attention outputs, and decode tokens a batch-shaped
            # projection, that may round differently in a batch)
            assert all(torch.equal(x, y) for x, y in zip(packed[b], packed_alone, strict=True))


def test_generate_on_a_padded_batch_equals_each_row_alone(make_llama):
    model = make_llama(seed=78)
    model.generation_config.eos_token_id = None
    rows = _rows([70, 49], seed=79)
    ids, mask = _left_pad(rows)
    config = PNMixConfig(**ISSUE8)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = ComposedModelCache(model.config, POLICY, config)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=cache
        )
        cache.check_values()
        for b, row in enumerate(rows):
            alone = model.generate(
                row.view(1, -1),
                max_new_tokens=12,
                do_sample=False,
                cache=ComposedModelCache(model.config, POLICY, config),
            )
            assert torch.equal(out[b, ids.shape[1] :], alone[0, len(row) :])


def test_window_layers_softcap_and_a_second_generate(make_llama):
    """Gemma 2 shape (sliding-window layers kept exactly between composed layers, attention
    soft-capping through the packed attention): a padded generate equals each row alone; a
    second generate continues the same cache (a multi-token forward after the packing)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=16,
        attn_logit_softcapping=0.05,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    torch.manual_seed(89)
    model = Gemma2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    rows = _rows([70, 49], seed=90)
    ids, mask = _left_pad(rows)
    eviction = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=8)
    pnmix = PNMixConfig(**ISSUE8)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = ComposedModelCache(model.config, eviction, pnmix)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=cache
        )
        assert [type(layer).__name__ for layer in cache.layers] == [
            "WindowLayer",
            "ComposedLayer",
            "WindowLayer",
        ]
        assert cache.layers[1].pnmix.group_counts.max() > 0
        for b, row in enumerate(rows):
            alone = model.generate(
                row.view(1, -1),
                max_new_tokens=6,
                do_sample=False,
                cache=ComposedModelCache(model.config, eviction, pnmix),
            )
            assert torch.equal(out[b, ids.shape[1] :], alone[0, len(row) :])
        turn = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(91))
        conversation = torch.cat([out, turn], 1)
        mask = torch.cat([mask, torch.ones(2, conversation.shape[1] - mask.shape[1])], 1).long()
        second = model.generate(
            conversation, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache
        )
        cache.check_values()
    assert torch.equal(second[:, : conversation.shape[1]], conversation)
    assert cache.get_seq_length() == second.shape[1] - 1
    composed = cache.layers[1].relay_layer
    assert composed.stream_lengths == [n + 6 + 5 + 3 for n in (70, 49)]
    assert len(cache.events()) == 2  # one eviction per row, at the prefill only


# ------------------------------------------------------------------ host syncs


def test_decode_forwards_read_the_mask_once_and_nothing_else(make_llama, monkeypatch):
    """Single-token forwards of a padded batch — with the mask and position ids generate
    passes, with the mask only, and with neither — read at most their mask into Python, once
    per forward (its check: a hole or a padding new token is refused before anything is
    stored); groups flush among them; the value checks run in check_values."""
    model = make_llama(seed=80)
    ids, mask = _left_pad(_rows([80, 66], seed=81))
    steps = torch.randint(3, 96, (2, 25), generator=torch.Generator().manual_seed(82))
    cache = ComposedModelCache(model.config, POLICY, PNMixConfig(**ISSUE8))
    reads = []
    as_bool = torch.Tensor.__bool__

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync: a tensor value was read by Python")

    def counted(self):
        reads.append(1)
        return as_bool(self)

    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, attention_mask=mask, cache=cache)
        before = cache.layers[0].pnmix.group_counts
        masks = [torch.cat([mask, torch.ones(2, t + 1, dtype=torch.long)], 1) for t in range(24)]
        positions = [m.sum(-1, keepdim=True) - 1 for m in masks]
        for name in ("item", "tolist", "__int__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        monkeypatch.setattr(torch.Tensor, "__bool__", counted)
        for t in range(20):
            model(
                steps[:, t : t + 1],
                attention_mask=masks[t],
                position_ids=positions[t],
                cache=cache,
            )
        for t in range(20, 24):
            model(steps[:, t : t + 1], attention_mask=masks[t], cache=cache)
        assert len(reads) == 24  # one mask check per forward, for every layer
        monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
        model(steps[:, 24:25], cache=cache)  # no mask: nothing read
        monkeypatch.undo()
        assert (cache.layers[0].pnmix.group_counts - before).min() >= 1
        cache.check_values()
        seen = cache.get_seq_length()
        pad_column = torch.cat([masks[-1], torch.ones(2, 1, dtype=torch.long),
                                torch.tensor([[1], [0]])], 1)  # fmt: skip
        with pytest.raises(ValueError, match="padding new token"):
            model(steps[:, :1], attention_mask=pad_column, cache=cache)
        assert cache.get_seq_length() == seen
        cache.check_values()


# ------------------------------------------------------------------ refusals and atomic failure


def _state(cache: ComposedModelCache) -> list:
    out = []
    for layer in cache.layers:
        pnmix = layer.pnmix
        data = None
        if pnmix is not None:
            data = [t.clone() for b in range(pnmix.batch_size) for t in row_bytes(pnmix, b)]
            data.append(torch.from_numpy(pnmix.position_offsets.copy()))
        stage = layer.relay_layer
        out.append(
            (
                layer.is_initialized,
                stage.store is None,
                stage.seen_tokens,
                list(stage.padding),
                list(stage.stream_lengths),
                list(stage.next_positions),
                stage.forwards,
                len(stage.events),
                data,
            )
        )
    return out


def _same(a: list, b: list) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y

    return eq(a, b)


def test_stream_mode_and_bad_pnmix_settings_are_refused_at_construction(make_llama):
    config = make_llama(seed=83).config
    with pytest.raises(ValueError, match=r"capacity \(stream\) mode would evict tokens already"):
        ComposedModelCache(config, EvictionConfig(capacity=40))
    with pytest.raises(ValueError, match="rotary"):  # a pre-RoPE codec on the wrong pairs
        ComposedModelCache(config, POLICY, PNMixConfig(**ISSUE8, rotary_dim=8), match_rotary=False)
    with pytest.raises(ValueError, match="PNMixConfig"):
        ComposedModelCache(config, POLICY, {"bits": 2})


def test_every_input_error_changes_no_layer(make_llama):
    model = make_llama(seed=84)
    config = PNMixConfig(**ISSUE8)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        legacy = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=4, window_tokens=32)
        short = ComposedModelCache(model.config, legacy, config)
        before = _state(short)
        with pytest.raises(ValueError, match="cannot evict after the 20-token prefill"):
            model(torch.randint(3, 96, (1, 20)), cache=short)
        assert _same(_state(short), before) and not short.layers[0].is_initialized
        cache = ComposedModelCache(model.config, POLICY, config)
        before = _state(cache)
        ids, mask = _left_pad(_rows([40, 30], seed=85))
        mask[1] = 0  # a row that is all padding: it would never be evicted nor packed
        with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
            model(ids, attention_mask=mask, cache=cache)
        assert _same(_state(cache), before)

        ids, mask = _left_pad(_rows([70, 58], seed=86))
        model(ids, attention_mask=mask, cache=cache)
        cache.end_prompt()  # the 3-token forwards continue the conversation
        new = torch.full((2, 3), 7)
        good = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
        right_pad, late_pad, old = good.clone(), good.clone(), good.clone()
        right_pad[0, -2] = 0
        late_pad[1, -3] = 0
        old[0, 0] = 1 - old[0, 0]
        one = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        cases = [
            ({"attention_mask": good[:, 1:]}, "2-D attention_mask"),
            ({"attention_mask": right_pad}, "left padding only"),
            ({"attention_mask": late_pad}, "before a sequence's first token"),
            ({"attention_mask": old}, "differ from the padding"),
            ({"attention_mask": good, "position_ids": torch.tensor([[9, 7, 8]])}, "consecutive"),
            ({"input_ids": new[:1]}, "new batch"),
            ({"input_ids": new[:, :1], "attention_mask": one[:, 1:]}, "2-D attention_mask"),
        ]
        for kwargs, match in cases:
            snapshot = _state(cache)
            with pytest.raises(ValueError, match=match):
                model(**{"input_ids": new, **kwargs}, cache=cache)
            assert _same(_state(cache), snapshot), match
        # still works, exactly like a cache that never saw the bad inputs
        out = model(new, attention_mask=good, cache=cache).logits
        fresh = ComposedModelCache(model.config, POLICY, config)
        model(ids, attention_mask=mask, cache=fresh)
        fresh.end_prompt()
        assert torch.equal(out, model(new, attention_mask=good, cache=fresh).logits)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_prefill_the_pnmix_storage_cannot_hold_is_refused_before_anything_is_stored(
    make_llama, bad
):
    """Keys or values that are NaN or inf (one token's embedding) are refused by layer 0
    before its RelayStore commits or evicts: the cache is unchanged and the next forward
    equals a fresh cache's."""
    model = make_llama(seed=88)
    config = PNMixConfig(**ISSUE8)
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(89))
    embeds = model.get_input_embeddings()(ids)
    poisoned = embeds.clone()
    poisoned[0, 10] = bad
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = ComposedModelCache(model.config, POLICY, config)
        before = _state(cache)
        for _ in range(2):
            with pytest.raises(ValueError, match="non-finite"):
                model(inputs_embeds=poisoned, cache=cache)
            assert _same(_state(cache), before) and not cache.layers[0].is_initialized
        out = model(inputs_embeds=embeds, cache=cache).logits
        fresh = ComposedModelCache(model.config, POLICY, config)
        assert torch.equal(out, model(inputs_embeds=embeds, cache=fresh).logits)


def test_beam_reorder_selects_rows_bit_exactly(make_llama):
    model = make_llama(seed=87)
    ids = torch.randint(3, 96, (2, 90), generator=torch.Generator().manual_seed(88))
    cache = ComposedModelCache(model.config, POLICY, PNMixConfig(**ISSUE8), record_kept=True)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
        rows = [row_bytes(layer.pnmix, 1) for layer in cache.layers]
        kept = [_kept(layer, 1, 0).clone() for layer in cache.layers]
        cache.reorder_cache(torch.tensor([1, 1, 0]))
        for layer, row, positions in zip(cache.layers, rows, kept, strict=True):
            assert layer.pnmix.batch_size == 3
            for b in (0, 1):
                assert all(
                    torch.equal(x, y) for x, y in zip(row_bytes(layer.pnmix, b), row, strict=True)
                )
                assert torch.equal(_kept(layer, b, 0), positions)
        logits = model(torch.full((3, 1), 5), cache=cache).logits
        assert torch.equal(logits[0], logits[1])


# ------------------------------------------------------------------ one-call decode


@pytest.mark.parametrize("relay", [True, False])
def test_decode_in_one_call_gives_the_two_calls_bits(make_llama, monkeypatch, relay):
    """A single-token forward appends and attends with pnmix_decode_step (one compiled call
    on the CPU backend when the token only fills a residual slot, as PNMixView does): its
    logits, stored bytes and counts are bit-identical to the append + pnmix_attention path it
    replaced, across group flushes."""
    from kvlab.integrations import composed_layer
    from kvlab.pnmix.kernels import cpu

    model = make_llama(seed=95)
    ids, mask = _left_pad(_rows([72, 61], seed=96))
    eviction = dataclasses.replace(POLICY, relay=relay)
    config = PNMixConfig(**ISSUE8)

    def decode(cache):
        logits = []
        with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
            out = model(ids, attention_mask=mask, cache=cache)
            token, seen = out.logits[:, -1:].argmax(-1), mask
            for _ in range(20):  # more than one group of 16 tokens: flushes in between
                seen = torch.cat([seen, torch.ones_like(seen[:, :1])], 1)
                out = model(token, attention_mask=seen, cache=cache)
                logits.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        cache.check_values()
        return torch.cat(logits, 1)

    fused_calls = []
    step = cpu.decode_step_cpu

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(cpu, "decode_step_cpu", counted)
    fused = ComposedModelCache(model.config, eviction, config)
    one_call = decode(fused)
    monkeypatch.undo()

    def two_calls(query, keys, values, store, *, scale, logit_softcap, sink_logits):
        store.append(keys, values, checks="deferred", queries=query)
        out = pnmix_attention(
            query,
            store,
            scale=scale,
            causal=True,
            logit_softcap=logit_softcap,
            sink_logits=sink_logits,
        )
        return out.to(query.dtype)

    monkeypatch.setattr(composed_layer, "pnmix_decode_step", two_calls)
    plain = ComposedModelCache(model.config, eviction, config)
    assert torch.equal(one_call, decode(plain))
    for a, b in zip(fused.layers, plain.layers, strict=True):
        assert np.array_equal(a.pnmix.seq_lengths, b.pnmix.seq_lengths)
        for row in range(2):
            assert all(
                torch.equal(x, y)
                for x, y in zip(row_bytes(a.pnmix, row), row_bytes(b.pnmix, row), strict=True)
            )
    if cpu.load() is not None:
        assert fused_calls  # the one-call path ran
