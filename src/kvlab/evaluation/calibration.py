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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvlab.artifacts.io import read_json, write_json_atomic
from kvlab.cachedir import user_cache_dir
from kvlab.evaluation.fingerprint import code_digest, content_hash
from kvlab.evaluation.methods.method import Method
from kvlab.evaluation.methods.preparations import (
    PREPARATIONS,
    Progress,
    accepts_progress,
    count_forwards,
)

__all__ = [
    "CALIBRATION_CACHE_ENV",
    "Progress",
    "accepts_progress",
    "calibration_key",
    "count_forwards",
    "default_calibration_dir",
    "prepare_method",
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
        raise ValueError(f"method {method.name!r} has no preparation")
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
) -> dict[str, Any]:
    """Run (or reuse) ``method``'s preparation for ``model``.

    Args:
        cache_dir: the calibration cache folder, or ``None`` to neither read nor write one.
        progress: ``progress(done, total)`` while it computes (e.g. layers).

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
    if path is not None and path.is_file():
        try:
            stored = read_json(path)
        except (OSError, ValueError):
            stored = None
        if isinstance(stored, dict) and stored.get("key") == fields:
            return {**stored["prepared"], "calibration_cache": {"status": "reused", "key": key}}
    prepared = preparation.run(method.params, model, tokenizer, text, progress)
    status = "computed"
    if path is not None:
        try:
            write_json_atomic(path, {"key": fields, "prepared": prepared})
        except OSError as exc:
            status = f"computed (not stored: {exc.strerror or exc})"
    return {**prepared, "calibration_cache": {"status": status, "key": key}}


def merged_settings(method: Method, prepared: Mapping[str, Any] | None) -> dict[str, Any]:
    """``method.settings`` with the prepared state added (what artifacts record)."""
    return {**method.settings, **(prepared or {})}
