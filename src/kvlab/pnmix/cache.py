"""The PN-Mix quantized KV cache of one attention layer (docs/design.md, "PN-Mix").

Per row ``(b, h)`` (sequence ``b`` of the batch, kv head ``h``) the cache holds, in order:

1. **Sinks** — the first ``sink_tokens`` tokens, exact in the storage dtype.
2. **Quantized groups** — blocks of ``group_tokens`` consecutive tokens coded by the key codec
   (:mod:`kvlab.pnmix.codecs`; Cartesian per channel, Phase–Norm, per token, a mix of two
   pair codecs, per-pair widths with exact outliers — rotated or pre-RoPE) and, for values,
   per token over the head's channels by the value codec (KIVI, Liu et al. 2024: per-channel
   keys, per-token values), packed ``bits``-bit codes plus per-group scalars (and payload).
3. **Residual** — the most recent tokens, exact. When it reaches
   ``residual_tokens + group_tokens`` tokens the oldest ``group_tokens`` are quantized as one
   group. Which tokens form which group depends on the row's total length only, each group is
   coded from its own tokens only, and stored codes are never rewritten, so one prefill or one
   token at a time gives byte-identical storage.

Storage is a :class:`~kvlab.pnmix.store.PackedStore` (contiguous buffers
``[B, H_kv, groups, ...]``, per-row counts on the host). Rows may hold different numbers of
tokens (padded batches: :meth:`PNMixCache.append` takes per-row ``lengths``).

Per-pair tables: a key codec may keep one table per row — a mix's mask (one bit per rotary
pair: True = the mix's second codec, Phase–Norm) or per-pair code widths (``"bit_alloc"``). A
row's table is computed once, in the append that flushes its first group, from every group the
row flushes there and that append's queries (``append(..., queries=...)``), and frozen
(docs/design.md, "Per-pair tables"). The default mix rule reads only the row's **first
quantized group**, so its mask does not depend on how tokens arrived; the query-aware rules do
(the queries of the append that flushes first), and :meth:`PNMixCache.set_pair_table` replays a
table. Every other stored byte depends on the tokens only.

Positions: a position-aware (pre-RoPE) key codec codes keys rotated back to position 0; the
token at stream index ``i`` of a row sits at the row's position offset plus ``i``, and
:meth:`PNMixCache.set_position_offsets` moves a row's tokens without re-quantizing
(docs/design.md, "Positions"). Values go through the value codec (per token, or per token of
Hadamard-rotated channels).

Host syncs: an append checks its inputs (finite, within the storage range; key scalars
finite) with one device-to-host read (``checks="eager"``, the default), or, with
``checks="deferred"`` (the decode path), with none: the result accumulates on the device and
:meth:`PNMixCache.check_values` raises later (docs/design.md, "Host syncs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.codecs import (
    KeyCodec,
    KeyLayout,
    MixCodec,
    PairCodec,
    PhaseNormCodec,
    TableStatistics,
)
from kvlab.pnmix.config import KeyCoding, PNMixConfig, check_int
from kvlab.pnmix.kernels.cpu import encode_groups_cpu, flush_unsupported
from kvlab.pnmix.kernels.dispatch import requested_backend, select_flush_backend
from kvlab.pnmix.kernels.spec import KernelKeyDecode, kernel_key_decode
from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes
from kvlab.pnmix.quantizers import storage_range_message
from kvlab.pnmix.store import AppendPlan, EncodedGroups, PackedStore, StoreGeometry
from kvlab.pnmix.values import ValueCodec
from kvlab.pnmix.width_codec import BitAllocCodec
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = ["KeyCoding", "PNMixCache", "PNMixConfig", "PackedGroup"]


@dataclass(frozen=True, eq=False)
class PackedGroup:
    """Quantized group ``g`` of every row: read-only views into the store's buffers.

    Attributes:
        start: stream index of the group's first token (``sink_tokens + g * group_tokens``).
        num_tokens: tokens in the group (= ``group_tokens``).
        bits: code width.
        head_dim, value_head_dim: channels of keys and values.
        key_codes: uint8 ``[B, H_kv, ceil(T * D * bits / 8)]``: per row the token-major codes
            ``[T, D]`` packed by :func:`~kvlab.pnmix.packing.pack_codes`.
        key_scale, key_zero: storage dtype, the two halves of the key scalars: ``[B, H_kv, D]``
            for channel-wise codecs (per channel / pair slot), ``[B, H_kv, T]`` for per-token.
        value_codes: uint8 ``[B, H_kv, ceil(T * Dv * bits / 8)]``, token-major ``[T, Dv]``.
        value_scale, value_zero: storage dtype ``[B, H_kv, T]`` (per token).
        key_payload: uint8 ``[B, H_kv, E]``, the key codec's per-group side data (``E = 0``
            for most codecs).

    Rows that hold fewer groups read zeros. Do not modify the tensors in place.
    :meth:`key_code_matrix` assumes fixed-width codes (use the cache's
    :meth:`PNMixCache.decode_groups` for per-pair widths).
    """

    start: int
    num_tokens: int
    bits: int
    head_dim: int
    value_head_dim: int
    key_codes: Tensor
    key_scale: Tensor
    key_zero: Tensor
    value_codes: Tensor
    value_scale: Tensor
    value_zero: Tensor
    key_payload: Tensor | None = None

    def key_code_matrix(self) -> Tensor:
        """Unpacked key codes: uint8 ``[B, H_kv, T, D]``."""
        n = self.num_tokens * self.head_dim
        codes = unpack_codes(self.key_codes, self.bits, n)
        return codes.reshape(*codes.shape[:-1], self.num_tokens, self.head_dim)

    def value_code_matrix(self) -> Tensor:
        """Unpacked value codes: uint8 ``[B, H_kv, T, Dv]``."""
        n = self.num_tokens * self.value_head_dim
        codes = unpack_codes(self.value_codes, self.bits, n)
        return codes.reshape(*codes.shape[:-1], self.num_tokens, self.value_head_dim)

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by field name (``key_payload`` only when the codec stores one)."""
        out = {
            "key_codes": self.key_codes,
            "key_scale": self.key_scale,
            "key_zero": self.key_zero,
            "value_codes": self.value_codes,
            "value_scale": self.value_scale,
            "value_zero": self.value_zero,
        }
        if self.key_payload is not None and self.key_payload.shape[-1]:
            out["key_payload"] = self.key_payload
        return out


Checks = Literal["eager", "deferred"]


