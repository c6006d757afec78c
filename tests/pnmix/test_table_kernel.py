"""The compiled statistics of per-pair width tables (docs/design.md, "Per-pair tables",
"Flush") and the host greedy, against their torch references.

``table_distortion_cpu`` must give the bits of ``BitAllocCodec.table_distortion`` (float64
compared as bit patterns) over shapes, widths, bits, outlier fractions, both rotary layouts,
RoPE scalings, with and without queries and positions, on ordinary, tied, tiny and
out-of-range keys; where it declines (returns ``None``) the keys hold what it refuses (a
negative zero or a non-finite value). ``greedy_pair_bits`` on the host must give the widths of
its torch loop, ties, zeros and non-finite distortions included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import ROPE_SCALINGS, require_cpu_kernel

from kvlab.pnmix import BitAllocCodec
from kvlab.pnmix.bitalloc import greedy_pair_bits
from kvlab.pnmix.codecs import KeyLayout, TableStatistics
from kvlab.pnmix.kernels.cpu_tables import table_distortion_cpu
from kvlab.rope import RotaryConfig

F16 = torch.float16
DATA = ("normal", "normal", "normal", "ties", "signed-ties", "tiny", "specials", "huge")


def _keys(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float16 keys of a kind (see tests/pnmix/test_flush_kernel.py)."""
    if kind == "normal":
        x = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand((), generator=gen) * 6 - 3)
    elif kind in ("ties", "signed-ties"):
        levels = torch.tensor(
            [-1.0, 0.0, 0.5, 1.0, 2.0, *([-0.0] if kind == "signed-ties" else [])]
        )
        x = levels[torch.randint(0, len(levels), shape, generator=gen)]
    elif kind == "tiny":
        sign = torch.randint(0, 2, shape, generator=gen) * 2.0 - 1.0
        x = sign * (1.0 + torch.rand(shape, generator=gen) * 15.0) * 2.0**-24
    elif kind == "huge":
        x = torch.randn(shape, generator=gen) * 3e4
    else:
        x = torch.randn(shape, generator=gen)
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0])
        pick = torch.rand(shape, generator=gen) < 0.02
        x = torch.where(pick, specials[torch.randint(0, 6, shape, generator=gen)], x)
    return x.to(F16)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int64)


@pytest.fixture(autouse=True)
def _kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
    require_cpu_kernel()


@st.composite
def table_cases(draw: st.DrawFn) -> dict:
    bits = draw(st.sampled_from([2, 3, 4]))
    pairs = draw(st.integers(1, 8))
    return {
        "bits": bits,
        "pairs": pairs,
        "head_dim": 2 * pairs + draw(st.sampled_from([0, 0, 1, 3])),
        "layout": draw(st.sampled_from(["half", "interleaved"])),
        "tokens": draw(st.integers(2, 40)),
        "groups": draw(st.integers(1, 5)),
        "rows": draw(st.integers(1, 3)),
        "widths": draw(st.sampled_from([(0, 2, 3, 4), (1, bits, 8), (0, bits)])),
        "fraction": draw(st.sampled_from([0.0, 0.01, 0.05, 0.3])),
        "prerope": draw(st.booleans()),
        "query_aware": draw(st.booleans()),
        "queries": draw(st.booleans()),
        "scaling": draw(st.sampled_from(range(len(ROPE_SCALINGS)))),
        "data": draw(st.sampled_from(DATA)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=400, deadline=None)
@given(case=table_cases())
def test_compiled_table_distortion_equals_the_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    d, g, t, n = case["head_dim"], case["groups"], case["tokens"], min(case["rows"], case["groups"])
    rotary_dim = 2 * case["pairs"]
    codec = BitAllocCodec(
        case["bits"],
        widths=case["widths"],
        outlier_fraction=case["fraction"],
        prerope=case["prerope"],
        query_aware=case["query_aware"],
    )
    layout = KeyLayout.for_rotary(d, rotary_dim, case["layout"])
    rotary = RotaryConfig(
        head_dim=d,
        rotary_dim=rotary_dim,
        layout=case["layout"],
        scaling=ROPE_SCALINGS[case["scaling"]],
    )
    owner = torch.sort(torch.cat([torch.arange(n), torch.randint(0, n, (g - n,), generator=gen)]))
    moment = None
    if case["queries"]:
        q = torch.randn(n, 5, d, generator=gen, dtype=torch.float64)
        moment = q.transpose(-1, -2) @ q / 5
    stats = TableStatistics(
        keys=_keys(case["data"], (g, t, d), gen),
        owner=owner.values,
        first=torch.arange(n),
        storage_dtype=F16,
        layout=layout,
        moment=moment,
        positions=torch.randint(0, 100_000, (g, t), generator=gen) if case["prerope"] else None,
        rotary=rotary,
    )
    got = table_distortion_cpu(codec, stats)
    want = codec.table_distortion(stats)
    if got is None:  # declined: only for what the kernel refuses
        keys = stats.keys
        assert bool((~torch.isfinite(keys)).any() or ((keys == 0) & torch.signbit(keys)).any())
        return
    assert got.shape == want.shape == (len(codec.widths), n, layout.num_pairs)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(codec.table_from_distortion(got), codec.compute_table(stats))


def test_compiled_table_distortion_refuses_bad_input() -> None:
    codec = BitAllocCodec(2)
    layout = KeyLayout.for_rotary(8, 8)
    keys = torch.zeros(1, 4, 8, dtype=torch.float32)
    stats = TableStatistics(
        keys=keys, owner=torch.zeros(1, dtype=torch.int64), first=torch.zeros(1), storage_dtype=F16,
        layout=layout,
    )  # fmt: skip
    with pytest.raises(ValueError, match="float16"):
        table_distortion_cpu(codec, stats)
    with pytest.raises(ValueError, match="no per-pair table"):
        table_distortion_cpu(BitAllocCodec(2, widths=(2,)), stats)


@st.composite
def distortions(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, ...], int]:
    widths = draw(st.sampled_from([(0, 2, 3, 4), (0, 1, 2, 3, 4, 8), (2,), (1, 3), (0, 4)]))
    avg = draw(st.integers(widths[0], widths[-1]))
    shape = (len(widths), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(0, 9)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "ties", "special"]))
    if kind == "normal":
        dist = torch.rand(shape, generator=gen, dtype=torch.float64).cumsum(0).flip(0)
    elif kind == "ties":
        dist = torch.randint(0, 3, shape, generator=gen).double()
    else:
        dist = torch.randn(shape, generator=gen, dtype=torch.float64)
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
        pick = torch.rand(shape, generator=gen) < 0.2
        dist = torch.where(pick, specials[torch.randint(0, 5, shape, generator=gen)].double(), dist)
    return dist, widths, avg


