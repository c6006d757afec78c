"""What a kvlab model cache can hold for a given ``transformers`` decoder, read from its config.

:func:`plan_model` reads a config once and returns a :class:`ModelPlan`: per decoder layer,
whether it is a full-attention layer (the only kind kvlab compresses) or a window layer
(``sliding_attention`` / ``chunked_attention``: a query sees at most ``window`` keys), whether
the layer applies RoPE, and the features no kvlab cache can hold, each as one phrase. The two
model caches (:class:`~kvlab.integrations.pnmix_cache.PNMixModelCache`,
:class:`~kvlab.integrations.relay_cache.RelayModelCache`) call :meth:`ModelPlan.check` in their
constructors — so an unsupported model is refused before any layer stores anything — and build
their window layers with :meth:`ModelPlan.build_layers` as :class:`WindowLayer`: an exact
sliding-window layer that keeps only its window (``transformers``' own
``DynamicSlidingWindowLayer``), so a window layer costs ``window - 1`` tokens whatever the
context length.

The window layer and the guard that puts back the window layers of a refused forward live in
:mod:`kvlab.integrations.window_layer` (re-exported here).

Layer types come from ``transformers.cache_utils.get_layer_types_and_kwargs`` (the function
``DynamicCache`` uses): ``config.layer_types`` when present, else ``sliding_attention`` for
every layer of a config with ``sliding_window`` (Mistral, Phi-3, Starcoder2) and
``chunked_attention`` with ``attention_chunk_size``. The table of families is in README.md,
"Model families".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.cache_utils import CacheLayerMixin

from kvlab.integrations.window_layer import ForwardGuard, WindowLayer
from kvlab.rope import RotaryConfig

__all__ = [
    "FULL_ATTENTION",
    "WINDOW_LAYER_TYPES",
    "ForwardGuard",
    "LayerPlan",
    "ModelPlan",
    "WindowLayer",
    "layer_rotary",
    "plan_model",
]

#: The layer type kvlab compresses.
FULL_ATTENTION = "full_attention"
#: Layer types kept exactly in a :class:`WindowLayer` (transformers caches them the same way;
#: only their masks differ, and the ``"kvlab"`` mask materializes those exactly).
WINDOW_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention"})

# transformers 5.24 model types whose full-attention layers apply no RoPE (their modeling files
# rotate queries and keys only when the layer has a sliding window); cohere2_moe unless
# `force_rope`. SmolLM3 / Llama 4 say it per layer with `no_rope_layers` (0 = no RoPE).
_NOPE_FULL_LAYER_MODEL_TYPES = frozenset({"cohere2", "cohere2_moe", "flint"})


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer as a kvlab cache sees it.

    Attributes:
        layer_type: ``transformers``' layer type (``"full_attention"``, ``"sliding_attention"``,
            ``"chunked_attention"``, ``"linear_attention"``, ...).
        window: tokens a query sees in a window layer (``sliding_window``, or
            ``attention_chunk_size`` for chunked layers); ``None`` for other layers.
        uses_rope: the layer rotates its queries and keys (False: NoPE layer).
    """

    layer_type: str
    window: int | None
    uses_rope: bool

    @property
    def is_full(self) -> bool:
        """A full-attention layer: the only kind a kvlab cache compresses."""
        return self.layer_type == FULL_ATTENTION

    @property
    def is_window(self) -> bool:
        """A sliding/chunked layer, kept exactly in a :class:`WindowLayer`."""
        return self.layer_type in WINDOW_LAYER_TYPES


