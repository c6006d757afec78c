"""How a PN-Mix cache codes the groups an append flushes (docs/design.md, "PN-Mix",
"Per-pair tables", "Value codecs", "Kernels", "Flush").

:class:`CacheFlush` is the flush path of :class:`kvlab.pnmix.cache.PNMixCache` (which plans and
checks appends: :mod:`kvlab.pnmix.cache`): the key codec's ``encode_groups`` and ``pack`` — or
the compiled CPU flush, the same bytes (:func:`~kvlab.pnmix.kernels.cpu.encode_groups_cpu`) — on
keys in the codec's frame (rotated back to position 0 for a position-aware codec), the per-pair
tables of rows flushing their first group (from their groups and the append's queries), and the
``"hadamard_auto"`` value choice of those rows. Split from the cache by reason to change: a new
codec or table rule changes this module, not how appends are planned, checked or undone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.cache_tables import CacheTables
from kvlab.pnmix.codecs import TableStatistics
from kvlab.pnmix.kernels.cpu import encode_groups_cpu
from kvlab.pnmix.kernels.cpu_tables import distortion_from_terms, table_terms_cpu
from kvlab.pnmix.kernels.dispatch import select_flush_backend
from kvlab.pnmix.key_codec import query_pair_moment
from kvlab.pnmix.packing import pack_codes
from kvlab.pnmix.store import AppendPlan, EncodedGroups
from kvlab.pnmix.values import AutoHadamardValueCodec, ValueCodec, attention_weighted_value_error
from kvlab.pnmix.width_codec import BitAllocCodec
from kvlab.rope import rotate_by_delta, rotation_tables

__all__ = ["CacheFlush"]


class CacheFlush(CacheTables):
    """The flush path of a PN-Mix cache (module docstring; a base of
    :class:`kvlab.pnmix.cache.PNMixCache`, whose constructor sets these attributes too).

    Attributes (private):
        _auto_values: the value codec chooses per row (``"hadamard_auto"``).
        _flush_value_codec: the value codec that codes a flush (``"hadamard_auto"``: its
            min-max half; the rows that chose squared-error ranges are recoded).
    """

    _auto_values: bool
    _flush_value_codec: ValueCodec

    def _query_moment(
        self,
        queries: Tensor,
        plan: AppendPlan,
        rows: np.ndarray,
        query_lengths: np.ndarray | None = None,
    ) -> Tensor:
        """float64 ``[n, 3, P]``: per row ``(b, h)`` of ``rows [n, 2]``, the pair entries of
        the mean of ``q q^T`` (:func:`~kvlab.pnmix.key_codec.query_pair_moment`) over the
        append's real queries of the row's GQA group (the last ``query_lengths[b]``, or those
        of the row's real tokens; no device read)."""
        dev = self.device
        b, hq, t, d = queries.shape
        h = self._num_heads
        rep = hq // h
        q = queries.to(dev).double().reshape(b, h, rep, t, d)
        every = np.arange(b * h)
        if rows.shape[0] == b * h and (rows[:, 0] * h + rows[:, 1] == every).all():
            picked = q.reshape(b * h, rep, t, d)  # every row, in order: no copy
        else:
            rb = torch.from_numpy(rows[:, 0]).to(dev)
            rh = torch.from_numpy(rows[:, 1]).to(dev)
            picked = q[rb, rh]  # [n, rep, T, D]
        if query_lengths is None:
            real = plan.lengths[rows[:, 0], rows[:, 1]]  # host [n]
        else:
            real = query_lengths[rows[:, 0]]
        if (real < t).any():  # zero the padding queries (nothing to zero otherwise)
            first = torch.from_numpy(t - real).to(dev)
            real_q = torch.arange(t, device=dev)[None, :] >= first[:, None]  # [n, T]
            picked = torch.where(real_q[:, None, :, None], picked, torch.zeros_like(picked))
        count = torch.from_numpy(np.maximum(real, 1) * rep).to(dev).double()
        return query_pair_moment(picked.reshape(-1, rep * t, d), self._layout, count)

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
        rope_keys = gk  # the keys as the queries see them (before any pre-RoPE frame)
        rows = plan.group_rows
        positions: Tensor | None = None
        ok = torch.ones((), dtype=torch.bool, device=dev)
        if codec.position_aware:
            pos_host = self._store.stream_positions(rows[:, :2], rows[:, 2])
            positions = torch.from_numpy(pos_host).to(dev)
        member = ~self._store.mask_rows[rows[:, 0], rows[:, 1]] if codec.table_bits else None
        if self._flush_unsupported is None and select_flush_backend(dev) == "cpu":
            # the compiled flush and table statistics (docs/design.md, "Kernels", "Flush"):
            # the same bytes as the torch codecs below, which code what the kernels decline
            fast = self._encode_compiled(plan, gk, gv, positions, member, state)
            if fast is not None:
                return self._recode_values(plan, rope_keys, gv, fast, state), ok
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
        vcodes, vscalars = self._flush_value_codec.encode(gv, dt)
        ok = ok & torch.isfinite(vscalars).all()
        payload = coded.payload if coded.payload.shape[-1] else None
        enc = EncodedGroups(
            codec.pack(coded.codes, lay, table),
            coded.scalars,
            pack_codes(vcodes.reshape(n, -1), self._config.bits, check=False),
            vscalars,
            payload,
        )
        return self._recode_values(plan, rope_keys, gv, enc, state), ok

    def _encode_compiled(
        self,
        plan: AppendPlan,
        gk: Tensor,
        gv: Tensor,
        positions: Tensor | None,
        member: np.ndarray | None,
        state: dict[str, Any],
    ) -> EncodedGroups | None:
        """The flushed groups coded by the compiled flush
        (:func:`~kvlab.pnmix.kernels.cpu.encode_groups_cpu`), the tables of rows flushing
        their first group computed first by the compiled statistics (:meth:`_compiled_tables`)
        and recorded in ``state`` — the bytes and tables of the torch path; or ``None`` (and
        ``state`` untouched) where a kernel declines and the torch codecs must code them."""
        codec = self._codec
        assert isinstance(codec, BitAllocCodec)
        frame_tables = None
        if positions is not None:
            assert self._rotary is not None
            frame_tables = rotation_tables(-positions, self._rotary, torch.float32)
        table_all = self._mask_bool
        new = None
        index = None
        if member is not None and member.any():
            new = self._compiled_tables(plan, gk, positions, frame_tables, member, state)
            if new is None:
                return None
            new_table, new_rows, index = new
            table_all = table_all.clone()
            dev = table_all.device
            table_all[
                torch.from_numpy(new_rows[:, 0]).to(dev),
                torch.from_numpy(new_rows[:, 1]).to(dev),
            ] = new_table
        fast = encode_groups_cpu(
            gk,
            gv,
            codec=codec,
            value_codec=self._flush_value_codec,
            layout=self._layout,
            table=self._group_tables(plan, table_all) if codec.table_bits else None,
            positions=positions,
            rotary=self._rotary,
            frame_tables=frame_tables,
            outlier_index=index,
        )
        if fast is not None and new is not None:
            state["mask_rows"], state["mask_bits"] = new[1], new[0]
        return fast

    def _compiled_tables(
        self,
        plan: AppendPlan,
        gk: Tensor,
        positions: Tensor | None,
        frame_tables: tuple[Tensor, Tensor] | None,
        member: np.ndarray,
        state: dict[str, Any],
    ) -> tuple[Tensor, np.ndarray, Tensor | None] | None:
        """:meth:`_compute_tables` of a width codec by the compiled statistics
        (:func:`~kvlab.pnmix.kernels.cpu_tables.table_terms_cpu`; the reference's bits):
        ``(tables, rows, outlier_index)`` — the outliers of every flushed group when every
        group computes a table (else ``None``) — or ``None`` where the kernel declines."""
        codec = self._codec
        assert isinstance(codec, BitAllocCodec)
        rows = plan.group_rows
        dev = gk.device
        pick = np.flatnonzero(member)
        every = pick.size == rows.shape[0]
        keys_rows, owner = np.unique(rows[pick, :2], axis=0, return_inverse=True)
        pick_t = torch.from_numpy(pick).to(dev)
        owner_t = torch.from_numpy(owner.reshape(-1)).to(dev)
        queries = state.get("queries")
        moment = None
        if queries is not None and codec.query_aware:
            moment = self._query_moment(queries, plan, keys_rows, state.get("query_lengths"))
        error_tables = None
        if moment is not None and positions is not None:
            assert self._rotary is not None
            error_tables = rotation_tables(
                positions.index_select(0, pick_t), self._rotary, torch.float64
            )
        keys, tables = gk, frame_tables
        if not every:
            keys = gk.index_select(0, pick_t)
            if frame_tables is not None:
                tables = (frame_tables[0][pick_t], frame_tables[1][pick_t])
        t, d = gk.shape[1:]
        out = table_terms_cpu(
            keys,
            layout=self._layout,
            widths=codec.widths,
            outliers=codec.outlier_count(t, d),
            frame_tables=tables,
            error_tables=error_tables,
            pair_moment=moment,
            owner=owner_t,
        )
        if out is None:
            return None
        terms, index = out
        distortion = distortion_from_terms(terms, owner_t, keys_rows.shape[0])
        table = codec.table_from_distortion(distortion).to(codec.table_dtype)
        return table, keys_rows, index if every else None

    # ------------------------------------------------------------------ value choice
    #: the last queries of an append that choose a row's value coding (at most; docs/design.md,
    #: "Value codecs")
    VALUE_CHOICE_QUERIES = 32

    def _recode_values(
        self,
        plan: AppendPlan,
        gk: Tensor,
        gv: Tensor,
        enc: EncodedGroups,
        state: dict[str, Any],
    ) -> EncodedGroups:
        """With ``"hadamard_auto"`` values: choose the coding of rows flushing their first group
        (to ``state``), and recode with squared-error ranges the groups of rows that use them;
        ``enc`` (min-max values) otherwise. No device read."""
        if not self._auto_values:
            return enc
        codec = self._value_codec
        assert isinstance(codec, AutoHadamardValueCodec)
        s = self._store
        rows = plan.group_rows
        dev = gv.device
        new = ~s.value_choice_rows[rows[:, 0], rows[:, 1]]  # host [N]: first flush of the row
        known = self._value_mse_known[rows[:, 0], rows[:, 1]]
        maybe_mse = new | ~known | self._value_mse_host[rows[:, 0], rows[:, 1]]
        if not maybe_mse.any():
            return enc
        dt = self._config.storage_dtype
        mcodes, mscalars = codec.mse.encode(gv, dt)
        use = self._value_mse[
            torch.from_numpy(rows[:, 0]).to(dev), torch.from_numpy(rows[:, 1]).to(dev)
        ]
        if new.any():
            new_rows, choice = self._choose_values(plan, gk, gv, mcodes, mscalars, new, state)
            state["value_rows"], state["value_mse"] = new_rows, choice
            owner = {tuple(r): i for i, r in enumerate(new_rows.tolist())}
            pick = np.flatnonzero(new)
            at = torch.from_numpy(np.array([owner[tuple(r)] for r in rows[pick, :2].tolist()]))
            use = use.clone()
            use[torch.from_numpy(pick).to(dev)] = choice[at.to(dev)]
        packed = pack_codes(mcodes.reshape(gv.shape[0], -1), self._config.bits, check=False)
        return enc._replace(
            value_codes=torch.where(use[:, None], packed, enc.value_codes),
            value_scalars=torch.where(use[:, None], mscalars, enc.value_scalars),
        )

    def _choose_values(
        self,
        plan: AppendPlan,
        gk: Tensor,
        gv: Tensor,
        mcodes: Tensor,
        mscalars: Tensor,
        new: np.ndarray,
        state: dict[str, Any],
    ) -> tuple[np.ndarray, Tensor]:
        """The value coding of each row flushing its first group: ``(rows [n, 2], mse [n])``
        (device bool: True = squared-error ranges), by
        :func:`~kvlab.pnmix.values.attention_weighted_value_error` of each candidate over the
        row's flushed groups, with the attention probabilities of the append's last
        ``min(VALUE_CHOICE_QUERIES, residual_tokens)`` real queries (at least 1) of the row's
        GQA group, under a softmax (scale ``1/sqrt(D)``, the models' default) over the append's
        real keys, each query seeing the keys up to its own end-aligned position. Groups
        precede the last ``residual_tokens`` tokens, so those queries see every group token.
        Exact for a first prefill; later, tokens stored before the append are missing from the
        softmax's denominator. Without queries a row keeps min-max (``mse`` False). Errors
        (float64 ``[min-max, squared-error]``) go to :attr:`value_choice_errors`."""
        codec = self._value_codec
        assert isinstance(codec, AutoHadamardValueCodec)
        rows = plan.group_rows
        dev = gv.device
        dt = self._config.storage_dtype
        pick = np.flatnonzero(new)
        new_rows = np.unique(rows[pick, :2], axis=0)
        n = new_rows.shape[0]
        queries = state.get("queries")
        if queries is None:
            return new_rows, torch.zeros(n, dtype=torch.bool, device=dev)
        keys: Tensor = state["keys"]  # [B, H, T, D] storage-rounded
        _, hq, tq, d = queries.shape
        h = self._num_heads
        rep = hq // h
        t = keys.shape[2]
        qlen = state.get("query_lengths")
        w = max(1, min(self.VALUE_CHOICE_QUERIES, self._config.residual_tokens))
        tv = codec.minmax.frame(gv, dt)  # [N, G, Dv] rotated, storage-rounded
        dec_min = codec.decode(*codec.minmax.encode(gv, dt))  # the bytes `enc` holds
        dec_mse = codec.decode(mcodes, mscalars)
        errors = torch.zeros((n, 2), dtype=torch.float64, device=dev)
        scale = 1.0 / math.sqrt(d)
        for i, (rb, rh) in enumerate(new_rows.tolist()):
            real_k = int(plan.lengths[rb, rh])
            real_q = real_k if qlen is None else int(qlen[rb])
            wq = min(w, real_q)
            if wq == 0:
                continue
            q = queries[rb, rh * rep : (rh + 1) * rep, tq - wq :].to(dev).double()  # [rep, wq, D]
            ks = keys[rb, rh].double()  # [T, D]
            logits = torch.einsum("rqd,td->rqt", q, ks) * scale
            idx = torch.arange(t, device=dev)
            visible = (idx[None, :] >= t - real_k) & (
                idx[None, :] <= (t - wq + torch.arange(wq, device=dev))[:, None]
            )
            lse = torch.where(visible[None], logits, torch.full_like(logits, -math.inf))
            lse = torch.logsumexp(lse, dim=-1, keepdim=True)  # [rep, wq, 1]
            mine = np.flatnonzero((rows[:, 0] == rb) & (rows[:, 1] == rh) & new)
            sel = torch.from_numpy(mine).to(dev)
            gkeys = gk.index_select(0, sel).reshape(-1, d).double()
            probs = torch.exp(torch.einsum("rqd,td->rqt", q, gkeys) * scale - lse)
            probs = probs.reshape(1, rep * wq, -1)
            x = tv.index_select(0, sel).reshape(1, -1, tv.shape[-1])
            for j, dec in enumerate((dec_min, dec_mse)):
                y = dec.index_select(0, sel).reshape(1, -1, tv.shape[-1])
                errors[i, j] = attention_weighted_value_error(probs, x, y, dt)[0]
        self._value_choice_errors[
            torch.from_numpy(new_rows[:, 0]).to(dev), torch.from_numpy(new_rows[:, 1]).to(dev)
        ] = errors
        return new_rows, errors[:, 1] < errors[:, 0]

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
            pair_moment=(
                None
                if queries is None
                else self._query_moment(queries, plan, keys_rows, state.get("query_lengths"))
            ),
            positions=None if positions is None else positions.index_select(0, pick_t),
            rotary=self._rotary,
        )
        table = self._codec.compute_table(stats).to(self._codec.table_dtype)
        return table, keys_rows
