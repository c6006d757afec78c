"""Caches filled inside ``torch.inference_mode()`` and continued outside it.

Tensors created under ``torch.inference_mode()`` are *inference tensors*: outside that mode
PyTorch refuses any in-place update of them ("Inplace update to inference tensor outside
InferenceMode is not allowed"). ``transformers``' ``DynamicCache`` never writes in place (it
concatenates), so generating under inference mode and then continuing under ``no_grad`` — a
common serving pattern — works with it. kvlab's stores write into pre-allocated buffers, so a
layer filled under inference mode converts its storage once, on its first update outside the
mode: every inference tensor reachable from the storage object is replaced by a normal copy
(:func:`release_inference_tensors`). The copy holds the same bits; later forwards then run
exactly as on a cache filled outside inference mode (docs/design.md, "Cache life cycle").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

__all__ = ["InferenceModeTracker", "release_inference_tensors"]


def release_inference_tensors(root: Any) -> int:
    """Replace, in place, every inference tensor reachable from ``root`` by a normal copy.

    Walks tensors held in attributes (``__dict__``, ``__slots__``, frozen dataclasses
    included), lists, tuples and dicts; never enters ``torch.nn.Module`` objects, classes or
    functions. Must be called outside inference mode (a clone made inside it is an inference
    tensor again).

    Returns:
        the number of tensors replaced.

    Raises:
        RuntimeError: called inside ``torch.inference_mode()``.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("release_inference_tensors must run outside torch.inference_mode()")
    seen: set[int] = set()
    replaced = 0

    def fresh(value: Any) -> tuple[Any, bool]:
        nonlocal replaced
        if isinstance(value, Tensor):
            if value.is_inference():
                replaced += 1
                return value.clone(), True
            return value, False
        visit(value)
        return value, False

    def visit(obj: Any) -> None:
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, str, bytes, int, float)):
            return
        if callable(obj) and not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        if isinstance(obj, list):
            for i, item in enumerate(obj):
                new, changed = fresh(item)
                if changed:
                    obj[i] = new
            return
        if isinstance(obj, dict):
            for key, item in list(obj.items()):
                new, changed = fresh(item)
                if changed:
                    obj[key] = new
            return
        if isinstance(obj, tuple):
            for item in obj:  # tuples of tensors are rebuilt by their holder (below)
                if not isinstance(item, Tensor):
                    visit(item)
            return
        names: list[str] = list(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            names.extend(s for s in getattr(cls, "__slots__", ()) if s not in ("__dict__",))
        for name in names:
            if not hasattr(obj, name):
                continue
            value = getattr(obj, name)
            if isinstance(value, tuple) and any(
                isinstance(t, Tensor) and t.is_inference() for t in value
            ):
                new_tuple = tuple(fresh(t)[0] for t in value)
                object.__setattr__(obj, name, new_tuple)
                continue
            new, changed = fresh(value)
            if changed:
                object.__setattr__(obj, name, new)

    if dataclasses.is_dataclass(root) or hasattr(root, "__dict__") or isinstance(root, list):
        visit(root)
    return replaced


@dataclasses.dataclass
class InferenceModeTracker:
    """Remembers whether a layer stored anything under ``torch.inference_mode()``, so that its
    first update outside the mode releases its storage's inference tensors (one bool check per
    update otherwise). Compared by value (a deep copy of a cache equals its original)."""

    filled_in_inference: bool = False

    def before_update(self, storage: Any) -> None:
        """Call at the start of each update, with the layer's storage object (or ``None``)."""
        if torch.is_inference_mode_enabled():
            self.filled_in_inference = True
        elif self.filled_in_inference:
            if storage is not None:
                release_inference_tensors(storage)
            self.filled_in_inference = False
