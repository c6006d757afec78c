"""The README and docs/ render as written: every code fence is closed, and no fence opens (a
fence with a language) inside another — the mark of a stray opener that turns the rest of a
page into one code block."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def fence_errors(text: str) -> list[str]:
    """Unclosed fences and fences with an info string opened inside a fence, as ``line N: ...``."""
    errors = []
    open_at, marker = 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if not match:
            continue
        fence, info = match.group(1), match.group(2).strip()
        if not marker:
            open_at, marker = number, fence
        elif fence[0] != marker[0] or len(fence) < len(marker):
            continue  # a shorter or other fence inside a fence is its text
        elif not info:
            marker = ""
        else:
            errors.append(
                f"line {number}: fence '{fence}{info}' inside the fence of line {open_at}"
            )
    if marker:
        errors.append(f"line {open_at}: fence never closed")
    return errors


def test_fence_errors_finds_a_stray_opener() -> None:
    text = "a\n```python\nx = 1\n```\n\n```python\n\n**b**\n\n```python\ny = 2\n```\n"
    assert fence_errors(text) == ["line 10: fence '```python' inside the fence of line 6"]
    assert fence_errors("```\nx\n") == ["line 1: fence never closed"]
    assert fence_errors("````md\n```python\n```\n````\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_fences_are_closed(page: Path) -> None:
    assert fence_errors(page.read_text(encoding="utf-8")) == []
