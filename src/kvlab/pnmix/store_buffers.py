"""The buffers and host counts of a PN-Mix store (docs/design.md, "Storage format", "Byte
accounting"): :class:`StoreGeometry` (the sizes) and :class:`StoreBuffers` — allocation and
growth of the buffers, the per-row counts, byte accounting, the packed per-pair table, the
rows' position offsets and beam selection.

:class:`kvlab.pnmix.store.PackedStore` (where the layout is described) is a
:class:`StoreBuffers` plus the append path (plan, gather, write) and the view that attention
and its kernels read (:class:`~kvlab.pnmix.store.PackedKV`). Split from it by reason to change:
how an append moves tokens into the buffers does not touch their layout or their accounting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.packing import pack_codes, packed_length, unpack_codes
from kvlab.rope import rotate_by_delta

__all__ = ["GROUP_BUFFERS", "StoreBuffers", "StoreGeometry"]


@dataclass(frozen=True)
class StoreGeometry:
    """Sizes of a :class:`PackedStore` (tokens, channels, bytes).

    Attributes:
        batch_size: sequences ``B``.
        num_key_value_heads: kv heads ``H``.
        head_dim, value_head_dim: key / value channels ``D`` / ``Dv``.
        bits: code width of keys and values.
        sink_tokens, residual_tokens, group_tokens: ``S``, ``R``, ``T`` (tokens).
        key_scalar_count: storage-dtype key scalars per row and group ``S_k``.
        storage_dtype: dtype of exact tokens and scalars.
        mask_bytes: bytes of the packed per-pair table per sequence (0: no table).
        key_payload_bytes: ``E``, bytes of the key codec's per-group payload per row.
        table_bits: bits per entry of the packed per-pair table (0: no table).
        key_code_bytes: ``Kb`` (default ``ceil(T * D * bits / 8)``).
        value_choice_bytes: bytes of a row's recorded value-coding choice (0: the value codec
            makes none; 1 for ``"hadamard_auto"``), counted once the row has flushed a group.
        value_scalar_count: storage-dtype value scalars per row and group ``S_v`` (default
            ``2 * T``: one scale and zero per token; ``2 * T * G`` with ``G`` channel groups).
    """

    batch_size: int
    num_key_value_heads: int
    head_dim: int
    value_head_dim: int
    bits: int
    sink_tokens: int
    residual_tokens: int
    group_tokens: int
    key_scalar_count: int
    storage_dtype: torch.dtype
    mask_bytes: int = 0
    key_payload_bytes: int = 0
    table_bits: int = 0
    key_code_bytes: int = -1
    value_choice_bytes: int = 0
    value_scalar_count: int = -1

    def __post_init__(self) -> None:
        if self.value_scalar_count < 0:
            object.__setattr__(self, "value_scalar_count", 2 * self.group_tokens)
        if self.key_code_bytes < 0:
            kb = packed_length(self.group_tokens * self.head_dim, self.bits)
            object.__setattr__(self, "key_code_bytes", kb)
        if self.mask_bytes and not self.table_bits:
            object.__setattr__(self, "table_bits", 1)

    @property
    def value_code_bytes(self) -> int:
        """``Vb``: packed value-code bytes of one row's group."""
        return packed_length(self.group_tokens * self.value_head_dim, self.bits)

    @property
    def residual_capacity(self) -> int:
        """Most tokens a residual holds between appends: ``R + T - 1``."""
        return self.residual_tokens + self.group_tokens - 1


#: The per-group buffers of a store, in :class:`~kvlab.pnmix.store.EncodedGroups` order.
GROUP_BUFFERS = ("key_codes", "key_scalars", "value_codes", "value_scalars", "key_payload")


