"""Errors quote user input shortened and escaped (:func:`kvlab.userinput.quote`): a
100,000-character method name, model, path or option value gives one short error line."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.userinput import QUOTE_LIMIT, quote

LONG = 100_000


@given(st.text(max_size=QUOTE_LIMIT))
def test_a_short_value_is_its_repr(text):
    assert quote(text) == repr(text)
    assert ast.literal_eval(quote(text)) == text


@given(st.text(min_size=QUOTE_LIMIT + 1, max_size=400))
def test_a_long_value_shows_its_head_and_tail_and_its_length(text):
    quoted = quote(text)
    literal, _, rest = quoted.rpartition(" (")
    assert rest == f"{len(text):,} characters)"
    assert ast.literal_eval(literal) == text[: QUOTE_LIMIT - 20] + "…" + text[-20:]
    assert "\n" not in quoted and "\r" not in quoted  # one line, whatever the input holds


def test_line_breaks_and_control_characters_are_escaped():
    assert quote("a\nb\x00c\x1b[31m") == r"'a\nb\x00c\x1b[31m'"
    assert quote("x" * LONG).endswith(f"' ({LONG:,} characters)")
    assert len(quote("x" * LONG)) < 2 * QUOTE_LIMIT
    with pytest.raises(ValueError, match="limit must be >= 40"):
        quote("x", limit=10)


def _cases(tmp_path):
    long = "x" * LONG
    out = ["--output-dir", str(tmp_path / "o")]
    return [
        (["eval", "--method", "relay:snapkv@9" + "5" * LONG, *out], "R must lie in [0, 1)"),
        (["eval", "--method", long, *out], "unknown method"),
        (["eval", "--method", "relay:" + long + "@0.5", *out], "unknown scorer"),
        (["eval", "--model", long, *out], "File name too long"),
        (["eval", "--model", "not/" + long[:200], *out], "is neither a registered name"),
        (["eval", "--text", str(tmp_path / long[:200]), *out], "text file not found"),
        (["eval", "--device", long, *out], "unknown device"),
        (["eval", "--ruler-chat", long, *out], "--ruler-chat must be auto, yes or no"),
        (["eval", "--needle-lengths", "2K," + long, *out], "is not a number"),
        (["eval", "--executor", long, *out], "--executor must be local or ray"),
        (["sweep", str(tmp_path / long[:200])], "sweep file not found"),
        (["reproduce", "--paper", long], "unknown paper"),
        (["reproduce", "--paper", "rope-relay", "--seeds", "1," + long], "--seeds must be"),
        (["models", "install", long], "unknown model"),
        (["eval", "--method", "[/]", *out], "unknown method '[/]'"),  # not rich markup
    ]


def test_every_error_quotes_user_input_shortened(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import kvlab.models
    from kvlab.cli import app

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvlab.models, "load_model", refuse)
    runner = CliRunner()
    for args, fragment in _cases(tmp_path):
        result = runner.invoke(app, args)
        shown = [a[:40] for a in args]
        assert result.exit_code == 2, (shown, result.output[:500])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (shown, result.stderr[:500])
        assert fragment in lines[0], lines[0]
        # at most QUOTE_LIMIT characters of the input: the line is its message, not the input
        assert len(lines[0]) < 1000, (shown, len(lines[0]), lines[0][:300])
        assert "x" * QUOTE_LIMIT not in lines[0] and "5" * QUOTE_LIMIT not in lines[0]
