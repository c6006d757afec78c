"""The per-row side state of a PN-Mix cache: per-pair tables (a mix's mask, per-pair code
widths) and the per-row value-coding choice — how they are stored, recorded and read
(docs/design.md, "Per-pair tables", "Value codecs").

:class:`CacheTables` extends :class:`~kvlab.pnmix.cache_state.CacheState` and is the base of
the cache's flush path (:class:`kvlab.pnmix.cache_flush.CacheFlush`, which computes the tables)
and read path (:class:`kvlab.pnmix.cache_decode.CacheDecode`, which decodes with them). Split
from the state by reason to change: a new table-keeping codec changes this module, not the
cache's geometry, lengths or byte accounting.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.cache_state import CacheState, Checks
from kvlab.pnmix.codecs import MixCodec, PairCodec, PhaseNormCodec
from kvlab.pnmix.width_codec import BitAllocCodec

__all__ = ["CacheTables"]


class CacheTables(CacheState):
    """Per-pair tables and value choices of a PN-Mix cache (module docstring; a base of
    :class:`kvlab.pnmix.cache.PNMixCache`)."""

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

    # ------------------------------------------------------------------ tables
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

    def _record_value_choice(self, rows: np.ndarray, mse: Tensor, checks: Checks) -> None:
        """Record the value coding of rows ``rows [n, 2]`` (``mse``: device bool ``[n]``, True =
        squared-error ranges): device copy, counted bytes, and the host copy when the append
        was eager (one device read)."""
        dev = self.device
        self._value_mse[
            torch.from_numpy(rows[:, 0]).to(dev), torch.from_numpy(rows[:, 1]).to(dev)
        ] = mse.to(dev)
        self._store.value_choice_rows[rows[:, 0], rows[:, 1]] = True
        if checks == "eager":
            self._value_mse_host[rows[:, 0], rows[:, 1]] = np.asarray(mse.tolist(), dtype=bool)
            self._value_mse_known[rows[:, 0], rows[:, 1]] = True
        else:
            self._value_mse_known[rows[:, 0], rows[:, 1]] = False

    @property
    def value_mse_rows(self) -> np.ndarray | None:
        """With ``value_coding="hadamard_auto"``: host bool ``[B, H_kv]``, True where the row
        codes its values with squared-error ranges (False: min-max, or no group flushed yet);
        one device read when a deferred append chose. ``None`` for other value codings."""
        if self._geometry.value_choice_bytes == 0:
            return None
        return np.asarray(self._value_mse.tolist(), dtype=bool).reshape(self._value_mse.shape)

    @property
    def value_choice_errors(self) -> Tensor:
        """float64 ``[B, H_kv, 2]`` (device): per row, the attention-weighted output errors of
        min-max and squared-error value ranges its choice compared (squared value units;
        ``nan`` where no choice was made from queries)."""
        return self._value_choice_errors
