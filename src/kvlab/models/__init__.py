"""Pretrained checkpoints, loaded offline (see :mod:`kvlab.models.loading`)."""

from __future__ import annotations

from kvlab.models.loading import (
    SMOLLM2_GGUF,
    SMOLLM2_SPEC,
    LoadedModel,
    ModelNotAvailableError,
    load_model,
    smollm2_gguf_path,
)

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_SPEC",
    "LoadedModel",
    "ModelNotAvailableError",
    "load_model",
    "smollm2_gguf_path",
]
