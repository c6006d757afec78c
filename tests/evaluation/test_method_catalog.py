"""The method catalogue (kvlab.evaluation.methods.catalog): every registered name documented,
the generated tables in README.md and docs/methods.md current, `kvlab methods` readable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.evaluation.methods import available_method_names, parse_method
from kvlab.evaluation.methods.catalog import (
    CATALOG,
    TABLE_END,
    TABLE_START,
    catalog_entry,
    markdown_table,
    measure_fractions,
    render_tables,
)
from kvlab.relay.scorers import SCORERS

ROOT = Path(__file__).resolve().parents[2]


def _fixed_names() -> list[str]:
    return [name for name in available_method_names() if not re.search(r"[@\[]", name)]


def test_every_fixed_name_has_an_entry() -> None:
    missing = [name for name in _fixed_names() if catalog_entry(name) is None]
    assert not missing, f"add a MethodDoc to catalog.py for {missing}"


def test_every_scorer_has_an_entry() -> None:
    documented = {d.example.split(":")[1].split("@")[0] for d in CATALOG if ":" in d.example}
    assert set(SCORERS) <= documented, set(SCORERS) - documented


def test_every_example_parses_or_needs_an_extra() -> None:
    for doc in CATALOG:
        if doc.needs:
            continue
        assert parse_method(doc.example).name == doc.example


def test_catalog_entry_finds_forms() -> None:
    assert catalog_entry("int2") is catalog_entry("int4")
    assert catalog_entry("pn-mix-3bit").example == "pn-mix-4bit"
    assert catalog_entry("no-such-method") is None


def test_markdown_table_escapes_pipes_and_marks_missing_bytes() -> None:
    table = markdown_table(CATALOG[:1], {})
    assert (
        table.splitlines()[2]
        == "| `full` | transformers `DynamicCache`, exact: the reference | — | — |"
    )
    assert markdown_table([CATALOG[0]], {"full": 1.0}).splitlines()[2].count("| 1.000 |") == 1


def test_render_tables_needs_a_closing_marker() -> None:
    with pytest.raises(ValueError, match="has no"):
        render_tables(f"a\n{TABLE_START} -->\n| x |\n", {})
    text = f"a\n{TABLE_START} --headline -->\nold\n{TABLE_END}\nb\n"
    rendered = render_tables(text, {})
    assert "old" not in rendered and rendered.startswith("a\n") and rendered.endswith("\nb\n")
    assert render_tables(rendered, {}) == rendered  # a fixed point


def test_methods_command_lists_every_entry_at_80_columns() -> None:
    result = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    flat = " ".join(result.output.split())
    for doc in CATALOG:
        assert doc.shown_as in flat


@pytest.mark.parametrize("command", [["--help"], ["eval", "--help"], ["sweep", "--help"]])
def test_help_fits_80_columns(command: list[str]) -> None:
    result = CliRunner().invoke(app, command, env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    long = [line for line in result.output.splitlines() if len(line) > 80]
    assert not long, long
    assert "…" not in result.output  # nothing cut


@pytest.mark.slow  # one prefill of 4,096 tokens per method on a one-layer model (~40 s of CPU)
def test_generated_tables_are_current() -> None:
    fractions = measure_fractions(doc.example for doc in CATALOG)
    for name in ("README.md", "docs/methods.md"):
        text = (ROOT / name).read_text("utf-8")
        assert TABLE_START in text, name
        assert render_tables(text, fractions) == text, (
            f"{name}: regenerate with python -m kvlab.evaluation.methods.catalog README.md "
            "docs/methods.md"
        )
    # the byte figures are exact invariants of the codecs and budgets
    assert fractions["full"] == 1.0
    assert fractions["relay:snapkv@0.5"] == pytest.approx(0.5, abs=1e-9)
    assert fractions["pn-mix-lean"] < fractions["pn-mix"] < 0.25
