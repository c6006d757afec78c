"""Which methods can run on a model, decided from its config before any weight loads.

Every kvlab cache compresses a model's full-attention layers and keeps its bounded window
layers (``sliding_attention`` / ``chunked_attention``: Gemma 2/3, Mistral, GPT-OSS, ...) as
``transformers`` keeps them (:mod:`kvlab.integrations.model_support`), counting every layer's
bytes. A method that still cannot run on a model is refused here, naming the method, the
reason and an alternative, before the model loads (``kvlab eval`` calls
:func:`check_methods` from :func:`kvlab.evaluation.harness.prepare_inputs`).

:func:`read_model_config` reads the config without the weights (a GGUF file's metadata, or a
folder's ``config.json``). (The ``models`` branch adds ``kvlab.models.model_config(spec)``; this
module's helper is the stand-in until it lands.)

:func:`method_refusal` checks one method on a config: the per-layer plan's refusals
(:func:`kvlab.integrations.model_support.plan_model`: unsupported layer types, latent
attention), no full-attention layer to compress, RoPE-Relay on layers without RoPE, then
builds the method's cache from the config alone (caches allocate nothing until their first
forward), with stand-in preparation state, so that every refusal a cache's constructor makes
from the config (RoPE scaling, head sizes a codec cannot code, weights per layer) happens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.evaluation.methods import Method
from kvlab.userinput import quote

__all__ = ["check_lengths", "check_methods", "method_refusal", "read_model_config"]


def read_model_config(spec: str) -> Any:
    """The ``transformers`` config of a model spec, without its weights
    (:func:`kvlab.models.model_config`: a GGUF file's header, a folder's ``config.json``).

    Raises:
        kvlab.models.ModelNotAvailableError / ValueError: as :func:`kvlab.models.load_model`.
    """
    from kvlab.models import model_config

    return model_config(spec)


def _alternative(method: Method, relay_needs_rope: bool) -> str:
    name = method.name
    if relay_needs_rope and name.startswith("relay"):
        return "'" + name.replace("relay", "evict-no-relay", 1) + "'"
    if relay_needs_rope and name.startswith("streaming-llm"):
        return "'evict-no-relay:recency@" + name.split("@", 1)[-1] + "'"
    return "'full' (the exact cache)"


def _stand_in_prepared(method: Method, plan: Any) -> dict[str, Any] | None:
    """Preparation state of the right shape (the cache's constructor checks it), never used to
    evaluate anything."""
    if method.preparation == "relay-layer-budgets":
        return {"layer_fractions": [0.5] * len(plan.full_layers)}
    if method.preparation == "pnmix-group-allocation":
        group = int(method.params.get("group_tokens", 128))
        return {"layer_group_tokens": [group] * len(plan.layers)}
    if method.preparation == "kvzip-prompt":
        return {"kvzip_prompt": {"first_ids": [0], "next_ids": [0], "suffix_ids": [0]}}
    return None


def method_refusal(method: Method, model_config: Any) -> str | None:
    """Why ``method`` cannot run on the model of ``model_config`` (one line naming the method
    and an alternative), or ``None`` when it can (module docstring).

    Args:
        method: the :class:`~kvlab.evaluation.methods.Method`.
        model_config: the model's ``PretrainedConfig`` (:func:`read_model_config`).
    """
    from kvlab.integrations.model_support import plan_model

    if method.family == "full":
        return None
    plan = plan_model(model_config)
    model = plan.model_type or "this"
    prefix = f"method {quote(method.name)} cannot run on this {model!r} model"
    if method.family == "hf-quantized":
        if not plan.window_layers:
            return None
        # transformers' QuantizedCache raises "only supported for models with only full
        # attention layers" at its construction, after the model has loaded
        return (
            f"{prefix}: transformers' QuantizedCache supports only models whose layers are all "
            f"full attention, and layers {list(plan.window_layers)} are sliding/chunked; use "
            "'kivi-2bit' or 'pn-mix' (kvlab's 2-bit caches, which keep window layers as their "
            "window)"
        )
    relay = bool(method.params.get("relay", False))
    if plan.unsupported:
        return f"{prefix}: {'; '.join(plan.unsupported)}; use {_alternative(method, False)}"
    if not plan.full_layers:
        return (
            f"{prefix}: it has no full-attention layer to compress (layers "
            f"{list(plan.window_layers)} are sliding/chunked, kept as their window); use "
            f"{_alternative(method, False)}"
        )
    if relay and plan.nope_full_layers:
        return (
            f"{prefix}: full-attention layers {list(plan.nope_full_layers)} apply no RoPE, and "
            f"RoPE-Relay rotates their keys; use {_alternative(method, True)}"
        )
    try:
        method.make_cache(model_config, _stand_in_prepared(method, plan))
    except (ValueError, NotImplementedError) as error:
        return f"{prefix}: {error}; use {_alternative(method, False)}"
    return None


def check_methods(methods: Sequence[Method], model_config: Any, spec: str = "") -> None:
    """Refuse, before the model loads, every method that cannot run on it.

    Raises:
        ValueError: one line per refused method (:func:`method_refusal`), naming the model.
    """
    reasons = [r for r in (method_refusal(m, model_config) for m in methods) if r is not None]
    if reasons:
        where = f" ({spec})" if spec else ""
        raise ValueError(
            f"{len(reasons)} method(s) cannot run on the model{where}, checked before it loads: "
            + " | ".join(reasons)
        )


def quantized_length_refusal(method: Method, model_config: Any, tokens: int) -> str | None:
    """Why ``method`` (a ``transformers`` ``QuantizedCache`` row) cannot quantize a prompt of
    ``tokens`` tokens on this model, or ``None``: quanto's per-channel keys (``axis_key=-1``)
    are grouped along the flattened (kv head, token) axis, so ``num_key_value_heads * tokens``
    must be a multiple of ``q_group_size`` (optimum-quanto ``tensor/grouped.py``: "Group size
    must be a divisor")."""
    settings = method.settings
    if method.family != "hf-quantized" or settings.get("backend") != "quanto":
        return None
    if settings.get("axis_key") != -1:
        return None
    heads = int(
        getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    )
    group = int(settings["q_group_size"])
    if (heads * tokens) % group == 0:
        return None
    per_token = f"{method.name}-per-token"
    return (
        f"method {quote(method.name)} cannot quantize a {tokens}-token prompt: quanto groups its "
        f"per-channel keys along {heads} kv heads x tokens, which must be a multiple of "
        f"{group}; use {per_token!r} (per-token keys, any length)"
    )


def check_lengths(
    methods: Sequence[Method], model_config: Any, lengths: Sequence[int], spec: str = ""
) -> None:
    """Refuse, before the model loads, a method that cannot take one of the prompt lengths
    ``lengths`` (tokens) the plan feeds (:func:`quantized_length_refusal`).

    Raises:
        ValueError: one line per refused method, naming the first length it cannot take.
    """
    reasons = []
    for method in methods:
        for tokens in sorted(set(lengths)):
            reason = quantized_length_refusal(method, model_config, tokens)
            if reason is not None:
                reasons.append(reason)
                break
    if reasons:
        where = f" ({spec})" if spec else ""
        raise ValueError(f"not runnable on this model{where}: " + "; ".join(reasons))