@dataclass(frozen=True)
class ModelPlan:
    """The per-layer plan of a decoder (see :func:`plan_model`).

    Attributes:
        model_type: the text config's ``model_type``.
        layers: one :class:`LayerPlan` per decoder layer.
        unsupported: one phrase per feature no kvlab cache can hold (empty if none).
    """

    model_type: str
    layers: tuple[LayerPlan, ...]
    unsupported: tuple[str, ...] = ()

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (compressed by kvlab caches)."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.is_full)

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Indices of the window layers (kept exactly, only their window)."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.is_window)

    @property
    def nope_full_layers(self) -> tuple[int, ...]:
        """Full-attention layers that apply no RoPE."""
        return tuple(
            i for i, layer in enumerate(self.layers) if layer.is_full and not layer.uses_rope
        )

    def check(self, cache_name: str, *, rotates_keys: bool = False) -> None:
        """Refuse a model the cache cannot hold, with one line naming every reason.

        Args:
            cache_name: the refusing class, for the message.
            rotates_keys: the cache rotates stored keys to new positions (RoPE-Relay), which
                needs RoPE in every full-attention layer.

        Raises:
            ValueError: :attr:`unsupported` is not empty, or ``rotates_keys`` and some
                full-attention layer applies no RoPE.
        """
        reasons = list(self.unsupported)
        if rotates_keys and self.nope_full_layers:
            reasons.append(
                f"full-attention layers {list(self.nope_full_layers)} apply no RoPE, and "
                "RoPE-Relay rotates their keys (use EvictionConfig(relay=False))"
            )
        if reasons:
            raise ValueError(
                f"{cache_name} cannot hold this {self.model_type!r} model: " + "; ".join(reasons)
            )

    def build_layers(
        self,
        full_layer: Callable[[int], CacheLayerMixin],
        rotary: Callable[[str], RotaryConfig | None] | None = None,
    ) -> list[CacheLayerMixin]:
        """One cache layer per decoder layer: ``full_layer(i)`` for full-attention layers, a
        :class:`WindowLayer` for window layers.

        Args:
            full_layer: builds the cache's own layer for decoder layer ``i``.
            rotary: ``layer_type -> RotaryConfig`` (or ``None``) of the window layers, which
                lets them re-rotate keys if the model's positions jump (see
                :class:`WindowLayer`); ``None`` = window layers never re-rotate.

        Raises:
            ValueError: a layer type that is neither (call :meth:`check` first).
        """
        layers: list[CacheLayerMixin] = []
        for i, plan in enumerate(self.layers):
            if plan.is_full:
                layers.append(full_layer(i))
            elif plan.is_window:
                assert plan.window is not None
                rope = rotary(plan.layer_type) if rotary is not None and plan.uses_rope else None
                layers.append(WindowLayer(plan.window, rotary=rope, layer_idx=i))
            else:
                raise ValueError(
                    f"layer {i} has type {plan.layer_type!r}, which no kvlab cache holds"
                )
        return layers


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _uses_rope(text_config: Any, model_type: str, index: int, layer_type: str) -> bool:
    flags = getattr(text_config, "no_rope_layers", None)
    if isinstance(flags, Sequence) and index < len(flags):
        return bool(flags[index])
    if model_type in _NOPE_FULL_LAYER_MODEL_TYPES and layer_type == FULL_ATTENTION:
        return bool(getattr(text_config, "force_rope", False))
    return True


def plan_model(config: Any) -> ModelPlan:
    """Read the per-layer plan of a ``transformers`` decoder config (not modified).

    Args:
        config: a ``PretrainedConfig`` (multimodal configs: their text decoder's config).

    Returns:
        The :class:`ModelPlan`. Features that make ``unsupported`` non-empty: layer types other
        than full/sliding/chunked attention (linear attention, state-space, KV-sharing,
        indexed or compressed attention), layer types ``transformers`` itself cannot resolve,
        and multi-head latent attention (``qk_rope_head_dim``: keys split into RoPE and NoPE
        parts).
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or "")
    unsupported: list[str] = []
    n_layers = int(text.num_hidden_layers)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except (ValueError, AttributeError, TypeError) as err:
        unsupported.append(f"transformers cannot resolve its layer types ({err})")
        layer_types, layer_kwargs = [FULL_ATTENTION] * n_layers, [{}] * n_layers
    layers = []
    for i, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        window = kwargs.get("sliding_window") if layer_type in WINDOW_LAYER_TYPES else None
        layers.append(
            LayerPlan(
                layer_type=str(layer_type),
                window=None if window is None else int(window),
                uses_rope=_uses_rope(text, model_type, i, str(layer_type)),
            )
        )
    other = sorted({p.layer_type for p in layers if not (p.is_full or p.is_window)})
    if other:
        unsupported.append(
            f"layer types {other} (kvlab caches hold softmax-attention keys and values only)"
        )
    if getattr(text, "qk_rope_head_dim", None):
        unsupported.append(
            "multi-head latent attention (qk_rope_head_dim: keys split into RoPE and NoPE parts)"
        )
    return ModelPlan(model_type=model_type, layers=tuple(layers), unsupported=tuple(unsupported))


def layer_rotary(config: Any, layer_type: str = FULL_ATTENTION) -> RotaryConfig:
    """The :class:`~kvlab.rope.RotaryConfig` of the model's ``layer_type`` layers:
    ``RotaryConfig.from_hf_config`` of the text config, with ``layer_type=`` when its
    ``rope_parameters`` are nested per layer type (Gemma 3: local and global bases).

    Raises:
        ValueError: as :meth:`kvlab.rope.RotaryConfig.from_hf_config` (unsupported RoPE).
    """
    text = _text_config(config)
    params = getattr(text, "rope_parameters", None)
    nested = (
        isinstance(params, Mapping)
        and bool(params)
        and all(isinstance(v, Mapping) for v in params.values())
    )
    return RotaryConfig.from_hf_config(text, layer_type=layer_type if nested else None)
