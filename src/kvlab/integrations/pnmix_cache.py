"""PN-Mix as a ``transformers`` cache: one :class:`kvlab.pnmix.PNMixCache` per decoder layer.

``PNMixModelCache(model.config, PNMixConfig(...))`` is a ``transformers.Cache`` usable as
``model(..., cache=cache)`` and in ``model.generate(..., cache=cache)``, including a second
``generate`` that continues the same conversation. Switch the model to the ``"kvlab"``
attention first: :func:`kvlab.integrations.enable_kvlab_attention`.

Per forward and layer (docs/design.md, "Model integration"): ``update`` stashes the new
(already rotated) keys and values and returns a :class:`PNMixView`; the ``"kvlab"`` attention
function hands the view the query and the 2-D attention mask, and the view commits the stash
to the layer's PN-Mix storage — dropping padding, flushing groups — then attends with
:func:`kvlab.pnmix.pnmix_attention`, which reads the packed codes directly. The one exception
is the prefill (the first forward into an empty cache, more than one token): by default it
attends to its freshly computed keys and values exactly and stores them packed, as
``transformers``' ``QuantizedCache`` and KIVI do (``exact_prefill=False`` makes the prefill read
its own codes too).

Padded batches (left padding, a 2-D ``attention_mask``): the new part of each row's mask must
be zeros then ones (real tokens right-aligned); pads are never stored, never enter a group, the
mix saliency or a score, and each row's storage, and its logits given its own
``position_ids``, equal the row run alone. ``get_seq_length()`` counts token columns seen,
pads included — what ``transformers`` uses to align the next mask and cache positions.

Checks and host syncs: every input check (shapes, dtypes, mask format and lengths) runs in the
first layer before any layer stores anything. A multi-token forward reads its mask once (one
host sync) and checks values eagerly; a single-token forward (decode) reads nothing back from
the device: its value checks and mask check are recorded on the device and raised by
:meth:`PNMixModelCache.check_values` (or the next multi-token forward).

Beam search: ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
row-select every buffer and count with :meth:`PNMixCache.select_batch`; nothing is
re-quantized, so a reorder is bit-exact.

Speculative decoding (``generate(assistant_model=...)``, prompt lookup; docs/design.md "Cache
life cycle"): after :meth:`PNMixModelCache.activate_past_recording` (``transformers`` calls it)
and :meth:`PNMixModelCache.expect_prompt`, every token after the prompt is appended as a
one-token decode step with an undo point, and ``crop(-r)`` removes the last forward's last
``r`` such tokens byte for byte (groups they flushed are un-flushed); codes already written are
never rewritten.

Per-layer group sizes: ``layer_group_tokens`` gives each decoder layer its own
``group_tokens`` (everything else as ``config``), e.g. an allocation from
:func:`kvlab.integrations.pnmix_calibration.calibrate_group_tokens`.

Position-aware (pre-RoPE) key codings: every full-attention layer gets the model's RoPE
(:func:`kvlab.integrations.model_support.layer_rotary`); a full-attention layer without RoPE
(NoPE) codes its keys in their own frame, which is position 0 already
(:meth:`kvlab.pnmix.codecs.KeyCodec.without_positions`). A token's position is its row's
stream index (plus the row's offset, 0 unless a relay sets it): what ``generate`` gives
left-padded rows. Query-aware per-pair tables read the queries of the forward that computes
them (the view hands them to the commit; docs/design.md, "Per-pair tables").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.attention import (
    CacheView,
    dense_causal_attention,
    outputs_unused,
    unused_output,
)
from kvlab.integrations.cache_protocol import (
    CacheStorage,
    crop_count,
    dense_layer_storage,
    layers_storage,
)
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.model_support import ForwardGuard, layer_rotary, plan_model
from kvlab.pnmix import PNMixCache, PNMixConfig, pnmix_attention, pnmix_decode_step
from kvlab.pnmix.cache import UndoPoint
from kvlab.pnmix.kernels.dispatch import requested_backend
from kvlab.rope import RotaryConfig

__all__ = ["PNMixLayer", "PNMixModelCache", "PNMixView", "pnmix_config_for_model"]


def pnmix_config_for_model(model_config: Any, base: PNMixConfig | None = None) -> PNMixConfig:
    """``base`` (default ``PNMixConfig()``) with ``rotary_dim`` and ``rotary_layout`` taken from
    the RoPE of the model's full-attention layers
    (:func:`kvlab.integrations.model_support.layer_rotary`), so that Phase–Norm pairs are the
    model's true rotary pairs (partial rotary and interleaved layouts included).

    Raises:
        ValueError: the config has no supported RoPE (see ``RotaryConfig.from_hf_config``).
    """
    base = base or PNMixConfig()
    rotary = layer_rotary(model_config)  # model-matrix: per-layer-type RoPE (Gemma 3)
    return dataclasses.replace(base, rotary_dim=rotary.rotary_dim, rotary_layout=rotary.layout)


class _ForwardState:
    """What the layers of one model cache share: the forward's mask, read once for every layer
    (one host sync per multi-token forward, none for single-token forwards), and the deferred
    mask check of single-token forwards, and the guard that puts back the window layers a
    refused forward changed (set by the cache)."""

    def __init__(self) -> None:
        self.layers: list[PNMixLayer] = []
        self.guard = ForwardGuard()
        #: speculative decoding (``Cache.activate_past_recording``): decode-phase tokens are
        #: appended one step at a time and can be cropped (:meth:`PNMixLayer.attend_recording`)
        self.recording = False
        #: token columns the prompt ends at (:meth:`PNMixModelCache.expect_prompt`)
        self.prompt_end: int | None = None
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

    def pending(self) -> list[Tensor]:
        """Every device flag not yet checked (True = valid), over all layers."""
        flags: list[Tensor] = []
        for layer in self.layers:
            store = layer._store
            if store is not None and store.pending_check() is not None:
                flags.append(store.pending_check())
        return flags

    def check(self) -> None:
        """Check every deferred flag with one device read (none if there is nothing pending).

        Raises:
            ValueError: naming the offending layer.
        """
        flags = self.pending()
        if not flags:
            return
        ok = bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
        for i, layer in enumerate(self.layers):
            if layer._store is not None:
                try:
                    layer._store.check_values(assume_valid=ok)
                except ValueError as err:
                    raise ValueError(f"layer {i}: {err}") from err


class PNMixView(CacheView):
    """Returned by :meth:`PNMixLayer.update`; commits the layer's stashed tokens and attends
    over its packed storage (module docstring).

    With ``exact_prefill`` on, the first forward into an empty layer attends to its own keys
    and values exactly (they are stored packed for every later token), as ``transformers``'
    ``QuantizedCache`` and KIVI do.
    """

    supports_padding = True
    # Gemma 2 logit soft-capping and GPT-OSS learned sinks (kvlab.attention_logits)
    supported_features = frozenset({"softcap", "s_aux"})

    def __init__(self, layer: PNMixLayer) -> None:
        self.layer = layer

    def refusal_guard(self) -> AbstractContextManager[None]:
        """A refusal drops the layer's stash and puts back the window layers stored before the
        forward's first full-attention layer (:class:`~kvlab.integrations.model_support.
        ForwardGuard`)."""
        return self.layer._shared.guard.checking(self.layer._drop_stash)

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """Commit, then :func:`kvlab.pnmix.pnmix_attention` (causal, bottom-right aligned per
        row) of ``query`` ``[B, H_q, Q, D]`` — or exact attention over the prefill's own keys;
        returns ``[B, H_q, Q, Dv]`` in the query dtype. Padding queries return zeros. Applies
        ``kwargs["softcap"]`` (Gemma 2) and ``kwargs["s_aux"]`` (GPT-OSS sinks) when set.

        Raises:
            ValueError: a bad mask (see :class:`PNMixModelCache`), or, for a multi-token
                forward, keys/values beyond the storage range; nothing is stored then.
        """
        softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
        layer = self.layer
        if layer._shared.recording:
            return layer.attend_recording(
                query, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux
            )
        return layer.attend_plain(
            query, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux
        )


class PNMixLayer(CacheLayerMixin):
    """One decoder layer's PN-Mix cache (a ``transformers`` cache layer).

    The :class:`kvlab.pnmix.PNMixCache` (``store``) is created lazily from the first keys that
    pass the forward's checks: batch size, ``num_key_value_heads``, ``head_dim`` and value head
    dim are read from them. ``update`` stashes a forward's keys and values; :meth:`commit`
    (called by the view's ``attend``, or by the next ``update`` when no attention ran) stores
    them.

    Speculative decoding (``Cache.activate_past_recording``, docs/design.md "Cache life
    cycle"): :meth:`attend_recording` appends a forward's decode-phase tokens one step at a
    time, keeping an undo point per token, so that :meth:`crop` can remove them.
    """

    is_compileable = False
    is_sliding = False

    def __init__(
        self,
        config: PNMixConfig,
        exact_prefill: bool = True,
        shared: _ForwardState | None = None,
        rotary: RotaryConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.exact_prefill = exact_prefill
        self.rotary = rotary
        self._store: PNMixCache | None = None
        self.columns = 0
        self._pending: tuple[Tensor, Tensor] | None = None
        self._inference = InferenceModeTracker()
        self._undo: list[tuple[UndoPoint, int]] = []
        if shared is None:
            shared = _ForwardState()
        shared.layers.append(self)
        self._shared = shared

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """True while the cache records (``activate_past_recording``): :meth:`crop` then
        removes the tokens the last forward appended as decode steps."""
        return self._shared.recording

    def activate_past_recording(self, **kwargs: object) -> None:
        """Record decode-phase tokens so that :meth:`crop` can remove them (every PN-Mix layer
        of the cache: they share the flag). ``kwargs`` (``transformers`` >= 5.25 passes
        ``recurrent_states_to_keep``, which only linear-attention layers use) are ignored."""
        self._shared.recording = True

    def attend_plain(
        self,
        query: Tensor,
        attention_mask: Tensor | None,
        *,
        scaling: float,
        softcap: float | None,
        s_aux: Tensor | None,
    ) -> Tensor:
        """The view's attention outside recording (:meth:`PNMixView.attend`)."""
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

    def attend_recording(
        self,
        query: Tensor,
        attention_mask: Tensor | None,
        *,
        scaling: float,
        softcap: float | None,
        s_aux: Tensor | None,
    ) -> Tensor:
        """The view's attention while the cache records (speculative decoding).

        The forward's tokens up to the prompt's end (:meth:`PNMixModelCache.expect_prompt`)
        go the plain way (:meth:`attend_plain`: a prefill attends exactly); every later token
        ``j`` is one decode step (:func:`kvlab.pnmix.pnmix_decode_step` with query ``j``,
        key and value ``j``): it sees the cache exactly as the ``j``-th one-token forward of a
        plain run would (the exact residual as it stood then, only the groups flushed by then
        quantized) and stores the same bytes. Each decode step keeps an undo point for
        :meth:`crop`; the previous forward's are dropped (it was accepted).

        Returns:
            ``[B, H_q, Q, Dv]`` in the query dtype.

        Raises:
            ValueError: a bad mask (as :meth:`attend_plain`); decode-phase tokens with
                padding; a multi-token forward into an empty layer before ``expect_prompt``.
                Nothing is stored then.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("PNMixView used before its layer received any token")
        keys, values = pending
        batch, q = keys.shape[0], keys.shape[2]
        self._undo = []  # a new forward: the previous one was accepted
        end = self._shared.prompt_end
        if end is None:
            if self.columns == 0 and q > 1:
                raise ValueError(
                    "a PN-Mix cache recording for speculative decoding (generate(assistant_model"
                    "=...) or prompt_lookup_num_tokens) cannot tell the prompt from the draft "
                    "in transformers' first forward, which feeds both: call "
                    "cache.expect_prompt(input_ids.shape[1]) before generate"
                )
            end = self.columns
        plain = min(max(end - self.columns, 0), q)
        if plain == q:
            return self.attend_plain(
                query, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux
            )
        store = self._store
        stored = None if store is None else store.seq_lengths[:, 0]
        if store is not None and not int(stored.max()):
            stored = None
        lengths = self._shared.lengths(attention_mask, batch, q, self.columns, stored)
        if lengths is not None:
            raise ValueError(
                "a PN-Mix cache recording for speculative decoding takes no padding among a "
                "forward's decode-phase tokens"
            )
        outs: list[Tensor] = []
        if plain:
            self._pending = (keys[:, :, :plain], values[:, :, :plain])
            mask = None if attention_mask is None else attention_mask[:, : self.columns + plain]
            outs.append(
                self.attend_plain(
                    query[:, :, :plain], mask, scaling=scaling, softcap=softcap, s_aux=s_aux
                )
            )
        self._pending = None
        if self._store is None:
            self.lazy_initialization(keys, values)
        store = self._store
        assert store is not None
        for j in range(plain, q):
            self._undo.append((store.undo_point(), self.columns))
            outs.append(
                pnmix_decode_step(
                    query[:, :, j : j + 1],
                    keys[:, :, j : j + 1],
                    values[:, :, j : j + 1],
                    store,
                    scale=scaling,
                    logit_softcap=softcap,
                    sink_logits=s_aux,
                )
            )
            self.columns += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def croppable_tokens(self) -> int:
        """Tokens :meth:`crop` can remove now: the decode steps of the last forward while
        recording (0 otherwise)."""
        return len(self._undo) if self._shared.recording else 0

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

    def _check_states(self, key_states: Tensor, value_states: Tensor) -> None:
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

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[PNMixView, PNMixView]:
        """Stash ``[B, H_kv, T, D]`` keys (rotated) and ``[B, H_kv, T, Dv]`` values for the
        view to commit; return the view (twice: the key and the value slot).

        Raises:
            ValueError: states of the wrong rank, dtype or shape (nothing changes).
        """
        with self._shared.guard.checking(accept=False):
            self._check_states(key_states, value_states)
        # filled under torch.inference_mode(), continued outside it: release the storage once
        self._inference.before_update(self._store)
        if self._pending is not None:  # a previous update that no attention consumed
            self.commit(None)
        self._pending = (key_states, value_states)  # the store is created after the checks
        view = PNMixView(self)
        return view, view

    def _drop_stash(self) -> None:
        self._pending = None

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
        self._shared.lengths(attention_mask, keys.shape[0], 1, self.columns, stored)
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
        lengths = self._shared.lengths(attention_mask, keys.shape[0], q, self.columns, stored)
        if q > 1:  # a multi-token forward checks every layer's deferred flags first
            self._shared.check()
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

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the packed storage stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self._store = None
        self.columns = 0
        self._pending = None
        self._undo = []
        self._inference = InferenceModeTracker()
        self.is_initialized = False

    def _select(self, index: Tensor) -> None:
        if self._pending is not None:
            self.commit(None)
        if self.store is not None:
            self.store.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select every buffer (codes included) by ``beam_idx``; never re-quantizes."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            index = torch.arange(self.store.batch_size)
            self._select(index.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (``transformers``' convention: a
        negative count; ``crop(0)`` does nothing): only decode-step tokens of the last forward
        while the cache records (:meth:`attend_recording`). The store then holds exactly the
        bytes and counts it held before them (groups they flushed are un-flushed).

        Raises:
            NotImplementedError: a crop of a cache that does not record (nothing to undo).
            ValueError: a positive count, or more tokens than :meth:`croppable_tokens`;
                nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        if remove == 0:
            return
        if not self._shared.recording:
            raise NotImplementedError(
                "a PN-Mix cache can be cropped only while it records (Cache."
                "activate_past_recording(), which generate(assistant_model=...) calls): "
                "quantized groups are never rewritten"
            )
        if remove > len(self._undo):
            raise ValueError(
                f"a PN-Mix layer can crop only the {len(self._undo)} decode-step tokens of its "
                f"last forward (a prompt token or an earlier forward's token is never removed); "
                f"asked to remove {remove}"
            )
        points = self._undo[-remove:]
        assert self._store is not None
        self._store.rollback([p for p, _ in points])
        self.columns = points[0][1]
        del self._undo[-remove:]

    def nbytes(self) -> int:
        """Persistent bytes of this layer's storage (0 before the first token)."""
        return 0 if self.store is None else self.store.persistent_bytes

    def held_bytes(self) -> int:
        """Bytes of every buffer the layer's store has allocated (spare group and residual
        slots included); 0 before the first token."""
        store = self._store
        return 0 if store is None else sum(store.reserved_bytes().values())


class PNMixModelCache(Cache):
    """A ``transformers`` cache holding every decoder layer in PN-Mix form.

    Args:
        model_config: the model's ``PretrainedConfig`` (number of layers, RoPE).
        config: the PN-Mix configuration; ``rotary_dim``/``rotary_layout`` are overridden from
            the model's RoPE unless ``match_rotary=False``.
        match_rotary: see ``config``.
        exact_prefill: the first forward (the prefill) attends to its own keys and values
            exactly; every later forward reads the packed storage (see :class:`PNMixView`).
        layer_group_tokens: one ``group_tokens`` per decoder layer (tokens); ``None`` = every
            layer uses ``config.group_tokens``.

    Sliding-window and chunked layers (Mistral, Gemma 2/3, GPT-OSS, ...) are not compressed:
    each keeps exactly its last ``window - 1`` tokens
    (:class:`kvlab.integrations.model_support.WindowLayer`); the full-attention layers hold
    PN-Mix. ``plan`` is the :class:`~kvlab.integrations.model_support.ModelPlan` used.

    Raises:
        ValueError: a model :func:`kvlab.integrations.model_support.plan_model` marks
            unsupported (linear-attention or KV-sharing layers, latent attention), a RoPE that
            :class:`kvlab.rope.RotaryConfig` does not support, ``layer_group_tokens`` of the
            wrong length or with a value PNMixConfig rejects, or an unknown
            ``KVLAB_PNMIX_BACKEND`` (:func:`kvlab.pnmix.kernels.dispatch.requested_backend`).
    """

    def __init__(
        self,
        model_config: Any,
        config: PNMixConfig | None = None,
        *,
        match_rotary: bool = True,
        exact_prefill: bool = True,
        layer_group_tokens: Sequence[int] | None = None,
    ) -> None:
        text_config = model_config.get_text_config(decoder=True)
        # model-matrix: refuse unsupported models before any layer exists (one line, every
        # reason); full-attention layers hold PN-Mix, sliding/chunked layers only their window.
        plan = plan_model(text_config)
        plan.check(type(self).__name__)
        requested_backend("auto")  # the layers build their PNMixCache at the first token
        config = config or PNMixConfig()
        if match_rotary:
            config = pnmix_config_for_model(text_config, config)
        self.pnmix_config = config
        n_layers = text_config.num_hidden_layers
        groups = [config.group_tokens] * n_layers
        if layer_group_tokens is not None:
            groups = list(layer_group_tokens)
            if len(groups) != n_layers:
                raise ValueError(
                    f"layer_group_tokens has {len(groups)} entries; the model has {n_layers} layers"
                )
        self.layer_group_tokens = tuple(groups)
        # window layers (WindowLayer) keep their window exactly, as transformers does; their
        # layer_group_tokens entries are unused. PN-Mix layers share one forward state.
        self.plan = plan
        shared = _ForwardState()
        codec = config.key_codec
        rotary = layer_rotary(text_config) if codec.position_aware else None

        def full_layer(i: int) -> PNMixLayer:
            layer_config = dataclasses.replace(config, group_tokens=groups[i])
            uses_rope = plan.layers[i].uses_rope
            if codec.position_aware and not uses_rope:  # NoPE: its keys are position-0 keys
                layer_config = dataclasses.replace(
                    layer_config, key_coding=codec.without_positions(), key_outlier_fraction=0.0
                )
            return PNMixLayer(layer_config, exact_prefill, shared, rotary if uses_rope else None)

        super().__init__(layers=plan.build_layers(full_layer))
        self._shared = shared
        shared.guard = ForwardGuard(self.layers)  # atomic failure with leading window layers

    # ---------------- speculative decoding (docs/design.md, "Cache life cycle": crop)
    def activate_past_recording(self, **kwargs: object) -> None:
        """Record from now on (``transformers``' ``generate(assistant_model=...)`` and
        prompt-lookup decoding call this first; ``kwargs``, such as ``transformers`` >=
        5.25's ``recurrent_states_to_keep``, pass on to the layers): each forward's
        decode-phase tokens — every token after the prompt's end (:meth:`expect_prompt`) — are
        appended as one-token decode steps, so a multi-token forward attends and stores exactly
        as the one-token forwards of a plain run would, and :meth:`crop` can remove them;
        window layers keep their states until the next ``crop`` (``transformers``' own
        recording)."""
        super().activate_past_recording(**kwargs)

    def expect_prompt(self, tokens: int) -> None:
        """Mark where the prompt ends: token columns ``tokens`` (``input_ids.shape[1]`` of the
        ``generate`` call, the conversation so far included). While recording, a forward's
        tokens before it go the plain way (a prefill attends exactly), later ones are decode
        steps: ``transformers``' first speculative forward feeds the prompt and the first
        draft together, which the cache cannot tell apart otherwise.

        Raises:
            ValueError: ``tokens`` not an int >= 1, or fewer than the tokens already seen.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise ValueError(f"expect_prompt takes a token count >= 0, got {tokens!r}")
        if int(tokens) < max(1, self.get_seq_length()):
            raise ValueError(
                f"expect_prompt({tokens}): the cache has seen {self.get_seq_length()} tokens; "
                "pass the prompt's total length, input_ids.shape[1] of the generate call"
            )
        self._shared.prompt_end = int(tokens)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens from every layer (``transformers``'
        convention; ``crop(0)`` only shrinks recording window layers back to their window).
        PN-Mix layers remove only the decode-step tokens of the last forward while recording
        (:meth:`PNMixLayer.crop`: the state before them comes back byte for byte). Checked for
        every layer before any changes.

        Raises:
            NotImplementedError: ``tokens_to_remove != 0`` while not recording.
            ValueError: a positive count, or more tokens than the last forward's decode steps;
                nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        pnmix = [layer for layer in self.layers if isinstance(layer, PNMixLayer)]
        if remove and pnmix:
            if not self._shared.recording:
                pnmix[0].crop(tokens_to_remove)  # raises NotImplementedError
            can = min(layer.croppable_tokens() for layer in pnmix)
            if remove > can:
                raise ValueError(
                    f"a PN-Mix cache can crop only the {can} decode-step tokens of its last "
                    "forward (a prompt token or an earlier forward's token is never removed); "
                    f"asked to remove {remove}"
                )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty every layer and stop recording (a new cache: no prompt end, no undo)."""
        super().reset()
        self._shared.recording = False
        self._shared.prompt_end = None
        for layer in self.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False

    def nbytes(self) -> int:
        """Persistent bytes of every layer (sinks, residual, codes, scales, masks; window
        layers: their exact keys and values)."""
        return sum(layer.nbytes() for layer in self.layers)

    def storage_report(self) -> dict[str, int]:
        """Bytes by component, summed over layers (see :meth:`PNMixCache.nbytes`)."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if getattr(layer, "store", None) is not None:  # model-matrix: skip window layers
                for name, value in layer.store.nbytes().items():
                    total[name] = total.get(name, 0) + value
        return total

    def attention_calls(self) -> int:
        """Packed-attention calls over all layers (each reads codes, never a dequantized copy)."""
        stores = [getattr(layer, "store", None) for layer in self.layers]  # window layers: None
        return sum(0 if store is None else store.attention_calls for store in stores)

    def check_values(self) -> None:
        """Check every single-token forward since the last check (values finite and within the
        storage range, no padding column): one device read for all layers, none if there is
        nothing to check.

        Raises:
            ValueError: naming the first offending layer (its storage holds the bad values).
        """
        self._shared.check()

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    #: the RoPE positions are the model's own (the tokens seen): forwards pass no position_ids
    explicit_positions = False

    def position_ids(self, num_new: int, device: torch.device | str | None = None) -> Tensor:
        """The RoPE positions of the next ``num_new`` tokens, int64 ``[1, num_new]``: the
        tokens seen onward (what the model uses when given none)."""
        start = self.get_seq_length()
        return torch.arange(start, start + num_new, dtype=torch.int64, device=device).view(1, -1)

    def rope_position(self) -> int:
        """The RoPE position of the next token: the tokens seen."""
        return int(self.get_seq_length())

    def details(self) -> dict[str, Any]:
        """``{"packed_attention_calls": ...}`` (:meth:`attention_calls`)."""
        return {"packed_attention_calls": self.attention_calls()}

    def end_prompt(self) -> None:
        """A no-op: PN-Mix stores every forward's tokens alike (no prompt rule)."""

    def storage(self) -> CacheStorage:
        """PN-Mix layers at their persistent bytes (:meth:`PNMixLayer.nbytes`) in both counts
        (every stored float is already 2 bytes, docs/design.md, PN-Mix "Byte accounting");
        window layers as held (:func:`~kvlab.integrations.cache_protocol.dense_layer_storage`).
        No index bytes. Held: each store's allocation, spare group and residual slots
        included (:meth:`PNMixCache.reserved_bytes`)."""
        return layers_storage(
            (
                layer,
                CacheStorage(layer.nbytes(), layer.nbytes(), 0, layer.held_bytes())
                if isinstance(layer, PNMixLayer)
                else dense_layer_storage(layer),
            )
            for layer in self.layers
        )
