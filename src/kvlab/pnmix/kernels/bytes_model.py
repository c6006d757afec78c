"""Bytes one packed decode step must read, and the time that implies at a memory bandwidth
(docs/benchmarks.md, "Decode bytes model").

A decode step of one layer (one query token per sequence) reads every stored byte of the
cache once — codes, per-group scalars, the per-pair tables, the outliers' sparse side table,
the exact sink and residual tokens — plus the queries, and writes the output. A
bandwidth-bound kernel cannot beat ``bytes / bandwidth``; float16 SDPA over the exact cache
reads ``2 * B * H_kv * T * D * 2`` bytes (keys and values). This module counts those bytes in
closed form from a coding's description (:class:`Coding`), independently of the codec classes,
so tests can hold it to what a filled :class:`~kvlab.pnmix.cache.PNMixCache` stores
(``nbytes()``).

The whole model's step on the CPU (:class:`ModelStepBytes`, docs/benchmarks.md, "Decode on the
CPU against the bytes limit"): one decode step of a decoder reads its weights once (every
parameter but the input embedding, of which it reads one row per sequence), every stored byte
of the cache, and the tables a kernel reads besides (PN-Mix: the cos/sin rows of a pre-RoPE
coding, the Hadamard matrix). The speed-up over another method that bytes alone allow is the
ratio of the two totals (:meth:`ModelStepBytes.limit_over`): what a decode bound by memory
bandwidth would reach.

Token accounting (docs/design.md, "Flush rule"): a row of ``n`` tokens keeps
``s = min(n, S)`` sinks; of the rest, ``G = max(0, (n - s - R) // T)`` full groups are
quantized and the remaining ``n - s - G * T`` tokens (``R .. R + T - 1`` once a group has
flushed) stay exact in the residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = [
    "CODINGS",
    "H200_BANDWIDTH",
    "MODEL_SHAPES",
    "PEAK_BANDWIDTH",
    "Coding",
    "DecodeBytes",
    "ModelStepBytes",
    "decode_bytes",
    "decode_weight_bytes",
    "dense_cache_bytes",
    "pnmix_table_bytes",
    "sdpa_fp16_bytes",
    "token_split",
]

#: H200 SXM HBM3e peak bandwidth, bytes per second (4.8 TB/s).
H200_BANDWIDTH = 4.8e12
#: Peak memory bandwidths (bytes/s) by a substring of ``torch.cuda.get_device_name``; the
#: first match wins (vendor figures).
PEAK_BANDWIDTH: dict[str, float] = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "A10G": 0.6e12,
}
#: Attention shapes of the benchmarked models: (query heads, kv heads, head_dim).
MODEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "smollm2-135m": (9, 3, 64),
    "qwen2.5-1.5b": (12, 2, 128),
}


@dataclass(frozen=True)
class Coding:
    """A PN-Mix cache coding as the bytes model sees it.

    Attributes:
        name: a label.
        bits: code width of keys and values (the width layout's mean width).
        group_tokens: ``T``.
        sink_tokens, residual_tokens: ``S``, ``R``.
        storage_bytes: bytes of one storage-dtype element (float16 / bfloat16: 2).
        key_scalars_per_channel: storage scalars per key channel and group (scale and zero,
            or span and offset: 2); 0 with ``key_scalars_per_token``.
        key_scalars_per_token: storage scalars per token and group (per-token keys: 2).
        table_bits: bits per (kv head, rotary pair) entry of the per-sequence table (a mix's
            mask: 1; per-pair widths {0, 2, 3, 4}: 2; none: 0).
        outlier_fraction: fraction of a group's key elements kept exact (value + int16
            index each).
        prerope: keys are coded before RoPE (the kernel rotates them: reads cos/sin of every
            position and rotary pair unless it computes them in registers).
        hadamard_values: values coded in the Hadamard frame (the kernel reads ``H``, ``Dv²``
            float32).
    """

    name: str
    bits: int = 2
    group_tokens: int = 128
    sink_tokens: int = 32
    residual_tokens: int = 32
    storage_bytes: int = 2
    key_scalars_per_channel: int = 2
    key_scalars_per_token: int = 0
    table_bits: int = 0
    outlier_fraction: float = 0.0
    prerope: bool = False
    hadamard_values: bool = False
    notes: str = field(default="", compare=False)


#: The codings of docs/benchmarks.md: the seed layout (PNMixConfig defaults), the ``pn-mix``
#: method (kvlab.evaluation.methods), ``kivi-2bit``.
CODINGS: dict[str, Coding] = {
    "seed": Coding("seed", table_bits=1, notes="2-bit Cartesian/Phase-Norm mix, groups of 128"),
    "pn-mix": Coding(
        "pn-mix",
        group_tokens=32,
        table_bits=2,
        outlier_fraction=0.01,
        prerope=True,
        hadamard_values=True,
        notes="pre-RoPE per-pair widths 0/2/3/4, 1% outliers, Hadamard values, groups of 32",
    ),
    "kivi-2bit": Coding("kivi-2bit", group_tokens=32, notes="per-channel keys, groups of 32"),
}


def token_split(n: int, coding: Coding) -> tuple[int, int, int]:
    """``(sinks, quantized groups, residual tokens)`` of a row of ``n`` tokens (module
    docstring). Raises ``ValueError`` for a negative ``n``."""
    if n < 0:
        raise ValueError(f"tokens must be >= 0, got {n}")
    s = min(n, coding.sink_tokens)
    groups = max(0, (n - s - coding.residual_tokens) // coding.group_tokens)
    return s, groups, n - s - groups * coding.group_tokens


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes of one decode step by component (all rows together), and derived totals.

    ``key_codes``, ``value_codes``: packed codes; ``key_scalars``, ``value_scalars``:
    per-group storage scalars; ``tables``: the per-sequence per-pair table (packed);
    ``outliers``: exact sparse key entries; ``exact``: sink and residual keys and values;
    ``rope_tables``: float32 cos/sin of every (position, rotary pair) a pre-RoPE kernel reads
    (shared by the rows of a batch at equal offsets: counted once); ``hadamard``: the ``Dv²``
    float32 matrix; ``queries``, ``output``: float16 query in, float32 output out;
    ``partials``: split-K ``(m, l, acc)`` float32 partials written and read once
    (``splits`` per row).
    """

    key_codes: int
    value_codes: int
    key_scalars: int
    value_scalars: int
    tables: int
    outliers: int
    exact: int
    rope_tables: int
    hadamard: int
    queries: int
    output: int
    partials: int

    @property
    def cache(self) -> int:
        """The stored cache's bytes (what ``PNMixCache.persistent_bytes`` counts)."""
        return (
            self.key_codes
            + self.value_codes
            + self.key_scalars
            + self.value_scalars
            + self.tables
            + self.outliers
            + self.exact
        )

    @property
    def total(self) -> int:
        """Everything one step moves: the cache, tables, queries, output and partials."""
        return (
            self.cache
            + self.rope_tables
            + self.hadamard
            + self.queries
            + self.output
            + (self.partials)
        )

    def as_dict(self) -> dict[str, int]:
        """Components and the two totals, bytes."""
        out = {k: int(getattr(self, k)) for k in self.__dataclass_fields__}
        out["cache"] = self.cache
        out["total"] = self.total
        return out


