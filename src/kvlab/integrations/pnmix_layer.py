"""The PN-Mix cache layer: one :class:`kvlab.pnmix.PNMixCache` per full-attention decoder layer
of a :class:`~kvlab.integrations.pnmix_cache.PNMixModelCache` (its module docstring: a
forward, padding, checks and host syncs, speculative decoding).

:class:`PNMixLayer` implements the kvlab layer contract (:mod:`kvlab.integrations.layer`):
``update`` stashes; the plain way (:meth:`PNMixLayer.attend_plain`) commits the stash to the
PN-Mix storage — dropping padding, flushing groups — and attends with
:func:`kvlab.pnmix.pnmix_attention` (a prefill: exactly over its own keys and values); the
decode-phase tokens of a recording forward are appended one decode step at a time, each with an
undo point (:meth:`kvlab.pnmix.PNMixCache.undo_point`) that ``crop`` rolls back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvlab.integrations.attention import outputs_unused, unused_output
from kvlab.integrations.cache_protocol import CacheStorage
from kvlab.integrations.decode_steps import attend_decode_tokens, rollback_decode_tokens
from kvlab.integrations.dense_attention import dense_causal_attention
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.layer import Forward, KVLabLayer, LayerView, SharedState
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step
from kvlab.rope import RotaryConfig

__all__ = ["PNMixLayer", "PNMixState", "PNMixView"]


class PNMixState(SharedState):
    """What the PN-Mix layers of one model cache share besides :class:`~kvlab.integrations.
    layer.SharedState`: the forward's mask, read once for every layer (one host sync per
    multi-token forward, none for single-token forwards without a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self._key: tuple[Any, ...] | None = None
        self._mask: Tensor | None = None
        self._lengths: np.ndarray | None = None

    def lengths(
        self, mask: Tensor | None, batch: int, queries: int, columns: int, stored: np.ndarray | None
    ) -> np.ndarray | None:
        """Real tokens per row among the forward's ``queries`` new ones.

        Args:
            mask: the 2-D keep mask ``[B, columns + queries]`` or ``None``.
            batch: the forward's batch size ``B``.
            queries: the forward's new tokens ``Q``.
            columns: token columns the layer has seen before this forward (pads included).
            stored: int64 ``[B]`` tokens the layer stores per row (``None``: empty layer).

        Returns:
            host int64 ``[B]``, or ``None`` when all ``Q`` are real. The mask is read once per
            forward (one host sync; none without a mask), single-token forwards included: a
            mask whose past columns mark another number of real tokens than the row stores (a
            hole in a past position) is refused before anything is stored, never ignored
            (docs/design.md, "Cache life cycle").

        Raises:
            ValueError: a mask that is not 2-D, has the wrong number of rows or columns, pads a
                row's new tokens anywhere but on the left (in a single-token forward: at all),
                or whose past columns disagree with the tokens the layer stores for a row.
        """
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"PN-Mix caches take a 2-D attention_mask [B, past + Q] (or none), got {shape}"
            )
        if mask.shape[0] != batch:
            raise ValueError(f"attention_mask has {mask.shape[0]} rows; the batch has {batch}")
        if mask.shape[1] != columns + queries:
            raise ValueError(
                f"attention_mask has {mask.shape[1]} columns; the cache has seen {columns} "
                f"token columns and this forward adds {queries}: it needs {columns + queries}"
            )
        # an inference tensor has no version counter (it cannot change outside inference mode)
        version = None if mask.is_inference() else mask._version
        key = (id(mask), version, tuple(mask.shape), columns, queries)
        if key != self._key:
            self._lengths = self._read(mask, queries, columns, stored)
            if queries == 1 and not self._lengths.all():
                row = int(np.flatnonzero(self._lengths == 0)[0])
                raise ValueError(
                    f"attention_mask row {row}: a single-token forward marks its new token as "
                    "padding; PN-Mix stores the new token of every row in single-token forwards"
                )
            # only a mask that passed is remembered (a refused one is read again if retried);
            # held so that its id stays unique
            self._key, self._mask = key, mask
        lengths = self._lengths
        if lengths is None or (lengths == queries).all():
            return None
        return lengths.copy()

    @staticmethod
    def _read(mask: Tensor, queries: int, columns: int, stored: np.ndarray | None) -> np.ndarray:
        host = np.asarray(mask.bool().tolist(), dtype=np.int64)  # nonzero = keep
        new = host[:, columns:]
        lengths = new.sum(axis=1)
        left_padded = (new == (np.arange(queries)[None, :] >= queries - lengths[:, None])).all()
        if not left_padded:
            raise ValueError(
                "attention_mask pads a row's new tokens on the right or in between; PN-Mix "
                "takes left padding only (a row's real tokens last)"
            )
        past = host[:, :columns].sum(axis=1)
        expected = np.zeros_like(past) if stored is None else stored
        if (past != expected).any():
            row = int(np.flatnonzero(past != expected)[0])
            raise ValueError(
                f"attention_mask row {row} marks {int(past[row])} past tokens as real; the cache "
                f"stores {int(expected[row])} for that row (a mask with a hole in a past "
                "position is refused)"
            )
        return lengths


