"""Content hashes for evaluation tasks and caches: canonical JSON and source-code digests."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvlab.artifacts.provenance import file_sha256, manifest_digest, sha256_bytes

__all__ = ["canonical_json", "code_digest", "content_hash", "module_file", "package_modules"]


def canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys and no whitespace (the hashed form)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def content_hash(obj: Any) -> str:
    """Hex sha256 of :func:`canonical_json` of ``obj``."""
    return sha256_bytes(canonical_json(obj).encode("utf-8"))


def module_file(name: str) -> Path:
    """The source file of module ``name``, found without importing it.

    Raises:
        ModuleNotFoundError: no such module.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"module {name!r} not found")
    return Path(spec.origin)


def package_modules(name: str) -> tuple[str, ...]:
    """``name`` and, when it is a package, every module below it (sorted), found from its
    files without importing them: a package's module list cannot drift from its files.

    Raises:
        ModuleNotFoundError: no such module.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"module {name!r} not found")
    if not spec.submodule_search_locations:
        return (name,)
    found = {name}
    for folder in spec.submodule_search_locations:
        root = Path(folder)
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts:
                found.add(".".join((name, *parts)))
    return tuple(sorted(found))


_DIGESTS: dict[tuple[str, ...], str] = {}


def code_digest(modules: Iterable[str]) -> str:
    """One sha256 over the source files of ``modules`` (module name -> file sha256, see
    :func:`kvlab.artifacts.provenance.manifest_digest`), and over the C++ sources beside them
    (``*.cpp`` and ``*.h`` in a module's folder, e.g. the PN-Mix CPU kernels, which their
    modules compile and run, and the headers of :mod:`kvlab.kernels_common`:
    ``module:file.cpp`` -> file sha256). Editing any of them changes it. Memoized per
    process (sources do not change under a running evaluation)."""
    names = tuple(sorted(set(modules)))
    if names not in _DIGESTS:
        files = {n: file_sha256(module_file(n)) for n in names}
        for n in names:
            folder = module_file(n).parent
            for extra in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
                files[f"{n}:{extra.name}"] = file_sha256(extra)
        _DIGESTS[names] = manifest_digest(files)
    return _DIGESTS[names]
