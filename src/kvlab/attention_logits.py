"""Logit transforms that some model families apply inside softmax attention.

Shared by the exact attention of :mod:`kvlab.integrations.attention` (plain tensors, relay
views) and the packed attention of :mod:`kvlab.pnmix.attention`, so that every kvlab attention
path applies them with one formula:

* **Logit soft-capping** (Gemma 2, ``config.attn_logit_softcapping``): the scaled logits
  ``x = scaling * q·k`` become ``softcap * tanh(x / softcap)`` *before* the mask is applied
  (transformers' ``gemma2`` eager attention).
* **Learned attention sinks** (GPT-OSS, the ``s_aux`` argument; one logit per query head): an
  extra logit column that takes part in the softmax but has no value, so each row's
  probabilities over the real keys sum to less than one (transformers' ``gpt_oss`` eager
  attention).

Which families pass which argument: README.md, "Model families".
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["softcap_logits", "softmax_with_sinks"]


def softcap_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma 2 attention-logit soft-capping), or
    ``logits`` unchanged when ``softcap`` is ``None``.

    Args:
        logits: scaled attention logits, any shape and floating dtype, *before* masking
            (``tanh`` maps a masked ``-inf`` to ``-softcap``, which would unmask it).
        softcap: the cap (a positive number, in logit units) or ``None``.

    Raises:
        ValueError: ``softcap`` is not a positive finite number.
    """
    if softcap is None:
        return logits
    cap = float(softcap)
    if not (cap > 0.0 and cap != float("inf")):
        raise ValueError(f"softcap must be a positive finite number, got {softcap!r}")
    return torch.tanh(logits / cap) * cap


def softmax_with_sinks(logits: Tensor, sink_logits: Tensor | None) -> Tensor:
    """Softmax over the last dimension of ``logits`` with one extra "sink" logit per row that
    takes probability mass but is then dropped (GPT-OSS learned attention sinks).

    Args:
        logits: ``[..., K]`` masked logits (masked entries ``-inf`` or a very negative number).
        sink_logits: ``None`` (plain softmax) or a tensor broadcastable to ``logits[..., :1]``
            (e.g. ``[1, H, 1, 1]`` for per-head sinks of ``[B, H, Q, K]`` logits).

    Returns:
        ``[..., K]`` probabilities in ``logits``' dtype; each row sums to
        ``1 - p_sink <= 1`` (exactly one without sinks).
    """
    if sink_logits is None:
        return torch.softmax(logits, dim=-1)
    sinks = sink_logits.to(device=logits.device, dtype=logits.dtype)
    sinks = sinks.expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sinks], dim=-1)
    # subtract the row max first, as transformers' gpt_oss eager attention does
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]