class PNMixView(LayerView):
    """Returned by :meth:`PNMixLayer.update`: commits the layer's stashed tokens and attends
    over its packed storage (:meth:`PNMixLayer.attend`)."""


class PNMixLayer(KVLabLayer):
    """One decoder layer's PN-Mix cache (a ``transformers`` cache layer).

    The :class:`kvlab.pnmix.PNMixCache` (``store``) is created lazily from the first keys that
    pass the forward's checks: batch size, ``num_key_value_heads``, ``head_dim`` and value head
    dim are read from them. ``update`` stashes a forward's keys and values; :meth:`commit`
    (called by the plain way, or by the next ``update`` when no attention ran) stores them.

    Args:
        config: the layer's PN-Mix configuration.
        exact_prefill: the first forward into an empty layer (more than one token) attends to
            its own keys and values exactly (they are stored packed for every later token), as
            ``transformers``' ``QuantizedCache`` and KIVI do.
        shared: the state the cache's PN-Mix layers share (a new one for a layer on its own).
        rotary: the RoPE a position-aware key codec rotates with (``None`` otherwise).
        layer_idx: the decoder layer (messages).

    Speculative decoding (docs/design.md "Cache life cycle"): the decode-phase tokens of a
    recording forward are appended one decode step at a time, each keeping an undo point, so
    that ``crop`` can remove them.
    """

    kind = "PN-Mix"
    view_class = PNMixView

    def __init__(
        self,
        config: PNMixConfig,
        exact_prefill: bool = True,
        shared: PNMixState | None = None,
        rotary: RotaryConfig | None = None,
        layer_idx: int | None = None,
    ) -> None:
        super().__init__(PNMixState() if shared is None else shared, layer_idx)
        self.shared: PNMixState
        self.config = config
        self.exact_prefill = exact_prefill
        self.rotary = rotary
        self._store: PNMixCache | None = None
        self.columns = 0
        self._pending: tuple[Tensor, Tensor] | None = None

    # ---------------------------------------------------------------- the layer contract
    def held_store(self) -> PNMixCache | None:
        return self._store

    def deferred_store(self) -> PNMixCache | None:
        return self._store

    def stash_states(
        self, key_states: Tensor, value_states: Tensor, kwargs: dict[str, Any]
    ) -> None:
        """Stash the states (a previous update that no attention consumed is committed first,
        as no-mask tokens); the store is created after the forward's checks."""
        if self._pending is not None:
            self.commit(None)
        self._pending = (key_states, value_states)

    def drop_stash(self) -> None:
        self._pending = None

    def begin(self, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> Forward:
        """The stash and where its decode-phase tokens start (:meth:`decode_start`); a
        forward with decode-phase tokens may have no padding.

        Raises:
            ValueError: a bad mask (see :class:`~kvlab.integrations.pnmix_cache.
                PNMixModelCache`), decode-phase tokens with padding, a recording multi-token
                first forward without the prompt's end; nothing is stored.
            RuntimeError: no stash.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("PNMixView used before its layer received any token")
        keys, values = pending
        q = keys.shape[2]
        prompt = self.decode_start(self.columns, q)
        if prompt < q:
            store = self._store
            stored = None if store is None else store.seq_lengths[:, 0]
            if store is not None and not int(stored.max()):
                stored = None
            lengths = self.shared.lengths(attention_mask, keys.shape[0], q, self.columns, stored)
            if lengths is not None:
                raise ValueError(
                    "a PN-Mix cache recording for speculative decoding takes no padding among a "
                    "forward's decode-phase tokens"
                )
        return Forward(keys, values, prompt, plan=attention_mask)

    def attend_prompt(
        self, query: Tensor, forward: Forward, columns: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        mask = forward.plan
        if columns < forward.num_new:
            self._pending = (forward.keys[:, :, :columns], forward.values[:, :, :columns])
            mask = None if mask is None else mask[:, : self.columns + columns]
        return self.attend_plain(
            query, mask, scaling=scaling, softcap=kwargs.get("softcap"), s_aux=kwargs.get("s_aux")
        )

    def attend_decoded(
        self, query: Tensor, forward: Forward, start: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The columns from ``start`` on as decode steps: each token is stored as its one-token
        forward would store it (one append each, an undo point before each while the cache
        records), and all of them attend in ONE call with the numbers of the decode steps —
        token ``j`` sees the exact residual as it stood at step ``j`` and only the groups
        flushed by then quantized (:mod:`kvlab.integrations.decode_steps`). A single token is
        one :func:`kvlab.pnmix.pnmix_decode_step`, as a plain decode step."""
        self._pending = None
        keys, values = forward.keys[:, :, start:], forward.values[:, :, start:]
        if self._store is None:
            self.lazy_initialization(keys, values)
        store = self._store
        assert store is not None
        undo = self._undo if self.shared.recording else None
        out = attend_decode_tokens(query, keys, values, store, undo, scaling, kwargs)
        self.columns += keys.shape[2]
        return out

    def rollback(self, entries: list[Any]) -> None:
        """Roll the store back to the first entry's undo point (groups the removed tokens
        flushed are un-flushed: :meth:`kvlab.pnmix.PNMixCache.rollback`)."""
        assert self._store is not None
        rollback_decode_tokens(self._store, entries)
        self.columns -= len(entries)

    def batch_rows(self) -> int:
        store = self.store
        return 0 if store is None else store.batch_size

    def select_batch(self, index: Tensor) -> None:
        """Row-select every buffer (codes included); never re-quantizes."""
        if self._pending is not None:
            self.commit(None)
        if self.store is not None:
            self.store.select_batch(index)

    def storage(self) -> CacheStorage:
        """The persistent bytes (:meth:`nbytes`) in both counts (every stored float is already
        2 bytes, docs/design.md, PN-Mix "Byte accounting"), no index bytes, and the store's
        allocation as held (:meth:`held_bytes`)."""
        return CacheStorage(self.nbytes(), self.nbytes(), 0, self.held_bytes())

    # ---------------------------------------------------------------- the plain way
    def attend_plain(
        self,
        query: Tensor,
        attention_mask: Tensor | None,
        *,
        scaling: float,
        softcap: float | None,
        s_aux: Tensor | None,
    ) -> Tensor:
        """A forward's columns the plain way (the stash; ``attention_mask`` ``[B, columns +
        Q]`` or ``None``): a single-token forward appends and attends in one step
        (:func:`kvlab.pnmix.pnmix_decode_step`); a multi-token forward stores its tokens,
        flushing groups, then attends over the packed storage
        (:func:`kvlab.pnmix.pnmix_attention`, causal) — or, as an exact prefill, over its own
        keys and values exactly."""
        layer = self
        decode = layer.take_decode_token(attention_mask)
        if decode is not None:  # a single-token forward: append + attend in one step
            keys, values, store = decode
            out = pnmix_decode_step(
                query,
                keys,
                values,
                store,
                scale=scaling,
                logit_softcap=softcap,
                sink_logits=s_aux,
            )
            layer.columns += 1
            return out
        exact = layer.commit(attention_mask, query)
        store = layer.store
        if store is None:
            raise RuntimeError("PNMixView used before its layer received any token")
        if exact is not None:
            keys, values, real = exact
            if outputs_unused():  # a replayed prefill: nothing reads this output
                return unused_output(query, values.shape[-1])
            out = dense_causal_attention(
                query,
                keys,
                values,
                scaling=scaling,
                attention_mask=real,
                softcap=softcap,
                s_aux=s_aux,
            )
            if real is None:
                return out
            return torch.where(real[:, None, :, None], out, torch.zeros((), dtype=out.dtype))
        return pnmix_attention(
            query, store, scale=scaling, causal=True, logit_softcap=softcap, sink_logits=s_aux
        ).to(query.dtype)

    @property
    def store(self) -> PNMixCache | None:
        """The layer's :class:`PNMixCache` (``None`` before the first token). Reading it
        commits tokens an ``update`` stashed without any attention consuming them (as no-mask
        tokens)."""
        if self._pending is not None:
            self.commit(None)
        return self._store

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self._store = PNMixCache(
            self.config,
            batch_size=batch,
            num_key_value_heads=heads,
            head_dim=head_dim,
            value_head_dim=value_states.shape[-1],
            device=key_states.device,
            rotary=self.rotary,
        )
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        """Refuse states of the wrong rank, dtype or shape (nothing changes).

        Raises:
            ValueError: naming what differs.
        """
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D floating tensor [B, H_kv, T, D]")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                f"key_states {tuple(key_states.shape)} and value_states "
                f"{tuple(value_states.shape)} disagree on batch, heads or tokens"
            )
        store = self._store
        if store is not None:
            want = (store.batch_size, store.num_key_value_heads, store.head_dim)
            got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
            if got != want or value_states.shape[3] != store.value_head_dim:
                raise ValueError(
                    f"states of shape {tuple(key_states.shape)} / {tuple(value_states.shape)} do "
                    f"not fit this layer's cache (batch, kv heads, head_dim = {want}, value "
                    f"head dim {store.value_head_dim})"
                )

    def take_decode_token(
        self, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, PNMixCache] | None:
        """For a single-token forward: take the stashed token (the mask's format checked, its
        last column's check deferred, as :meth:`commit` does) and return ``(keys, values,
        store)`` for the caller to append and attend (:func:`kvlab.pnmix.pnmix_decode_step`;
        then it adds the column); else ``None`` (nothing changes).

        Raises:
            ValueError: a bad mask; the stash is dropped and the store is unchanged.
        """
        pending = self._pending
        if pending is None or pending[0].shape[2] != 1:
            return None
        self._pending = None
        keys, values = pending
        store = self._store
        stored = None if store is None else store.seq_lengths[:, 0]
        self.shared.lengths(attention_mask, keys.shape[0], 1, self.columns, stored)
        if self._store is None:
            self.lazy_initialization(keys, values)
        assert self._store is not None
        return keys, values, self._store

    def commit(
        self, attention_mask: Tensor | None, query: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Store the stashed tokens, dropping padding per ``attention_mask``; ``query`` (the
        forward's rotated queries ``[B, H_q, Q, D]``) feeds query-aware per-pair tables.

        Returns:
            ``(keys, values, real)`` when this was an exact prefill (``real``: bool ``[B, Q]``
            real-token mask, ``None`` without padding), else ``None``.

        Raises:
            ValueError: a bad mask, or a multi-token forward's values beyond the storage range;
                the stash is dropped and the store is unchanged.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        store = self._store
        keys, values = pending
        q = keys.shape[2]
        stored = None
        if store is not None and int(store.seq_lengths.max()):
            stored = store.seq_lengths[:, 0]
        lengths = self.shared.lengths(attention_mask, keys.shape[0], q, self.columns, stored)
        if q > 1:  # a multi-token forward checks every layer's deferred flags first
            self.shared.check()
        if store is None:  # created only now: a refused first forward leaves the layer empty
            self.lazy_initialization(keys, values)
            store = self._store
            assert store is not None
        if query is not None and tuple(query.shape[::2]) != (keys.shape[0], q):
            query = None  # not this forward's queries (a caller's own attention)
        store.append(keys, values, lengths, checks="deferred" if q == 1 else "eager", queries=query)
        first = stored is None and q > 1
        self.columns += q
        if not (first and self.exact_prefill):
            return None
        real = None
        if lengths is not None:
            real = (
                torch.arange(q, device=keys.device)
                >= torch.from_numpy(q - lengths).to(keys.device)[:, None]
            )
        return keys, values, real

    def get_seq_length(self) -> int:
        """Token columns seen, padding included (stashed ones too)."""
        pending = 0 if self._pending is None else self._pending[0].shape[2]
        return self.columns + pending

    def reset(self) -> None:
        self._store = None
        self.columns = 0
        self._pending = None
        self._undo = []
        self._inference = InferenceModeTracker()
        self.is_initialized = False

    def nbytes(self) -> int:
        """Persistent bytes of this layer's storage (0 before the first token)."""
        return 0 if self.store is None else self.store.persistent_bytes

    def held_bytes(self) -> int:
        """Bytes of every buffer the layer's store has allocated (spare group and residual
        slots included); 0 before the first token."""
        store = self._store
        return 0 if store is None else sum(store.reserved_bytes().values())
