"""A GGUF file's metadata and tensor names, read without its tensor data or its vocabulary.

The layout is the GGUF v2/v3 header of ggml's ``docs/gguf.md``: the magic ``b"GGUF"``, a
``uint32`` version, ``uint64`` tensor and key-value counts, then each key (``uint64`` length +
UTF-8 bytes), its ``uint32`` value type and the value (little-endian); then per tensor its
name, ``uint32`` dimension count, ``uint64`` dimensions, ``uint32`` ggml type and ``uint64``
offset. Long arrays (a tokenizer's vocabulary, merges and scores: hundreds of thousands of
items) are skipped and kept as their length, which makes this a few milliseconds where
``gguf.GGUFReader`` spends ~10-14 s parsing every array item (measured on the Qwen2.5 0.5B and
Gemma 3 270M files, README "Real models").

:func:`config_dict` turns the metadata into the ``transformers`` config dict with the mapping
``transformers`` itself applies when it loads a GGUF file
(``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``), for the cheap
:func:`kvlab.models.model_config`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GgufMetadata", "config_dict", "read_gguf_metadata"]

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
#: Arrays longer than this are kept as their length.
MAX_ARRAY = 4096


@dataclass(frozen=True)
class GgufMetadata:
    """``metadata``: key -> value (int/float/bool/str, a list for a short array, its length
    (int) for an array longer than :data:`MAX_ARRAY`); ``tensor_names``: in file order."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]

    @property
    def name(self) -> str | None:
        """``general.name``, or ``None`` when the file has none."""
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None


class _Cursor:
    def __init__(self, blob: Any, path: Path) -> None:
        self.blob, self.pos, self.path = blob, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.blob):
            raise ValueError(f"{self.path} is not a GGUF file: its header is truncated")
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.blob):
            raise ValueError(f"{self.path} is not a GGUF file: its header is truncated")
        raw = bytes(self.blob[self.pos : self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")
        item, count = self.unpack("<IQ")
        if item in _SCALARS:
            width = struct.calcsize(_SCALARS[item])
            if count > MAX_ARRAY:
                self.pos += width * count
                return count
            return [self.value(item) for _ in range(count)]
        if item == _STRING:
            if count > MAX_ARRAY:  # walk the lengths only: the hot loop of a vocabulary
                blob, pos, unpack = self.blob, self.pos, struct.unpack_from
                try:
                    for _ in range(count):
                        pos += 8 + unpack("<Q", blob, pos)[0]
                except struct.error:
                    raise ValueError(f"{self.path} is not a GGUF file: truncated header") from None
                self.pos = pos
                return count
            return [self.string() for _ in range(count)]
        if count > MAX_ARRAY:
            raise ValueError(f"{self.path}: a long GGUF array of arrays is not supported")
        return [self.value(item) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> GgufMetadata:
    """Read the metadata and tensor names of a GGUF file (module docstring); no tensor data.

    Raises:
        ValueError: not a GGUF v2/v3 file, or a truncated header.
        OSError: the file cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        if path.stat().st_size < 24:
            raise ValueError(f"{path} is not a GGUF file (too short)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            if bytes(blob[:4]) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
            cursor = _Cursor(blob, path)
            cursor.pos = 4
            version, tensor_count, kv_count = cursor.unpack("<IQQ")
            if version not in (2, 3):
                raise ValueError(f"{path} is GGUF v{version}; v2 and v3 are read")
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.unpack("<I"))
            names = []
            for _ in range(tensor_count):
                names.append(cursor.string())
                dims = cursor.unpack("<I")
                cursor.pos += 8 * dims + 4 + 8
    return GgufMetadata(metadata=metadata, tensor_names=tuple(names))


def config_dict(meta: GgufMetadata) -> dict[str, Any]:
    """The ``transformers`` config dict of a GGUF file's metadata.

    The steps of ``load_gguf_checkpoint`` (transformers 5.x) for an architecture without a
    special case there: ``general.architecture`` -> ``model_type``, the per-architecture keys
    of ``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``, the defaults of
    ``GGUF_CONFIG_DEFAULTS_MAPPING``, ``tie_word_embeddings`` = no ``output.weight`` tensor,
    ``vocab_size`` = the vocabulary's length when not stored, ``gemma3`` -> ``gemma3_text``.

    Raises:
        ValueError: an architecture ``transformers`` cannot read from GGUF, or one whose
            loader has special cases not reproduced here (t5, mistral-named llama,
            stablelm, lfm2, gpt-oss, gemma4, minimax-m2, the MoE renames).
    """
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    data = meta.metadata
    arch = data.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("the GGUF metadata has no general.architecture")
    special = ("t5", "stablelm", "lfm2", "gpt", "gemma4", "minimax", "moe")
    name = data.get("general.name", "")
    if any(s in arch for s in special) or ("llama" in arch and "mistral" in str(name)):
        raise ValueError(f"GGUF architecture {arch!r}: read its config with transformers")
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF architecture {arch!r} is not supported by transformers")
    config: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
    }
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    for key, value in data.items():
        prefix, _, rest = key.partition(".")
        renames = GGUF_CONFIG_MAPPING.get(prefix)
        if renames is None or rest not in renames:
            continue
        target = renames[rest]
        if target is None or target == -1:
            continue
        config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in data:
        tokens = data["tokenizer.ggml.tokens"]
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config