@settings(max_examples=300, deadline=None)
@given(case=distortions())
def test_host_greedy_equals_the_torch_loop(case) -> None:
    dist, widths, avg = case
    outcomes = []
    for on_host in (True, False):
        try:
            outcomes.append(greedy_pair_bits(dist, widths, avg, on_host=on_host))
        except IndexError:  # both: an infinite gain can step a pair past the last width
            outcomes.append(None)
    host, loop = outcomes
    if loop is None:
        assert host is None and not bool(torch.isfinite(dist).all())
        return
    assert host is not None and host.dtype == loop.dtype == torch.int64
    assert torch.equal(host, loop)


def test_pn_mix_prefill_tables_run_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill of the ``pn-mix`` configuration computes its rows' width tables with the
    compiled statistics (no silent fallback) and stores the bytes of the torch codecs."""
    import kvlab.pnmix.cache_flush as cache_module
    from kvlab.pnmix import PNMixCache, PNMixConfig

    config = PNMixConfig(
        bits=2,
        key_coding="bit_alloc",
        group_tokens=32,
        key_outlier_fraction=0.01,
        value_coding="hadamard",
    )
    rotary = RotaryConfig(head_dim=64, base=100000.0)
    calls = []
    compiled = cache_module.table_terms_cpu

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = compiled(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cache_module, "table_terms_cpu", spy)
    stores = []
    for env in ("torch", None):
        if env is None:
            monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)
        else:
            monkeypatch.setenv("KVLAB_PNMIX_BACKEND", env)
        gen = torch.Generator().manual_seed(2)
        cache = PNMixCache(config, batch_size=2, num_key_value_heads=3, head_dim=64, rotary=rotary)
        cache.append(
            torch.randn(2, 3, 300, 64, generator=gen) * 3,
            torch.randn(2, 3, 300, 64, generator=gen),
            queries=torch.randn(2, 9, 300, 64, generator=gen),
        )
        stores.append((cache.store.key_codes.clone(), cache.store.key_scalars.clone()))
        stores.append(cache.pair_table.clone())
    assert calls == [True]  # KVLAB_PNMIX_BACKEND=torch: the reference; else the kernel
    assert torch.equal(stores[0][0], stores[2][0]) and torch.equal(stores[0][1], stores[2][1])
    assert torch.equal(stores[1], stores[3])


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 3),
    queries=st.integers(1, 50),
    pairs=st.integers(1, 6),
    layout=st.sampled_from(["half", "interleaved"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_query_pair_moment_is_the_moments_pair_entries(rows, queries, pairs, layout, seed) -> None:
    """The pair entries of ``E[q q^T]`` without the ``D x D`` product: ``pair_moment_entries``
    reads them exactly; ``query_pair_moment`` sums them itself (float64 rounding apart)."""
    from kvlab.pnmix.bitalloc import pair_moment_entries
    from kvlab.pnmix.key_codec import query_pair_moment

    gen = torch.Generator().manual_seed(seed)
    d = 2 * pairs + 1
    lay = KeyLayout.for_rotary(d, 2 * pairs, layout)
    q = torch.randn(rows, queries, d, generator=gen, dtype=torch.float64)
    count = torch.full((rows,), float(queries), dtype=torch.float64)
    full = q.transpose(-1, -2) @ q / queries
    entries = pair_moment_entries(full, lay.first, lay.second)
    f, s = lay.first, lay.second
    assert torch.equal(entries[:, 0], full[:, f, f]) and torch.equal(entries[:, 2], full[:, f, s])
    assert torch.equal(entries[:, 1], full[:, s, s])
    qa, qb = lay.pair_channels(q)
    assert torch.equal(qa, q[..., lay.first]) and torch.equal(qb, q[..., lay.second])
    got = query_pair_moment(q, lay, count)
    torch.testing.assert_close(got, entries, rtol=1e-12, atol=1e-12)
