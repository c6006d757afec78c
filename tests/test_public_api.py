"""`import kvlab`: the public names, imported lazily; the README's example is the file."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab

ROOT = Path(__file__).resolve().parents[1]


def test_import_kvlab_is_cheap() -> None:
    code = (
        "import sys, kvlab; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_to_its_module_object() -> None:
    names = [n for n in kvlab.__all__ if n != "__version__"]
    assert 12 <= len(names) <= 20
    for name in names:
        value = getattr(kvlab, name)
        module = importlib.import_module(value.__module__)
        assert getattr(module, name) is value, name
        assert name in dir(kvlab)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvlab.nope  # noqa: B018


def test_subpackage_all_lists_hold_only_public_names() -> None:
    for package in ("kvlab.pnmix", "kvlab.relay", "kvlab.integrations", "kvlab.evaluation"):
        names = importlib.import_module(package).__all__
        assert not [n for n in names if n.startswith("_")], package


def _readme_block(language: str, after: str) -> str:
    text = (ROOT / "README.md").read_text("utf-8")
    start = text.index(after)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(text, start)
    assert match is not None
    return match.group(1)


def test_readme_example_is_the_example_file() -> None:
    assert _readme_block("python", "## Use it from Python") == (
        ROOT / "examples" / "quickstart.py"
    ).read_text("utf-8")


@pytest.mark.slow  # loads SmolLM2-135M and compresses a 700-token context three ways
def test_example_runs_and_prints_what_the_readme_shows(tmp_path) -> None:
    env = {**os.environ, "KVLAB_CALIBRATION_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shown = _readme_block("", "It prints").strip().splitlines()
    printed = out.stdout.strip().splitlines()
    assert len(printed) == len(shown)
    for got, want in zip(printed, shown, strict=True):
        # byte counts are exact; the answers are the model's (greedy, float32 on the CPU)
        assert re.findall(r"[\d,]{5,} bytes", got) == re.findall(r"[\d,]{5,} bytes", want)
        assert got == want
