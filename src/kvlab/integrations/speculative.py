"""Which ``generate`` call a recording kvlab cache serves (docs/design.md, "Cache life cycle":
speculative decoding).

``transformers``' ``generate(assistant_model=...)`` and prompt-lookup decoding (5.x:
``GenerationMixin._assisted_decoding``) call ``cache.activate_past_recording()`` before their
first forward, verify each draft in one multi-token forward and ``crop`` after it; nothing is
called when the ``generate`` call ends, so a cache would go on recording into the next, plain
turn. And the first forward feeds the prompt and the first draft together, which the cache
cannot tell apart. The cache therefore reads both from the ``generate`` call that activated its
recording: :func:`calling_generate` finds that call's frame on the stack
(``GenerationMixin.generate`` of ``transformers.generation``); its ``input_ids`` is the prompt
(:meth:`GenerateCall.prompt_tokens`), and :meth:`GenerateCall.running` tells, at a later
forward, whether it is still running. Recording activated by hand (no ``generate`` on the
stack) is not scoped: it lasts until ``reset()``, and the prompt's end is ``expect_prompt``'s.

The frame is held (frames take no weak references) until the cache's next forward, its
``is_croppable`` or ``reset()`` notices the call is over (then the finished frame is cleared:
its locals, the cache among them, are let go); a copy of the cache shares it, a pickled cache
drops it.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch import Tensor

__all__ = ["GenerateCall", "calling_generate"]

_GENERATION = "transformers.generation"


class GenerateCall:
    """A running ``transformers`` ``generate`` call (its frame), or none."""

    def __init__(self, frame: FrameType | None = None) -> None:
        self._frame = frame

    @property
    def scoped(self) -> bool:
        """Whether recording was activated by a ``generate`` call (``False``: by hand)."""
        return self._frame is not None

    def running(self) -> bool:
        """Whether the ``generate`` call is still running (``True`` when not scoped): on the
        calling thread's stack, or executing in another thread (``frame.clear()`` refuses an
        executing frame; a finished one it clears, releasing the call's locals)."""
        target = self._frame
        if target is None:
            return True
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame is target:
                return True
            frame = frame.f_back
        try:
            target.clear()
        except RuntimeError:  # executing, in another thread (a streamer's generate)
            return True
        return False

    def prompt_tokens(self) -> int | None:
        """The ``generate`` call's prompt length: its ``input_ids.shape[1]`` (the conversation
        so far included), or ``None`` (not scoped, or no 2-D integer ``input_ids``: a call
        with ``inputs_embeds``)."""
        if self._frame is None:
            return None
        ids = self._frame.f_locals.get("input_ids")
        if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            return int(ids.shape[1])
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> GenerateCall:
        return GenerateCall(self._frame)  # a copy serves the same call

    def __getstate__(self) -> dict[str, Any]:
        return {"_frame": None}  # frames do not pickle


def calling_generate(frame: FrameType | None) -> GenerateCall:
    """The ``transformers`` ``generate`` call ``frame`` runs in (the nearest
    ``GenerationMixin.generate`` frame at or above it), or an unscoped :class:`GenerateCall`."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "generate" and str(module).startswith(_GENERATION):
            return GenerateCall(frame)
        frame = frame.f_back
    return GenerateCall()
