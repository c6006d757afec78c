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

Modules: this one constructs the cache and writes tokens (appends, their checks, the decode
fast path's single-token commit, undo points); its bases are :mod:`kvlab.pnmix.cache_state`
(the state and its read-only views: lengths, buffers, positions, bytes),
:mod:`kvlab.pnmix.cache_tables` (per-pair tables and value choices as stored),
:mod:`kvlab.pnmix.cache_flush` (how an append's flushed groups are coded: codecs or the compiled
flush, table computation, the value choice) and :mod:`kvlab.pnmix.cache_decode` (the read path:
decoded groups, :meth:`~kvlab.pnmix.cache_decode.CacheDecode.dequantize`, the
:class:`~kvlab.pnmix.store.PackedKV` attention reads); every public name stays importable from
here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.cache_decode import CacheDecode
from kvlab.pnmix.cache_flush import CacheFlush
from kvlab.pnmix.cache_state import Checks, PackedGroup
from kvlab.pnmix.codecs import KeyLayout
from kvlab.pnmix.config import KeyCoding, PNMixConfig, check_int
from kvlab.pnmix.kernels.cpu import flush_unsupported
from kvlab.pnmix.kernels.dispatch import requested_backend
from kvlab.pnmix.kernels.spec import kernel_key_decode
from kvlab.pnmix.packing import packed_length
from kvlab.pnmix.quantizers import storage_range_message
from kvlab.pnmix.store import AppendPlan, EncodedGroups, StoreGeometry
from kvlab.pnmix.values import AutoHadamardValueCodec
from kvlab.rope import RotaryConfig

__all__ = ["KeyCoding", "PNMixCache", "PNMixConfig", "PackedGroup", "UndoPoint"]


class UndoPoint(NamedTuple):
    """One :meth:`PNMixCache.undo_point`: the store's host counts (int64 ``[3, B, H]``) and,
    when the next append may change more than one residual slot, copies of the exact
    buffers and table state (``None`` otherwise)."""

    counts: np.ndarray
    snapshot: dict[str, Any] | None


class PNMixCache(CacheFlush, CacheDecode):
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
        # a per-row value choice: groups are first coded min-max, then the rows that chose
        # squared-error ranges get their values recoded (_encode)
        self._auto_values = type(value_codec) is AutoHadamardValueCodec
        flush_values = (
            value_codec.minmax if isinstance(value_codec, AutoHadamardValueCodec) else value_codec
        )
        self._flush_value_codec = flush_values
        # None when the compiled CPU flush codes this cache's groups (docs/design.md, "Flush")
        self._flush_unsupported = flush_unsupported(
            codec, flush_values, config.storage_dtype, config.group_tokens, value_head_dim
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
            value_choice_bytes=1 if self._auto_values else 0,
            value_scalar_count=value_codec.scalar_count(config.group_tokens, value_head_dim),
        )
        self._saliency_computations = 0
        self._attention_calls = 0
        self._attention_backends = {}
        self._reset_storage(dev)

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
        state: dict[str, Any] = {"queries": queries, "query_lengths": real_queries, "keys": k}

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
        if "value_rows" in state:
            self._record_value_choice(state["value_rows"], state["value_mse"], checks)

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

    def undo_point(self) -> UndoPoint:
        """What :meth:`rollback` needs to put the cache back as it is now, taken before an
        append of ONE token per row (speculative decoding's decode steps, docs/design.md
        "Cache life cycle"): the host counts, and — only when that append may change more than
        one residual slot (sinks not full, or a flush due: :meth:`single_token_fits` false) —
        a copy of the exact sink and residual buffers and the per-pair table state. Group
        buffers are not copied: an append never rewrites a used group slot."""
        s = self._store
        snapshot = None
        if s.single_token_room == 0:
            snapshot = {
                "sink_keys": s.sink_keys.clone(),
                "sink_values": s.sink_values.clone(),
                "residual_keys": s.residual_keys.clone(),
                "residual_values": s.residual_values.clone(),
                "mask": None if s.mask is None else s.mask.clone(),
                "mask_rows": s.mask_rows.copy(),
                "mask_bool": self._mask_bool.clone(),
                "mask_host": self._mask_host.copy(),
                "mask_host_known": self._mask_host_known.copy(),
                "value_choice_rows": s.value_choice_rows.copy(),
                "value_mse": self._value_mse.clone(),
                "value_mse_host": self._value_mse_host.copy(),
                "value_mse_known": self._value_mse_known.copy(),
                "value_choice_errors": self._value_choice_errors.clone(),
            }
        return UndoPoint(s.counts.copy(), snapshot)

    def rollback(self, points: list[UndoPoint]) -> None:
        """Put the cache back as it was at ``points[0]``, where ``points`` are the
        :meth:`undo_point` results of consecutive one-token appends, in order, up to the last
        append (then the stored bytes and counts equal those of a cache that never received
        the removed tokens: flushed groups are un-flushed, their exact tokens back in the
        residual). Deferred value checks of the removed tokens stay pending (a bad removed
        token still raises in :meth:`check_values`).

        Raises:
            ValueError: ``points`` is empty.
        """
        if not points:
            raise ValueError("rollback needs at least one undo point")
        s = self._store
        # the first copied state at or after points[0]: no append between points[0] and it
        # changed more than one residual slot, so its buffers hold points[0]'s tokens
        snapshot = next((p.snapshot for p in points if p.snapshot is not None), None)
        if snapshot is not None:
            for name in ("sink_keys", "sink_values", "residual_keys", "residual_values", "mask"):
                setattr(s, name, snapshot[name])
            s.mask_rows = snapshot["mask_rows"]
            self._mask_bool = snapshot["mask_bool"]
            self._mask_host = snapshot["mask_host"]
            self._mask_host_known = snapshot["mask_host_known"]
            s.value_choice_rows = snapshot["value_choice_rows"]
            self._value_mse = snapshot["value_mse"]
            self._value_mse_host = snapshot["value_mse_host"]
            self._value_mse_known = snapshot["value_mse_known"]
            self._value_choice_errors = snapshot["value_choice_errors"]
            self._active_pairs_valid = False
        s.restore_counts(points[0].counts.copy())

    def pending_check(self) -> Tensor | None:
        """The device flag of appends not yet checked (True = all valid), or ``None``."""
        return self._pending_ok

    def __repr__(self) -> str:
        c = self._config
        lengths = self._store.seq_lengths
        return (
            f"PNMixCache(B={self.batch_size}, H_kv={self._num_heads}, D={self._head_dim}, "
            f"Dv={self._value_head_dim}, bits={c.bits}, key_coding={str(c.key_coding)!r}, "
            f"seq_lengths={int(lengths.min())}..{int(lengths.max(initial=0))}, "
            f"groups={int(self._store.group_counts.max(initial=0))})"
        )
