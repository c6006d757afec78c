"""kvlab's per-user cache folder (calibrations, converted tokenizers).

``$KVLAB_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvlab``, else ``~/.cache/kvlab`` (the XDG
base-directory convention). Everything in it can be deleted at any time; it is recomputed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "user_cache_dir"]

CACHE_DIR_ENV = "KVLAB_CACHE_DIR"


def user_cache_dir(*parts: str) -> Path:
    """``<cache root>/<parts...>`` (module docstring); not created."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvlab"
    return base.joinpath(*parts)
