"""The ``"kvlab"`` attention implementation for Hugging Face ``transformers`` (5.x).

kvlab's cache layers (:mod:`kvlab.integrations.pnmix_cache`, :mod:`kvlab.integrations.relay_cache`)
do not hand full key/value tensors back from ``Cache.update``: they return a light
:class:`CacheView` for both the key and the value slot. Every attention module of a
``transformers`` decoder (Llama, Phi-3, GLM, ...) only forwards those two objects to the
registered attention function, so no model code is patched: the function registered here under
:data:`KVLAB_ATTENTION` through ``transformers.AttentionInterface.register`` asks the view to
attend (reading packed codes, or ragged per-head storage), and falls back to exact softmax
attention (PyTorch SDPA) when it receives plain tensors (e.g. a ``DynamicCache``).

Masks: ``"kvlab"`` registers :func:`kvlab_mask` in ``transformers``' mask interface, which hands
the attention function the caller's 2-D ``attention_mask`` (``[B, past + Q]``, True = keep) as
given, or ``None`` (it never reads the mask's values: no host sync); queries are the last ``Q``
tokens of the cache and attend causally (bottom-right aligned), as ``transformers``' own causal
mask would make them. A view whose ``supports_padding`` is False refuses a mask with zeros.
Extra mask functions (packed sequences, bidirectional blocks) are not supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "KVLAB_ATTENTION",
    "CacheView",
    "dense_causal_attention",
    "enable_kvlab_attention",
    "kvlab_attention_forward",
    "kvlab_mask",
    "register_kvlab_attention",
    "use_attention",
]

#: Name under which the attention function is registered (``config._attn_implementation``).
KVLAB_ATTENTION = "kvlab"


class CacheView:
    """What a kvlab cache layer returns from ``update`` in place of the key and value tensors.

    Subclasses implement :meth:`attend`. Any attempt to use a view as a tensor (for example when
    the model runs with ``attn_implementation="sdpa"``) raises a ``TypeError`` that says how to
    switch to the ``"kvlab"`` attention implementation.

    Attributes:
        supports_padding: whether :meth:`attend` handles a 2-D padding mask itself; if False,
            the attention function refuses masks with zeros (and 4-D masks) before calling it.
    """

    supports_padding: bool = False

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        *,
        scaling: float,
        attention_mask: Tensor | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        """Attention of ``query`` ``[B, H_q, Q, D]`` (rotated by the model) over the layer's
        cache, whose last ``Q`` tokens are the queries' own. Returns ``[B, H_q, Q, Dv]`` in the
        query dtype."""
        raise NotImplementedError

    @classmethod
    def _misuse(cls) -> TypeError:
        return TypeError(
            f"{cls.__name__} is a kvlab cache view, readable only by the 'kvlab' attention "
            "implementation; call kvlab.integrations.enable_kvlab_attention(model) (or "
            "model.set_attn_implementation('kvlab')) before using a kvlab cache"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise cls._misuse()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes a view lacks, e.g. ``.shape`` when another attention
        # implementation treats the view as a tensor.
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._misuse()


def _check_padding(attention_mask: Tensor | None) -> None:
    """Reject padded batches for cache views (their storage assumes equal-length rows)."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2:
        raise ValueError(
            "kvlab caches take no 4-D attention mask; pass a 2-D all-ones mask or none "
            f"(got shape {tuple(attention_mask.shape)})"
        )
    if not bool(attention_mask.bool().all()):
        raise ValueError(
            "kvlab caches do not support padded batches (attention_mask has zeros); run "
            "sequences of equal length or one at a time"
        )


