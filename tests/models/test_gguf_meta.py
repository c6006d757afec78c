"""The header-only GGUF reader and the config it rebuilds, against ``transformers`` itself."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from model_fakes import tiny_gguf
from transformers import AutoConfig

from kvlab.models import model_config
from kvlab.models.gguf_meta import MAX_ARRAY, config_dict, read_gguf_metadata


def gemma3_gguf(path, layers: int = 7) -> None:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("Tiny Gemma")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(8)
    # a vocabulary longer than MAX_ARRAY: kept as its length, used as vocab_size
    writer.add_token_list([f"t{i}" for i in range(MAX_ARRAY + 5)])
    writer.add_token_scores([0.0] * (MAX_ARRAY + 5))
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reads_scalars_strings_and_tensor_names(tmp_path):
    tiny_gguf(tmp_path / "t.gguf")
    meta = read_gguf_metadata(tmp_path / "t.gguf")
    assert meta.name == "Fake Tiny"
    assert meta.metadata["general.architecture"] == "qwen2"
    assert meta.metadata["qwen2.block_count"] == 2
    assert meta.metadata["qwen2.rope.freq_base"] == 10000.0
    assert meta.tensor_names == ("output_norm.weight",)


def test_long_arrays_are_their_length(tmp_path):
    gemma3_gguf(tmp_path / "g.gguf")
    meta = read_gguf_metadata(tmp_path / "g.gguf")
    assert meta.metadata["tokenizer.ggml.tokens"] == MAX_ARRAY + 5
    assert meta.metadata["tokenizer.ggml.scores"] == MAX_ARRAY + 5
    assert meta.tensor_names == ("token_embd.weight",)


@pytest.mark.parametrize("make", [tiny_gguf, gemma3_gguf], ids=["qwen2", "gemma3"])
def test_config_equals_transformers_own(tmp_path, make):
    make(tmp_path / "m.gguf")
    ours = model_config(str(tmp_path / "m.gguf"))
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf", local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.to_dict() == theirs.to_dict()


def test_gemma3_layer_types(tmp_path):
    gemma3_gguf(tmp_path / "g.gguf", layers=7)
    config = model_config(str(tmp_path / "g.gguf"))
    assert config.model_type == "gemma3_text" and config.vocab_size == MAX_ARRAY + 5
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (config.head_dim, config.sliding_window, config.tie_word_embeddings) == (16, 8, True)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "too short"),
        (b"NOTGGUF" + bytes(40), "no GGUF magic"),
        (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "GGUF v7"),
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little"), "truncated"),
    ],
)
def test_bad_files_raise_one_error(tmp_path, data, fragment):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=fragment):
        read_gguf_metadata(path)


def test_unsupported_architecture(tmp_path):
    tiny_gguf(tmp_path / "t.gguf", arch="stablelm")
    with pytest.raises(ValueError, match="stablelm"):
        config_dict(read_gguf_metadata(tmp_path / "t.gguf"))