class PNMixCache:
    """PN-Mix quantized KV cache of ONE layer.

    Args:
        config: :class:`PNMixConfig`.
        batch_size: sequences ``B`` (>= 1).
        num_key_value_heads: kv heads ``H_kv`` (>= 1).
        head_dim: key channels ``D`` (>= 1, >= rotary_dim).
        value_head_dim: value channels ``Dv`` (default ``head_dim``).
        device: device of the storage; ``None`` = the device of the first appended keys.
        rotary: the layer's RoPE (:class:`kvlab.rope.RotaryConfig`; partial rotary,
            interleaved layouts and scaled frequencies included), required by a
            position-aware (pre-RoPE) key codec; its ``head_dim``, ``rotary_dim`` and
            ``layout`` must match the cache's. Token positions are the row's position offset
            (0 unless :meth:`set_position_offsets`) plus its stream index (docs/design.md,
            "Positions").

    Raises:
        ValueError: bad sizes; ``rotary_dim`` (``config.rotary_dim`` or ``head_dim``) not an
            even number ``<= head_dim``; a position-aware codec without ``rotary`` or a
            ``rotary`` that does not match; a value codec that cannot code ``value_head_dim``
            channels; a key payload the group cannot address; an unknown
            ``KVLAB_PNMIX_BACKEND`` (:func:`kvlab.pnmix.kernels.dispatch.requested_backend`).
    """

    def __init__(
        self,
        config: PNMixConfig,
        *,
        batch_size: int,
        num_key_value_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        device: torch.device | str | None = None,
        rotary: RotaryConfig | None = None,
    ) -> None:
        if not isinstance(config, PNMixConfig):
            raise ValueError(f"config must be a PNMixConfig, got {type(config).__name__}")
        requested_backend("auto")  # an unknown KVLAB_PNMIX_BACKEND fails here, not in attention
        check_int("batch_size", batch_size, 1)
        check_int("num_key_value_heads", num_key_value_heads, 1)
        check_int("head_dim", head_dim, 1)
        if value_head_dim is None:
            value_head_dim = head_dim
        check_int("value_head_dim", value_head_dim, 1)
        rotary_dim = head_dim if config.rotary_dim is None else config.rotary_dim
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}"
                + (" (head_dim is odd: set config.rotary_dim)" if config.rotary_dim is None else "")
            )
        codec = config.key_codec
        if rotary is not None:
            if not isinstance(rotary, RotaryConfig):
                raise ValueError(f"rotary must be a RotaryConfig, got {type(rotary).__name__}")
            got = (rotary.head_dim, rotary.rotary_dim, rotary.layout)
            want = (head_dim, rotary_dim, config.rotary_layout)
            if got != want:
                raise ValueError(
                    f"rotary (head_dim, rotary_dim, layout) = {got} does not match the cache's "
                    f"{want}"
                )
        elif codec.position_aware:
            raise ValueError(
                f"key coding {codec} is position-aware (pre-RoPE): pass the layer's "
                "RotaryConfig as rotary="
            )
        value_codec = config.value_codec
        value_codec.check_head_dim(value_head_dim)
        payload = codec.payload_bytes(config.group_tokens, head_dim, config.storage_dtype)
        self._config = config
        self._codec = codec
        self._kernel_decode = kernel_key_decode(codec, value_codec, payload)
        # None when the compiled CPU flush codes this cache's groups (docs/design.md, "Flush")
        self._flush_unsupported = flush_unsupported(
            codec, value_codec, config.storage_dtype, config.group_tokens, value_head_dim
        )
        self._value_codec = value_codec
        self._rotary = rotary
        self._num_heads = num_key_value_heads
        self._head_dim = head_dim
        self._value_head_dim = value_head_dim
        self._rotary_dim = rotary_dim
        self._device_fixed = device is not None
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._layout = KeyLayout.for_rotary(head_dim, rotary_dim, config.rotary_layout, dev)
        p = self._layout.num_pairs
        self._geometry = StoreGeometry(
            batch_size=batch_size,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            value_head_dim=value_head_dim,
            bits=config.bits,
            sink_tokens=config.sink_tokens,
            residual_tokens=config.residual_tokens,
            group_tokens=config.group_tokens,
            key_scalar_count=codec.scalar_count(config.group_tokens, head_dim),
            storage_dtype=config.storage_dtype,
            mask_bytes=(
                packed_length(num_key_value_heads * p, codec.table_bits) if codec.table_bits else 0
            ),
            key_payload_bytes=payload,
            table_bits=codec.table_bits,
            key_code_bytes=codec.code_bytes(config.group_tokens, head_dim),
        )
        self._saliency_computations = 0
        self._attention_calls = 0
        self._reset_storage(dev)

    def _reset_storage(self, device: torch.device) -> None:
        g = self._geometry
        self._store = PackedStore(g, device)
        self._layout = self._layout.to(device)
        p = self._layout.num_pairs
        # derived (not counted) copies of the per-pair table: on the device (the codec's table
        # dtype: a mix's bool mask, widths), and, for a mix, its mask on the host
        self._mask_bool = torch.zeros(
            (g.batch_size, g.num_key_value_heads, p), dtype=self._codec.table_dtype, device=device
        )
        self._mask_host = np.zeros((g.batch_size, g.num_key_value_heads, p), dtype=bool)
        self._mask_host_known = np.ones((g.batch_size, g.num_key_value_heads), dtype=bool)
        self._active_pairs: Tensor | None = None
        self._active_pairs_valid = False
        self._pending_ok: Tensor | None = None

    # ------------------------------------------------------------------ description
    @property
    def config(self) -> PNMixConfig:
        return self._config

    @property
    def codec(self) -> KeyCodec:
        """The key codec."""
        return self._codec

    @property
    def kernel_decode(self) -> KernelKeyDecode | str:
        """The codec as compiled kernels decode it, or why they cannot
        (:func:`kvlab.pnmix.kernels.spec.kernel_key_decode`; decided once, at construction)."""
        return self._kernel_decode

    @property
    def value_codec(self) -> ValueCodec:
        """The value codec."""
        return self._value_codec

    @property
    def rotary(self) -> RotaryConfig | None:
        """The layer's RoPE (``None`` when not given)."""
        return self._rotary

    @property
    def is_mix(self) -> bool:
        """Whether the key codec is a :class:`~kvlab.pnmix.codecs.MixCodec` (a mask is kept)."""
        return isinstance(self._codec, MixCodec)

    @property
    def has_table(self) -> bool:
        """Whether the key codec keeps a per-pair table (a mix mask or per-pair widths)."""
        return self._codec.table_bits > 0

    @property
    def position_offsets(self) -> np.ndarray:
        """int64 ``[B, H_kv]`` (host): each row's RoPE position offset; the token at stream
        index ``i`` sits at position ``offset + i`` (docs/design.md, "Positions")."""
        return self._store.position_offsets.copy()

    @property
    def layout(self) -> KeyLayout:
        """The key head's channel geometry (rotary pairs), on the storage device."""
        return self._layout

    @property
    def store(self) -> PackedStore:
        """The packed storage (buffers and host counts; docs/design.md, "Storage format")."""
        return self._store

    @property
    def batch_size(self) -> int:
        return self._geometry.batch_size

    @property
    def num_key_value_heads(self) -> int:
        return self._num_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def value_head_dim(self) -> int:
        return self._value_head_dim

    @property
    def rotary_dim(self) -> int:
        return self._rotary_dim

    @property
    def num_pairs(self) -> int:
        """Rotary pairs per key head: ``rotary_dim // 2``."""
        return self._layout.num_pairs

    @property
    def pair_indices(self) -> tuple[Tensor, Tensor]:
        """``(first, second)`` int64 ``[P]`` channel indices of the rotary pairs (CPU)."""
        return self._layout.first.cpu(), self._layout.second.cpu()

    @property
    def device(self) -> torch.device:
        return self._store.device

    # ------------------------------------------------------------------ lengths
    @property
    def seq_lengths(self) -> np.ndarray:
        """int64 ``[B, H_kv]``: tokens stored per row (host)."""
        return self._store.seq_lengths

    @property
    def sink_lengths(self) -> np.ndarray:
        """int64 ``[B, H_kv]``: exact sink tokens per row (host)."""
        return self._store.sink_lengths.copy()

    @property
    def group_counts(self) -> np.ndarray:
        """int64 ``[B, H_kv]``: quantized groups per row (host)."""
        return self._store.group_counts.copy()

    @property
    def residual_lengths(self) -> np.ndarray:
        """int64 ``[B, H_kv]``: exact residual tokens per row (host)."""
        return self._store.residual_lengths.copy()

    def _same(self, counts: np.ndarray, what: str) -> int:
        lo, hi = int(counts.min()), int(counts.max(initial=0))
        if lo != hi:
            raise ValueError(
                f"rows hold different {what} ({lo}..{hi}: a padded batch); read the per-row "
                "counts (seq_lengths, sink_lengths, group_counts, residual_lengths)"
            )
        return lo

    @property
    def sink_length(self) -> int:
        """Tokens in the exact sink buffer (<= ``sink_tokens``), equal for every row.

        Raises:
            ValueError: rows differ (read :attr:`sink_lengths`).
        """
        return self._same(self._store.sink_lengths, "sink lengths")

    @property
    def residual_length(self) -> int:
        """Tokens in the exact residual buffer, equal for every row (else ``ValueError``)."""
        return self._same(self._store.residual_lengths, "residual lengths")

    @property
    def num_groups(self) -> int:
        """Quantized groups, equal for every row (else ``ValueError``)."""
        return self._same(self._store.group_counts, "group counts")

    @property
    def quantized_tokens(self) -> int:
        """Tokens stored as packed codes (``num_groups * group_tokens``)."""
        return self.num_groups * self._config.group_tokens

    @property
    def seq_length(self) -> int:
        """Tokens stored per row: sinks + quantized + residual, equal for every row (else
        ``ValueError``)."""
        return self._same(self._store.seq_lengths, "lengths")

    @property
    def groups(self) -> tuple[PackedGroup, ...]:
        """Views of the quantized groups in sequence order, up to the largest row's count."""
        s, g = self._store, self._geometry
        n = int(s.group_counts.max(initial=0))
        half = g.key_scalar_count // 2
        t = g.group_tokens
        out = []
        for i in range(n):
            ks, vs = s.key_scalars[:, :, i], s.value_scalars[:, :, i]
            out.append(
                PackedGroup(
                    start=g.sink_tokens + i * t,
                    num_tokens=t,
                    bits=g.bits,
                    head_dim=g.head_dim,
                    value_head_dim=g.value_head_dim,
                    key_codes=s.key_codes[:, :, i],
                    key_scale=ks[..., :half],
                    key_zero=ks[..., half:],
                    value_codes=s.value_codes[:, :, i],
                    value_scale=vs[..., :t],
                    value_zero=vs[..., t:],
                    key_payload=s.key_payload[:, :, i],
                )
            )
        return tuple(out)

    @property
    def sink_keys(self) -> Tensor:
        """Exact sink keys, storage dtype ``[B, H_kv, max sink length, D]`` (do not modify)."""
        return self._store.sink_keys[:, :, : int(self._store.sink_lengths.max(initial=0))]

    @property
    def sink_values(self) -> Tensor:
        """Exact sink values, storage dtype ``[B, H_kv, max sink length, Dv]``."""
        return self._store.sink_values[:, :, : int(self._store.sink_lengths.max(initial=0))]

    @property
    def residual_keys(self) -> Tensor:
        """Exact residual keys, storage dtype ``[B, H_kv, max residual length, D]``."""
        return self._store.residual_keys[:, :, : int(self._store.residual_lengths.max(initial=0))]

    @property
    def residual_values(self) -> Tensor:
        """Exact residual values, storage dtype ``[B, H_kv, max residual length, Dv]``."""
        return self._store.residual_values[:, :, : int(self._store.residual_lengths.max(initial=0))]

    # ------------------------------------------------------------------ mask
    @property
    def mask_packed(self) -> Tensor | None:
        """The stored per-pair table (a mix mask; per-pair width indices), uint8 ``[B,
        ceil(H_kv * P * table_bits / 8)]`` (entry ``h * P + p`` of each sequence's
        little-endian bitstream); ``None`` before any row has one and for codecs without a
        table. Rows without a table yet read zeros."""
        s = self._store
        return s.mask if s.mask is not None and s.mask_rows.any() else None

    @property
    def mix_mask(self) -> Tensor | None:
        """The mix mask, bool ``[B, H_kv, P]`` (True = the mix's second codec, Phase–Norm),
        unpacked from :attr:`mask_packed`; ``None`` before the first group is flushed and for
        codecs other than a mix. Rows without a mask yet read False
        (:attr:`mask_rows` says which have one)."""
        if not self.is_mix:
            return None
        return self.pair_table

    @property
    def pair_table(self) -> Tensor | None:
        """The per-pair table ``[B, H_kv, P]`` in the codec's table dtype (a mix's bool mask;
        per-pair widths in bits, uint8), decoded from :attr:`mask_packed`; ``None`` before any
        row has one and for codecs without a table."""
        if self.mask_packed is None:
            return None
        entries = self._store.read_table_entries(self.num_pairs)
        return self._codec.table_from_entries(entries)

    @property
    def pair_widths(self) -> Tensor | None:
        """Per-pair key code widths in bits, int64 ``[B, H_kv, P]`` for codecs with per-pair
        widths (``None`` before the first table and for other codecs)."""
        from kvlab.pnmix.width_codec import BitAllocCodec

        if not isinstance(self._codec, BitAllocCodec) or not self._codec.table_bits:
            return None
        table = self.pair_table
        return None if table is None else table.long()

    @property
    def mask_rows(self) -> np.ndarray:
        """bool ``[B, H_kv]`` (host): rows whose mix mask has been computed."""
        return self._store.mask_rows.copy()

    @property
    def phase_norm_pairs(self) -> Tensor | None:
        """Bool ``[B, H_kv, P]``: which rotary pairs the quantized groups code in Phase–Norm
        (the mix mask; all False for ``"cartesian"``, all True for ``"phase_norm"``).
        ``None`` for per-token keys and for a mix before its first flush."""
        codec = self._codec
        shape = (self.batch_size, self._num_heads, self.num_pairs)
        if isinstance(codec, MixCodec):
            mask = self.mix_mask
            if mask is None:
                return None
            first_pn = isinstance(codec.first, PhaseNormCodec)
            second_pn = isinstance(codec.second, PhaseNormCodec)
            if first_pn == second_pn:
                return torch.full_like(mask, first_pn)
            return mask if second_pn else ~mask
        if isinstance(codec, PairCodec):
            return torch.full(
                shape, isinstance(codec, PhaseNormCodec), dtype=torch.bool, device=self.device
            )
        return None

    def codec_mask(self) -> Tensor | None:
        """The per-pair table the codec's ``decode`` / ``unpack`` need for every row, ``[B,
        H_kv, P]`` on the storage device in the codec's table dtype (a mix: bool mask; per-pair
        widths: uint8 bits), or ``None`` for codecs without a table. Derived from the stored
        table; rows without one read zeros."""
        return self._mask_bool if self.has_table else None

    def active_pairs(self) -> Tensor | None:
        """int64 ``[U]`` pairs whose mask bit is set in some row (known on the host without a
        device read), or ``None`` when a row's mask is not yet known on the host (after a
        deferred-checked flush): then every pair counts as active."""
        if not self.is_mix:
            return None
        if not self._active_pairs_valid:
            if not self._mask_host_known.all():
                return None
            used = np.flatnonzero(self._mask_host.any(axis=(0, 1)))
            self._active_pairs = torch.from_numpy(used).to(self.device)
            self._active_pairs_valid = True
        return self._active_pairs

    def set_pair_table(self, table: Tensor) -> None:
        """Set the per-pair table of every row (instead of computing it at the first flush),
        e.g. to replay a table: docs/design.md, "Per-pair tables".

        Args:
            table: ``[B, H_kv, P]`` (or broadcastable, e.g. ``[H_kv, P]``) in the codec's table
                dtype: a mix's bool mask (True = second codec) or per-pair widths in bits (each
                row's widths within its budget).

        Raises:
            ValueError: a codec without a table, a table of the wrong shape, dtype or values,
                or a row that already holds a group (its codes depend on its table). Nothing
                changes then.
        """
        if not self.has_table:
            raise ValueError(f"key coding {self._codec} keeps no per-pair table")
        if int(self._store.group_counts.max(initial=0)) > 0:
            raise ValueError("rows already hold quantized groups coded with their own tables")
        if not isinstance(table, Tensor):
            raise ValueError(f"table must be a tensor, got {type(table).__name__}")
        shape = (self.batch_size, self._num_heads, self.num_pairs)
        try:
            full = torch.broadcast_to(table.to(self.device), shape)
        except RuntimeError as exc:
            raise ValueError(f"table of shape {tuple(table.shape)} does not fit {shape}") from exc
        self._codec.check_table(full, self._layout)
        rows = np.argwhere(np.ones(shape[:2], dtype=bool))
        flat = full.reshape(-1, self.num_pairs).to(self._codec.table_dtype)
        self._record_tables(rows, flat, "eager", computed=False)

    def set_position_offsets(self, offsets: Any) -> None:
        """Move the rows' tokens to new RoPE positions (a relay): the token at stream index
        ``i`` of row ``(b, h)`` is at position ``offsets[b, h] + i`` afterwards.

        Codes are not touched (they hold position-0 keys: nothing is re-quantized); exact
        sink and residual keys are rotated by the change (float32, rounded to the storage
        dtype). Attention rotates decoded keys to the new positions (docs/design.md,
        "Positions").

        Args:
            offsets: host ints ``[B]`` or ``[B, H_kv]`` (list, numpy or CPU tensor).

        Raises:
            ValueError: a key codec that is not position-aware (its codes would need
                re-quantization), or offsets of the wrong shape or type. Nothing changes then.
        """
        if not self._codec.position_aware:
            raise ValueError(
                f"key coding {self._codec} stores keys rotated at their positions: moving them "
                "would re-quantize; use a position-aware (pre-RoPE) coding"
            )
        if isinstance(offsets, Tensor):
            if offsets.device.type != "cpu":
                raise ValueError("offsets must be host integers (a list, numpy or CPU tensor)")
            offsets = offsets.numpy()
        arr = np.asarray(offsets)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"offsets must hold integers, got dtype {arr.dtype}")
        b, h = self.batch_size, self._num_heads
        if arr.shape == (b,):
            arr = np.repeat(arr[:, None], h, axis=1)
        if arr.shape != (b, h):
            raise ValueError(f"offsets must have shape [B] or [B, H] = [{b}, {h}], got {arr.shape}")
        assert self._rotary is not None
        self._store.shift_positions(
            arr.astype(np.int64) - self._store.position_offsets, self._rotary
        )

    @property
    def saliency_computations(self) -> int:
        """How many table-rule calls computed per-pair tables (mix masks, widths; one call
        covers every row whose first group flushed in the same append: 0 or 1 for
        equal-length rows)."""
        return self._saliency_computations

    @property
    def attention_calls(self) -> int:
        """Calls of :func:`kvlab.pnmix.attention.pnmix_attention` on this cache."""
        return self._attention_calls

    def _record_attention_call(self) -> None:
        self._attention_calls += 1

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> dict[str, int]:
        """Persistent (used) storage by component, in bytes, from the host counts:
        ``key_sink``, ``key_residual``, ``key_codes``, ``key_scales`` (scales + zero points /
        phase spans + offsets), ``key_mask``, ``value_sink``, ``value_residual``,
        ``value_codes``, ``value_scales`` (docs/design.md, "Byte accounting")."""
        return self._store.nbytes()

    def reserved_bytes(self) -> dict[str, int]:
        """Allocated bytes by buffer, spare capacity included (see
        :meth:`~kvlab.pnmix.store.PackedStore.reserved_bytes`)."""
        return self._store.reserved_bytes()

    @property
    def key_bytes(self) -> int:
        """Bytes of key storage (sinks, residual, codes, scalars, payload, table)."""
        return sum(v for k, v in self.nbytes().items() if k.startswith("key_"))

    @property
    def value_bytes(self) -> int:
        """Bytes of value storage (sinks, residual, codes, scalars)."""
        return sum(v for k, v in self.nbytes().items() if k.startswith("value_"))

    @property
    def persistent_bytes(self) -> int:
        """``key_bytes + value_bytes``."""
        return self.key_bytes + self.value_bytes

    @property
    def key_bits_per_element(self) -> float:
        """Key storage bits per stored key element, sinks and residual included:
        ``key_bytes * 8 / (Σ_rows seq_length * D)`` (``nan`` when empty)."""
        elements = int(self._store.seq_lengths.sum()) * self._head_dim
        return self.key_bytes * 8 / elements if elements else math.nan

    # ------------------------------------------------------------------ writing
    def _check_input(self, keys: Tensor, values: Tensor) -> None:
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [B, H_kv, T, D], got shape {tuple(t.shape)}")
        b, h, d, dv = self.batch_size, self._num_heads, self._head_dim, self._value_head_dim
        if keys.shape[0] != b or values.shape[0] != b:
            raise ValueError(
                f"batch size mismatch: cache has {b}, keys {keys.shape[0]}, "
                f"values {values.shape[0]}"
            )
        if keys.shape[1] != h or values.shape[1] != h:
            raise ValueError(
                f"num_key_value_heads mismatch: cache has {h}, keys {keys.shape[1]}, "
                f"values {values.shape[1]}"
            )
        if keys.shape[3] != d:
            raise ValueError(f"keys head_dim {keys.shape[3]} != cache head_dim {d}")
        if values.shape[3] != dv:
            raise ValueError(f"values head dim {values.shape[3]} != cache value_head_dim {dv}")
        if keys.shape[2] != values.shape[2]:
            raise ValueError(
                f"keys and values disagree on tokens: {keys.shape[2]} vs {values.shape[2]}"
            )

    def _real(self, x: Tensor, plan: AppendPlan) -> Tensor:
        """``x`` with non-real (padding) positions replaced by zeros, for range checks."""
        if plan.uniform:
            return x[:, :, plan.tokens - int(plan.lengths[0, 0]) :]
        t = plan.tokens
        first = torch.from_numpy(t - plan.lengths).to(x.device)
        real = torch.arange(t, device=x.device) >= first[..., None]
        return torch.where(real[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    def _raise_input_error(self, keys: Tensor, values: Tensor, plan: AppendPlan) -> None:
        """Raise the specific error for bad input (called only when a check failed)."""
        dt = self._config.storage_dtype
        for name, x in (("keys", keys), ("values", values)):
            real = self._real(x, plan)
            if not bool(torch.isfinite(real).all()):
                raise ValueError(f"{name} contains non-finite values (NaN or inf)")
            if not bool(torch.isfinite(real.to(dt)).all()):
                raise ValueError(storage_range_message(f"{name} has values whose magnitude", dt))

    def append(
        self,
        keys: Tensor,
        values: Tensor,
        lengths: Any = None,
        *,
        checks: Checks = "eager",
        queries: Tensor | None = None,
        query_lengths: Any = None,
    ) -> None:
        """Append tokens to every row.

        Args:
            keys: ``[B, H_kv, T, D]`` keys, already RoPE-rotated at their positions, any
                floating dtype (rounded to the storage dtype).
            values: ``[B, H_kv, T, Dv]``.
            lengths: real tokens per row, host ints ``[B]`` or ``[B, H_kv]`` (list, numpy or
                CPU tensor; default all ``T``): the LAST ``lengths[b]`` tokens of row ``b``
                are real (right-aligned, as in a left-padded batch); the others are padding
                and never stored.
            checks: ``"eager"`` validates the values with one device read before anything is
                stored (atomic); ``"deferred"`` stores without any device read and records
                the validity on the device for :meth:`check_values` (the decode path; an
                eager append or :meth:`check_values` raises if a deferred append was bad).
            queries: the RoPE-rotated queries of these tokens, ``[B, H_q, T, D]`` (``H_q`` a
                multiple of ``H_kv``, GQA; query ``j`` of a row is real where token ``j`` is):
                read only by query-aware per-pair tables computed in this append
                (docs/design.md, "Per-pair tables"); ``None``: such tables use plain key
                errors.
            query_lengths: real queries per sequence, host ints ``[B]``: the LAST
                ``query_lengths[b]`` of the ``T_q`` queries of sequence ``b`` are real, and
                ``queries`` may then have any token count ``T_q`` (e.g. a whole prefill's
                queries for the tokens an eviction kept: docs/design.md, "Eviction composed
                with PN-Mix"). Default ``None``: query ``j`` is real where token ``j`` is.

        Each row's first ``sink_tokens`` tokens fill its sinks; the rest enter its residual,
        which flushes every full ``group_tokens`` beyond ``residual_tokens``. With a codec
        that keeps a per-pair table (a mix mask, per-pair widths) the append that flushes a
        row's first group computes that row's table. A position-aware codec codes each
        flushed key rotated back to position 0. All groups flushed by one append are coded by
        one codec call. ``T = 0`` stores nothing. Atomic: on an error nothing is stored.

        Raises:
            ValueError: wrong type, dtype, rank or shape (keys, values or queries); bad
                ``lengths``, ``query_lengths`` or ``checks``; and with ``checks="eager"``:
                NaN/inf; a value beyond the storage dtype's range (the float16 message names
                bfloat16 storage); a stored scalar or pre-RoPE key beyond it (e.g. a Phase–Norm
                pair norm); or an earlier deferred append's bad values.
        """
        self._check_input(keys, values)
        if checks not in ("eager", "deferred"):
            raise ValueError(f"checks must be 'eager' or 'deferred', got {checks!r}")
        real_queries = None
        if queries is not None:
            real_queries = self._check_queries(queries, keys.shape[2], query_lengths)
        elif query_lengths is not None:
            raise ValueError("query_lengths needs queries")
        if checks == "eager":
            self.check_values()
        if not self._device_fixed:
            self._device_fixed = True
            if keys.device != self.device:
                self._reset_storage(keys.device)
        dev = self.device
        cfg = self._config
        dt = cfg.storage_dtype
        k_in, v_in = keys.to(dev), values.to(dev)
        k, v = k_in.to(dt), v_in.to(dt)
        state: dict[str, Any] = {"queries": queries, "query_lengths": real_queries}

        def encode(plan: AppendPlan, groups: tuple[Tensor, Tensor] | None) -> EncodedGroups | None:
            enc, ok = (None, None) if groups is None else self._encode(plan, *groups, state)
            ok_kv = (
                torch.isfinite(self._real(k, plan)).all()
                & torch.isfinite(self._real(v, plan)).all()
            )
            ok = ok_kv if ok is None else ok & ok_kv
            if checks == "eager":
                if not bool(ok):
                    self._raise_input_error(k_in, v_in, plan)
                    raise ValueError(
                        storage_range_message(
                            "a stored scalar or pre-RoPE key (e.g. a Phase–Norm pair norm)", dt
                        )
                    )
            else:
                self._pending_ok = ok if self._pending_ok is None else self._pending_ok & ok
            return enc

        if k.shape[2] == 0:
            return
        self._store.append(k, v, lengths, encode=encode)
        if "mask_rows" in state:
            self._record_tables(state["mask_rows"], state["mask_bits"], checks)

    def _record_tables(
        self, rows: np.ndarray, table: Tensor, checks: Checks, *, computed: bool = True
    ) -> None:
        """Store the tables ``table [n, P]`` of rows ``rows [n, 2]`` (packed entries and the
        derived device copy; for a mix, the host copy when the append was eager)."""
        dev = self.device
        self._store.write_mask(rows, self._codec.table_entries(table))
        self._mask_bool[
            torch.from_numpy(rows[:, 0]).to(dev), torch.from_numpy(rows[:, 1]).to(dev)
        ] = table.to(device=dev, dtype=self._codec.table_dtype)
        self._saliency_computations += int(computed)
        self._active_pairs_valid = False
        if not self.is_mix:
            return
        if checks == "eager":
            host = np.asarray(table.tolist(), dtype=bool).reshape(rows.shape[0], -1)
            self._mask_host[rows[:, 0], rows[:, 1]] = host
        else:
            self._mask_host_known[rows[:, 0], rows[:, 1]] = False

    def _check_queries(
        self, queries: Tensor, tokens: int, query_lengths: Any = None
    ) -> np.ndarray | None:
        """Check ``queries`` (and ``query_lengths``); return the real queries per sequence as
        host int64 ``[B]``, or ``None`` when they follow the tokens' ``lengths``."""
        if not isinstance(queries, Tensor) or not queries.is_floating_point() or queries.dim() != 4:
            raise ValueError("queries must be a 4-D floating tensor [B, H_q, T, D]")
        b, hq, t, d = queries.shape
        if b != self.batch_size or d != self._head_dim or (query_lengths is None and t != tokens):
            want_t = f"T={tokens}" if query_lengths is None else "T_q"
            raise ValueError(
                f"queries must be [B={self.batch_size}, H_q, {want_t}, D={self._head_dim}], "
                f"got {tuple(queries.shape)}"
            )
        if hq % self._num_heads:
            raise ValueError(
                f"query heads {hq} must be a multiple of num_key_value_heads {self._num_heads}"
            )
        if query_lengths is None:
            return None
        if isinstance(query_lengths, Tensor):
            if query_lengths.device.type != "cpu":
                raise ValueError("query_lengths must be host integers (list, numpy or CPU tensor)")
            query_lengths = query_lengths.numpy()
        arr = np.asarray(query_lengths)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) or arr.shape != (b,):
            raise ValueError(
                f"query_lengths must be {b} integers (one per sequence), got {arr.tolist()}"
            )
        if arr.min() < 0 or arr.max() > t:
            raise ValueError(f"query_lengths must lie in 0..{t} (the queries given), got {arr}")
        return arr.astype(np.int64)

    def _query_moment(
        self,
        queries: Tensor,
        plan: AppendPlan,
        rows: np.ndarray,
        query_lengths: np.ndarray | None = None,
    ) -> Tensor:
        """float64 ``[n, D, D]``: per row ``(b, h)`` of ``rows [n, 2]``, the mean of ``q q^T``
        over the append's real queries of the row's GQA group (the last ``query_lengths[b]``,
        or those of the row's real tokens; no device read)."""
        dev = self.device
        b, hq, t, d = queries.shape
        h = self._num_heads
        rep = hq // h
        q = queries.to(dev).double().reshape(b, h, rep, t, d)
        rb = torch.from_numpy(rows[:, 0]).to(dev)
        rh = torch.from_numpy(rows[:, 1]).to(dev)
        picked = q[rb, rh]  # [n, rep, T, D]
        if query_lengths is None:
            real = plan.lengths[rows[:, 0], rows[:, 1]]  # host [n]
        else:
            real = query_lengths[rows[:, 0]]
        first = torch.from_numpy(t - real).to(dev)
        real_q = torch.arange(t, device=dev)[None, :] >= first[:, None]  # [n, T]
        picked = torch.where(real_q[:, None, :, None], picked, torch.zeros_like(picked))
        total = torch.einsum("nrtd,nrte->nde", picked, picked)
        count = torch.from_numpy(np.maximum(real, 1) * rep).to(dev).double()
        return total / count[:, None, None]

    def _to_frame(self, keys: Tensor, positions: Tensor) -> Tensor:
        """Storage-rounded keys ``[N, T, D]`` rotated back from ``positions [N, T]`` to
        position 0 and rounded to the storage dtype (no device read)."""
        assert self._rotary is not None
        return rotate_by_delta(keys, -positions, self._rotary).to(self._config.storage_dtype)

    def _encode(
        self, plan: AppendPlan, gk: Tensor, gv: Tensor, state: dict[str, Any]
    ) -> tuple[EncodedGroups, Tensor]:
        """Code the flushed groups (one codec call); returns them and a device flag that every
        stored scalar and pre-RoPE key is finite. Tables of rows flushing their first group
        go to ``state``."""
        codec, lay = self._codec, self._layout
        dt = self._config.storage_dtype
        dev = gk.device
        n = plan.num_groups
        rows = plan.group_rows
        positions: Tensor | None = None
        ok = torch.ones((), dtype=torch.bool, device=dev)
        if codec.position_aware:
            pos_host = self._store.stream_positions(rows[:, :2], rows[:, 2])
            positions = torch.from_numpy(pos_host).to(dev)
        member = ~self._store.mask_rows[rows[:, 0], rows[:, 1]] if codec.table_bits else None
        if (
            self._flush_unsupported is None
            and (member is None or not member.any())
            and select_flush_backend(dev) == "cpu"
        ):
            # the compiled flush (docs/design.md, "Kernels", "Flush"): the same bytes
            assert isinstance(codec, BitAllocCodec)
            fast = encode_groups_cpu(
                gk,
                gv,
                codec=codec,
                value_codec=self._value_codec,
                layout=lay,
                table=self._group_tables(plan, self._mask_bool) if codec.table_bits else None,
                positions=positions,
                rotary=self._rotary,
            )
            if fast is not None:
                return fast, ok
        if positions is not None:
            gk = self._to_frame(gk, positions)
            ok = ok & torch.isfinite(gk).all()
        table = None
        if codec.table_bits:
            assert member is not None
            table_all = self._mask_bool
            if member.any():
                table_all = table_all.clone()
                new_table, new_rows = self._compute_tables(plan, gk, positions, member, state)
                table_all[
                    torch.from_numpy(new_rows[:, 0]).to(dev),
                    torch.from_numpy(new_rows[:, 1]).to(dev),
                ] = new_table
                state["mask_rows"], state["mask_bits"] = new_rows, new_table
            table = self._group_tables(plan, table_all)
        coded = codec.encode_groups(gk, dt, lay, table)
        ok = ok & torch.isfinite(coded.scalars).all()
        vcodes, vscalars = self._value_codec.encode(gv, dt)
        ok = ok & torch.isfinite(vscalars).all()
        payload = coded.payload if coded.payload.shape[-1] else None
        return EncodedGroups(
            codec.pack(coded.codes, lay, table),
            coded.scalars,
            pack_codes(vcodes.reshape(n, -1), self._config.bits, check=False),
            vscalars,
            payload,
        ), ok

    def _group_tables(self, plan: AppendPlan, table_all: Tensor) -> Tensor:
        """The per-pair table ``[N, P]`` of each flushed group's row, from the rows' tables
        ``table_all [B, H, P]`` (no device read)."""
        n = plan.num_groups
        if plan.uniform:
            f = int(plan.flush[0, 0])
            return table_all.unsqueeze(2).expand(-1, -1, f, -1).reshape(n, -1)
        rows, dev = plan.group_rows, table_all.device
        return table_all[torch.from_numpy(rows[:, 0]).to(dev), torch.from_numpy(rows[:, 1]).to(dev)]

    def _compute_tables(
        self,
        plan: AppendPlan,
        gk: Tensor,
        positions: Tensor | None,
        member: np.ndarray,
        state: dict[str, Any],
    ) -> tuple[Tensor, np.ndarray]:
        """Tables of the rows whose groups ``member`` marks (rows without a table: each flushes
        its first group here), from every group they flush and the append's queries."""
        rows = plan.group_rows
        dev = gk.device
        pick = np.flatnonzero(member)
        picked = rows[pick]
        keys_rows, owner = np.unique(picked[:, :2], axis=0, return_inverse=True)
        owner = owner.reshape(-1)
        first = np.flatnonzero(picked[:, 2] == self._store.group_counts[picked[:, 0], picked[:, 1]])
        pick_t = torch.from_numpy(pick).to(dev)
        queries = state.get("queries")
        stats = TableStatistics(
            keys=gk.index_select(0, pick_t),
            owner=torch.from_numpy(owner).to(dev),
            first=torch.from_numpy(first).to(dev),
            storage_dtype=self._config.storage_dtype,
            layout=self._layout,
            moment=(
                None
                if queries is None
                else self._query_moment(queries, plan, keys_rows, state.get("query_lengths"))
            ),
            positions=None if positions is None else positions.index_select(0, pick_t),
            rotary=self._rotary,
        )
        table = self._codec.compute_table(stats).to(self._codec.table_dtype)
        return table, keys_rows

    def check_values(self, *, assume_valid: bool = False) -> None:
        """Raise if a ``checks="deferred"`` append stored non-finite or out-of-range values
        (one device read, only when such appends happened since the last check); also brings
        masks computed by deferred appends to the host.

        Args:
            assume_valid: the caller has read :meth:`pending_check` as True (e.g. batched with
                other layers' flags): clear it without reading it again.

        Raises:
            ValueError: the offending values are stored (the cache should be reset).
        """
        pending, self._pending_ok = self._pending_ok, None
        if assume_valid:
            pending = None
        if not self._mask_host_known.all():
            rows = np.argwhere(~self._mask_host_known)
            idx = [torch.from_numpy(rows[:, i]).to(self.device) for i in range(2)]
            host = np.asarray(self._mask_bool[idx[0], idx[1]].tolist(), dtype=bool)
            self._mask_host[rows[:, 0], rows[:, 1]] = host.reshape(rows.shape[0], -1)
            self._mask_host_known[:] = True
            self._active_pairs_valid = False
        if pending is not None and not bool(pending):
            raise ValueError(
                "an append with deferred checks stored keys or values that are NaN, inf or "
                "beyond the storage dtype's range (or a key scalar beyond it); the cache holds "
                "them and should be reset. "
                + storage_range_message("a value", self._config.storage_dtype)
            )

    def single_token_fits(self, keys: Tensor, values: Tensor) -> bool:
        """Whether appending ``keys [B, H_kv, 1, D]`` / ``values [B, H_kv, 1, Dv]`` (one token
        per row, floating, on the storage device) only writes one residual slot per row: every
        row's sinks are full and its residual takes the token without a flush. Then
        :meth:`commit_single_token` after writing the slot equals ``append(keys, values,
        checks="deferred")`` (the decode fast path, docs/design.md "Kernels")."""
        g, s = self._geometry, self._store
        return (
            self._device_fixed
            and keys.dim() == 4
            and values.dim() == 4
            and keys.shape == (g.batch_size, g.num_key_value_heads, 1, g.head_dim)
            and values.shape == (g.batch_size, g.num_key_value_heads, 1, g.value_head_dim)
            and keys.is_floating_point()
            and values.is_floating_point()
            and keys.device == s.device
            and values.device == s.device
            and s.single_token_room > 0
        )

    def deferred_flag(self) -> Tensor:
        """The device flag that deferred appends AND their validity into (bool, 0-d; created
        True on first use); :meth:`check_values` reads it."""
        if self._pending_ok is None:
            self._pending_ok = torch.ones((), dtype=torch.bool, device=self.device)
        return self._pending_ok

    def commit_single_token(self) -> None:
        """Count the token a decode fast path wrote at residual slot ``residual_lengths`` of
        every row (see :meth:`single_token_fits`)."""
        self._store.note_residual_token()

    def pending_check(self) -> Tensor | None:
        """The device flag of appends not yet checked (True = all valid), or ``None``."""
        return self._pending_ok

    # ------------------------------------------------------------------ reading
    def group_positions(self, start: int, stop: int) -> Tensor:
        """RoPE positions (tokens) of group slots ``start .. stop - 1`` of every row, int64
        ``[B, H_kv, (stop - start) * T]`` on the storage device: ``offset + S + g * T + t``
        (docs/design.md, "Positions"; slots beyond a row's count get positions too)."""
        g = self._geometry
        t = g.group_tokens
        local = g.sink_tokens + np.arange(start * t, stop * t, dtype=np.int64)
        pos = self._store.position_offsets[..., None] + local[None, None, :]
        return torch.from_numpy(pos).to(self.device)

    def decode_groups(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Float32 keys ``[B, H_kv, (stop - start) * T, D]`` and values ``[..., Dv]`` of group
        slots ``start .. stop - 1`` of every row, decoded exactly as :meth:`dequantize` does
        (slots beyond a row's count decode whatever they hold): codes unpacked and decoded,
        the payload applied, position-aware keys rotated to their positions, values mapped
        back by the value codec's output transform."""
        s, g = self._store, self._geometry
        b, h, t = g.batch_size, g.num_key_value_heads, g.group_tokens
        n = stop - start
        table = self.codec_mask()
        kc = self._codec.unpack(
            s.key_codes[:, :, start:stop],
            t,
            self._layout,
            None if table is None else table[:, :, None],
        )
        if table is not None:
            table = table.unsqueeze(2).expand(-1, -1, n, -1).reshape(b * h * n, table.shape[-1])
        keys = self._codec.decode(
            kc.reshape(b * h * n, t, g.head_dim),
            s.key_scalars[:, :, start:stop].reshape(b * h * n, g.key_scalar_count),
            self._layout,
            table,
        )
        payload = s.key_payload[:, :, start:stop].reshape(b * h * n, g.key_payload_bytes)
        keys = self._codec.apply_payload(keys, payload, g.storage_dtype)
        keys = keys.reshape(b, h, n * t, g.head_dim)
        if self._codec.position_aware:
            assert self._rotary is not None
            keys = rotate_by_delta(keys, self.group_positions(start, stop), self._rotary)
        vc = unpack_codes(s.value_codes[:, :, start:stop], g.bits, t * g.value_head_dim)
        values = self._value_codec.decode(
            vc.reshape(b, h, n, t, g.value_head_dim), s.value_scalars[:, :, start:stop]
        )
        values = self._value_codec.output_transform(values)
        return keys, values.reshape(b, h, n * t, g.value_head_dim)

    def dequantize(self) -> tuple[Tensor, Tensor]:
        """The whole cache in float32, each row in stream order (sinks, groups, residual).

        Reference/testing only (attention never calls it).

        Returns:
            ``(keys [B, H_kv, L, D], values [B, H_kv, L, Dv])`` float32, ``L`` the longest
            row; shorter rows are followed by zeros.
        """
        s, g = self._store, self._geometry
        n_groups = int(s.group_counts.max(initial=0))
        gk, gv = self.decode_groups(0, n_groups)
        n_sink = int(s.sink_lengths.max(initial=0))
        n_res = int(s.residual_lengths.max(initial=0))
        keys = torch.cat(
            [s.sink_keys[:, :, :n_sink].float(), gk, s.residual_keys[:, :, :n_res].float()], 2
        )
        values = torch.cat(
            [s.sink_values[:, :, :n_sink].float(), gv, s.residual_values[:, :, :n_res].float()], 2
        )
        if s.is_uniform():
            return keys, values
        # compact each row: its sinks, its groups, its residual, then zeros
        lengths = s.seq_lengths
        width = int(lengths.max(initial=0))
        t = g.group_tokens
        pos = np.arange(width)[None, None, :]
        sl, gc = s.sink_lengths[..., None], s.group_counts[..., None]
        idx = np.where(
            pos < sl,
            pos,
            np.where(
                pos < sl + gc * t, n_sink + pos - sl, n_sink + n_groups * t + pos - sl - gc * t
            ),
        )
        valid = torch.from_numpy(pos < lengths[..., None]).to(self.device)
        idx_t = torch.from_numpy(np.where(pos < lengths[..., None], idx, 0)).to(self.device)
        out = []
        for x in (keys, values):
            picked = torch.gather(x, 2, idx_t[..., None].expand(-1, -1, -1, x.shape[-1]))
            out.append(torch.where(valid[..., None], picked, torch.zeros((), device=self.device)))
        return out[0], out[1]

    def select_batch(self, index: Tensor) -> None:
        """Keep/reorder sequences (beam search): sequence ``i`` becomes old ``index[i]``.

        Every buffer — exact tensors, packed codes, scalars and the packed mask — and every
        host count is row-selected; nothing is re-quantized. ``index`` may repeat entries and
        change the batch size. Reads ``index`` on the host (one device read when it lives on
        an accelerator).

        Args:
            index: 1-D integer tensor (or sequence of ints) of length >= 1, entries in
                ``0 .. B - 1``.

        Raises:
            ValueError: not 1-D, not integer, empty, or out of range.
        """
        idx = torch.as_tensor(index)
        if idx.dim() != 1 or idx.numel() == 0:
            raise ValueError(f"index must be a non-empty 1-D tensor, got shape {tuple(idx.shape)}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"index must have an integer dtype, got {idx.dtype}")
        host = np.asarray(idx.tolist(), dtype=np.int64)
        if host.min() < 0 or host.max() >= self.batch_size:
            raise ValueError(
                f"index entries must lie in 0..{self.batch_size - 1}, got "
                f"{host.min()}..{host.max()}"
            )
        self._store.select_batch(host)
        self._geometry = self._store.geometry
        dev_idx = torch.from_numpy(host).to(self.device)
        self._mask_bool = self._mask_bool.index_select(0, dev_idx)
        self._mask_host = self._mask_host[host].copy()
        self._mask_host_known = self._mask_host_known[host].copy()
        self._active_pairs_valid = False

    def __repr__(self) -> str:
        c = self._config
        lengths = self._store.seq_lengths
        return (
            f"PNMixCache(B={self.batch_size}, H_kv={self._num_heads}, D={self._head_dim}, "
            f"Dv={self._value_head_dim}, bits={c.bits}, key_coding={str(c.key_coding)!r}, "
            f"seq_lengths={int(lengths.min())}..{int(lengths.max(initial=0))}, "
            f"groups={int(self._store.group_counts.max(initial=0))})"
        )
