"""RelayModelCache with left-padded batches, atomic failure, and the decode path's host reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.integrations import KVLAB_ATTENTION, EvictionConfig, RelayModelCache, use_attention
from kvlab.relay.scorers import SnapKVScorer

ROW_LENGTHS = [37, 52, 44]
SEED = 48
CONFIGS = {
    "ratio-snapkv-relay": EvictionConfig(
        ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=8
    ),
    "ratio-keynorm-norelay": EvictionConfig(
        ratio=0.5, scorer="keynorm", relay=False, sink_tokens=2, window_tokens=8
    ),
    "capacity-snapkv-relay": EvictionConfig(
        capacity=20, scorer="snapkv", sink_tokens=2, window_tokens=8
    ),
    "capacity-recency-norelay": EvictionConfig(
        capacity=20, scorer="recency", relay=False, sink_tokens=2, window_tokens=8
    ),
    # issue 9's scorers and policy settings, per row like the others
    "ratio-expected-attention-norelay": EvictionConfig(
        ratio=0.5, scorer="expected-attention", relay=False, sink_tokens=2, window_tokens=8
    ),
    "capacity-expected-attention-relay": EvictionConfig(
        capacity=20, scorer="expected-attention", sink_tokens=2, window_tokens=8
    ),
    "ratio-tova-relay": EvictionConfig(ratio=0.5, scorer="tova", sink_tokens=2, window_tokens=8),
    "capacity-tova-norelay": EvictionConfig(
        capacity=20, scorer="tova", relay=False, sink_tokens=2, window_tokens=8
    ),
    "ratio-snapkv-policy-relay": EvictionConfig(
        ratio=0.5,
        scorer=SnapKVScorer(7, value_norm=True),
        window_fraction=0.75,
        layer_budget=(3.0, 1.0),
        sink_tokens=2,
    ),
}


def _rows(seed: int = 31) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen) for n in ROW_LENGTHS]


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


def _kept(cache: RelayModelCache, row: int) -> list[list[tuple[torch.Tensor, ...]]]:
    return [
        [
            (seg.original_positions, seg.rotary_positions, seg.keys, seg.values)
            for seg in (layer.segment(row, h) for h in range(layer.store.heads))
        ]
        for layer in cache.layers
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("explicit_positions", [False, True])
def test_each_row_of_a_padded_batch_equals_the_row_run_alone(make_llama, name, explicit_positions):
    model = make_llama(seed=SEED)
    rows = _rows()
    ids, mask = _left_pad(rows)
    steps = torch.randint(3, 96, (len(rows), 6), generator=torch.Generator().manual_seed(7))
    config = CONFIGS[name]
    batched = RelayModelCache(model.config, config)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        extra = {}
        if explicit_positions:  # what generate passes: each row's own positions, pads at 0
            extra = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
        logits = [model(ids, attention_mask=mask, cache=batched, **extra).logits]
        for j in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
            if explicit_positions:
                extra = {"position_ids": mask.sum(-1, keepdim=True) - 1}
            step = steps[:, j : j + 1]
            logits.append(model(step, attention_mask=mask, cache=batched, **extra).logits)
        assert bool(torch.isfinite(logits[0]).all())  # pad query rows included
        assert batched.get_seq_length() == ids.shape[1] + steps.shape[1]
        for b, row in enumerate(rows):
            alone = RelayModelCache(model.config, config)
            expected = [model(row.view(1, -1), cache=alone).logits]
            expected += [
                model(steps[b : b + 1, j : j + 1], cache=alone).logits
                for j in range(steps.shape[1])
            ]
            pad = ids.shape[1] - len(row)
            torch.testing.assert_close(logits[0][b : b + 1, pad:], expected[0], atol=2e-5, rtol=0)
            for got, want in zip(logits[1:], expected[1:], strict=True):
                torch.testing.assert_close(got[b : b + 1], want, atol=2e-5, rtol=0)
            assert batched.stream_lengths[b] == alone.stream_length == len(row) + steps.shape[1]
            assert batched.next_positions[b] == alone.next_position
            for layer_b, layer_a in zip(_kept(batched, b), _kept(alone, 0), strict=True):
                for (orig, rot, k, v), (orig_a, rot_a, k_a, v_a) in zip(
                    layer_b, layer_a, strict=True
                ):
                    assert torch.equal(orig, orig_a)  # the same kept tokens, no pad among them
                    assert torch.equal(rot, rot_a)
                    torch.testing.assert_close(k, k_a, atol=2e-5, rtol=0)
                    torch.testing.assert_close(v, v_a, atol=2e-5, rtol=0)
            events_b = [(e.layer_idx, e.tokens_after) for e in batched.events() if e.row == b]
            assert events_b == [(e.layer_idx, e.tokens_after) for e in alone.events()]
            assert events_b  # the row did evict
    # each row evicted on its own schedule (at its own stream lengths)
    schedules = {tuple(e.stream_length for e in batched.events() if e.row == b) for b in range(3)}
    assert len(schedules) == len(rows)


def test_generate_on_a_padded_batch_equals_each_row_alone(make_llama):
    model = make_llama(seed=42)
    model.generation_config.eos_token_id = None
    rows = _rows(seed=32)
    ids, mask = _left_pad(rows)
    config = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=2, window_tokens=8)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            cache=RelayModelCache(model.config, config),
        )
        for b, row in enumerate(rows):
            alone = model.generate(
                row.view(1, -1),
                max_new_tokens=10,
                do_sample=False,
                cache=RelayModelCache(model.config, config),
            )
            assert torch.equal(out[b, ids.shape[1] :], alone[0, len(row) :])


# ------------------------------------------------------------------ atomic failure


def _state(cache: RelayModelCache) -> list[tuple]:
    """Everything a layer holds, copied."""
    out = []
    for layer in cache.layers:
        store = layer.store
        buffers = ()
        if store is not None:
            buffers = (
                list(store.offsets),
                list(store.lengths),
                list(store.capacities),
                store.keys.clone(),
                store.values.clone(),
                store.original_positions.clone(),
                store.rotary_positions.clone(),
            )
        out.append(
            (
                layer.is_initialized,
                layer.seen_tokens,
                list(layer.padding),
                list(layer.stream_lengths),
                list(layer.next_positions),
                layer.forwards,
                len(layer.events),
                layer._pending is None,
                buffers,
            )
        )
    return out


def _same(a: list[tuple], b: list[tuple]) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y

    return eq(a, b)


def _bad_inputs(prompt: torch.Tensor, mask: torch.Tensor):
    """(name, forward kwargs, error match) of bad follow-up forwards after a padded prefill."""
    batch, seen = prompt.shape
    ones = torch.ones(batch, 3, dtype=mask.dtype)
    new = torch.full((batch, 3), 7)
    good_mask = torch.cat([mask, ones], 1)
    four_d = torch.ones(batch, 1, 3, seen + 3, dtype=torch.bool)
    right_pad = good_mask.clone()
    right_pad[0, -2] = 0
    late_pad = good_mask.clone()
    late_pad[1, -3] = 0
    old_mismatch = good_mask.clone()
    old_mismatch[0, 0] = 1 - old_mismatch[0, 0]
    holes = torch.arange(3).view(1, 3).expand(batch, 3) * 2 + 60
    return [
        ("4-D mask", {"attention_mask": four_d}, "2-D attention_mask"),
        ("short mask", {"attention_mask": good_mask[:, 1:]}, "2-D attention_mask"),
        ("right padding", {"attention_mask": right_pad}, "left padding only"),
        ("pad after tokens", {"attention_mask": late_pad}, "before a sequence's first token"),
        ("old columns", {"attention_mask": old_mismatch}, "differ from the padding"),
        (
            "non-consecutive position_ids",
            {"attention_mask": good_mask, "position_ids": holes},
            "consecutive position_ids",
        ),
        ("batch change", {"input_ids": new[:1]}, "new batch"),
    ], new


def test_every_error_changes_no_layer(make_llama):
    model = make_llama(seed=43)
    config = EvictionConfig(ratio=0.5, scorer="snapkv", sink_tokens=4, window_tokens=32)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        # a prompt shorter than the protected tokens: refused before layer 0 stores anything
        cache = RelayModelCache(model.config, config)
        before = _state(cache)
        with pytest.raises(ValueError, match="20-token prefill"):
            model(torch.randint(3, 96, (1, 20)), cache=cache)
        assert _same(_state(cache), before) and not cache.layers[0].is_initialized
        # one short row in a padded batch is enough to refuse the whole forward
        ids, mask = _left_pad([torch.randint(3, 96, (n,)) for n in (80, 30)])
        with pytest.raises(ValueError, match="30-token prefill of row 1"):
            model(ids, attention_mask=mask, cache=cache)
        assert _same(_state(cache), before)

        gen = torch.Generator().manual_seed(33)
        ids, mask = _left_pad([torch.randint(3, 96, (n,), generator=gen) for n in (80, 96, 88)])
        cache = RelayModelCache(model.config, config)
        model(ids, attention_mask=mask, cache=cache)
        cases, new = _bad_inputs(ids, mask)
        for name, kwargs, match in cases:
            before = _state(cache)
            kwargs = {"input_ids": new, **kwargs}
            with pytest.raises(ValueError, match=match):
                model(**kwargs, cache=cache)
            assert _same(_state(cache), before), name
        # the cache still works, exactly like one that never saw the bad inputs
        good = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], 1)
        out = model(new, attention_mask=good, cache=cache).logits
        fresh = RelayModelCache(model.config, config)
        model(ids, attention_mask=mask, cache=fresh)
        assert torch.equal(out, model(new, attention_mask=good, cache=fresh).logits)


def test_capacity_below_the_per_head_cap_is_refused_at_construction():
    with pytest.raises(ValueError, match="max_head_tokens 30 is below capacity 40"):
        EvictionConfig(capacity=40, max_head_tokens=30)


# ------------------------------------------------------------------ the decode path


def test_a_decode_step_reads_the_device_once_per_forward_not_per_layer(make_llama, monkeypatch):
    model = make_llama(seed=44, num_hidden_layers=3)
    cache = RelayModelCache(model.config, EvictionConfig(ratio=0.5, scorer="keynorm"))
    ids = torch.randint(3, 96, (2, 80))
    reads: list[str] = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, cache=cache)
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, counted(name))
        model(ids[:, :1], cache=cache)  # position_ids from the model: one read, at layer 0
        assert reads == ["tolist"]
        reads.clear()
        model(ids[:, :1], cache=cache, position_ids=cache.position_ids(1))
        assert reads == ["tolist"]
        # the store and the attention themselves never read the device
        layer = cache.layers[1]
        store = layer.store
        store.append(
            torch.zeros(2, 2, 1, 16),
            torch.zeros(2, 2, 1, 16),
            real=[1, 1],
            original_start=[0, 0],
            rotary_start=[0, 0],
        )
        reads.clear()
        from kvlab.relay.attention import ragged_attention

        ragged_attention(torch.zeros(2, 4, 1, 16), store, scale=0.25)
        assert reads == []


def test_one_attention_call_per_layer(make_llama, monkeypatch):
    model = make_llama(seed=45, num_hidden_layers=3)
    cache = RelayModelCache(model.config, CONFIGS["ratio-snapkv-relay"])
    ids, mask = _left_pad(_rows(seed=34))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr("kvlab.relay.attention.F.scaled_dot_product_attention", counting)
    monkeypatch.setenv("KVLAB_RELAY_BACKEND", "torch")  # the reference; the kernel: below
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids, attention_mask=mask, cache=cache)
        assert len(calls) == 3
        calls.clear()
        step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        model(ids[:, :1], attention_mask=step_mask, cache=cache)
        assert len(calls) == 3
    # heads hold different counts (adaptive) and rows different lengths: still one call
    assert len({n for layer in cache.layers for n in layer.store.lengths}) > 1
    # the default backend: a decode step is one compiled-kernel call per layer, no SDPA
    from kvlab.relay.kernels import cpu as relay_cpu

    if relay_cpu.load() is None:
        return
    kernel_calls = []
    kernel = relay_cpu.ragged_decode_cpu
    monkeypatch.setattr(
        relay_cpu, "ragged_decode_cpu", lambda *a: kernel_calls.append(1) or kernel(*a)
    )
    monkeypatch.delenv("KVLAB_RELAY_BACKEND")
    calls.clear()
    step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        model(ids[:, :1], attention_mask=step_mask, cache=cache)
    assert (len(calls), len(kernel_calls)) == (0, 3)


def test_padded_batch_with_window_layers_and_softcap_equals_rows_alone():
    """Gemma 2 shape: sliding-window layers (transformers' own, exact) between relay layers,
    attention-logit soft-capping in both; generate on a left-padded batch."""
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
    torch.manual_seed(47)
    model = Gemma2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    rows = _rows(seed=35)
    ids, mask = _left_pad(rows)
    eviction = CONFIGS["ratio-snapkv-relay"]
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad(), use_attention(model, KVLAB_ATTENTION):
        cache = RelayModelCache(model.config, eviction)
        out = model.generate(ids, attention_mask=mask, cache=cache, output_logits=True, **settings)
        assert [type(layer).__name__ for layer in cache.layers] == [
            "WindowLayer",
            "RelayLayer",
            "WindowLayer",
        ]
        for b, row in enumerate(rows):
            alone_cache = RelayModelCache(model.config, eviction)
            alone = model.generate(
                row.view(1, -1), cache=alone_cache, output_logits=True, **settings
            )
            assert torch.equal(out.sequences[b, ids.shape[1] :], alone.sequences[0, len(row) :])
            for got, want in zip(out.logits, alone.logits, strict=True):
                torch.testing.assert_close(got[b : b + 1], want, atol=2e-5, rtol=0)
            relay_b, relay_a = cache.layers[1], alone_cache.layers[1]
            for h in range(2):
                assert torch.equal(
                    relay_b.segment(b, h).original_positions,
                    relay_a.segment(0, h).original_positions,
                )
