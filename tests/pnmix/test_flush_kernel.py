"""The compiled group flush (docs/design.md, "Kernels", "Flush") against the torch reference.

``encode_groups_cpu`` must store exactly the bytes the torch codecs store (``PNMixCache``'s
reference path: ``rotate_by_delta`` to the pre-RoPE frame, ``BitAllocCodec.encode_groups`` and
``pack``, the value codec's ``encode`` and ``pack_codes``): compared byte for byte (float16
buffers as their bit patterns, so that ``-0.0`` and ``0.0`` differ) over shapes, widths, bits,
outlier fractions, both rotary layouts, RoPE scalings, value codecs and input dtypes, on
ordinary, tied, tiny and out-of-range data. Where it declines (returns ``None``) the input must
hold what it refuses (a negative zero or non-finite frame key or value, or a stored scalar that
would not be finite). Then whole caches, one flushing with the torch codecs
(``KVLAB_PNMIX_BACKEND=torch``) and one with the kernel, must hold the same bytes in every
buffer after the same appends.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import ROPE_SCALINGS, require_cpu_kernel

import kvlab.pnmix.cache_flush as cache_module
from kvlab.pnmix import BitAllocCodec, PNMixCache, PNMixConfig
from kvlab.pnmix.codecs import KeyLayout
from kvlab.pnmix.kernels import cpu
from kvlab.pnmix.kernels.dispatch import select_flush_backend
from kvlab.pnmix.packing import pack_codes
from kvlab.pnmix.store import EncodedGroups
from kvlab.pnmix.values import HadamardValueCodec, PerTokenValueCodec, ValueCodec
from kvlab.rope import RotaryConfig, rotate_by_delta

F16 = torch.float16
# ordinary data most often; the others probe ties, rounding to zero, specials and overflow
DATA = ("normal", "normal", "normal", "ties", "signed-ties", "tiny", "specials", "huge")


@pytest.fixture(autouse=True)
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
    require_cpu_kernel()


def _bytes(x: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's bytes (bit patterns: ``-0.0 != 0.0``, NaNs compare by payload)."""
    return None if x is None else x.contiguous().view(torch.uint8)


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _data(
    kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Random float tensors of a kind (rounded to ``dtype``): ``normal`` (a random scale),
    ``ties`` (few distinct values; ``signed-ties`` with ``-0.0`` among them), ``tiny`` (float16
    subnormals), ``specials`` (normal with signed zeros, ±inf, NaN and ±65504 sprinkled in),
    ``huge`` (near float16's largest values: rotations and Hadamard sums overflow)."""
    if kind == "normal":
        scale = 10.0 ** (torch.rand((), generator=gen).item() * 6 - 3)
        x = torch.randn(shape, generator=gen) * scale
    elif kind in ("ties", "signed-ties"):
        signed = [-0.0] if kind == "signed-ties" else []
        levels = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, *signed])
        x = levels[torch.randint(0, len(levels), shape, generator=gen)]
    elif kind == "tiny":  # float16 subnormals, none rounding to zero
        sign = torch.randint(0, 2, shape, generator=gen) * 2.0 - 1.0
        x = sign * (1.0 + torch.rand(shape, generator=gen) * 15.0) * 2.0**-24
    elif kind == "huge":
        x = torch.randn(shape, generator=gen) * 3e4
    else:
        x = torch.randn(shape, generator=gen)
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0])
        pick = torch.rand(shape, generator=gen) < 0.02
        fill = specials[torch.randint(0, len(specials), shape, generator=gen)]
        x = torch.where(pick, fill, x)
    return x.to(dtype)


def _random_table(
    n: int, p: int, widths: tuple[int, ...], bits: int, gen: torch.Generator
) -> torch.Tensor:
    """Width tables ``[n, p]`` from ``widths`` within the budget ``sum <= bits * p``."""
    allowed = torch.tensor(widths, dtype=torch.int64)
    table = allowed[torch.randint(0, len(widths), (n, p), generator=gen)]
    for row in table:
        while int(row.sum()) > bits * p:
            j = int(torch.randint(0, p, (), generator=gen))
            lower = allowed[allowed < row[j]]
            if lower.numel():
                row[j] = lower[-1]
    return table.to(torch.uint8)


