"""Tiny random-initialized decoders for the transformers-integration tests (no downloads)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_LLAMA, tiny_llama_config
from transformers import LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from kvlab.integrations import register_kvlab_attention

VOCAB = TINY_LLAMA["vocab_size"]


def _llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    settings = dict(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**settings)).eval()
    model.set_attn_implementation("sdpa")
    return model


def _phi3_partial(seed: int = 0) -> Phi3ForCausalLM:
    """Phi-3 layout (rotate_half on the first rotary_dim channels) with
    partial_rotary_factor 0.5: head_dim 16, rotary_dim 8."""
    torch.manual_seed(seed)
    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        partial_rotary_factor=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Phi3ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="session", autouse=True)
def _kvlab_attention_registered() -> None:
    register_kvlab_attention()


@pytest.fixture
def make_llama():
    """Factory: ``make_llama(seed=0, **LlamaConfig overrides)`` -> eval-mode model (SDPA)."""
    return _llama


@pytest.fixture
def make_phi3_partial():
    """Factory: ``make_phi3_partial(seed=0)`` -> partial-rotary Phi-3 model (SDPA)."""
    return _phi3_partial
