"""The rotary configuration of one attention layer: pair layout, partial rotary, base, scaling,
and the reader of ``transformers`` configs (see :mod:`kvlab.rope` for the conventions).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from kvlab.rope.scaling import (
    INV_FREQ_FUNCTIONS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    default_inv_freq,
    is_int,
    is_real,
    normalize_scaling,
)

__all__ = ["Layout", "RotaryConfig"]

Layout = Literal["half", "interleaved"]
_LAYOUTS = ("half", "interleaved")

# Model types whose HF attention pairs channels (2i, 2i+1) (`rotate_every_two` or the
# "Interleave them instead of usual shape" variant), from transformers 5.24's modeling files.
# Every other model type is assumed to use rotate_half ("half"); pass `layout=` to override.
_INTERLEAVED_MODEL_TYPES = frozenset(
    {
        "gptj",
        "codegen",
        "glm",
        "glm4",
        "ernie4_5",
        "ernie4_5_moe",
        "helium",
        # Cohere's rotate_half pairs x[..., ::2] with x[..., 1::2]; Llama 4 rotates (2i, 2i+1)
        # through view_as_complex.
        "cohere",
        "cohere2",
        "llama4",
        "llama4_text",
    }
)
# Model types with a fixed base of 10000 and a `rotary_dim` attribute instead of rope_parameters.
_ROTARY_DIM_MODEL_TYPES = frozenset({"gptj", "codegen"})


@dataclass(frozen=True)
class RotaryConfig:
    """Rotary position embedding configuration for one attention layer.

    Args:
        head_dim: channels per query/key head.
        rotary_dim: leading channels that rotate (even, ``0 < rotary_dim <= head_dim``);
            defaults to ``head_dim``. Channels ``rotary_dim .. head_dim - 1`` are never touched.
        base: RoPE base (HF ``rope_theta``), > 0.
        layout: ``"half"`` pairs ``(i, i + rotary_dim/2)`` (GPT-NeoX / Llama ``rotate_half``);
            ``"interleaved"`` pairs ``(2i, 2i + 1)`` (GPT-J).
        scaling: None, or an HF ``rope_parameters``/``rope_scaling`` dict with key
            ``"rope_type"`` (or legacy ``"type"``) in ``"default"``, ``"linear"`` (``factor``),
            ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``) or ``"yarn"`` (``factor``,
            ``original_max_position_embeddings``; optional ``attention_factor``,
            ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``).
            Stored as a read-only mapping keyed by ``"rope_type"``; ``"default"`` becomes None.

    Raises:
        ValueError: odd or out-of-range ``rotary_dim``, non-positive ``head_dim`` or ``base``,
            unknown ``layout``, or an unknown/unsupported/incomplete ``scaling``.

    The config is immutable and hashable; its float64 inverse frequencies are computed once.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    layout: Layout = "half"
    scaling: Mapping[str, Any] | None = None
    _inv_freq: Tensor = field(init=False, repr=False, compare=False)
    _attention_scaling: float = field(init=False, repr=False, compare=False)
    _device_cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_int(self.head_dim) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        rotary_dim = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if not is_int(rotary_dim) or not 0 < rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim must be an int with 0 < rotary_dim <= head_dim={self.head_dim}, "
                f"got {rotary_dim!r}"
            )
        if rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even (channels rotate in pairs), got {rotary_dim}"
            )
        if not is_real(self.base) or not math.isfinite(self.base) or self.base <= 0:
            raise ValueError(f"base must be a finite number > 0, got {self.base!r}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {self.layout!r}")
        base = float(self.base)
        scaling = normalize_scaling(
            self.scaling, base=base, head_dim=self.head_dim, rotary_dim=rotary_dim
        )
        if scaling is None:
            inv_freq, attention_scaling = default_inv_freq(base, rotary_dim), 1.0
        else:
            inv_freq, attention_scaling = INV_FREQ_FUNCTIONS[scaling["rope_type"]](
                base, rotary_dim, scaling
            )
        object.__setattr__(self, "head_dim", int(self.head_dim))
        object.__setattr__(self, "rotary_dim", int(rotary_dim))
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "_inv_freq", inv_freq)
        object.__setattr__(self, "_attention_scaling", float(attention_scaling))
        object.__setattr__(self, "_device_cache", {})

    def __hash__(self) -> int:
        return hash((self.head_dim, self.rotary_dim, self.base, self.layout, self.scaling))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_device_cache"] = {}  # never pickle device copies
        return state

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        """The cached float64 inverse frequencies on ``device`` (internal; never mutate)."""
        cached = self._device_cache.get(device)
        if cached is None:
            with torch.inference_mode(False):  # a normal tensor even if first used there
                cached = self._inv_freq.to(device)
            self._device_cache[device] = cached
        return cached

    @property
    def num_pairs(self) -> int:
        """Number of rotary pairs ``P = rotary_dim / 2``."""
        return self.rotary_dim // 2  # type: ignore[operator]

    @property
    def rope_type(self) -> str:
        """HF ``rope_type``: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``."""
        return "default" if self.scaling is None else str(self.scaling["rope_type"])

    @property
    def attention_scaling(self) -> float:
        """HF's post-processing factor on cos/sin (``attention_factor``): 1.0 except for yarn.

        Exposed for model integrations that must reproduce HF's cos/sin exactly
        (``apply_rotary(..., attention_scaling=True)``); a relay never uses it.
        """
        return self._attention_scaling

    def inv_freq(self, device: torch.device | str | None = None) -> Tensor:
        """Scaled inverse frequencies, float64 ``[rotary_dim / 2]`` (radians per token), a copy."""
        return self._inv_freq.to(device=device, copy=True)

    def pair_indices(self, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """Channel indices of each rotary pair's two members.

        Returns:
            ``(first, second)``, int64 ``[P]`` each: pair ``i`` rotates channels
            ``(first[i], second[i])`` by ``position * inv_freq[i]``, ``first`` playing the
            cosine ("real") role: ``(i, i + P)`` for ``"half"``, ``(2i, 2i + 1)`` for
            ``"interleaved"``.
        """
        index = torch.arange(self.num_pairs, dtype=torch.int64, device=device)
        if self.layout == "half":
            return index, index + self.num_pairs
        return 2 * index, 2 * index + 1

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        layer_type: str | None = None,
        layout: Layout | None = None,
    ) -> RotaryConfig:
        """Build the RotaryConfig of a ``transformers`` ``PretrainedConfig`` (read-only).

        Reads ``head_dim`` (``config.head_dim`` or ``hidden_size // num_attention_heads``),
        ``rope_parameters`` (transformers 5.x: ``rope_theta``, ``rope_type``,
        ``partial_rotary_factor`` and scaling keys inside it; nested per layer type, e.g.
        Gemma 3, needs ``layer_type``), or the legacy ``rope_theta`` / ``rope_scaling`` /
        ``partial_rotary_factor`` attributes. ``rotary_dim = int(head_dim *
        partial_rotary_factor)`` as in HF. GPT-J / CodeGen (``rotary_dim`` attribute, base
        10000) are supported. As in HF, a missing ``original_max_position_embeddings`` (llama3,
        yarn) falls back to the config's, then to ``max_position_embeddings``, and a missing
        yarn ``factor`` is ``max_position_embeddings / original_max_position_embeddings``.

        Args:
            config: the model config (not modified).
            layer_type: key of a nested (per-layer-type) ``rope_parameters``.
            layout: pair layout; by default ``"interleaved"`` for model types that HF rotates
                with interleaved pairs (gptj, codegen, glm, glm4, ernie4_5, ernie4_5_moe,
                helium) and ``"half"`` otherwise.

        Raises:
            ValueError: no RoPE parameters, a nested ``rope_parameters`` without a valid
                ``layer_type``, an unsupported rope_type (dynamic, longrope, mrope, ...), or an
                invalid resulting config.
        """
        model_type = getattr(config, "model_type", "") or ""
        if layout is None:
            layout = "interleaved" if model_type in _INTERLEAVED_MODEL_TYPES else "half"
        num_heads = getattr(config, "num_attention_heads", None)
        hidden_size = getattr(config, "hidden_size", None)
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            if not num_heads or not hidden_size:
                raise ValueError(
                    "config has neither head_dim nor hidden_size and num_attention_heads"
                )
            head_dim = hidden_size // num_heads

        if model_type in _ROTARY_DIM_MODEL_TYPES:
            rotary_dim = getattr(config, "rotary_dim", None) or head_dim
            return cls(head_dim=head_dim, rotary_dim=rotary_dim, base=10000.0, layout=layout)

        raw = getattr(config, "rope_parameters", None)
        if raw is None:
            raw = getattr(config, "rope_scaling", None)
        params: dict[str, Any] = dict(raw or {})
        if params and all(isinstance(v, Mapping) for v in params.values()):
            if layer_type is None or layer_type not in params:
                raise ValueError(
                    f"config.rope_parameters is nested per layer type {sorted(params)}; "
                    f"pass layer_type= one of them (got {layer_type!r})"
                )
            params = dict(params[layer_type])
        elif layer_type is not None:
            raise ValueError(
                f"layer_type={layer_type!r} given but config.rope_parameters is not nested"
            )
        theta = params.pop("rope_theta", None)
        if theta is None:
            theta = getattr(config, "rope_theta", None)
        if theta is None:
            if not params:
                raise ValueError(
                    f"config (model_type={model_type!r}) has no RoPE parameters "
                    "(rope_parameters, rope_scaling or rope_theta)"
                )
            theta = getattr(config, "default_theta", 10000.0)
        partial = params.pop("partial_rotary_factor", None)
        if partial is None:
            partial = getattr(config, "partial_rotary_factor", None)
        if partial is None:
            partial = 1.0
        rotary_dim = int(head_dim * partial)

        if "mrope_section" in params:
            raise ValueError("multimodal RoPE (rope_parameters['mrope_section']) is not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in ("llama3", "yarn"):
            original = getattr(config, "original_max_position_embeddings", None)
            if original is not None:  # HF: the attribute takes priority (Phi-3 convention)
                params["original_max_position_embeddings"] = original
            params.setdefault(
                "original_max_position_embeddings",
                getattr(config, "max_position_embeddings", None),
            )
            if rope_type == "yarn" and params.get("factor") is None:
                max_positions = getattr(config, "max_position_embeddings", None)
                if max_positions and params["original_max_position_embeddings"]:
                    params["factor"] = max_positions / params["original_max_position_embeddings"]
        if rope_type in REQUIRED_KEYS:
            # HF ignores keys it does not know (with a warning); do the same.
            known = {"rope_type", "type"} | REQUIRED_KEYS[rope_type] | OPTIONAL_KEYS[rope_type]
            ignored = sorted(set(params) - known)
            if ignored:
                warnings.warn(
                    f"ignoring rope_parameters keys {ignored} for rope_type {rope_type!r}",
                    stacklevel=2,
                )
                params = {k: v for k, v in params.items() if k in known}
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            base=float(theta),
            layout=layout,
            scaling=params or None,
        )
