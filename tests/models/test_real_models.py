"""The real registered models, each only when installed (``kvlab models install NAME``).

Skipped otherwise: nothing here downloads. What is pinned is the published architecture of each
checkpoint (docs/design.md, "Real models"), read cheaply from the GGUF header.
"""

from __future__ import annotations

import pytest

from kvlab.models import load_tokenizer, model_config
from kvlab.models.install import installed_path
from kvlab.models.registry import MODELS


def needs(name: str) -> None:
    """Skip unless ``name`` is installed where the test runs: checked inside the test, after
    the suite's private cache folder (tests/evaluation/conftest.py) is in place."""
    if installed_path(MODELS[name], verify=False) is None:
        pytest.skip(f"{name} is not installed ({MODELS[name].install_command})")


#: name -> (model_type, layers, query heads, kv heads, head_dim, full-attention layers)
ARCHITECTURES = {
    "qwen2.5-coder-0.5b": ("qwen2", 24, 14, 2, 64, 24),
    "qwen2.5-coder-1.5b": ("qwen2", 28, 12, 2, 128, 28),
    "gemma3-270m": ("gemma3_text", 18, 4, 1, 256, 3),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_from_the_header(name):
    if installed_path(MODELS[name], verify=False) is None:
        pytest.skip(f"{name} is not installed ({MODELS[name].install_command})")
    config = model_config(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = config.layer_types or ["full_attention"] * config.num_hidden_layers
    got = (
        config.model_type,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        layer_types.count("full_attention"),
    )
    assert got == ARCHITECTURES[name]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_chat_template_as_registered(name):
    from kvlab.models.gguf_meta import read_gguf_metadata

    path = installed_path(MODELS[name], verify=False)
    if path is None:
        pytest.skip(f"{name} is not installed ({MODELS[name].install_command})")
    meta = read_gguf_metadata(path)
    assert ("tokenizer.chat_template" in meta.metadata) == MODELS[name].chat_template
    assert meta.name == MODELS[name].gguf_name


def test_gemma3_sliding_and_full_layers():
    needs("gemma3-270m")
    config = model_config("gemma3-270m")
    assert config.sliding_window == 512
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_header_config_equals_transformers_own(name):
    from transformers import AutoConfig

    path = installed_path(MODELS[name], verify=False)
    if path is None:
        pytest.skip(f"{name} is not installed ({MODELS[name].install_command})")
    folder, file = str(path.parent), path.name
    theirs = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
    assert model_config(name).to_dict() == theirs.to_dict()


def test_qwen_tokenizer_and_chat_template():
    needs("qwen2.5-coder-0.5b")
    tokenizer = load_tokenizer("qwen2.5-coder-0.5b")
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer("def fib(n):").input_ids) == "def fib(n):"