class StoreBuffers:
    """The buffers, counts and accounting of one layer's store (module docstring); the base of
    :class:`kvlab.pnmix.store.PackedStore`, which is what the cache builds.

    Buffers are public attributes; treat them as read-only outside the store.

    Args:
        geometry: the sizes.
        device: where the buffers live.
    """

    def __init__(self, geometry: StoreGeometry, device: torch.device | str) -> None:
        g = geometry
        self.geometry = g
        dev = torch.device(device)
        b, h, dt = g.batch_size, g.num_key_value_heads, g.storage_dtype
        self.sink_keys = torch.zeros((b, h, g.sink_tokens, g.head_dim), dtype=dt, device=dev)
        self.sink_values = torch.zeros(
            (b, h, g.sink_tokens, g.value_head_dim), dtype=dt, device=dev
        )
        r = g.residual_capacity
        self.residual_keys = torch.zeros((b, h, r, g.head_dim), dtype=dt, device=dev)
        self.residual_values = torch.zeros((b, h, r, g.value_head_dim), dtype=dt, device=dev)
        self.key_codes: Tensor
        self.key_scalars: Tensor
        self.value_codes: Tensor
        self.value_scalars: Tensor
        self.key_payload: Tensor
        self._set_group_buffers(self._group_buffers(b, 0, dev))
        self.mask: Tensor | None = (
            torch.zeros((b, g.mask_bytes), dtype=torch.uint8, device=dev) if g.mask_bytes else None
        )
        self._set_counts(np.zeros((3, b, h), dtype=np.int64))
        self.mask_rows = np.zeros((b, h), dtype=bool)
        #: rows whose value-coding choice is recorded (``value_choice_bytes`` each)
        self.value_choice_rows = np.zeros((b, h), dtype=bool)
        self.position_offsets = np.zeros((b, h), dtype=np.int64)

    # ------------------------------------------------------------------ counts
    def _set_counts(self, counts: np.ndarray) -> None:
        self.counts = counts
        self._update_room()

    def restore_counts(self, counts: np.ndarray) -> None:
        """Make ``counts`` (host int64 ``[3, B, H]``, e.g. a copy taken before appends) the
        store's counts: the rows end where they ended then (a rollback: the buffers' used
        regions up to those counts must hold what they held then)."""
        self._set_counts(counts)

    def _update_room(self) -> None:
        g = self.geometry
        full = int(self.counts[0].min(initial=g.sink_tokens)) == g.sink_tokens
        used = int(self.counts[2].max(initial=0))
        self.single_token_room = g.residual_capacity - used if full else 0

    @property
    def sink_lengths(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): sink tokens per row (a view of :attr:`counts`)."""
        return self.counts[0]

    @sink_lengths.setter
    def sink_lengths(self, value: np.ndarray) -> None:
        self.counts[0] = value

    @property
    def group_counts(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): quantized groups per row (a view of :attr:`counts`)."""
        return self.counts[1]

    @group_counts.setter
    def group_counts(self, value: np.ndarray) -> None:
        self.counts[1] = value

    @property
    def residual_lengths(self) -> np.ndarray:
        """int64 ``[B, H]`` (host): residual tokens per row (a view of :attr:`counts`)."""
        return self.counts[2]

    @residual_lengths.setter
    def residual_lengths(self, value: np.ndarray) -> None:
        self.counts[2] = value

    def note_residual_token(self) -> None:
        """Count one token per row that a kernel wrote at residual slot ``residual_lengths``
        (only while :attr:`single_token_room` > 0: sinks full, no flush)."""
        assert self.single_token_room > 0
        self.counts[2] += 1
        self.single_token_room -= 1

    # ------------------------------------------------------------------ description
    @property
    def device(self) -> torch.device:
        return self.sink_keys.device

    @property
    def batch_size(self) -> int:
        return self.geometry.batch_size

    @property
    def group_capacity(self) -> int:
        """``G_cap``: allocated group slots per row."""
        return self.key_codes.shape[2]

    @property
    def seq_lengths(self) -> np.ndarray:
        """int64 ``[B, H]``: tokens stored per row (sinks + groups + residual)."""
        return (
            self.sink_lengths
            + self.group_counts * self.geometry.group_tokens
            + self.residual_lengths
        )

    def stream_positions(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """RoPE positions (host int64 ``[n, T]``) of the tokens of group slots ``slots [n]`` of
        rows ``rows [n, 2]`` (``(b, h)``): ``position_offsets[b, h] + S + slot * T + t``."""
        g = self.geometry
        t = g.group_tokens
        base = self.position_offsets[rows[:, 0], rows[:, 1]] + g.sink_tokens + slots * t
        return base[:, None] + np.arange(t)[None, :]

    def is_uniform(self) -> bool:
        """Whether every row holds the same counts (then slices address every row alike)."""
        return all(
            int(a.min()) == int(a.max(initial=0))
            for a in (self.sink_lengths, self.group_counts, self.residual_lengths)
        )

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> dict[str, int]:
        """USED bytes by component, from the host counts (docs/design.md, "Byte accounting"):
        ``key_sink``, ``key_residual``, ``key_codes``, ``key_scales``, ``key_mask`` (the packed
        per-pair table of every sequence that has one), ``value_sink``, ``value_residual``,
        ``value_codes``, ``value_scales``, and ``key_payload`` (the key codec's per-group side
        data, e.g. exact outliers) for codecs that store one."""
        g = self.geometry
        es = torch.finfo(g.storage_dtype).bits // 8
        sinks = int(self.sink_lengths.sum())
        groups = int(self.group_counts.sum())
        res = int(self.residual_lengths.sum())
        masked = int(self.mask_rows.any(axis=1).sum())
        out = {
            "key_sink": sinks * g.head_dim * es,
            "key_residual": res * g.head_dim * es,
            "key_codes": groups * g.key_code_bytes,
            "key_scales": groups * g.key_scalar_count * es,
            "key_mask": masked * g.mask_bytes,
            "value_sink": sinks * g.value_head_dim * es,
            "value_residual": res * g.value_head_dim * es,
            "value_codes": groups * g.value_code_bytes,
            "value_scales": groups * g.value_scalar_count * es,
        }
        if g.key_payload_bytes:  # only codecs that store one (the seed's dict is pinned)
            out["key_payload"] = groups * g.key_payload_bytes
        if g.value_choice_bytes:  # only value codecs that choose per row
            out["value_choice"] = int(self.value_choice_rows.sum()) * g.value_choice_bytes
        return out

    def reserved_bytes(self) -> dict[str, int]:
        """ALLOCATED bytes by buffer (capacity, including unused slots)."""
        out = {
            name: t.numel() * t.element_size()
            for name, t in (
                ("sink_keys", self.sink_keys),
                ("sink_values", self.sink_values),
                ("key_codes", self.key_codes),
                ("key_scalars", self.key_scalars),
                ("value_codes", self.value_codes),
                ("value_scalars", self.value_scalars),
                ("key_payload", self.key_payload),
                ("residual_keys", self.residual_keys),
                ("residual_values", self.residual_values),
            )
        }
        out["mask"] = 0 if self.mask is None else self.mask.numel()
        return out

    # ------------------------------------------------------------------ capacity
    def _group_buffers(
        self, batch: int, capacity: int, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Zero buffers in :data:`GROUP_BUFFERS` order."""
        g = self.geometry
        h, dt, u8 = g.num_key_value_heads, g.storage_dtype, torch.uint8
        return (
            torch.zeros((batch, h, capacity, g.key_code_bytes), dtype=u8, device=device),
            torch.zeros((batch, h, capacity, g.key_scalar_count), dtype=dt, device=device),
            torch.zeros((batch, h, capacity, g.value_code_bytes), dtype=u8, device=device),
            torch.zeros((batch, h, capacity, g.value_scalar_count), dtype=dt, device=device),
            torch.zeros((batch, h, capacity, g.key_payload_bytes), dtype=u8, device=device),
        )

    def _group_tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in GROUP_BUFFERS)

    def _set_group_buffers(self, buffers: tuple[Tensor, ...]) -> None:
        for name, t in zip(GROUP_BUFFERS, buffers, strict=True):
            setattr(self, name, t)

    def reserve_groups(self, groups: int) -> None:
        """Make room for ``groups`` group slots per row (capacity at least doubles)."""
        cap = self.group_capacity
        if groups <= cap:
            return
        new_cap = max(groups, 2 * cap, 4)
        used = int(self.group_counts.max(initial=0))
        fresh = self._group_buffers(self.batch_size, new_cap, self.device)
        for new, cur in zip(fresh, self._group_tensors(), strict=True):
            new[:, :, :used] = cur[:, :, :used]
        self._set_group_buffers(fresh)

    # ------------------------------------------------------------------ per-pair table
    def write_mask(self, rows: np.ndarray, entries: Tensor) -> None:
        """Set the per-pair table of rows ``(b, h)`` (int64 ``[n, 2]``) to ``entries`` (``[n,
        P]``, bool or uint8 ``< 2 ** table_bits``; a mix mask is its bool mask)."""
        assert self.mask is not None
        if rows.shape[0] == 0:
            return
        h = self.geometry.num_key_value_heads
        nbits = self.geometry.table_bits
        p = entries.shape[-1]
        seqs = np.unique(rows[:, 0])
        pos = np.searchsorted(seqs, rows[:, 0])
        dev = self.mask.device
        seq_idx = torch.from_numpy(seqs).to(dev)
        current = unpack_codes(self.mask[seq_idx], nbits, h * p).reshape(len(seqs), h, p)
        current[torch.from_numpy(pos).to(dev), torch.from_numpy(rows[:, 1]).to(dev)] = entries.to(
            device=dev, dtype=torch.uint8
        )
        self.mask[seq_idx] = pack_codes(current.reshape(len(seqs), h * p), nbits, check=False)
        self.mask_rows[rows[:, 0], rows[:, 1]] = True

    def read_table_entries(self, num_pairs: int) -> Tensor:
        """The stored table entries, uint8 ``[B, H, P]`` (rows without a table read 0)."""
        assert self.mask is not None
        h = self.geometry.num_key_value_heads
        entries = unpack_codes(self.mask, self.geometry.table_bits, h * num_pairs)
        return entries.reshape(self.batch_size, h, num_pairs)

    # ------------------------------------------------------------------ positions
    def shift_positions(self, delta: np.ndarray, rotary: Any) -> None:
        """Move every token of row ``(b, h)`` by ``delta[b, h]`` positions (host int64 ``[B,
        H]``): the position offsets change and the exact sink and residual keys (stored
        rotated at their positions) are rotated by ``delta`` (:func:`kvlab.rope.
        rotate_by_delta`, float32, rounded to the storage dtype). Codes are not touched: a
        position-aware codec's codes hold position-0 keys (docs/design.md, "Positions")."""
        delta = np.asarray(delta, dtype=np.int64)
        if not delta.any():
            return
        d = torch.from_numpy(delta).to(self.device)[..., None]  # [B, H, 1]
        for name in ("sink_keys", "residual_keys"):
            buf = getattr(self, name)
            if buf.shape[2]:
                buf.copy_(rotate_by_delta(buf.float(), d, rotary).to(buf.dtype))
        self.position_offsets = self.position_offsets + delta

    # ------------------------------------------------------------------ beams
    def select_batch(self, index: np.ndarray) -> None:
        """Row-select every buffer and count by ``index`` (host int64 ``[B']``, entries in range,
        already validated): sequence ``i`` becomes old ``index[i]``; bytes are copied exactly."""
        idx = torch.from_numpy(np.ascontiguousarray(index)).to(self.device)
        for name in (
            "sink_keys",
            "sink_values",
            "residual_keys",
            "residual_values",
            *GROUP_BUFFERS,
        ):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
        self.mask_rows = self.mask_rows[index].copy()
        self.value_choice_rows = self.value_choice_rows[index].copy()
        self.position_offsets = self.position_offsets[index].copy()
        self.geometry = dataclasses.replace(self.geometry, batch_size=int(index.shape[0]))
        self._set_counts(self.counts[:, index].copy())
