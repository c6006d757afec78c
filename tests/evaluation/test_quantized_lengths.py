"""transformers' QuantizedCache with quanto's per-channel keys groups them along the flattened
(kv head, token) axis: a prompt whose ``num_key_value_heads * tokens`` is not a multiple of the
group is refused before the model loads, naming the per-token row that runs at any length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab.evaluation.methods import Method
from kvlab.evaluation.methods.builtin import HF_QUANTIZED
from kvlab.evaluation.support import check_lengths, quantized_length_refusal


def _hf(name: str) -> Method:
    """The method as ``build_hf_quantized`` makes it, without needing quanto installed."""
    backend, bits, axis_key, axis_value = HF_QUANTIZED[name]
    settings = {"backend": backend, "nbits": bits, "axis_key": axis_key,
                "axis_value": axis_value, "q_group_size": 64, "residual_length": 128}  # fmt: skip
    return Method(name, "hf-quantized", "sdpa", "", settings, "hf-quantized", settings)


CONFIG = SimpleNamespace(num_key_value_heads=2, num_attention_heads=14)


@pytest.mark.parametrize(
    ("tokens", "refused"), [(3913, True), (4096, False), (32, False), (33, True), (31, True)]
)
def test_per_channel_quanto_needs_heads_times_tokens_divisible(tokens: int, refused: bool) -> None:
    reason = quantized_length_refusal(_hf("hf-quanto-2bit"), CONFIG, tokens)
    assert (reason is not None) == refused
    if refused:
        assert "'hf-quanto-2bit'" in reason and "'hf-quanto-2bit-per-token'" in reason
        assert f"{tokens}-token" in reason


def test_per_token_quanto_and_other_methods_take_any_length() -> None:
    for name in ("hf-quanto-2bit-per-token", "hf-quanto-4bit-per-token", "hf-hqq-2bit"):
        assert quantized_length_refusal(_hf(name), CONFIG, 3913) is None
    full = Method("full", "full", "sdpa", "", {}, "full")
    assert quantized_length_refusal(full, CONFIG, 3913) is None


def test_check_lengths_names_every_refused_method_once() -> None:
    methods = [_hf("hf-quanto-2bit"), _hf("hf-quanto-4bit"), _hf("hf-quanto-2bit-per-token")]
    with pytest.raises(ValueError) as info:
        check_lengths(methods, CONFIG, [4096, 3913, 3911], "qwen")
    text = str(info.value)
    assert text.count("cannot quantize") == 2 and "(qwen)" in text
    assert "3911-token" in text  # the first refused length, in sorted order
    check_lengths(methods[2:], CONFIG, [3913])  # nothing to refuse
