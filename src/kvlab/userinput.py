"""Quoting what a user gave (a method or model name, a path, an option's value, a text) inside
an error message: one line, escaped, and short, whatever the input.

Every kvlab error that repeats user input goes through :func:`quote`: a 100,000-character
``--method`` value gives a message of one short line, not one 100,000-character line.
"""

from __future__ import annotations

__all__ = ["QUOTE_LIMIT", "quote"]

#: Characters of the input a quote shows at most (head and tail of a longer one).
QUOTE_LIMIT = 80
_TAIL = 20


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``str(value)`` as a Python string literal (``repr``: quotes around it, line breaks,
    control and other unprintable characters escaped, so the message stays one line), shortened
    when it has more than ``limit`` characters to its first ``limit - 20`` and last 20
    characters around ``…``, followed by its full length:
    ``'relay:xxxxxxxx…xxxx@0.5' (100,012 characters)``.

    A value of at most ``limit`` characters is ``repr(str(value))``, exactly.

    Raises:
        ValueError: ``limit`` below 2 * 20 (no room for a head and a tail).
    """
    if limit < 2 * _TAIL:
        raise ValueError(f"limit must be >= {2 * _TAIL}, got {limit}")
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit - _TAIL] + '…' + text[-_TAIL:]!r} ({len(text):,} characters)"
