"""The kernel contract and the dispatch table (docs/design.md, "Kernels"): what
``PNMixCache.packed_kv`` hands a backend, which kernel of a backend runs a store, and the
split-K kernel's capability check (host metadata only). Nothing here needs ``triton``: the
table's checks live in triton-free modules; the Triton kernels themselves are tested against
the reference in test_triton.py and test_triton_splitk.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_checks import require_cpu_kernel

from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step
from kvlab.pnmix.codecs import KeyLayout
from kvlab.pnmix.kernels import cpu, dispatch
from kvlab.pnmix.kernels.dispatch import KERNELS, KernelEntry, kernel_entry
from kvlab.pnmix.kernels.spec import KernelKeyDecode
from kvlab.pnmix.kernels.splits import rotary_pairs_kind, splitk_unsupported
from kvlab.pnmix.reference import packed_attention_reference
from kvlab.pnmix.store import PackedKV


@pytest.fixture(autouse=True)
def _backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_PNMIX_BACKEND", raising=False)


def make_cache(
    coding: str = "mix", *, head: int = 32, group: int = 16, bits: int = 2, n: int = 70
) -> PNMixCache:
    """Two rows of ``n`` and ``n - 20`` tokens (padded), 2 kv heads, ``head`` channels."""
    cfg = PNMixConfig(
        bits=bits,
        sink_tokens=2,
        residual_tokens=3,
        group_tokens=group,
        key_coding=coding,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(head + group + bits)
    cache = PNMixCache(cfg, batch_size=2, num_key_value_heads=2, head_dim=head, device="cpu")
    keys = torch.randn(2, 2, n, head, generator=gen)
    cache.append(keys, torch.randn(2, 2, n, head, generator=gen), [n, n - 20])
    return cache


def test_packed_kv_views_the_store_and_copies_its_counts() -> None:
    """The contract: the store's own buffers (a kernel reads them in place; the fused decode
    step writes the residual there), copies of the host counts and offsets (a later append
    does not change a PackedKV taken before it)."""
    cache = make_cache()
    kv = cache.packed_kv()
    assert isinstance(kv, PackedKV)
    s = cache.store
    for name in ("sink_keys", "key_codes", "key_scalars", "value_codes", "residual_values"):
        assert getattr(kv, name) is getattr(s, name)
    assert np.array_equal(kv.seq_lengths, s.seq_lengths)
    assert torch.equal(kv.counts_tensor(), torch.from_numpy(s.counts))
    before = kv.residual_lengths.copy()
    cache.append(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32))
    assert np.array_equal(kv.residual_lengths, before)
    assert not np.array_equal(cache.packed_kv().residual_lengths, before)


def test_the_table_picks_a_backends_first_kernel_that_covers_the_store() -> None:
    """``"triton"``: the split-K kernel where it covers the store, else the older kernel
    (per-token keys, 3-bit codes, a head below 32 channels); ``"cpu"``: the C++ kernel, with
    the fused decode step. Deciding reads no tensor of the store."""
    covered = make_cache("mix")
    decode = covered.kernel_decode
    assert isinstance(decode, KernelKeyDecode)
    assert kernel_entry("triton", covered.packed_kv(), decode).name == "triton-splitk"
    assert kernel_entry("cpu", covered.packed_kv(), decode).name == "cpu"
    for cache in (make_cache("per_token"), make_cache(bits=3), make_cache(head=16)):
        kv, decode = cache.packed_kv(), cache.kernel_decode
        assert isinstance(decode, KernelKeyDecode)
        assert splitk_unsupported(kv, decode) is not None
        assert kernel_entry("triton", kv, decode).name == "triton-decode"
    assert dispatch.has_decode_step("cpu") and not dispatch.has_decode_step("triton")
    assert {e.backend for e in KERNELS} == set(dispatch.BACKENDS) - {"torch"}


def test_a_backend_without_a_covering_kernel_is_refused_with_each_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = make_cache()
    decode = cache.kernel_decode
    assert isinstance(decode, KernelKeyDecode)
    picky = KernelEntry(
        "triton", "picky", "kvlab.pnmix.kernels.cpu", "x", unsupported=lambda kv, d: "no"
    )
    monkeypatch.setattr(dispatch, "KERNELS", (picky,))
    with pytest.raises(ValueError, match=r"no 'triton' kernel runs this cache \(picky: no\)"):
        kernel_entry("triton", cache.packed_kv(), decode)
    with pytest.raises(ValueError, match=r"no 'cpu' kernel runs this cache \(none\)"):
        kernel_entry("cpu", cache.packed_kv(), decode)


def test_the_table_returns_the_function_as_its_module_holds_it_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel function is looked up when chosen (a replaced function is the one called);
    ``pnmix_attention`` hands it the store's PackedKV and the reference keys, and its result
    is the reference's to rounding."""
    require_cpu_kernel()
    cache = make_cache()
    decode = cache.kernel_decode
    assert isinstance(decode, KernelKeyDecode)
    assert dispatch.attention_kernel("cpu", cache.packed_kv(), decode) is cpu.packed_attention_cpu
    assert dispatch.decode_step_kernel("cpu", cache.packed_kv(), decode) is cpu.decode_step_cpu
    calls: list[PackedKV] = []
    original = cpu.packed_attention_cpu

    def spy(query: torch.Tensor, kv: PackedKV, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kv)
        return original(query, kv, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu, "packed_attention_cpu", spy)
    query = torch.randn(2, 4, 1, 32)
    out = pnmix_attention(query, cache, backend="cpu")
    assert len(calls) == 1 and calls[0].key_codes is cache.store.key_codes
    ref = packed_attention_reference(query, cache.packed_kv(), scale=32**-0.5)
    assert float((out - ref).abs().max()) < 1e-5
    # the fused decode step comes from the table too
    steps: list[int] = []
    step = cpu.decode_step_cpu
    monkeypatch.setattr(cpu, "decode_step_cpu", lambda *a, **k: steps.append(1) or step(*a, **k))
    k, v = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
    pnmix_decode_step(query, k, v, cache, backend="cpu")
    assert steps == [1]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotary_pairs_kind_reads_host_metadata_and_agrees_with_the_indices(layout: str) -> None:
    named = KeyLayout.for_rotary(32, 32, layout)
    assert named.rotary_layout == layout
    assert named.to("cpu").rotary_layout == layout
    unnamed = KeyLayout(32, named.first, named.second)  # no metadata: the indices are read
    assert rotary_pairs_kind(named) == rotary_pairs_kind(unnamed) == layout
    partial = KeyLayout.for_rotary(32, 16, layout)  # pairs do not cover the head
    assert rotary_pairs_kind(partial) is None
    swapped = KeyLayout(32, named.second, named.first)
    assert rotary_pairs_kind(swapped) is None
