"""Method preparations (calibrations), cached on disk and reused across runs and workers.

A preparation (:data:`kvlab.evaluation.methods.PREPARATIONS`, e.g. PN-Mix's per-layer group
allocation) runs once per model and method settings. Its JSON-ready result is stored under
the calibration cache folder — ``--calibration-cache``, else ``$KVLAB_CALIBRATION_CACHE``, else
``<user cache>/calibration`` (:func:`kvlab.cachedir.user_cache_dir`) — as ``<key>.json``, where
the key is the sha256 of:

* the preparation's name and the method's ``params`` (its settings; only the part that
  decides the result when the preparation says so, ``Preparation.key_params``: e.g. relay and
  no relay share one per-layer eviction budget calibration);
* the model checkpoint's sha256 (:func:`kvlab.models.checkpoint_sha256`), weight dtype and
  device type;
* the calibration text's sha256;
* the code hash of the modules the preparation lists (editing the calibration, the cache or
  the attention invalidates every entry), and the ``torch`` / ``transformers`` versions.

The method's recorded settings get ``calibration_cache``: ``{"status": "reused" | "computed",
"key": ...}``. Entries are written atomically (:func:`kvlab.artifacts.write_json_atomic`), so
concurrent workers at worst compute the same entry twice.

An entry is ``{"key": <the fields above>, "prepared": <the state>, "content_sha256": ...}``,
sealed (:mod:`kvlab.evaluation.runfiles`). One that does not parse, whose checksum does not
match its content, that has no checksum (written before entries were sealed), or whose key
fields are not the ones asked for, is damaged: a warning names the file, the preparation runs
again and its entry replaces the damaged one. An entry is never used unchecked: a prepared
state edited in place, even to values that look valid, is recomputed, not used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvlab.artifacts.io import write_json_atomic
from kvlab.cachedir import user_cache_dir
from kvlab.evaluation.fingerprint import code_digest, content_hash
from kvlab.evaluation.methods.method import Method, check_method
from kvlab.evaluation.methods.preparations import (
    PREPARATIONS,
    Progress,
    accepts_progress,
    count_forwards,
)
from kvlab.evaluation.runfiles import (
    CalibrationEntry,
    DamagedRunFile,
    as_read_back,
    read_sealed,
    seal,
    warn_damaged,
)
from kvlab.userinput import quote

__all__ = [
    "CALIBRATION_CACHE_ENV",
    "Progress",
    "accepts_progress",
    "calibration_key",
    "count_forwards",
    "default_calibration_dir",
    "prepare",
    "prepare_method",
    "prepare_methods",
]

CALIBRATION_CACHE_ENV = "KVLAB_CALIBRATION_CACHE"


def default_calibration_dir() -> Path:
    """``$KVLAB_CALIBRATION_CACHE`` when set, else ``<user cache>/calibration``."""
    env = os.environ.get(CALIBRATION_CACHE_ENV)
    return Path(env).expanduser() if env else user_cache_dir("calibration")


def calibration_key(
    method: Method, *, checkpoint_sha256: str, text_sha256: str, dtype: str, device: str
) -> tuple[dict[str, Any], str]:
    """The fields that decide a preparation's result, and their sha256 (module docstring).

    Raises:
        ValueError: ``method`` has no preparation.
    """
    import torch
    import transformers

    if method.preparation is None:
        raise ValueError(f"method {quote(method.name)} has no preparation")
    preparation = PREPARATIONS[method.preparation]
    params = (
        method.params if preparation.key_params is None else preparation.key_params(method.params)
    )
    fields = {
        "preparation": method.preparation,
        "params": dict(params),
        "checkpoint_sha256": checkpoint_sha256,
        "dtype": dtype,
        "device": device,
        "text_sha256": text_sha256,
        "code_sha256": code_digest(preparation.modules),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return fields, content_hash(fields)


def prepare_method(
    method: Method,
    model: Any,
    tokenizer: Any,
    *,
    checkpoint_sha256: str,
    dtype: str,
    cache_dir: Path | None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or reuse) ``method``'s preparation for ``model``.

    Args:
        cache_dir: the calibration cache folder, or ``None`` to neither read nor write one.
        progress: ``progress(done, total)`` while it computes (e.g. layers).
        warn: receives one line when a damaged entry is set aside (module docstring; default
            :func:`warnings.warn`).

    Returns:
        The prepared state (JSON-ready) plus ``calibration_cache`` (module docstring).
    """
    preparation = PREPARATIONS[method.preparation or ""]
    device = next(model.parameters()).device.type
    text = preparation.text()
    fields, key = calibration_key(
        method,
        checkpoint_sha256=checkpoint_sha256,
        text_sha256=text.sha256,
        dtype=dtype,
        device=device,
    )
    path = None if cache_dir is None else Path(cache_dir) / f"{key}.json"
    stored = _read_entry(path, fields, warn)
    if stored is not None:
        return {**stored, "calibration_cache": {"status": "reused", "key": key}}
    prepared = preparation.run(method.params, model, tokenizer, text, progress)
    status = _store(path, fields, prepared)
    return {**prepared, "calibration_cache": {"status": status, "key": key}}


