"""C++ sources shared by kvlab's compiled CPU kernels (docs/design.md, "Kernels").

``kvlab_simd.h`` (eight-lane float32 loads, horizontal sum, dot products) is included by the
PN-Mix attention kernel and the RoPE-Relay decode kernel; :func:`kvlab.native.compile_module`
puts :data:`INCLUDE_DIR` on the compiler's include path and hashes :func:`header_sources`
into each build's name, so an edited header rebuilds both kernels.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["HEADERS", "INCLUDE_DIR", "header_sources"]

#: The folder holding the shared headers (this package's folder).
INCLUDE_DIR: Path = Path(__file__).resolve().parent

#: The shared headers, by file name.
HEADERS: tuple[str, ...] = ("kvlab_simd.h",)


def header_sources() -> tuple[str, ...]:
    """The text of each of :data:`HEADERS` (UTF-8), in that order.

    Raises:
        OSError: a header is missing from the installed package.
    """
    return tuple((INCLUDE_DIR / name).read_text("utf-8") for name in HEADERS)
