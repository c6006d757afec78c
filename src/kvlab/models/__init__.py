"""Pretrained checkpoints, loaded offline (see :mod:`kvlab.models.loading`)."""

from __future__ import annotations

from kvlab.models.loading import (
    SMOLLM2_GGUF,
    SMOLLM2_SPEC,
    LoadedModel,
    ModelNotAvailableError,
    checkpoint_label,
    checkpoint_sha256,
    load_model,
    load_tokenizer,
    smollm2_gguf_path,
)

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_SPEC",
    "LoadedModel",
    "ModelNotAvailableError",
    "checkpoint_label",
    "checkpoint_sha256",
    "load_model",
    "load_tokenizer",
    "smollm2_gguf_path",
]
