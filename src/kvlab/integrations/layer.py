"""The layer contract of kvlab's model caches, and what every kvlab layer does the same way.

``transformers``' caches are a list of layers that implement ``CacheLayerMixin``; a cache only
chooses its layers (``DynamicCache``: ``DynamicLayer`` or ``DynamicSlidingWindowLayer`` per
layer type; ``QuantizedCache``: ``QuantizedLayer``). kvlab's model caches are built the same way
(:class:`kvlab.integrations.model_cache.KVLabModelCache`): a full-attention layer is a
:class:`KVLabLayer` — :class:`~kvlab.integrations.pnmix_layer.PNMixLayer`,
:class:`~kvlab.integrations.relay_layer.RelayLayer`,
:class:`~kvlab.integrations.composed_layer.ComposedLayer` — and a sliding-window or chunked
layer a :class:`~kvlab.integrations.window_layer.WindowLayer` (``transformers``' own, exact).

A :class:`KVLabLayer` implements a small contract, and gets the rest from this class:

* ``update`` checks the new keys and values (:meth:`KVLabLayer.check_states`, nothing
  stored on a refusal) and stashes them (:meth:`KVLabLayer.stash_states`); it returns a
  :class:`LayerView` for both the key and the value slot, which the ``"kvlab"`` attention
  hands the query and the 2-D attention mask.
* :meth:`KVLabLayer.attend` — the forward, written once: the layer checks and plans it
  (:meth:`KVLabLayer.begin`, before it stores anything) and says where its *decode-phase*
  tokens start (:meth:`KVLabLayer.decode_start`: every token after the prompt's end — a
  speculative draft, an answer scored by teacher forcing). The columns before go the layer's
  plain way (:meth:`KVLabLayer.attend_prompt`), the rest as the one-token forwards of a plain
  run would store and see them (:meth:`KVLabLayer.attend_decoded`), each keeping an undo entry
  while the cache records.
* :meth:`KVLabLayer.crop` — written once: removes the last forward's decode-phase tokens with
  the layer's :meth:`KVLabLayer.rollback` (docs/design.md, "Cache life cycle": crop).
* rows (beam search, ``generate``'s batch expansion): :meth:`KVLabLayer.select_batch`.
* bytes: :meth:`KVLabLayer.storage` (:class:`~kvlab.integrations.cache_protocol.CacheStorage`).

The layers of one model cache share a :class:`SharedState`: whether the cache records, where
the prompt ends, the guard that puts back the window layers of a refused forward, and the
deferred value checks of PN-Mix storage (one device read for every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvlab.integrations.attention import CacheView
from kvlab.integrations.cache_protocol import CacheStorage, crop_count
from kvlab.integrations.inference_mode import InferenceModeTracker
from kvlab.integrations.window_layer import ForwardGuard

__all__ = ["Forward", "KVLabLayer", "LayerView", "SharedState"]


class SharedState:
    """What the kvlab layers of one model cache share.

    Attributes:
        layers: the layers (each registers itself).
        guard: puts back the window layers stored before a refused forward's first kvlab
            layer (:class:`~kvlab.integrations.window_layer.ForwardGuard`; set by the cache).
        recording: speculative decoding (``Cache.activate_past_recording``): decode-phase
            tokens keep undo entries, so that ``crop`` can remove them.
        prompt_end: the token column the prompt ends at (``expect_prompt``), or ``None``.
    """

    def __init__(self) -> None:
        self.layers: list[KVLabLayer] = []
        self.guard = ForwardGuard()
        self.recording = False
        self.prompt_end: int | None = None

    def reset(self) -> None:
        """Stop recording and forget the prompt's end (``Cache.reset``)."""
        self.recording = False
        self.prompt_end = None

    def pending(self) -> list[Tensor]:
        """Every deferred value flag not yet checked (True = valid), over all layers."""
        flags: list[Tensor] = []
        for layer in self.layers:
            store = layer.deferred_store()
            if store is not None and store.pending_check() is not None:
                flags.append(store.pending_check())
        return flags

    def check(self) -> None:
        """Check every deferred flag with one device read (none if nothing is pending).

        Raises:
            ValueError: naming the offending layer (its storage holds the bad values).
        """
        flags = self.pending()
        if not flags:
            return
        ok = bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
        for i, layer in enumerate(self.layers):
            store = layer.deferred_store()
            if store is not None:
                try:
                    store.check_values(assume_valid=ok)
                except ValueError as err:
                    index = i if layer.layer_idx is None else layer.layer_idx
                    raise ValueError(f"layer {index}: {err}") from err


