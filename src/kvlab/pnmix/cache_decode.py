"""The read path of a PN-Mix cache: its quantized groups decoded to float32 keys and values
(docs/design.md, "PN-Mix", "Positions", "Attention"), and the view packed attention reads.

:class:`CacheDecode` decodes group slots exactly as packed attention's torch reference reads
them (:mod:`kvlab.pnmix.reference`; the compiled kernels agree to rounding), the whole cache
for reference and tests (:meth:`CacheDecode.dequantize`), and hands attention its
:class:`~kvlab.pnmix.store.PackedKV` (:meth:`CacheDecode.packed_kv`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvlab.pnmix.cache_tables import CacheTables
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.store import PackedKV
from kvlab.rope import rotate_by_delta

__all__ = ["CacheDecode"]


class CacheDecode(CacheTables):
    """Decoding of a :class:`~kvlab.pnmix.cache_tables.CacheTables` (a base of
    :class:`kvlab.pnmix.cache.PNMixCache`)."""

    def packed_kv(self) -> PackedKV:
        """What packed attention reads of this cache (:class:`~kvlab.pnmix.store.PackedKV`):
        views of the store's buffers, copies of its host counts and position offsets, and the
        codec description — the key codec, the rotary pairs, the per-pair table every row
        decodes with (:meth:`codec_mask`), the active pairs of a mix (:meth:`active_pairs`),
        the RoPE and the value codec. No device read."""
        return self._store.packed_kv(
            codec=self._codec,
            layout=self._layout,
            mask=self.codec_mask(),
            active_pairs=self.active_pairs(),
            rotary=self._rotary,
            value_codec=self._value_codec,
        )

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
