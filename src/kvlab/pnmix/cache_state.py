"""What a PN-Mix cache holds and reports: its state, read-only views, positions and byte
accounting (docs/design.md, "PN-Mix", "Storage format", "Positions", "Byte accounting").

:class:`CacheState` is the base of every part of :class:`kvlab.pnmix.cache.PNMixCache` (which
constructs it and writes tokens: :mod:`kvlab.pnmix.cache`): its per-row tables
(:class:`kvlab.pnmix.cache_tables.CacheTables`), its flush path
(:class:`kvlab.pnmix.cache_flush.CacheFlush`) and its read path
(:class:`kvlab.pnmix.cache_decode.CacheDecode`). Nothing here codes a token: a change to how
groups are flushed or decoded does not touch this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.codecs import KeyCodec, KeyLayout, MixCodec
from kvlab.pnmix.config import PNMixConfig
from kvlab.pnmix.kernels.spec import KernelKeyDecode
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.store import PackedStore, StoreGeometry
from kvlab.pnmix.values import ValueCodec
from kvlab.rope import RotaryConfig

__all__ = ["CacheState", "Checks", "PackedGroup"]


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
        value_scale, value_zero: storage dtype ``[B, H_kv, T * G]`` (per token, token-major over
            the value codec's ``G`` channel groups; ``G = 1`` without ``group_channels``).
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


class CacheState:
    """The state of a PN-Mix cache of one layer and everything read from it without decoding
    (docs/design.md, "PN-Mix"). Not constructed directly: :class:`kvlab.pnmix.cache.PNMixCache`
    sets these attributes in its constructor (and :meth:`_reset_storage`).

    Attributes (private; see :class:`~kvlab.pnmix.cache.PNMixCache` for their meaning):
        _config, _codec, _value_codec, _rotary: the configuration and its codecs.
        _kernel_decode, _flush_unsupported: what the compiled kernels make of the codecs.
        _num_heads, _head_dim, _value_head_dim, _rotary_dim, _layout, _geometry: the geometry.
        _device_fixed: whether the storage device is decided.
        _store: the packed buffers and host counts.
        _mask_bool, _mask_host, _mask_host_known, _active_pairs, _active_pairs_valid: derived
            copies of the per-pair tables (device; a mix's mask on the host).
        _pending_ok: the device flag of deferred-checked appends (``None``: none pending).
        _saliency_computations, _attention_calls: counters.
    """

    _config: PNMixConfig
    _codec: KeyCodec
    _kernel_decode: KernelKeyDecode | str
    _flush_unsupported: str | None
    _value_codec: ValueCodec
    _rotary: RotaryConfig | None
    _num_heads: int
    _head_dim: int
    _value_head_dim: int
    _rotary_dim: int
    _device_fixed: bool
    _layout: KeyLayout
    _geometry: StoreGeometry
    _store: PackedStore
    _mask_bool: Tensor
    _mask_host: np.ndarray
    _mask_host_known: np.ndarray
    _active_pairs: Tensor | None
    _active_pairs_valid: bool
    _pending_ok: Tensor | None
    _saliency_computations: int
    _attention_calls: int
    _attention_backends: dict[str, int]

    def _reset_storage(self, device: torch.device) -> None:
        """Empty storage on ``device`` and fresh derived table copies (construction, and the
        first append when the device was not given)."""
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
        # a "hadamard_auto" value codec's per-row choice (True: squared-error ranges), its host
        # copy (valid where known) and the errors it was chosen by
        bh = (g.batch_size, g.num_key_value_heads)
        self._value_mse = torch.zeros(bh, dtype=torch.bool, device=device)
        self._value_mse_host = np.zeros(bh, dtype=bool)
        self._value_mse_known = np.ones(bh, dtype=bool)
        self._value_choice_errors = torch.full(
            (*bh, 2), math.nan, dtype=torch.float64, device=device
        )

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
        v_half = g.value_scalar_count // 2
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
                    value_scale=vs[..., :v_half],
                    value_zero=vs[..., v_half:],
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

    @property
    def attention_backends(self) -> dict[str, int]:
        """Attention calls by the backend that ran them (``"torch"``, ``"cpu"``, ``"triton"``):
        whether a compiled kernel or the torch reference attended (a copy)."""
        return dict(self._attention_backends)

    def note_attention_call(self, backend: str) -> None:
        """Count one attention call run by ``backend`` (:func:`kvlab.pnmix.attention.
        pnmix_attention` and the fused decode step call it)."""
        self._attention_calls += 1
        self._attention_backends[backend] = self._attention_backends.get(backend, 0) + 1

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

    # ------------------------------------------------------------------ rows
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
        self._value_mse = self._value_mse.index_select(0, dev_idx)
        self._value_mse_host = self._value_mse_host[host].copy()
        self._value_mse_known = self._value_mse_known[host].copy()
        self._value_choice_errors = self._value_choice_errors.index_select(0, dev_idx)