def prepare_methods(
    methods: Sequence[Method],
    model: Any,
    tokenizer: Any,
    *,
    checkpoint_sha256: str,
    dtype: str,
    cache_dir: Path | None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """:func:`prepare_method` for several methods of one model, sharing measurements: methods
    whose preparation has ``run_many`` and agrees on its ``batch_params`` (e.g. SnapKV layer
    budgets at several ratios) and whose entries are not cached are computed by one
    ``run_many`` call, and each is stored under its own key (the key :func:`prepare_method`
    reads, so a later run of any one of them reuses it). The others go through
    :func:`prepare_method`.

    Returns:
        one prepared state per method, in order (as :func:`prepare_method` returns it).

    Raises:
        ValueError: a method without a preparation (nothing is computed then).
    """
    for method in methods:
        if method.preparation is None:
            raise ValueError(f"method {quote(method.name)} has no preparation")
    device = next(model.parameters()).device.type
    results: list[dict[str, Any] | None] = [None] * len(methods)
    groups: dict[str, list[tuple[int, dict[str, Any], str, Path | None]]] = {}
    for index, method in enumerate(methods):
        preparation = PREPARATIONS[method.preparation or ""]
        if preparation.run_many is None or preparation.batch_params is None:
            continue
        text = preparation.text()
        fields, key = calibration_key(
            method,
            checkpoint_sha256=checkpoint_sha256,
            text_sha256=text.sha256,
            dtype=dtype,
            device=device,
        )
        path = None if cache_dir is None else Path(cache_dir) / f"{key}.json"
        stored = _read_entry(path, fields, warn)
        if stored is not None:
            results[index] = {**stored, "calibration_cache": {"status": "reused", "key": key}}
            continue
        group = content_hash(
            {"preparation": method.preparation, "batch": preparation.batch_params(method.params)}
        )
        groups.setdefault(group, []).append((index, fields, key, path))
    for members in groups.values():
        first = methods[members[0][0]]
        preparation = PREPARATIONS[first.preparation or ""]
        assert preparation.run_many is not None
        unique: dict[str, tuple[int, dict[str, Any], str, Path | None]] = {}
        for member in members:
            unique.setdefault(member[2], member)
        prepared_list = preparation.run_many(
            [methods[i].params for i, _, _, _ in unique.values()],
            model,
            tokenizer,
            preparation.text(),
            progress,
        )
        by_key = {}
        for (_, fields, key, path), prepared in zip(unique.values(), prepared_list, strict=True):
            by_key[key] = {
                **prepared,
                "calibration_cache": {"status": _store(path, fields, prepared), "key": key},
            }
        for index, _, key, _ in members:
            results[index] = by_key[key]
    for index, method in enumerate(methods):
        if results[index] is None:
            results[index] = prepare_method(
                method,
                model,
                tokenizer,
                checkpoint_sha256=checkpoint_sha256,
                dtype=dtype,
                cache_dir=cache_dir,
                progress=progress,
                warn=warn,
            )
    return [r for r in results if r is not None]


def _read_entry(
    path: Path | None, fields: Mapping[str, Any], warn: Callable[[str], None] | None
) -> dict[str, Any] | None:
    """The stored prepared state at ``path`` when the entry is sound and its key fields are
    ``fields``; else ``None`` (a damaged entry is reported through ``warn``)."""
    if path is None:
        return None
    expected = as_read_back(fields)

    def same_key(entry: dict[str, Any]) -> str | None:
        if entry["key"] == expected:
            return None
        return "its key fields are another calibration's (a renamed or copied entry)"

    try:
        entry = read_sealed(path, CalibrationEntry, require_checksum=True, check=same_key)
    except DamagedRunFile as damaged:
        warn_damaged(damaged, "calibration entry", warn)
        return None
    return None if entry is None else dict(entry["prepared"])


def _store(path: Path | None, fields: Mapping[str, Any], prepared: Mapping[str, Any]) -> str:
    """Write one entry (atomically); the ``calibration_cache`` status to record."""
    if path is None:
        return "computed"
    try:
        write_json_atomic(path, seal({"key": dict(fields), "prepared": dict(prepared)}))
    except OSError as exc:
        return f"computed (not stored: {exc.strerror or exc})"
    return "computed"


def merged_settings(method: Method, prepared: Mapping[str, Any] | None) -> dict[str, Any]:
    """``method.settings`` with the prepared state added (what artifacts record)."""
    return {**method.settings, **(prepared or {})}


_DEFAULT_DIR = object()


def prepare(
    method: Method,
    loaded: Any,
    *,
    cache_dir: Path | str | object | None = _DEFAULT_DIR,
    progress: Progress | None = None,
) -> dict[str, Any] | None:
    """The prepared state ``method`` needs on the model of ``loaded``, reusing the calibration
    cache ``kvlab eval`` uses by default (module docstring), or ``None`` for a method without
    a preparation.

    The one call a library user needs before :func:`~kvlab.evaluation.questions.compress_context`
    with a calibrated method (``relay:snapkv@R``, ``evict-no-relay:kvzip@R``, ``pn-mix-v1``):
    the key fields come from ``loaded`` (its checkpoint's sha256, weight dtype and device), so
    an entry ``kvlab eval`` computed for the same model and method is reused, and the other way
    round.

    Args:
        method: from :func:`~kvlab.evaluation.methods.parse_method`.
        loaded: a :class:`kvlab.models.LoadedModel` (from :func:`kvlab.models.load_model`).
        cache_dir: the calibration cache folder (default: :func:`default_calibration_dir`,
            as ``kvlab eval``); ``None`` neither reads nor writes one.
        progress: ``progress(done, total)`` while it computes.

    Raises:
        TypeError: ``method`` is not a :class:`Method` (e.g. its name: call
            :func:`~kvlab.evaluation.methods.parse_method` first); ``loaded`` is not a
            ``LoadedModel`` (a bare model has no checkpoint to key the cache by: use
            :func:`prepare_method`).
    """
    from kvlab.models import LoadedModel, checkpoint_sha256

    check_method(method)
    if method.preparation is None:
        return None
    if not isinstance(loaded, LoadedModel):
        raise TypeError(
            f"prepare() takes the LoadedModel of kvlab.load_model(...), got "
            f"{type(loaded).__name__}; for a model loaded otherwise call "
            "kvlab.evaluation.calibration.prepare_method(method, model, tokenizer, "
            "checkpoint_sha256=..., dtype=..., cache_dir=...)"
        )
    folder = default_calibration_dir() if cache_dir is _DEFAULT_DIR else cache_dir
    return prepare_method(
        method,
        loaded.model,
        loaded.tokenizer,
        checkpoint_sha256=checkpoint_sha256(loaded.spec),
        dtype=str(loaded.dtype).removeprefix("torch."),
        cache_dir=None if folder is None else Path(folder),  # type: ignore[arg-type]
        progress=progress,
    )
