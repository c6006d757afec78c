"""The registry: method names (:mod:`kvlab.evaluation.methods.grammar`) to their
:class:`~kvlab.evaluation.methods.method.Method`.

A name resolves, in this order, to a registered fixed name (:func:`register_method`), a
parametric name of the grammar (the built-in eviction and composed builders of
:mod:`kvlab.evaluation.methods.builtin`), or a registered pattern (:func:`register_pattern`,
a regular expression for a parametric name outside the grammar).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable

from kvlab.evaluation.methods.builtin import (
    HF_QUANTIZED,
    PNMIX_METHODS,
    build_composed,
    build_eviction,
    build_full,
    build_hf_quantized,
    build_pnmix,
)
from kvlab.evaluation.methods.grammar import (
    COMPOSABLE_KINDS,
    EVICTION_KINDS,
    GRAMMAR_NAMES,
    MethodName,
    parse_name,
    parse_ratio,
)
from kvlab.evaluation.methods.method import METHOD_PROTOCOLS, Method, MethodContext
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
        protocol: one of :data:`~kvlab.evaluation.methods.method.METHOD_PROTOCOLS`
            (``"prefill-score"``, ``"stream"``, ``"needle"`` or ``"ruler"``; decides how
            eviction budgets apply).
        cache_slots: the stream/needle protocol's cache window in tokens per head.

    Raises:
        TypeError: ``spec`` is not a ``str``.
        ValueError: an empty or unknown name (with the known names close to it), a parametric
            name without ``@R``, an R that is not a number in [0, 1), a scorer that does not
            exist, an HF ``QuantizedCache`` backend that is not installed, or an unknown
            ``protocol``.
    """
    if not isinstance(spec, str):
        raise TypeError(f"method must be a str, got {type(spec).__name__}")
    if protocol not in METHOD_PROTOCOLS:
        raise ValueError(
            f"protocol must be one of {', '.join(METHOD_PROTOCOLS)}, got {quote(protocol)}"
        )
    name = spec.strip()
    if not name:
        raise ValueError(
            "the method name is empty: give one, e.g. 'pn-mix' or 'relay:snapkv@0.5' "
            "(kvlab methods lists them)"
        )
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
    raise ValueError(_unknown(spec, name))


def _unknown(spec: str, name: str) -> str:
    """Why ``name`` (``spec`` stripped) names no method: a known kind without ``@R``, an
    unknown scorer, an R that is not a number in [0, 1) (:func:`parse_ratio` raises), a fixed
    name given ``@R``, or an unknown name (with the known names close to it)."""
    from kvlab.relay.scorers import SCORERS

    head, at, tail = name.partition("@")
    kind, colon, scorer = head.partition(":")
    if kind in EVICTION_KINDS and not at:
        scorer, plus, pnmix = scorer.partition("+")
        example = f"{kind}:{scorer or 'snapkv'}" if colon else kind
        return (
            f"method {quote(spec)} needs the evicted fraction: append @R with R in [0, 1), "
            f"e.g. {quote(f'{example}@0.5{plus}{pnmix}')}"
        )
    if kind in EVICTION_KINDS and colon and scorer not in SCORERS:
        return (
            f"method {quote(spec)}: unknown scorer {quote(scorer)}"
            + _did_you_mean(_close(scorer, SCORERS))
            + f"; known: {', '.join(SCORERS)}"
        )
    if kind in EVICTION_KINDS:
        ratio, plus, pnmix = tail.partition("+")
        parse_ratio(name, ratio)  # raises for an R that is not in [0, 1)
        if plus and kind not in COMPOSABLE_KINDS:
            return (
                f"method {quote(spec)}: only {' and '.join(COMPOSABLE_KINDS)} compose with "
                f"PN-Mix ('+PNMIX'), not {kind}"
            )
        if plus:
            known = [k for k, v in PNMIX_METHODS.items() if not v.get("calibrated")]
            return (
                f"method {quote(spec)}: unknown PN-Mix method {quote(pnmix)} after '+'"
                + _did_you_mean(_close(pnmix, known))
                + f"; known: {', '.join(known)}"
            )
    if at and head in _NAMED:
        return (
            f"method {quote(head)} takes no @R (only the parametric names do: "
            f"{', '.join(GRAMMAR_NAMES)})"
        )
    return (
        f"unknown method {quote(spec)}"
        + _did_you_mean(_close_names(name))
        + f"; known: {', '.join(available_method_names())}"
    )


def _did_you_mean(names: list[str]) -> str:
    if not names:
        return ""
    listed = " or ".join(quote(n) for n in names[-2:])
    return f" (did you mean {', '.join([*(quote(n) for n in names[:-2]), listed])}?)"


def _close(word: str, known: Iterable[str]) -> list[str]:
    """The known words close to ``word``, case ignored (:func:`difflib.get_close_matches`)."""
    lower = {k.lower(): k for k in known}
    return [lower[k] for k in difflib.get_close_matches(word.lower(), lower)]


def _close_names(name: str) -> list[str]:
    """Known names close to ``name`` (case ignored): fixed names and kinds (shown as
    ``KIND@R``), or for a name with ``:`` or ``@`` the same name with its kind replaced by a
    close kind."""
    head, at, rest = name.partition("@")
    kind, colon, scorer = head.partition(":")
    if at or colon:
        kinds = _close(kind, EVICTION_KINDS)
        return [f"{k}{colon}{scorer}{at}{rest}" for k in kinds if k != kind]
    return _close(name, [*_NAMED, *(f"{k}@R" for k in EVICTION_KINDS)])


register_method("full", build_full)
for _name in PNMIX_METHODS:
    register_method(_name, build_pnmix)
for _name in HF_QUANTIZED:
    register_method(_name, build_hf_quantized)