def _outliers_per_group(coding: Coding, head_dim: int) -> int:
    # round half to even, as Python's round (kvlab.pnmix.outliers.outlier_count)
    return round(coding.outlier_fraction * coding.group_tokens * head_dim)


def decode_bytes(
    coding: Coding | str,
    *,
    batch: int,
    kv_heads: int,
    query_heads: int,
    head_dim: int,
    tokens: int,
    value_head_dim: int | None = None,
    group_tokens: int | None = None,
    rotary_dim: int | None = None,
    splits: int = 0,
    query_bytes: int = 2,
) -> DecodeBytes:
    """Bytes one decode step (one query token per sequence, every row ``tokens`` long) reads
    and writes for ``coding`` (a :class:`Coding` or a :data:`CODINGS` name).

    Args:
        batch, kv_heads, query_heads, head_dim: ``B``, ``H_kv``, ``H_q``, ``D``.
        tokens: context tokens per sequence.
        value_head_dim: ``Dv`` (default ``D``).
        group_tokens: overrides the coding's ``T``.
        rotary_dim: rotary channels (default ``D``): ``rotary_dim / 2`` pairs per kv head.
        splits: split-K partials per row (0: none counted).
        query_bytes: bytes per query element (float16: 2).

    Raises:
        ValueError: an unknown coding name, or ``H_q`` not a multiple of ``H_kv``.
    """
    if isinstance(coding, str):
        if coding not in CODINGS:
            raise ValueError(f"unknown coding {coding!r}; known: {sorted(CODINGS)}")
        coding = CODINGS[coding]
    if group_tokens is not None:
        coding = replace(coding, group_tokens=group_tokens)
    if query_heads % kv_heads:
        raise ValueError(f"query heads {query_heads} not a multiple of kv heads {kv_heads}")
    dv = head_dim if value_head_dim is None else value_head_dim
    pairs = (head_dim if rotary_dim is None else rotary_dim) // 2
    rows = batch * kv_heads
    es = coding.storage_bytes
    t = coding.group_tokens
    s, g, r = token_split(tokens, coding)
    groups = rows * g
    key_code = math.ceil(t * head_dim * coding.bits / 8)
    value_code = math.ceil(t * dv * coding.bits / 8)
    per_group = coding.key_scalars_per_channel * head_dim + coding.key_scalars_per_token * t
    key_scalars = per_group * es
    k_out = _outliers_per_group(coding, head_dim)
    table = math.ceil(kv_heads * pairs * coding.table_bits / 8) if coding.table_bits else 0
    m = query_heads // kv_heads
    return DecodeBytes(
        key_codes=groups * key_code,
        value_codes=groups * value_code,
        key_scalars=groups * key_scalars,
        value_scalars=groups * 2 * t * es,
        tables=batch * table if g else 0,
        outliers=groups * k_out * (es + 2),
        exact=rows * (s + r) * (head_dim + dv) * es,
        rope_tables=(s + g * t + r) * pairs * 2 * 4 if coding.prerope else 0,
        hadamard=dv * dv * 4 if coding.hadamard_values else 0,
        queries=batch * query_heads * head_dim * query_bytes,
        output=batch * query_heads * dv * 4,
        partials=2 * rows * splits * m * (dv + 2) * 4,
    )


