"""A tiny random-initialized Llama with a byte-level tokenizer, saved as a local transformers
folder (no downloads), and a tiny text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TEXT = (
    "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! "
    "You come most carefully upon your hour. 'Tis now struck twelve; get thee to bed. "
    "For this relief much thanks: 'tis bitter cold, and I am sick at heart. "
) * 12


def save_tiny_model(folder: Path, *, max_position_embeddings: int = 2048) -> Path:
    from tiny_models import tiny_llama_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=256, max_position_embeddings=max_position_embeddings, pad_token_id=0
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="session", autouse=True)
def private_kvlab_cache(tmp_path_factory):
    """Calibrations and converted tokenizers go to a temporary folder, never ~/.cache
    (subprocesses inherit it through the environment)."""
    folder = tmp_path_factory.mktemp("kvlab-cache")
    saved = {k: os.environ.get(k) for k in ("KVLAB_CACHE_DIR", "KVLAB_CALIBRATION_CACHE")}
    os.environ["KVLAB_CACHE_DIR"] = str(folder)
    os.environ.pop("KVLAB_CALIBRATION_CACHE", None)
    yield folder
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def long_text(tmp_path_factory) -> Path:
    """The tiny text repeated: enough tokens (bytes, for the byte-level tokenizer) for needle
    prompts of a few hundred tokens at several offsets."""
    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text(TEXT * 4, encoding="utf-8")
    return path