class LayerView(CacheView):
    """What a :class:`KVLabLayer`'s ``update`` returns: its ``attend`` is the layer's; a refusal
    drops the layer's stash and puts back the window layers stored before the forward's first
    kvlab layer. Handles left-padded batches (``supports_padding``), Gemma 2 soft-capping and
    GPT-OSS learned sinks."""

    supports_padding = True
    # model-matrix: Gemma 2 logit soft-capping and GPT-OSS learned sinks (kvlab.attention_logits)
    supported_features = frozenset({"softcap", "s_aux"})

    def __init__(self, layer: KVLabLayer) -> None:
        self.layer = layer

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """The layer's :meth:`KVLabLayer.attend` (its docstring says what a forward does)."""
        return self.layer.attend(
            query, scaling=scaling, attention_mask=attention_mask, kwargs=kwargs
        )

    def refusal_guard(self) -> AbstractContextManager[None]:
        """Drop the stash and put back the window layers on a refusal."""
        return self.layer.shared.guard.checking(self.layer.drop_stash)


@dataclass
class Forward:
    """One layer's part of a forward, checked (:meth:`KVLabLayer.begin`).

    Attributes:
        keys: ``[B, H_kv, T, D]`` the new keys, rotated by the model at its ``position_ids``.
        values: ``[B, H_kv, T, Dv]``.
        prompt: the first ``prompt`` columns go the layer's plain way; the other ``T -
            prompt`` are decode-phase tokens.
        plan: the layer's own plan of the forward (a relay layer's
            :class:`~kvlab.integrations.forward.ForwardPlan`; a PN-Mix layer's mask).
        accepts: a forward that accepts the last one's decode-phase tokens (``False``: a
            reconstruction pass, which stores nothing).
        positions: per row, the RoPE position of the next token before this forward (relay
            layers: where the decode-phase tokens go once the prompt part evicted).
    """

    keys: Tensor
    values: Tensor
    prompt: int
    plan: Any = None
    accepts: bool = True
    positions: Sequence[int] = ()

    @property
    def num_new(self) -> int:
        """``T``: the forward's new columns."""
        return int(self.keys.shape[2])


