"""The registry: method names (:mod:`kvlab.evaluation.methods.grammar`) to their
:class:`~kvlab.evaluation.methods.method.Method`.

A name resolves, in this order, to a registered fixed name (:func:`register_method`), a
parametric name of the grammar (the built-in eviction and composed builders of
:mod:`kvlab.evaluation.methods.builtin`), or a registered pattern (:func:`register_pattern`,
a regular expression for a parametric name outside the grammar).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvlab.evaluation.methods.builtin import (
    HF_QUANTIZED,
    PNMIX_METHODS,
    build_composed,
    build_eviction,
    build_full,
    build_hf_quantized,
    build_pnmix,
)
from kvlab.evaluation.methods.grammar import GRAMMAR_NAMES, MethodName, parse_name
from kvlab.evaluation.methods.method import Method, MethodContext
from kvlab.userinput import quote

__all__ = [
    "available_method_names",
    "parse_method",
    "register_method",
    "register_pattern",
    "takes_ratio",
]

_NAMED: dict[str, Callable[[str, MethodContext], Method]] = {}
_PATTERNS: list[tuple[re.Pattern[str], Callable[[re.Match[str], MethodContext], Method], str]] = []


def register_method(name: str, build: Callable[[str, MethodContext], Method]) -> None:
    """Register a fixed method name: ``build(name, context)`` returns its :class:`Method`.

    Raises:
        ValueError: the name is taken.
    """
    if name in _NAMED:
        raise ValueError(f"method {quote(name)} is already registered")
    _NAMED[name] = build


def register_pattern(
    pattern: str, build: Callable[[re.Match[str], MethodContext], Method], shown_as: str
) -> None:
    """Register a parametric method name outside the grammar: a full-match regular
    expression, a builder ``build(match, context)``, and how help texts show it (e.g.
    ``"pn-mix-bN"``). The grammar's names take precedence."""
    _PATTERNS.append((re.compile(pattern), build, shown_as))


def available_method_names() -> list[str]:
    """Method names (patterns for parametric methods) for help texts."""
    return [*_NAMED, *GRAMMAR_NAMES, *(shown for _, _, shown in _PATTERNS)]


def _build_parametric(parsed: MethodName, context: MethodContext) -> Method:
    if parsed.pnmix is not None:
        return build_composed(parsed, context)
    return build_eviction(parsed, context)


def takes_ratio(name: str) -> bool:
    """Whether ``name`` is a parametric method that needs ``@R`` appended (a sweep's
    ``ratios``): ``name@0.5`` is a parametric name of the grammar or matches a registered
    pattern."""
    if "@" in name:
        return False
    if parse_name(f"{name}@0.5") is not None:
        return True
    return any(p.fullmatch(f"{name}@0.5") for p, _, _ in _PATTERNS)


def parse_method(spec: str, *, protocol: str = "prefill-score", cache_slots: int = 2048) -> Method:
    """The :class:`Method` named ``spec`` (:mod:`kvlab.evaluation.methods.grammar`).

    Args:
        spec: a method name (surrounding white space ignored).
        protocol: ``"prefill-score"``, ``"stream"`` or ``"needle"`` (decides how eviction
            budgets apply).
        cache_slots: the stream/needle protocol's cache window in tokens per head.

    Raises:
        ValueError: an unknown name, an R outside [0, 1), a scorer that does not exist, or an
            HF ``QuantizedCache`` backend that is not installed.
    """
    name = spec.strip()
    context = MethodContext(protocol=protocol, cache_slots=cache_slots)
    if name in _NAMED:
        return _NAMED[name](name, context)
    parsed = parse_name(name)
    if parsed is not None:
        return _build_parametric(parsed, context)
    for pattern, build, _ in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return build(match, context)
    raise ValueError(f"unknown method {quote(spec)}; known: {', '.join(available_method_names())}")


register_method("full", build_full)
for _name in PNMIX_METHODS:
    register_method(_name, build_pnmix)
for _name in HF_QUANTIZED:
    register_method(_name, build_hf_quantized)