def sdpa_fp16_bytes(batch: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """float16 SDPA's cache reads over the exact cache: ``2 * B * H_kv * T * D * 2``."""
    return 2 * batch * kv_heads * tokens * head_dim * 2


# ---------------------------------------------------------------------- the whole model's step
@dataclass(frozen=True)
class ModelStepBytes:
    """Bytes one decode step of a whole model reads (all sequences of the batch).

    Attributes:
        weights: the parameters (:func:`decode_weight_bytes`).
        cache: the stored cache of every layer (a ``Cache``'s ``kv_bytes + index_bytes``:
            :func:`kvlab.cache_storage`; closed forms: :func:`dense_cache_bytes`,
            :func:`decode_bytes`).
        tables: what a kernel reads besides the cache (:func:`pnmix_table_bytes`; 0 for
            exact caches).
    """

    weights: int
    cache: int
    tables: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.tables

    def limit_over(self, reference: ModelStepBytes) -> float:
        """The speed-up over ``reference`` these bytes allow: ``reference.total / total``."""
        return reference.total / self.total


def decode_weight_bytes(
    parameters: list[tuple[str, tuple[int, ...], int]],
    batch: int,
    embedding: str,
    *,
    tied: bool = False,
) -> int:
    """Parameter bytes one decode step reads: every parameter once, but of the input embedding
    (``[vocabulary, hidden]``) only the ``batch`` rows of the step's tokens — unless it is tied
    to the output projection, which reads it whole.

    Args:
        parameters: ``(name, shape, element_size)`` of each distinct parameter tensor (a shared
            one once).
        batch: sequences per step.
        embedding: the input embedding's parameter name.
        tied: the input embedding is also the output projection.

    Raises:
        ValueError: ``embedding`` is not among ``parameters``.
    """
    total, found = 0, False
    for name, shape, size in parameters:
        numel = math.prod(shape)
        if name == embedding:
            found = True
            numel = numel if tied else batch * shape[-1]
        total += numel * size
    if not found:
        raise ValueError(f"no parameter named {embedding!r}")
    return total


def dense_cache_bytes(
    layers: int,
    batch: int,
    kv_heads: int,
    tokens: int,
    head_dim: int,
    value_head_dim: int | None = None,
    element_size: int = 4,
) -> int:
    """An exact cache's keys and values: ``layers * B * H_kv * T * (D + Dv) * element_size``."""
    dv = head_dim if value_head_dim is None else value_head_dim
    return layers * batch * kv_heads * tokens * (head_dim + dv) * element_size


def pnmix_table_bytes(
    layers: int,
    positions: int,
    rotary_dim: int,
    value_head_dim: int,
    *,
    prerope: bool,
    hadamard_values: bool,
) -> int:
    """What the CPU kernel reads per step besides a PN-Mix cache, all layers: the float32
    cos/sin rows of the ``positions`` quantized positions of a pre-RoPE coding (shared by the
    rows and heads of a layer: counted once per layer, as :class:`DecodeBytes`'
    ``rope_tables``) and the float32 ``Dv x Dv`` Hadamard matrix."""
    rope = positions * (rotary_dim // 2) * 2 * 4 if prerope else 0
    had = value_head_dim * value_head_dim * 4 if hadamard_values else 0
    return layers * (rope + had)