def _reference(
    keys: torch.Tensor,
    values: torch.Tensor,
    codec: BitAllocCodec,
    value_codec: ValueCodec,
    layout: KeyLayout,
    table: torch.Tensor | None,
    positions: torch.Tensor | None,
    rotary: RotaryConfig | None,
) -> tuple[EncodedGroups, torch.Tensor]:
    """The torch path of ``PNMixCache._encode``: the coded groups and the frame keys."""
    n = keys.shape[0]
    frame = keys
    if positions is not None:
        assert rotary is not None
        frame = rotate_by_delta(keys, -positions, rotary).to(F16)
    coded = codec.encode_groups(frame, F16, layout, table)
    vcodes, vscalars = value_codec.encode(values, F16)
    enc = EncodedGroups(
        codec.pack(coded.codes, layout, table),
        coded.scalars,
        pack_codes(vcodes.reshape(n, -1), value_codec.bits, check=False),
        vscalars,
        coded.payload if coded.payload.shape[-1] else None,
    )
    return enc, frame


def _refused(x: torch.Tensor) -> bool:
    """Holds a value the kernel refuses: not finite, or a negative zero."""
    neg_zero = (x == 0) & torch.signbit(x)
    return bool((~torch.isfinite(x)).any() or neg_zero.any())


@st.composite
def flush_cases(draw: st.DrawFn) -> dict:
    bits = draw(st.sampled_from([2, 3, 4]))
    pairs = draw(st.integers(1, 8))
    head_dim = 2 * pairs + draw(st.sampled_from([0, 0, 1, 3]))
    widths = draw(st.sampled_from([(0, 2, 3, 4), (bits,), (1, bits, 8)]))
    hadamard = draw(st.booleans())
    return {
        "bits": bits,
        "pairs": pairs,
        "head_dim": head_dim,
        "layout": draw(st.sampled_from(["half", "interleaved"])),
        "tokens": draw(st.integers(2, 40)),
        "groups": draw(st.integers(1, 4)),
        "widths": widths,
        "fraction": draw(st.sampled_from([0.0, 0.01, 0.05, 0.3])),
        "prerope": draw(st.booleans()),
        "scaling": draw(st.sampled_from(range(len(ROPE_SCALINGS)))),
        "value_dim": draw(st.sampled_from([1, 2, 8, 32, 64]) if hadamard else st.integers(1, 20)),
        # value channels per scale/zero: a divisor of value_dim is kept, others mean one group
        "value_group": draw(st.sampled_from([None, None, 1, 2, 4, 8, 16, 64])),
        "hadamard": hadamard,
        "dtype": draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        "key_data": draw(st.sampled_from(DATA)),
        "value_data": draw(st.sampled_from(DATA)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=500, deadline=None)
@given(case=flush_cases())
def test_compiled_flush_bytes_equal_the_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    bits, d, n, t = case["bits"], case["head_dim"], case["groups"], case["tokens"]
    rotary_dim = 2 * case["pairs"]
    codec = BitAllocCodec(
        bits,
        widths=case["widths"],
        outlier_fraction=case["fraction"],
        prerope=case["prerope"],
    )
    c = case["value_group"]
    c = c if c is not None and case["value_dim"] % c == 0 else None
    value_codec: ValueCodec = (
        HadamardValueCodec(bits, c) if case["hadamard"] else PerTokenValueCodec(bits, c)
    )
    layout = KeyLayout.for_rotary(d, rotary_dim, case["layout"])
    rotary = RotaryConfig(
        head_dim=d,
        rotary_dim=rotary_dim,
        base=10000.0,
        layout=case["layout"],
        scaling=ROPE_SCALINGS[case["scaling"]],
    )
    keys = _data(case["key_data"], (n, t, d), case["dtype"], gen).to(F16)
    values = _data(case["value_data"], (n, t, case["value_dim"]), case["dtype"], gen).to(F16)
    table = (
        _random_table(n, layout.num_pairs, codec.widths, bits, gen) if codec.table_bits else None
    )
    positions = torch.randint(0, 100_000, (n, t), generator=gen) if case["prerope"] else None
    got = cpu.encode_groups_cpu(
        keys,
        values,
        codec=codec,
        value_codec=value_codec,
        layout=layout,
        table=table,
        positions=positions,
        rotary=rotary,
    )
    want, frame = _reference(keys, values, codec, value_codec, layout, table, positions, rotary)
    if got is None:  # declined: only for what the kernel refuses
        frame_values = value_codec.frame(values, F16)
        assert (
            _refused(frame)
            or _refused(values)
            or _refused(frame_values)
            or not bool(torch.isfinite(want.key_scalars).all())
            or not bool(torch.isfinite(want.value_scalars).all())
        )
        return
    assert bool(torch.isfinite(frame).all())
    for name, a, b in zip(EncodedGroups._fields, got, want, strict=True):
        assert _same_bytes(a, b), name


def test_ordinary_pn_mix_flushes_are_never_declined() -> None:
    """The ``pn-mix`` coding (2 bits, widths 0/2/3/4, 1 % outliers, pre-RoPE, Hadamard
    values) on ordinary keys: the kernel codes every flush (no silent fallback), bit-equal."""
    gen = torch.Generator().manual_seed(0)
    codec = BitAllocCodec(2, outlier_fraction=0.01)
    layout = KeyLayout.for_rotary(64, 64)
    rotary = RotaryConfig(head_dim=64, base=100000.0)
    for step in range(20):
        keys = (torch.randn(3, 32, 64, generator=gen) * 4).to(F16)
        values = torch.randn(3, 32, 64, generator=gen).to(F16)
        table = _random_table(3, 32, codec.widths, 2, gen)
        positions = 32 * step + torch.arange(96).reshape(3, 32)
        args = (codec, HadamardValueCodec(2), layout, table, positions, rotary)
        got = cpu.encode_groups_cpu(
            keys,
            values,
            codec=codec,
            value_codec=HadamardValueCodec(2),
            layout=layout,
            table=table,
            positions=positions,
            rotary=rotary,
        )
        assert got is not None
        want, _ = _reference(keys, values, *args)
        assert all(_same_bytes(a, b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------ whole caches


def _store_bytes(cache: PNMixCache) -> dict[str, object]:
    s = cache.store
    out: dict[str, object] = {}
    for name in (
        "sink_keys",
        "sink_values",
        "residual_keys",
        "residual_values",
        "key_codes",
        "key_scalars",
        "value_codes",
        "value_scalars",
        "key_payload",
        "mask",
    ):
        x = getattr(s, name)
        out[name] = None if x is None else _bytes(x).clone()
    out["counts"] = s.counts.copy()
    out["mask_rows"] = s.mask_rows.copy()
    out["position_offsets"] = s.position_offsets.copy()
    out["table"] = None if cache.pair_table is None else cache.pair_table.clone()
    return out


def _same_stores(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name  # type: ignore[arg-type]
        elif x is None:
            assert y is None, name
        else:
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), name  # type: ignore[arg-type]


@st.composite
def cache_cases(draw: st.DrawFn) -> dict:
    coding, fraction = draw(
        st.sampled_from(
            [
                ("bit_alloc", 0.01),
                ("bit_alloc", 0.0),
                ("bit_alloc", 0.05),
                ("prerope_cartesian", 0.05),
                ("cartesian", 0.05),
            ]
        )
    )
    return {
        "bits": draw(st.sampled_from([2, 3, 4])),
        "coding": coding,
        "fraction": fraction,
        "value_coding": draw(st.sampled_from(["hadamard", "per_token"])),
        "value_group_channels": draw(st.sampled_from([None, None, 4, 8])),  # divide head_dim
        "group_tokens": draw(st.sampled_from([2, 4, 8, 32])),
        "sink_tokens": draw(st.sampled_from([0, 3])),
        "residual_tokens": draw(st.sampled_from([0, 5])),
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([8, 16, 32])),
        "partial": draw(st.booleans()),
        "layout": draw(st.sampled_from(["half", "interleaved"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "prefill": draw(st.integers(0, 70)),
        "steps": draw(st.integers(0, 40)),
        "chunks": draw(st.lists(st.integers(1, 20), max_size=3)),
        "padded": draw(st.booleans()),
        "offsets": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _run(case: dict, env: str | None, monkeypatch: pytest.MonkeyPatch) -> PNMixCache:
    if env is None:
        monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
    else:
        monkeypatch.setenv("KVLAB_PNMIX_BACKEND", env)
    gen = torch.Generator().manual_seed(case["seed"])
    b, h, d = case["batch"], case["heads"], case["head_dim"]
    rotary_dim = d // 2 if case["partial"] else d
    config = PNMixConfig(
        bits=case["bits"],
        key_coding=case["coding"],
        key_outlier_fraction=case["fraction"],
        value_coding=case["value_coding"],
        value_group_channels=case["value_group_channels"],
        group_tokens=case["group_tokens"],
        sink_tokens=case["sink_tokens"],
        residual_tokens=case["residual_tokens"],
        rotary_dim=rotary_dim,
        rotary_layout=case["layout"],
    )
    rotary = RotaryConfig(head_dim=d, rotary_dim=rotary_dim, layout=case["layout"])
    cache = PNMixCache(config, batch_size=b, num_key_value_heads=h, head_dim=d, rotary=rotary)
    if case["offsets"] and cache.codec.position_aware:
        cache.set_position_offsets(torch.randint(0, 5_000, (b, h), generator=gen).numpy())

    def kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.randn(b, h, tokens, d, generator=gen) * 3
        values = torch.randn(b, h, tokens, d, generator=gen)
        return keys.to(case["dtype"]), values.to(case["dtype"])

    if case["prefill"]:
        keys, values = kv(case["prefill"])
        lengths = None
        if case["padded"]:
            lengths = torch.randint(0, case["prefill"] + 1, (b,), generator=gen).tolist()
        queries = torch.randn(b, 2 * h, case["prefill"], d, generator=gen)
        cache.append(keys, values, lengths, queries=queries)
    for _ in range(case["steps"]):
        cache.append(*kv(1), checks="deferred", queries=torch.randn(b, 2 * h, 1, d, generator=gen))
    for tokens in case["chunks"]:
        cache.append(*kv(tokens))
    cache.check_values()
    return cache


@settings(max_examples=60, deadline=None)
@given(case=cache_cases())
def test_caches_store_the_same_bytes_with_the_compiled_flush(case: dict) -> None:
    with pytest.MonkeyPatch.context() as mp:
        calls = {"coded": 0}
        compiled = cache_module.encode_groups_cpu

        def spy(*args: object, **kwargs: object) -> EncodedGroups | None:
            out = compiled(*args, **kwargs)  # type: ignore[arg-type]
            calls["coded"] += out is not None
            return out

        mp.setattr(cache_module, "encode_groups_cpu", spy)
        reference = _store_bytes(_run(case, "torch", mp))
        assert calls["coded"] == 0  # KVLAB_PNMIX_BACKEND=torch: the torch codecs
        fast = _run(case, None, mp)
        _same_stores(reference, _store_bytes(fast))
        if not fast.codec.table_bits and int(fast.group_counts.sum()):
            # without per-pair tables every flush of ordinary data is coded by the kernel
            assert calls["coded"] > 0


def test_pn_mix_decode_flushes_run_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill and a decode loop of the ``pn-mix`` method's configuration: every flush is
    coded by the kernel (the prefill's after its row tables are computed), and the store
    equals the reference's."""
    config = PNMixConfig(
        bits=2,
        key_coding="bit_alloc",
        group_tokens=32,
        key_outlier_fraction=0.01,
        value_coding="hadamard",
    )
    rotary = RotaryConfig(head_dim=64, base=100000.0)
    calls = {"coded": 0}
    compiled = cpu.encode_groups_cpu

    def spy(*args: object, **kwargs: object) -> EncodedGroups | None:
        out = compiled(*args, **kwargs)  # type: ignore[arg-type]
        calls["coded"] += out is not None
        return out

    monkeypatch.setattr(cache_module, "encode_groups_cpu", spy)
    stores = []
    counted = []
    for env in ("torch", None):
        if env is None:
            monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
        else:
            monkeypatch.setenv("KVLAB_PNMIX_BACKEND", env)
        calls["coded"] = 0
        gen = torch.Generator().manual_seed(1)
        cache = PNMixCache(config, batch_size=1, num_key_value_heads=3, head_dim=64, rotary=rotary)
        cache.append(
            torch.randn(1, 3, 512, 64, generator=gen),
            torch.randn(1, 3, 512, 64, generator=gen),
            queries=torch.randn(1, 9, 512, 64, generator=gen),
        )
        for _ in range(96):
            cache.append(
                torch.randn(1, 3, 1, 64, generator=gen),
                torch.randn(1, 3, 1, 64, generator=gen),
                checks="deferred",
            )
        cache.check_values()
        stores.append(_store_bytes(cache))
        counted.append(calls["coded"])
    _same_stores(stores[0], stores[1])
    assert counted == [0, 4]  # the prefill's flush; decode flushes at 544, 576 and 608 tokens


def test_flush_dispatch() -> None:
    codec = BitAllocCodec(2, outlier_fraction=0.01)
    assert cpu.flush_unsupported(codec, HadamardValueCodec(2), F16, 32, 64) is None
    assert cpu.flush_unsupported(codec, PerTokenValueCodec(2), F16, 32, 64) is None
    assert "bfloat16" in str(
        cpu.flush_unsupported(codec, HadamardValueCodec(2), torch.bfloat16, 32, 64)
    )
    mix = PNMixConfig(key_coding="mix").key_codec
    assert "BitAllocCodec" in str(cpu.flush_unsupported(mix, PerTokenValueCodec(2), F16, 32, 64))

    class Subclass(BitAllocCodec):
        pass

    assert cpu.flush_unsupported(Subclass(2), PerTokenValueCodec(2), F16, 32, 64) is not None
    assert cpu.flush_unsupported(codec, PerTokenValueCodec(2), F16, 16384, 64) is not None
    assert select_flush_backend(torch.device("cpu")) == "cpu"
    assert select_flush_backend(torch.device("meta")) == "torch"


def test_flush_dispatch_follows_the_backend_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "torch")
    assert select_flush_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "cpu")
    assert select_flush_backend(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("KVLAB_PNMIX_BACKEND", "fast")
    with pytest.raises(ValueError, match="KVLAB_PNMIX_BACKEND"):
        select_flush_backend(torch.device("cpu"))


def test_encode_groups_refuses_bad_buffers() -> None:
    """One clear error for buffers the kernel cannot read (the cache never passes them)."""
    module = cpu.load()
    assert module is not None
    layout = KeyLayout.for_rotary(8, 8)
    empty = torch.empty(0)
    good = torch.zeros(2, 4, 8, dtype=F16)
    args = (empty, empty, layout.first, layout.second, empty, good, 2, 0, False, empty, 1)
    with pytest.raises(RuntimeError, match="float16"):
        module.encode_groups(good.float(), *args)
    with pytest.raises(RuntimeError, match="outliers"):
        module.encode_groups(good, *args[:7], 32, False, empty, 1)
    with pytest.raises(RuntimeError, match="power-of-two"):
        module.encode_groups(good, *args[:5], torch.zeros(2, 4, 6, dtype=F16), 2, 0, True, empty, 1)
    bad_widths = torch.full((2, 4), 9, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="widths"):
        module.encode_groups(good, *args[:4], bad_widths, *args[5:])
    for index in (torch.tensor([[3, 1], [0, 2]]), torch.tensor([[0, 32], [0, 1]])):
        with pytest.raises(RuntimeError, match="outlier_index"):
            module.encode_groups(good, *args[:7], 2, False, index.to(torch.int32), 1)
    for groups in (0, 3, 16):  # value channel groups must divide the 8 value channels
        with pytest.raises(RuntimeError, match="value groups must divide"):
            module.encode_groups(good, *args[:10], groups)
