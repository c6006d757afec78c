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
    model_config,
    smollm2_gguf_path,
)
from kvlab.models.registry import MODELS, AssembledModel, ModelPart, PackagedModel, model_names

__all__ = [
    "MODELS",
    "SMOLLM2_GGUF",
    "SMOLLM2_SPEC",
    "AssembledModel",
    "LoadedModel",
    "ModelNotAvailableError",
    "ModelPart",
    "PackagedModel",
    "checkpoint_label",
    "checkpoint_sha256",
    "load_model",
    "load_tokenizer",
    "model_config",
    "model_names",
    "smollm2_gguf_path",
]
