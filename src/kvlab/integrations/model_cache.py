"""What every kvlab model cache does, whatever layers it chooses: :class:`KVLabModelCache`.

A kvlab model cache is a ``transformers.Cache`` whose constructor only chooses its layers (as
``DynamicCache`` and ``QuantizedCache`` do): a :class:`~kvlab.integrations.layer.KVLabLayer`
per full-attention layer and a :class:`~kvlab.integrations.window_layer.WindowLayer` per
sliding-window or chunked layer (:meth:`kvlab.integrations.model_support.ModelPlan.
build_layers`). This class adds what does not depend on the layers: speculative decoding's
recording, prompt end and crop (docs/design.md, "Cache life cycle"), reset, the deferred value
checks, bytes, and the defaults of the evaluation protocol
(:class:`~kvlab.integrations.cache_protocol.KVLabCache`).
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.integrations.cache_protocol import CacheStorage, crop_count, layers_storage
from kvlab.integrations.layer import KVLabLayer, SharedState
from kvlab.integrations.speculative import GenerateCall, calling_generate
from kvlab.integrations.window_layer import ForwardGuard

__all__ = ["KVLabModelCache"]


class KVLabModelCache(Cache):
    """A ``transformers`` cache of kvlab layers (module docstring).

    Args:
        layers: one cache layer per decoder layer.
        shared: the state the cache's kvlab layers share.
    """

    #: the cache kind, in messages
    kind: ClassVar[str] = "kvlab"
    #: the RoPE positions are the model's own (the tokens seen): forwards pass no position_ids
    explicit_positions: ClassVar[bool] = False

    def __init__(self, layers: list[CacheLayerMixin], shared: SharedState) -> None:
        super().__init__(layers=layers)
        self.shared = shared
        shared.guard = ForwardGuard(self.layers)  # atomic failure with leading window layers
        # the generate call that activated recording (kvlab.integrations.speculative)
        self._generate = GenerateCall()

    def kvlab_layers(self) -> list[KVLabLayer]:
        """The cache's full-attention layers (its own kind), in decoder order."""
        return [layer for layer in self.layers if isinstance(layer, KVLabLayer)]

    # ---------------- speculative decoding (docs/design.md, "Cache life cycle": crop)
    def speculative_refusal(self) -> str | None:
        """Why this cache cannot be cropped, refusing speculative decoding (``None``: it can)."""
        return None

    def activate_past_recording(self, **kwargs: object) -> None:
        """Record from now on (``transformers``' ``generate(assistant_model=...)`` and
        prompt-lookup decoding call this first, before any forward; ``kwargs``, such as
        ``transformers`` >= 5.25's ``recurrent_states_to_keep``, pass on to the layers): a
        forward's tokens after the prompt's end (:meth:`expect_prompt`) are decode-phase
        tokens — stored and attended as the one-token forwards of a plain run would — and
        :meth:`crop` can remove them; window layers keep their states until the next ``crop``
        (``transformers``' own recording). Called inside a ``generate`` call, the prompt ends
        where that call's ``input_ids`` end (unless :meth:`expect_prompt` marked it) and the
        recording lasts as long as the call: the first forward after it returns (or
        :attr:`is_croppable`) finds it over and :meth:`stop_recording` (nothing tells the
        cache otherwise; :mod:`kvlab.integrations.speculative`); called by hand, until
        :meth:`stop_recording` or :meth:`reset`, with the prompt's end given by
        :meth:`expect_prompt`.

        Raises:
            NotImplementedError: :meth:`speculative_refusal`; nothing changes.
        """
        reason = self.speculative_refusal()
        if reason is not None:
            raise NotImplementedError(
                f"{type(self).__name__} cannot be cropped here, so speculative decoding "
                f"(generate(assistant_model=...), prompt_lookup_num_tokens) is refused: "
                f"{reason}; nothing was stored"
            )
        self.shared.recording = True
        self._generate = calling_generate(sys._getframe(1))
        # the prompt's end: the generate call's input_ids, unless expect_prompt marked one
        seen, end = self.get_seq_length(), self.shared.prompt_end
        prompt = self._generate.prompt_tokens()
        if prompt is not None and prompt >= max(1, seen) and (end is None or end <= seen):
            self.shared.prompt_end = prompt
        super().activate_past_recording(**kwargs)

    def stop_recording(self) -> None:
        """Leave speculative decoding's recording: later forwards run as plain ones (no undo
        entries, no decode-phase tokens unless a prompt end is marked), window layers keep
        only their window again, and :meth:`crop` refuses. What is stored stays."""
        self.shared.recording = False
        self.shared.prompt_end = None
        self._generate = GenerateCall()
        for layer in self.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False

    def _end_finished_generate(self) -> None:
        """Stop recording when the ``generate`` call that activated it has returned."""
        if self.shared.recording and not self._generate.running():
            self.stop_recording()

    @property
    def is_croppable(self) -> bool:
        """Whether every layer can be cropped now: while the cache records (a ``generate``
        call's recording ends with the call)."""
        self._end_finished_generate()
        return bool(super().is_croppable)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        """``transformers``' ``Cache.update``; a forward's first layer first ends a finished
        ``generate`` call's recording (:meth:`activate_past_recording`) and forgets a prompt
        end the cache has passed (:meth:`expect_prompt`)."""
        if layer_idx == 0:
            self._end_finished_generate()
            end = self.shared.prompt_end
            if end is not None and self.get_seq_length() >= end:
                self.shared.prompt_end = None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def expect_prompt(self, tokens: int) -> None:
        """Mark where the prompt ends: token columns ``tokens`` (``input_ids.shape[1]`` of the
        ``generate`` call, the conversation so far included). A forward's columns before it go
        the plain way (a prefill attends exactly, an eviction cache's prompt evicts at its
        end), later ones are decode-phase tokens: stored and attended as the one-token forwards
        of a plain run would (docs/design.md, "Cache life cycle"). ``transformers``' first
        speculative forward feeds the prompt and the first draft together; a ``generate``
        call's recording reads its prompt itself (:meth:`activate_past_recording`), so this
        is the explicit override there, and what recording by hand needs. Teacher-forced
        scoring marks the question's end, so that the answer's tokens attend as ``answer``'s
        decode steps do. The mark is forgotten at the first forward after the cache passed it.

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
        self.shared.prompt_end = int(tokens)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens from every layer (``transformers``'
        convention; ``crop(0)`` only shrinks recording window layers back to their window):
        while recording, the decode-phase tokens of the last forward
        (:meth:`~kvlab.integrations.layer.KVLabLayer.crop`). Checked for every layer before
        any changes.

        Raises:
            NotImplementedError: ``tokens_to_remove != 0`` while not recording.
            ValueError: a positive count, or more tokens than the last forward's decode-phase
                tokens; nothing changes.
        """
        remove = crop_count(tokens_to_remove)
        layers = self.kvlab_layers()
        if remove and layers:
            if not self.shared.recording:
                layers[0].crop(tokens_to_remove)  # raises NotImplementedError
            can = min(layer.croppable_tokens() for layer in layers)
            if remove > can:
                raise ValueError(
                    f"a {self.kind} cache can crop only the {can} decode-phase tokens of its "
                    "last forward (a prompt token or an earlier forward's token is never "
                    f"removed); asked to remove {remove}"
                )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty every layer and stop recording (as a new cache: no prompt end, no undo)."""
        super().reset()
        self.stop_recording()
        self.shared.reset()

    # ---------------- checks and bytes
    def check_values(self) -> None:
        """Check every single-token forward since the last check (values finite and within the
        storage range): one device read for all layers, none if there is nothing to check
        (a cache without deferred checks has none).

        Raises:
            ValueError: naming the first offending layer (its storage holds the bad values).
        """
        self.shared.check()

    def nbytes(self) -> int:
        """Bytes of every layer's stored keys and values (window layers: their exact window)."""
        return sum(layer.nbytes() for layer in self.layers)

    # ---------------- evaluation protocol (kvlab.integrations.cache_protocol.KVLabCache)
    def position_ids(self, num_new: int, device: torch.device | str | None = None) -> Tensor:
        """The RoPE positions of the next ``num_new`` tokens, int64 ``[1, num_new]``: the
        tokens seen onward (what the model uses when given none)."""
        start = self.get_seq_length()
        return torch.arange(start, start + num_new, dtype=torch.int64, device=device).view(1, -1)

    def rope_position(self) -> int:
        """The RoPE position of the next token: the tokens seen."""
        return int(self.get_seq_length())

    def details(self) -> dict[str, Any]:
        """Method-specific facts (none here)."""
        return {}

    def end_prompt(self) -> None:
        """A no-op: the cache stores every forward's tokens alike (no prompt rule)."""

    def storage(self) -> CacheStorage:
        """Every layer's :meth:`~kvlab.integrations.layer.KVLabLayer.storage` (window layers:
        their tensors as held), summed per layer kind."""
        return layers_storage((layer, layer.storage()) for layer in self.layers)
