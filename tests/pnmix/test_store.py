"""PackedStore through PNMixCache: pinned bytes, padded (ragged) rows, capacity, host syncs."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.data import default_text
from kvlab.models.byte_rope_gqa import ByteRopeGQA
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention

CODINGS = ["mix", "cartesian", "phase_norm", "per_token"]


# ---------------------------------------------------------------- pinned bytes
def storage_digest(cache: PNMixCache) -> str:
    """sha256 over every stored byte, in this order: per group (sequence order) its key codes,
    key scale, key zero, value codes, value scale, value zero (each ``[B, H, ...]``
    contiguous); the sink keys, sink values, residual keys, residual values; the packed mix
    mask. Floating tensors are hashed as their 16-bit patterns."""
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.contiguous().view(torch.int16)
        h.update(t.contiguous().cpu().numpy().tobytes())

    for g in cache.groups:
        for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale"):
            add(getattr(g, name))
        add(g.value_zero)
    for t in (cache.sink_keys, cache.sink_values, cache.residual_keys, cache.residual_values):
        add(t)
    if cache.mask_packed is not None:
        add(cache.mask_packed)
    return h.hexdigest()


# Digests computed with the list-of-groups storage this store replaced (commit 95352a7, before
# any change), by the same serialization (`storage_digest`, reading `cache._state.mask_packed`
# for the mask there) on the same inputs and appends.
SEED_DIGESTS = {
    "mix": "07d64bde874eaa91f78197d687500187ebde5fb8647a02ab852487df4de8b4c9",
    "cartesian": "f3a5417964ccc991e7c256f05ed009326cf0c4cb48aa3497ca0dadb6a81d5ae3",
    "per_token": "ee6717cf9539635f29531180d2635cadc0af7183bb56238a807b6284bcff20d1",
}
RANDOM_DIGESTS = {
    ("mix", 2, torch.float16): "5db122d0ddc41e3f5d01bd729067c12dae817f1d8346135d6e174d94460b24fc",
    ("mix", 2, torch.bfloat16): "64a957c356e09ec4328be13ec53edd4bdaa4e868bb61975563327cafd7b847a8",
    ("mix", 3, torch.float16): "a0dc072ef19a3fe24f6f3ca2724bedd923088fc49b627aabebac3765241cb53b",
    ("mix", 3, torch.bfloat16): "a40099b268e04de47330d079f58cdf24c3f5ff8e746cf5a971cdf8e077bd3981",
    ("mix", 4, torch.float16): "166a13d6175b88fa79289a35a1116d4342d5ed309aa3bc81a337475039ed3aa3",
    ("mix", 4, torch.bfloat16): "74bf42ac0f95b261aafb7866f408a5cfb556a881a66a5b7d05703dd26c2b1793",
    ("cartesian", 2, torch.float16): (
        "d5971b6a497a0eb2efb9f8e6da77903efe03765c8825a7468ffce1031b1d1ec2"
    ),
    ("cartesian", 3, torch.bfloat16): (
        "7a938400f97208c463f12f49f084e50ca62e00f6834b2cdd29dc55901c678bec"
    ),
    ("phase_norm", 2, torch.float16): (
        "443ae7e891b65d1d17c0a39c6ffa3e6c74968c44d69c3922d312cac7af6ea50c"
    ),
    ("phase_norm", 3, torch.float16): (
        "906909a3612b76af7aab01539b7c389dabb14348a08dd21560cf5a9f5aeec481"
    ),
    ("phase_norm", 4, torch.bfloat16): (
        "abf74baef031caf92c497b95ba10af347d80891f1e8b8aa0719d76928b0a469d"
    ),
    ("per_token", 2, torch.float16): (
        "42b0d401c4af6b21e310dae314f0755bb8c4d7fa2add8a064643320889e25ee4"
    ),
    ("per_token", 3, torch.bfloat16): (
        "5115911b8461b6c7cc82ae306c6b3bdf937f56d840d35160c437afe244288523"
    ),
}


def test_seed_configuration_bytes_are_pinned() -> None:
    """The seed diagnostic's inputs (ByteRopeGQA seed 42, the package text's first 448 bytes),
    prefill 384 then 64 single tokens: every stored byte as before the PackedStore."""
    model = ByteRopeGQA.from_seed(42, torch.device("cpu"))
    ids = torch.tensor(list(default_text().data[:448]), dtype=torch.int64)
    proj = model.project(ids)
    k, v = proj.keys, proj.values
    for coding, digest in SEED_DIGESTS.items():
        cfg = PNMixConfig(bits=2, sink_tokens=32, residual_tokens=32, group_tokens=128)
        cfg = PNMixConfig(**{**cfg.__dict__, "key_coding": coding})
        cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=k.shape[1], head_dim=32)
        cache.append(k[:, :, :384], v[:, :, :384])
        for t in range(384, 448):
            cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1], checks="deferred")
        cache.check_values()
        assert storage_digest(cache) == digest, coding
        if coding == "mix":
            assert cache.persistent_bytes == 32516 and cache.key_bytes == 15108


def _random_kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, 200, 16, generator=gen) * 3 + 1
    steps = torch.randint(0, 4, (2, 3, 200), generator=gen).float()
    theta = 0.5 * steps + 0.3 * torch.arange(6).reshape(2, 3, 1)
    k[..., 0] = 3 * torch.cos(theta)
    k[..., 1] = 3 * torch.sin(theta)
    return k, torch.randn(2, 3, 200, 8, generator=gen)


@pytest.mark.parametrize(("coding", "bits", "dtype"), list(RANDOM_DIGESTS))
def test_other_configurations_bytes_are_pinned(coding: str, bits: int, dtype: torch.dtype) -> None:
    """3-bit codes straddle bytes; interleaved partial rotary; bfloat16; four appends."""
    k, v = _random_kv(bits)
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=3,
        residual_tokens=5,
        group_tokens=8,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_dim=12,
        rotary_layout="interleaved",
        storage_dtype=dtype,
    )
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=3, head_dim=16, value_head_dim=8)
    for lo, hi in ((0, 50), (50, 51), (51, 120), (120, 200)):
        cache.append(k[:, :, lo:hi], v[:, :, lo:hi])
    assert storage_digest(cache) == RANDOM_DIGESTS[(coding, bits, dtype)]


# ---------------------------------------------------------------- padded (ragged) rows
def row_bytes(cache: PNMixCache, b: int) -> dict[str, torch.Tensor]:
    """Every used byte of sequence ``b`` (all its kv heads have equal counts in PN-Mix)."""
    s = cache.store
    ns, ng, nr = (int(a[b, 0]) for a in (s.sink_lengths, s.group_counts, s.residual_lengths))
    for a in (s.sink_lengths, s.group_counts, s.residual_lengths):
        assert (a[b] == a[b, 0]).all()
    out = {
        "sink_keys": s.sink_keys[b, :, :ns],
        "sink_values": s.sink_values[b, :, :ns],
        "key_codes": s.key_codes[b, :, :ng],
        "key_scalars": s.key_scalars[b, :, :ng],
        "value_codes": s.value_codes[b, :, :ng],
        "value_scalars": s.value_scalars[b, :, :ng],
        "residual_keys": s.residual_keys[b, :, :nr],
        "residual_values": s.residual_values[b, :, :nr],
    }
    if s.mask is not None and s.mask_rows[b].any():
        out["mask"] = s.mask[b]
    return {
        n: t.contiguous().view(torch.int16) if t.is_floating_point() else t for n, t in out.items()
    }


def assert_row_equals(batch: PNMixCache, b: int, alone: PNMixCache) -> None:
    x, y = row_bytes(batch, b), row_bytes(alone, 0)
    assert list(x) == list(y)
    for name in x:
        assert torch.equal(x[name], y[name]), name


@settings(max_examples=40, deadline=None)
@given(
    coding=st.sampled_from(CODINGS),
    bits=st.sampled_from([2, 3]),
    sink=st.sampled_from([0, 2]),
    residual=st.sampled_from([0, 3]),
    group=st.sampled_from([2, 4]),
    data=st.data(),
)
def test_padded_rows_store_exactly_what_each_row_stores_alone(
    coding: str, bits: int, sink: int, residual: int, group: int, data: st.DataObject
) -> None:
    """Appends of left-padded chunks (a row's real tokens last, its own count per append): each
    row's bytes equal a batch-1 cache fed that row's real tokens; pads (even NaN) never enter."""
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=sink,
        residual_tokens=residual,
        group_tokens=group,
        key_coding=coding,  # type: ignore[arg-type]
        rotary_dim=4,
    )
    b, h = 3, 2
    batch = PNMixCache(cfg, batch_size=b, num_key_value_heads=h, head_dim=6, value_head_dim=5)
    alone = [
        PNMixCache(cfg, batch_size=1, num_key_value_heads=h, head_dim=6, value_head_dim=5)
        for _ in range(b)
    ]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    for _ in range(data.draw(st.integers(1, 5))):
        t = data.draw(st.integers(0, 9))
        lengths = [data.draw(st.integers(0, t)) for _ in range(b)]
        k = torch.randn(b, h, t, 6, generator=gen)
        v = torch.randn(b, h, t, 5, generator=gen)
        for i, n in enumerate(lengths):
            k[i, :, : t - n] = float("nan")  # padding: never read
            v[i, :, : t - n] = float("inf")
            alone[i].append(k[i : i + 1, :, t - n :], v[i : i + 1, :, t - n :])
        batch.append(k, v, lengths)
    for i in range(b):
        assert_row_equals(batch, i, alone[i])
    expected = {name: sum(a.nbytes()[name] for a in alone) for name in alone[0].nbytes()}
    assert batch.nbytes() == expected
    assert batch.saliency_computations <= sum(a.saliency_computations for a in alone)
    if coding == "mix" and any(a.mix_mask is not None for a in alone):
        for i, a in enumerate(alone):
            if a.mix_mask is not None:
                assert torch.equal(batch.mix_mask[i], a.mix_mask[0])


def test_per_head_lengths_and_row_views() -> None:
    cfg = PNMixConfig(sink_tokens=1, residual_tokens=1, group_tokens=2)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=4)
    k = torch.randn(2, 2, 6, 4)
    cache.append(k, k, [[6, 2], [0, 5]])
    assert cache.seq_lengths.tolist() == [[6, 2], [0, 5]]
    assert cache.group_counts.tolist() == [[2, 0], [0, 1]]
    with pytest.raises(ValueError, match="different"):
        _ = cache.seq_length
    keys, _ = cache.dequantize()
    assert keys.shape == (2, 2, 6, 4)
    assert torch.equal(keys[0, 1, :2], k[0, 1, 4:].half().float())  # the sink and residual
    assert torch.equal(keys[0, 1, 2:], torch.zeros(4, 4))  # beyond the row: zeros
    assert torch.equal(keys[1, 0], torch.zeros(6, 4))


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([1, 2, 3], "shape"),
        ([[1, 2, 3]], "shape"),
        ([4, 0], "0..3"),
        ([-1, 0], "0..3"),
        ([1.0, 2.0], "integers"),
        ([True, False], "integers"),
    ],
)
def test_bad_lengths_are_refused_and_change_nothing(lengths: object, match: str) -> None:
    cache = PNMixCache(PNMixConfig(), batch_size=2, num_key_value_heads=2, head_dim=4)
    cache.append(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    before = (cache.nbytes(), cache.seq_lengths.tolist())
    with pytest.raises(ValueError, match=match):
        cache.append(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), lengths)
    assert (cache.nbytes(), cache.seq_lengths.tolist()) == before


# ---------------------------------------------------------------- capacity and bytes
def test_used_bytes_and_reserved_capacity() -> None:
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=4)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    k = torch.randn(1, 2, 80, 8)
    capacities = []
    for i in range(80):
        cache.append(k[:, :, i : i + 1], k[:, :, i : i + 1])
        capacities.append(cache.store.group_capacity)
        reserved = cache.reserved_bytes()
        assert reserved["key_codes"] >= cache.nbytes()["key_codes"]
        assert reserved["key_scalars"] >= cache.nbytes()["key_scales"]
    # 19 groups: capacities 4, 8, 16, 32 (doubling), so 3 reallocations for 19 flushes
    assert cache.num_groups == 19
    assert sorted(set(capacities)) == [0, 4, 8, 16, 32]
    nb = cache.nbytes()
    assert nb["key_codes"] == 19 * 2 * (4 * 8 * 2 // 8)
    assert nb["key_scales"] == 19 * 2 * 2 * 8 * 2
    assert nb["key_sink"] == 2 * 2 * 8 * 2 and nb["key_residual"] == 2 * 2 * 8 * 2
    assert cache.reserved_bytes()["key_codes"] == 32 * 2 * 8


def test_select_batch_of_padded_rows() -> None:
    cfg = PNMixConfig(sink_tokens=1, residual_tokens=1, group_tokens=2)
    cache = PNMixCache(cfg, batch_size=3, num_key_value_heads=2, head_dim=4)
    k, v = torch.randn(3, 2, 9, 4), torch.randn(3, 2, 9, 4)
    cache.append(k, v, [9, 4, 6])
    rows = [row_bytes(cache, i) for i in range(3)]
    lengths = cache.seq_lengths
    cache.select_batch(torch.tensor([2, 0, 2, 1]))
    assert cache.seq_lengths.tolist() == lengths[[2, 0, 2, 1]].tolist()
    for new, old in enumerate([2, 0, 2, 1]):
        got = row_bytes(cache, new)
        assert all(torch.equal(got[n], rows[old][n]) for n in rows[old])
    cache.append(torch.randn(4, 2, 3, 4), torch.randn(4, 2, 3, 4))  # decoding continues
    assert cache.seq_lengths[:, 0].tolist() == (lengths[[2, 0, 2, 1], 0] + 3).tolist()


# ---------------------------------------------------------------- host syncs and checks
SYNCS = ("item", "__bool__", "tolist", "__int__", "__float__")


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch):
    """Inside ``with no_host_sync():`` any read of a tensor value by Python raises."""

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync: a tensor value was read by Python")

    class Guard:
        def __enter__(self) -> None:
            for name in SYNCS:
                monkeypatch.setattr(torch.Tensor, name, forbidden)

        def __exit__(self, *exc: object) -> None:
            monkeypatch.undo()

    return Guard


@pytest.mark.parametrize("coding", CODINGS)
def test_decode_steps_read_nothing_back_from_the_device(coding: str, no_host_sync) -> None:
    """append(1 token, checks="deferred") + attention, flushes included, equal and padded rows."""
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=3, group_tokens=4, key_coding=coding)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    for lengths in (None, [20, 13]):
        cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
        cache.append(torch.randn(2, 2, 20, 8, generator=gen), torch.randn(2, 2, 20, 8), lengths)
        steps = [
            (torch.randn(2, 2, 1, 8, generator=gen), torch.randn(2, 4, 1, 8)) for _ in range(9)
        ]
        before = cache.group_counts
        with no_host_sync():
            for kv, q in steps:  # 9 steps: every row flushes at least two groups
                cache.append(kv, kv, checks="deferred")
                pnmix_attention(q, cache)
        assert (cache.group_counts - before).min() >= 2
        cache.check_values()


def test_deferred_checks_record_bad_values_and_raise_later() -> None:
    cfg = PNMixConfig(sink_tokens=1, residual_tokens=1, group_tokens=2)
    cache = PNMixCache(cfg, batch_size=1, num_key_value_heads=1, head_dim=4)
    cache.append(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4))
    cache.check_values()  # nothing pending: no error
    bad = torch.full((1, 1, 1, 4), 7e4)  # beyond float16
    cache.append(bad, bad, checks="deferred")
    assert cache.pending_check() is not None
    with pytest.raises(ValueError, match="bfloat16"):
        cache.check_values()
    cache.check_values()  # reported once
    cache.append(bad, bad, checks="deferred")
    with pytest.raises(ValueError, match="deferred"):  # an eager append reports it first
        cache.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="checks"):
        cache.append(bad, bad, checks="never")  # type: ignore[arg-type]


def test_deferred_flush_leaves_the_mask_to_the_host_later() -> None:
    """A mix mask computed by a deferred append is not read back: attention then decodes the
    second codec on every pair (same result); check_values brings the mask to the host."""
    cfg = PNMixConfig(sink_tokens=1, residual_tokens=1, group_tokens=4)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 12, 8, generator=gen)
    eager = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    deferred = PNMixCache(cfg, batch_size=1, num_key_value_heads=2, head_dim=8)
    eager.append(k, k)
    for i in range(12):
        deferred.append(k[:, :, i : i + 1], k[:, :, i : i + 1], checks="deferred")
    assert deferred.active_pairs() is None  # unknown on the host
    q = torch.randn(1, 2, 1, 8, generator=gen)
    assert torch.equal(pnmix_attention(q, eager), pnmix_attention(q, deferred))
    deferred.check_values()
    assert torch.equal(deferred.active_pairs(), eager.active_pairs())
    assert eager.active_pairs().numel() >= 1
    assert torch.equal(pnmix_attention(q, eager), pnmix_attention(q, deferred))


def test_streamed_ragged_appends_equal_one_shot_per_row() -> None:
    """The same real tokens arriving in different chunkings (and paddings) give equal bytes."""
    cfg = PNMixConfig(sink_tokens=2, residual_tokens=2, group_tokens=3)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 30, 8, generator=gen)
    one = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    one.append(k, k, [30, 17])
    streamed = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=8)
    cuts = [0, 4, 5, 11, 30]
    for lo, hi in itertools.pairwise(cuts):
        # row 1 holds the last 17 tokens of row 1's stream: left-pad what precedes them
        n1 = max(0, hi - max(lo, 13))
        streamed.append(k[:, :, lo:hi], k[:, :, lo:hi], np.array([hi - lo, n1]))
    for i in range(2):
        a, b = row_bytes(one, i), row_bytes(streamed, i)
        assert all(torch.equal(a[n], b[n]) for n in a)