def dense_causal_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float,
    attention_mask: Tensor | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Exact softmax attention with bottom-right causal alignment, for plain tensors.

    Args:
        query: ``[B, H_q, Q, D]``; the queries are the last ``Q`` of the ``K`` keys.
        key: ``[B, H_kv, K, D]``, ``H_q`` a multiple of ``H_kv`` (GQA: query head ``i`` reads kv
            head ``i // (H_q / H_kv)``).
        value: ``[B, H_kv, K, Dv]``.
        scaling: softmax scale of the logits.
        attention_mask: ``None``; a 2-D ``[B, K]`` keep mask (1/True = attend; padding);
            or a 4-D ``[B, 1|H_q, Q, K]`` boolean keep mask or additive float mask, used as is
            (no causal mask added).
        dropout: attention dropout probability.

    Returns:
        ``[B, H_q, Q, Dv]`` in the query dtype (PyTorch SDPA).

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, or ``Q > K``.
    """
    _, hq, q_len, _ = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if q_len > k_len:
        raise ValueError(f"{q_len} queries but only {k_len} keys")
    rep = hq // hkv
    if rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
    else:
        offset = k_len - q_len
        rows = torch.arange(q_len, device=query.device).unsqueeze(-1) + offset
        cols = torch.arange(k_len, device=query.device).unsqueeze(0)
        mask = (cols <= rows).view(1, 1, q_len, k_len)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != k_len:
                raise ValueError(
                    f"2-D attention_mask must be [B, {k_len}], got {tuple(attention_mask.shape)}"
                )
            mask = mask & attention_mask.bool().view(-1, 1, 1, k_len)
        if q_len == 1 and attention_mask is None:
            mask = None
    return F.scaled_dot_product_attention(
        query,
        key.to(query.dtype),
        value.to(query.dtype),
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
    )


def kvlab_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """Mask builder registered as ``"kvlab"`` in ``transformers.AttentionMaskInterface``.

    Returns the 2-D boolean keep mask ``[B, past + Q]`` as given (the attention decides what
    to do with it, without this function reading its values), or ``None`` when there is none
    (plain causal attention, applied by the attention itself).
    """
    if attention_mask is None:
        return None
    return attention_mask.bool()


def kvlab_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor | CacheView,
    value: Tensor | CacheView,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function registered as ``"kvlab"`` in ``transformers.AttentionInterface``.

    Args:
        module: the calling attention module (``num_key_value_groups``, ``layer_idx``).
        query: ``[B, H_q, Q, D]``, rotated by the model at its ``position_ids``.
        key, value: a :class:`CacheView` (kvlab cache) or plain ``[B, H_kv, K, D|Dv]`` tensors.
        attention_mask: what the model passes (see module docstring).
        dropout: attention dropout (plain tensors only; views are inference-only).
        scaling: softmax scale (default ``D ** -0.5``).

    Returns:
        ``(output [B, Q, H_q, Dv], None)`` — the layout ``transformers``' SDPA path returns.
        Attention weights are never returned.

    Raises:
        ValueError: a padded batch or a 4-D mask with a kvlab cache view that does not support
            padding (``supports_padding`` False).
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(key, CacheView):
        if not key.supports_padding:
            _check_padding(attention_mask)
        out = key.attend(
            module, query, scaling=float(scaling), attention_mask=attention_mask, kwargs=kwargs
        )
    else:
        out = dense_causal_attention(
            query,
            key,
            value,
            scaling=float(scaling),
            attention_mask=attention_mask,
            dropout=dropout if module.training else 0.0,
        )
    return out.transpose(1, 2).contiguous(), None


def register_kvlab_attention() -> str:
    """Register :func:`kvlab_attention_forward` (attention) and :func:`kvlab_mask` (mask) as
    ``"kvlab"`` (idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(KVLAB_ATTENTION, kvlab_attention_forward)
    AttentionMaskInterface.register(KVLAB_ATTENTION, kvlab_mask)
    return KVLAB_ATTENTION


def enable_kvlab_attention(model: Any) -> None:
    """Register the ``"kvlab"`` attention and switch ``model`` (a ``PreTrainedModel``) to it."""
    register_kvlab_attention()
    model.set_attn_implementation(KVLAB_ATTENTION)


class use_attention:
    """Context manager: run ``model`` with attention implementation ``name``, then restore.

    Example: ``with use_attention(model, "kvlab"): model(ids, cache=PNMixModelCache(...))``.
    """

    def __init__(self, model: Any, name: str) -> None:
        self.model = model
        self.name = name
        self.previous: str | None = None

    def __enter__(self) -> Any:
        if self.name == KVLAB_ATTENTION:
            register_kvlab_attention()
        self.previous = self.model.config._attn_implementation
        if self.previous != self.name:
            self.model.set_attn_implementation(self.name)
        return self.model

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None and self.previous != self.name:
            self.model.set_attn_implementation(self.previous)