class KVLabLayer(CacheLayerMixin):
    """A full-attention layer of a kvlab model cache (module docstring: the contract).

    Args:
        shared: the state the layers of the cache share (a new one for a layer on its own).
        layer_idx: the decoder layer (messages), or ``None``.

    Subclasses implement :meth:`check_states`, :meth:`stash_states`, :meth:`drop_stash`,
    :meth:`begin`, :meth:`attend_prompt`, :meth:`attend_decoded`, :meth:`rollback`,
    :meth:`select_batch`, :meth:`batch_rows`, :meth:`storage` and ``transformers``'
    ``lazy_initialization``, ``get_seq_length`` and ``reset``.
    """

    is_compileable = False
    is_sliding = False
    #: the cache kind, in messages
    kind: ClassVar[str] = "kvlab"
    #: what ``update`` returns
    view_class: ClassVar[type[LayerView]] = LayerView

    def __init__(self, shared: SharedState, layer_idx: int | None = None) -> None:
        super().__init__()
        self.shared = shared
        self.layer_idx = layer_idx
        self._inference = InferenceModeTracker()
        #: one entry per decode-phase token of the last forward, while the cache records
        self._undo: list[Any] = []
        shared.layers.append(self)

    # ---------------------------------------------------------------- the contract
    def check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        """Refuse new states that do not fit what the layer stores (nothing changes).

        Raises:
            ValueError: naming what differs.
        """
        raise NotImplementedError

    def held_store(self) -> Any:
        """The storage :class:`~kvlab.integrations.inference_mode.InferenceModeTracker`
        releases when a cache filled under ``torch.inference_mode()`` continues outside it."""
        return None

    def stash_states(
        self, key_states: Tensor, value_states: Tensor, kwargs: dict[str, Any]
    ) -> None:
        """Keep this forward's checked states for :meth:`attend` (``kwargs``: ``update``'s)."""
        raise NotImplementedError

    def drop_stash(self) -> None:
        """Forget the stash (a refused forward)."""
        raise NotImplementedError

    def begin(self, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> Forward:
        """Take the stash, check the forward (before anything is stored) and plan it.

        Raises:
            ValueError: inputs the layer refuses; nothing is stored.
            RuntimeError: no stash (``attend`` without a preceding ``update``).
        """
        raise NotImplementedError

    def attend_prompt(
        self, query: Tensor, forward: Forward, columns: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The layer's plain way for the forward's first ``columns`` columns (all of them, or
        those before the prompt's end), ``query`` ``[B, H_q, columns, D]``."""
        raise NotImplementedError

    def attend_decoded(
        self, query: Tensor, forward: Forward, start: int, scaling: float, kwargs: dict[str, Any]
    ) -> Tensor:
        """The forward's columns from ``start`` on as decode steps (``query`` ``[B, H_q, T -
        start, D]``): stored and attended as the one-token forwards of a plain run would; one
        entry per token appended to :attr:`_undo` while the cache records."""
        raise NotImplementedError

    def rollback(self, entries: list[Any]) -> None:
        """Put the layer back as it was before the decode-phase tokens of ``entries`` (the
        last ``len(entries)`` of the last forward's undo entries)."""
        raise NotImplementedError

    def batch_rows(self) -> int:
        """Sequences the layer holds (0 before the first token)."""
        raise NotImplementedError

    def select_batch(self, index: Tensor) -> None:
        """Keep sequences ``index`` (int64 ``[B']``, repeats allowed) of every buffer."""
        raise NotImplementedError

    def deferred_store(self) -> Any:
        """The PN-Mix storage whose deferred value checks :meth:`SharedState.check` reads, or
        ``None``."""
        return None

    def storage(self) -> CacheStorage:
        """What the layer holds, in bytes (:class:`~kvlab.integrations.cache_protocol.
        CacheStorage`)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- transformers' API
    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[LayerView, LayerView]:
        """Check and stash ``[B, H_kv, T, D]`` rotated keys and ``[B, H_kv, T, Dv]`` values
        for this forward's :meth:`attend` (nothing is stored yet); return the view (for the key
        and the value slot).

        Raises:
            ValueError: states that do not fit what the layer stores (nothing changes).
        """
        with self.shared.guard.checking(accept=False):
            self.check_states(key_states, value_states)
        # filled under torch.inference_mode(), continued outside it: release the storage once
        self._inference.before_update(self.held_store())
        self.stash_states(key_states, value_states, kwargs)
        view = self.view_class(self)
        return view, view

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the storage stays where it is
        return None

    def prefetch(self) -> None:
        return None

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """True while the cache records: :meth:`crop` then removes the last forward's
        decode-phase tokens."""
        return self.shared.recording

    def activate_past_recording(self, **kwargs: object) -> None:
        """Record decode-phase tokens so that :meth:`crop` can remove them (every layer of the
        cache: they share the flag). ``kwargs`` (``transformers`` >= 5.25 passes
        ``recurrent_states_to_keep``, which only linear-attention layers use) are ignored."""
        self.shared.recording = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row-select every buffer by ``beam_idx`` (beam search)."""
        self.select_batch(torch.as_tensor(beam_idx))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select_batch(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.batch_rows()
        if rows:
            self.select_batch(torch.arange(rows).repeat_interleave(repeats))

    # ---------------------------------------------------------------- crop
    def croppable_tokens(self) -> int:
        """Tokens :meth:`crop` can remove now: the last forward's decode-phase tokens while the
        cache records (0 otherwise)."""
        return len(self._undo) if self.shared.recording else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (``transformers``' convention: a
        negative count; ``crop(0)`` does nothing): only the decode-phase tokens of the last
        forward while the cache records; the layer then holds exactly what it held before them
        (:meth:`rollback`).

        Raises:
            NotImplementedError: a crop of a cache that does not record (nothing to undo).
            ValueError: a positive count, or more tokens than :meth:`croppable_tokens`;
                nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        if remove == 0:
            return
        if not self.shared.recording:
            raise NotImplementedError(
                f"a {self.kind} cache can be cropped only while it records (Cache."
                "activate_past_recording(), which generate(assistant_model=...) calls): what "
                "it stores is never rewritten otherwise"
            )
        if remove > len(self._undo):
            raise ValueError(
                f"a {self.kind} layer can crop only the {len(self._undo)} decode-phase tokens "
                "of its last forward (a prompt token or an earlier forward's token is never "
                f"removed); asked to remove {remove}"
            )
        self.rollback(self._undo[-remove:])
        del self._undo[-remove:]

    # ---------------------------------------------------------------- the forward
    def decode_start(self, seen: int, num_new: int) -> int:
        """Where a forward's decode-phase tokens start among its ``num_new`` columns (after
        ``seen`` columns): every column at or after the prompt's end (``prompt_end``, while the
        cache records or not); without one, while the cache records, every column of a forward
        into a non-empty layer; ``num_new`` (none) otherwise.

        Raises:
            ValueError: a recording cache's multi-token first forward without a prompt end
                (recording activated by hand: a ``generate`` call gives its prompt's end).
        """
        end = self.shared.prompt_end
        if end is None:
            if not self.shared.recording:
                return num_new
            if seen == 0 and num_new > 1:
                raise ValueError(
                    f"a {self.kind} cache recording for speculative decoding cannot tell the "
                    "prompt from the draft in a first forward that feeds both (a generate call "
                    "tells it; recording activated by hand does not): call "
                    "cache.expect_prompt(prompt_tokens) first"
                )
            end = seen
        return min(max(end - seen, 0), num_new)

    def attend(
        self,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """This layer's part of a forward: :meth:`begin` (checks, plan; nothing stored on a
        refusal), then the columns before the prompt's end the plain way
        (:meth:`attend_prompt`) and the decode-phase ones as decode steps
        (:meth:`attend_decoded`). A new forward accepts the last one: its tokens can no longer
        be cropped.

        Args:
            query: ``[B, H_q, T, D]`` rotated by the model at its ``position_ids``.
            scaling: the model's softmax scale.
            attention_mask: ``None`` or the 2-D keep mask ``[B, seen + T]`` (left padding).
            kwargs: the attention kwargs (``position_ids``; ``softcap`` and ``s_aux``).

        Returns:
            ``[B, H_q, T, Dv]`` in the query dtype; padding queries give zeros.

        Raises:
            ValueError: see :meth:`begin`; nothing is stored then.
            RuntimeError: ``attend`` without a preceding ``update``.
        """
        forward = self.begin(attention_mask, kwargs)
        if forward.accepts:
            self._undo = []
        head, total = forward.prompt, forward.num_new
        if head == total:
            return self.attend_prompt(query, forward, total, scaling, kwargs)
        outs: list[Tensor] = []
        if head:
            outs.append(self.attend_prompt(query[:, :, :head], forward, head, scaling, kwargs))
        outs.append(self.attend_decoded(query[:, :, head:], forward, head, scaling, kwargs))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
