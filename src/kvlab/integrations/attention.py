"""The ``"kvlab"`` attention implementation for Hugging Face ``transformers`` (5.x).

kvlab's cache layers (:mod:`kvlab.integrations.pnmix_cache`, :mod:`kvlab.integrations.relay_cache`)
do not hand full key/value tensors back from ``Cache.update``: they return a light
:class:`CacheView` for both the key and the value slot. Every attention module of a
``transformers`` decoder (Llama, Phi-3, GLM, ...) only forwards those two objects to the
registered attention function, so no model code is patched: the function registered here under
:data:`KVLAB_ATTENTION` through ``transformers.AttentionInterface.register`` asks the view to
attend (reading packed codes, or ragged per-head storage), and falls back to exact softmax
attention (PyTorch SDPA; float32 logits when soft-capping or sinks apply) when it receives plain
tensors (e.g. a ``DynamicCache``, or a kvlab cache's sliding-window layers).

Masks: ``"kvlab"`` registers :func:`kvlab_mask` in ``transformers``' mask interface. For the
plain causal mask it hands the attention function the caller's 2-D ``attention_mask`` (``[B,
past + Q]``, True = keep) as given, or ``None`` (it never reads the mask's values: no host
sync); queries are the last ``Q`` tokens of the cache and attend causally (bottom-right
aligned), as ``transformers``' own causal mask would make them. A view whose
``supports_padding`` is False refuses a 2-D mask with zeros. Any other mask pattern (sliding
window, chunked, packed sequences, bidirectional blocks) is materialized exactly as
``transformers``' SDPA mask (a 4-D boolean ``[B, 1, Q, K]``), which plain tensors honour and
cache views refuse.

Attention arguments: every keyword ``transformers`` (5.x) passes to an attention function is
honoured or refused with one clear error, never dropped — ``scaling``, ``dropout``,
``sliding_window`` (a query sees the last ``sliding_window`` keys, itself included),
``softcap`` (Gemma 2 logit soft-capping), ``s_aux`` (GPT-OSS learned sinks), ``is_causal``;
``position_ids`` and the bookkeeping flags in :data:`HARMLESS_KWARGS` carry no attention
semantics (RoPE is applied by the model before the call). Anything else raises
``ValueError`` naming it. Cache views honour what their class lists in
:attr:`CacheView.supported_features`; the features reach :meth:`CacheView.attend` in its
``kwargs`` (keys ``"softcap"``, ``"s_aux"``, ``"sliding_window"``). The table of families and
features is in README.md, "Model families".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvlab.integrations.dense_attention import dense_causal_attention, softmax_attention

__all__ = [
    "HARMLESS_KWARGS",
    "KVLAB_ATTENTION",
    "VIEW_FEATURES",
    "CacheView",
    "attention_outputs_unused",
    "check_attention_kwargs",
    "dense_causal_attention",
    "enable_kvlab_attention",
    "kvlab_attention_forward",
    "kvlab_mask",
    "outputs_unused",
    "register_kvlab_attention",
    "softmax_attention",
    "unused_output",
    "use_attention",
]

#: Name under which the attention function is registered (``config._attn_implementation``).
KVLAB_ATTENTION = "kvlab"

#: Keyword arguments ``transformers`` passes to attention functions that carry no attention
#: semantics here: ``position_ids`` (RoPE is applied by the model before the call; relay
#: caches read them in ``update``), output/bookkeeping flags and MoE router flags.
#: ``output_attentions=True`` is refused separately (kvlab never returns attention weights).
HARMLESS_KWARGS: frozenset[str] = frozenset(
    {
        "position_ids",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "cache_position",
    }
)

_OUTPUTS_UNUSED: ContextVar[bool] = ContextVar("kvlab_attention_outputs_unused", default=False)


@contextlib.contextmanager
def attention_outputs_unused() -> Iterator[None]:
    """Within this context the caller drops every attention output (a replayed prefill,
    :func:`kvlab.integrations.prefill_replay.replay_prefill`): the ``"kvlab"`` attention and
    the cache views still store, evict, score and pack exactly as without it, but a prefill's
    attention over its own tokens — the one output nothing else reads — is not computed and
    comes back as zeros of its shape (:func:`unused_output`). What a cache stores never
    depends on that output (tests/integrations/test_prefill_replay.py checks the caches
    bit-identical with and without it). Decode-phase attention (one-token and recording
    forwards) runs as always."""
    token = _OUTPUTS_UNUSED.set(True)
    try:
        yield
    finally:
        _OUTPUTS_UNUSED.reset(token)


def outputs_unused() -> bool:
    """Whether the caller drops attention outputs (:func:`attention_outputs_unused`)."""
    return _OUTPUTS_UNUSED.get()


def unused_output(query: Tensor, value_dim: int) -> Tensor:
    """Zeros ``[B, H_q, Q, value_dim]`` in the query's dtype: the stand-in for an attention
    output nobody reads (:func:`attention_outputs_unused`)."""
    return query.new_zeros((*query.shape[:-1], value_dim))


#: Attention features a :class:`CacheView` may honour; they reach ``attend`` in ``kwargs``.
VIEW_FEATURES: tuple[str, ...] = ("softcap", "s_aux", "sliding_window")


class CacheView:
    """What a kvlab cache layer returns from ``update`` in place of the key and value tensors.

    Subclasses implement :meth:`attend` and list in :attr:`supported_features` the entries of
    :data:`VIEW_FEATURES` they honour; :func:`kvlab_attention_forward` refuses any other active
    feature before calling ``attend``. Any attempt to use a view as a tensor (for example when
    the model runs with ``attn_implementation="sdpa"``) raises a ``TypeError`` that says how to
    switch to the ``"kvlab"`` attention implementation.
    """

    #: Features of :data:`VIEW_FEATURES` that :meth:`attend` applies (read from its ``kwargs``:
    #: ``kwargs["softcap"]`` a float or None, ``kwargs["s_aux"]`` a ``[H_q]`` tensor or None).
    supported_features: ClassVar[frozenset[str]] = frozenset()
    #: Whether :meth:`attend` handles a 2-D padding mask itself (PN-Mix and relay views do); if
    #: False, :func:`kvlab_attention_forward` refuses masks with zeros (and 4-D masks) before
    #: the call.
    supports_padding: ClassVar[bool] = False

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
        cache, whose last ``Q`` tokens are the queries' own. ``kwargs`` holds the model's extra
        attention keywords plus the :data:`VIEW_FEATURES` keys (None when inactive). Returns
        ``[B, H_q, Q, Dv]`` in the query dtype."""
        raise NotImplementedError

    def refusal_guard(self) -> contextlib.AbstractContextManager[None]:
        """The context :func:`kvlab_attention_forward` runs this view's refusals and
        :meth:`attend` in: on a ``ValueError`` it puts back what the forward changed (the
        layer's stash; the window layers stored before the forward's first kvlab layer, see
        :class:`kvlab.integrations.model_support.ForwardGuard`). Default: nothing to put back."""
        return contextlib.nullcontext()

    def _abandon_forward(self) -> None:
        """Put back what this forward changed, as a refusal does (another attention
        implementation read this view: nothing of the forward may stay)."""
        with contextlib.suppress(ValueError), self.refusal_guard():
            raise ValueError("a kvlab cache view was read by another attention implementation")

    @classmethod
    def _misuse(cls) -> TypeError:
        return TypeError(
            f"{cls.__name__} is a kvlab cache view, readable only by the 'kvlab' attention "
            "implementation; call kvlab.integrations.enable_kvlab_attention(model) before "
            "using a kvlab cache (the forward that raised this stored nothing)"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        view = next((a for a in args if isinstance(a, CacheView)), None)
        if view is not None:
            view._abandon_forward()
        raise cls._misuse()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes a view lacks, e.g. ``.shape`` when another attention
        # implementation treats the view as a tensor.
        if name.startswith("__"):
            raise AttributeError(name)
        self._abandon_forward()
        raise self._misuse()


def _check_padding(attention_mask: Tensor | None) -> None:
    """Reject padded batches for cache views (their storage assumes equal-length rows)."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2:
        raise ValueError(
            "kvlab cache views attend causally only: this layer's mask is a 4-D "
            f"{tuple(attention_mask.shape)} pattern (sliding window, chunked, packed sequences "
            "or a custom mask); pass a 2-D all-ones mask or none"
        )
    if not bool(attention_mask.bool().all()):
        raise ValueError(
            "kvlab caches do not support padded batches (attention_mask has zeros); run "
            "sequences of equal length or one at a time"
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

    For ``transformers``' plain causal mask function over a cache whose keys are exactly the
    tokens seen (``kv_offset == 0`` and ``q_offset + q_length == kv_length``: the queries are
    the cache's last ``Q`` keys): the 2-D boolean keep mask ``[B, past + Q]`` as given (its
    values are not read), or ``None`` when there is none (plain causal attention, applied by
    the attention itself). For any other mask function (sliding window, chunked, packed
    sequences, bidirectional or block overlays), and for a causal mask over keys that are not
    the tokens seen (a pre-allocated cache such as ``transformers.StaticCache``, whose
    ``kv_length`` is its capacity: the slots past the last query are not written yet):
    ``transformers.masking_utils.sdpa_mask`` materialized as a 4-D boolean
    ``[B, 1, Q, kv_length]`` keep mask, exactly what the ``"sdpa"`` implementation would
    receive (plain tensors honour it; kvlab cache views refuse it).
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    # a tensor q_offset comes from pre-allocated (static) caches only: never tail-aligned here,
    # and comparing it would be a host sync
    tail_aligned = isinstance(q_offset, int) and kv_offset == 0 and q_offset + q_length == kv_length
    if tail_aligned and (mask_function is None or mask_function is causal_mask_function):
        # as given, without reading it (no host sync): the attention decides about padding
        return None if attention_mask is None else attention_mask.bool()
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


#: The keywords :func:`kvlab_attention_forward` takes by name (not checked by
#: :func:`check_attention_kwargs`).
_NAMED_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal"})


def check_attention_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse attention keywords kvlab does not implement (one error naming all of them).

    A keyword set to ``None`` is inactive in every ``transformers`` attention function and is
    accepted; so is ``output_attentions=False``; the keywords :func:`kvlab_attention_forward`
    takes by name are not checked here. Also run by the window layers a kvlab cache holds in
    front of its first full-attention layer (on the keywords the model passes to
    ``Cache.update``), so that a refusal comes before they store anything.

    Raises:
        ValueError: an active keyword outside :data:`HARMLESS_KWARGS`, or
            ``output_attentions=True``.
    """
    unknown = [
        k
        for k, v in kwargs.items()
        if v is not None and k not in HARMLESS_KWARGS and k not in _NAMED_KWARGS
    ]
    if unknown:
        unknown.sort()
        raise ValueError(
            f"the 'kvlab' attention does not implement the attention argument(s) {unknown} "
            "that this model passes; supported: scaling, dropout, sliding_window, softcap, s_aux, "
            f"is_causal, and the no-op keywords {sorted(HARMLESS_KWARGS)}"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "the 'kvlab' attention never returns attention weights; call the model with "
            "output_attentions=False (or use attn_implementation='eager' to inspect them)"
        )


def _check_view_call(
    module: torch.nn.Module,
    view: CacheView,
    attention_mask: Tensor | None,
    features: Mapping[str, Any],
    dropout: float,
    causal: bool,
) -> None:
    """Refuse what a cache view cannot do (see :func:`kvlab_attention_forward`, Raises)."""
    refused = [
        name
        for name, v in features.items()
        if v is not None and name not in type(view).supported_features
    ]
    if refused:
        refused.sort()
        raise ValueError(
            f"{type(view).__name__} (layer {getattr(module, 'layer_idx', '?')}) cannot apply "
            f"the attention argument(s) {refused}; the cache should have refused this model "
            "at construction (see kvlab.integrations.model_support)"
        )
    if dropout > 0.0:
        raise ValueError(
            f"kvlab cache views are inference-only: attention dropout {dropout} in training "
            "mode; call model.eval()"
        )
    if not causal:
        raise ValueError("kvlab cache views attend causally only (is_causal=False given)")
    if not type(view).supports_padding:
        _check_padding(attention_mask)


def kvlab_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor | CacheView,
    value: Tensor | CacheView,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function registered as ``"kvlab"`` in ``transformers.AttentionInterface``.

    Args:
        module: the calling attention module (``layer_idx``, ``training``, ``is_causal``).
        query: ``[B, H_q, Q, D]``, rotated by the model at its ``position_ids``.
        key, value: a :class:`CacheView` (kvlab cache) or plain ``[B, H_kv, K, D|Dv]`` tensors.
        attention_mask: what the model passes (see module docstring).
        dropout: attention dropout, applied in training mode (plain tensors only; views are
            inference-only and refuse it).
        scaling: softmax scale (default ``D ** -0.5``).
        sliding_window: the layer's window in tokens (a query sees the last ``sliding_window``
            keys, itself included), or ``None``.
        softcap: attention-logit soft-cap (Gemma 2), or ``None``.
        s_aux: ``[H_q]`` learned sink logits (GPT-OSS), or ``None``.
        is_causal: ``False`` = bidirectional when no 4-D mask is given (plain tensors only);
            default the module's ``is_causal`` (True).
        **kwargs: the rest of what the model passes; see :data:`HARMLESS_KWARGS`.

    Returns:
        ``(output [B, Q, H_q, Dv], None)`` — the layout ``transformers``' SDPA path returns.
        Attention weights are never returned.

    Raises:
        ValueError: an attention argument kvlab does not implement (named); with a kvlab cache
            view: a padded batch or a 4-D mask (unless its ``supports_padding``), dropout in
            training mode, ``is_causal=False``, or a feature the view does not list in
            ``supported_features``.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    p = float(dropout) if module.training else 0.0
    if isinstance(key, CacheView):
        features = {"softcap": softcap, "s_aux": s_aux, "sliding_window": sliding_window}
        with key.refusal_guard():  # a refusal puts back what the forward changed
            check_attention_kwargs(kwargs)
            _check_view_call(module, key, attention_mask, features, p, causal)
            out = key.attend(
                module,
                query,
                scaling=float(scaling),
                attention_mask=attention_mask,
                kwargs={**kwargs, **features},
            )
    else:
        # all-window models: layer 0 stored before this call's checks; a refusal puts it back
        with _window_update_guard(key):
            check_attention_kwargs(kwargs)
            if outputs_unused():
                return unused_output(query, value.shape[-1]).transpose(1, 2).contiguous(), None
            out = dense_causal_attention(
                query,
                key,
                value,
                scaling=float(scaling),
                attention_mask=attention_mask,
                dropout=p,
                sliding_window=sliding_window,
                softcap=softcap,
                s_aux=s_aux,
                is_causal=causal,
            )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _window_update_guard(key: Tensor) -> Iterator[None]:
    """A call on plain tensors (its checks and attention): keys returned by a kvlab window
    layer that keeps its last update for this attention (``undo_by_attention`` of
    :class:`~kvlab.integrations.model_support.WindowLayer`) put it back on a ``ValueError``
    and forget it on success."""
    ref = getattr(key, "_kvlab_window_layer", None)
    layer = ref() if ref is not None else None
    try:
        yield
    except ValueError:
        if layer is not None:
            layer.undo_update()
        raise
    if layer is not None:
        layer.keep_update()


def register_kvlab_attention() -> str:
    """Register :func:`kvlab_attention_forward` (attention) and :func:`kvlab_mask` (mask) as
    ``"kvlab"`` (idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(KVLAB_ATTENTION, kvlab_attention_forward)
    AttentionMaskInterface.register(KVLAB_ATTENTION, kvlab_mask)
    return KVLAB_ATTENTION


def enable_kvlab_attention(model: Any) -> None:
    """Switch ``model`` (a ``PreTrainedModel``) to the ``"kvlab"`` attention (registered when
    :mod:`kvlab.integrations` is imported)."""
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
        self.previous = self.model.config._attn_implementation
        if self.previous != self.name:
            self.model.set_attn_implementation(self.name)
        return self.model

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None and self.previous != self.name:
            self.model.set_attn_implementation(self.previous)
