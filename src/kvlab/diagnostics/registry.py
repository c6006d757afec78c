"""The one explicit registry of diagnostics. Adding a paper means adding a line here.

Each key maps to the module that defines its ``PAPER``; the module is imported only when the
paper is asked for, so importing the registry has no side effects and one broken diagnostic
cannot break the others.
"""

from __future__ import annotations

import importlib

from kvlab.diagnostics.paper import Paper
from kvlab.userinput import quote

__all__ = ["get_paper", "paper_keys"]

_REGISTRY: dict[str, str] = {
    "rope-relay": "kvlab.diagnostics.rope_relay",
    "pn-mix": "kvlab.diagnostics.pn_mix",
}


def paper_keys() -> list[str]:
    """Registered paper keys, in registry order."""
    return list(_REGISTRY)


def get_paper(key: str) -> Paper:
    """The paper registered under ``key``.

    Raises:
        KeyError: unknown key; the message lists the known ones.
    """
    if key not in _REGISTRY:
        raise KeyError(f"unknown paper {quote(key)}; known papers: {', '.join(_REGISTRY)}")
    paper: Paper = importlib.import_module(_REGISTRY[key]).PAPER
    if paper.key != key:
        raise RuntimeError(f"module {_REGISTRY[key]} registers {paper.key!r}, not {key!r}")
    return paper
