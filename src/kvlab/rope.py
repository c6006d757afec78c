"""Rotary position embeddings (RoPE): configuration, rotation and relay-by-delta.

RoPE (RoFormer; Su et al. 2021, arXiv:2104.09864) splits the first ``rotary_dim`` channels of
every query/key head into ``P = rotary_dim / 2`` pairs ``(x_a, x_b)`` and rotates pair ``i`` by
the angle ``position * inv_freq[i]``::

    y_a = x_a * cos(theta) - x_b * sin(theta)
    y_b = x_a * sin(theta) + x_b * cos(theta)

with ``inv_freq[i] = base ** (-2i / rotary_dim)`` (before any context-extension scaling).
Rotations compose additively in the angle, so a key already rotated at position ``p`` and then
rotated by ``p' - p`` equals the raw key rotated at ``p'``: the identity RoPE-Relay rests on
(see :mod:`kvlab.relay`).

Conventions follow Hugging Face ``transformers`` (5.x):

* ``layout="half"``: pair ``i`` is channels ``(i, i + rotary_dim/2)`` (GPT-NeoX / Llama
  ``rotate_half``); ``layout="interleaved"``: pair ``i`` is channels ``(2i, 2i + 1)`` (GPT-J
  ``rotate_every_two``).
* Partial rotary (``rotary_dim < head_dim``, HF ``partial_rotary_factor``): only the first
  ``rotary_dim`` channels rotate; channels ``rotary_dim .. head_dim - 1`` are returned
  bit-identical.
* Scaling (``rope_parameters`` / legacy ``rope_scaling``): ``"linear"``, ``"llama3"`` and
  ``"yarn"`` with exactly HF's parameter names and formulas, transcribed from
  ``transformers/modeling_rope_utils.py`` (``_compute_linear_scaling_rope_parameters``,
  ``_compute_llama3_parameters``, ``_compute_yarn_parameters``), but evaluated in float64.

Numerics: angles are formed and their cos/sin evaluated in float64 (positions can be large);
the rotation itself runs in float32 (float64 for float64 inputs) and the result is cast back
to the input dtype. For float32 rotation and ``|position| <= 2**24`` (about 1.7e7 tokens) each
rotated output component differs from the exact rotation (by the angle
``position * inv_freq`` with this module's float64 ``inv_freq``) by at most
``ROTATION_ERROR_BOUND * ||(x_a, x_b)||`` with ``ROTATION_ERROR_BOUND = 4 * 2**-24``
(about 2.4e-7): 3 float32 roundings (cos/sin storage, products, sum) plus at most
``|position| * inv_freq * 2**-53 <= 2**-29`` rad of float64 angle error. Outputs in float16 or
bfloat16 add one rounding to that dtype.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "ROTATION_ERROR_BOUND",
    "RotaryConfig",
    "apply_rotary",
    "rotate_by_delta",
    "rotation_tables",
]

#: Per-component error bound of a float32 rotation, relative to the pair norm, for
#: ``|position| <= 2**24``; see the module docstring for the derivation.
ROTATION_ERROR_BOUND: float = 4.0 * 2.0**-24

Layout = Literal["half", "interleaved"]
_LAYOUTS = ("half", "interleaved")

# Scaling parameters per rope_type, with HF's names (transformers 5.x `RopeParameters`).
# "rope_theta" and "partial_rotary_factor" may also appear in an HF dict; they are accepted when
# they agree with `base` / `rotary_dim` and then dropped (the config carries them itself).
_REQUIRED_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
}
_OPTIONAL_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset(),
    "llama3": frozenset(),
    "yarn": frozenset(
        {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    ),
}
# HF rope types that this module deliberately does not implement (they are not pure
# position-independent frequency tables, or need per-model data): a clear error names them.
_UNSUPPORTED_TYPES = frozenset(
    {"dynamic", "longrope", "proportional", "axial", "mrope", "su", "ntk"}
)

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


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _FrozenMapping(Mapping):
    """A read-only, hashable, picklable mapping (the stored ``RotaryConfig.scaling``)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        # Hash values as ==-compatible keys (4 == 4.0 must hash alike): floats for numbers.
        def key(v: Any) -> Any:
            return float(v) if _is_real(v) else repr(v)

        return hash(tuple(sorted((k, key(v)) for k, v in self._data.items())))

    def __repr__(self) -> str:
        return repr(self._data)


def _normalize_scaling(
    scaling: Mapping[str, Any] | None, *, base: float, head_dim: int, rotary_dim: int
) -> Mapping[str, Any] | None:
    """Validate an HF-style scaling dict; return a read-only copy keyed by ``rope_type``.

    Returns None for no scaling (None or ``rope_type == "default"``). Raises ValueError for an
    unknown or unsupported type, a missing or unknown key, or an out-of-range value.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"scaling must be a mapping or None, got {type(scaling).__name__}")
    params = dict(scaling)
    legacy = params.pop("type", None)
    rope_type = params.pop("rope_type", None)
    if rope_type is None:
        rope_type = legacy
    elif legacy is not None and legacy != rope_type:
        raise ValueError(
            f"scaling has conflicting 'rope_type'={rope_type!r} and legacy 'type'={legacy!r}"
        )
    if rope_type is None:
        rope_type = "default"
    if rope_type in _UNSUPPORTED_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling rope_type {rope_type!r}; kvlab supports "
            f"{sorted(_REQUIRED_KEYS)} (a relay needs a position-independent frequency table)"
        )
    if rope_type not in _REQUIRED_KEYS:
        raise ValueError(
            f"unknown RoPE scaling rope_type {rope_type!r}; "
            f"expected one of {sorted(_REQUIRED_KEYS)}"
        )

    theta = params.pop("rope_theta", None)
    if theta is not None and float(theta) != base:
        raise ValueError(
            f"scaling['rope_theta']={theta} disagrees with base={base}; pass the base via `base`"
        )
    factor_p = params.pop("partial_rotary_factor", None)
    if factor_p is not None and int(head_dim * factor_p) != rotary_dim:
        raise ValueError(
            f"scaling['partial_rotary_factor']={factor_p} implies rotary_dim="
            f"{int(head_dim * factor_p)} for head_dim={head_dim}, but rotary_dim={rotary_dim}"
        )

    required, optional = _REQUIRED_KEYS[rope_type], _OPTIONAL_KEYS[rope_type]
    missing = required - params.keys()
    if missing:
        hint = (
            " (RotaryConfig.from_hf_config derives a missing yarn 'factor' from "
            "max_position_embeddings)"
            if rope_type == "yarn"
            else ""
        )
        raise ValueError(
            f"RoPE scaling rope_type {rope_type!r} is missing required keys {sorted(missing)}{hint}"
        )
    unknown = params.keys() - required - optional
    if unknown:
        raise ValueError(
            f"unknown keys {sorted(unknown)} for RoPE scaling rope_type {rope_type!r}; "
            f"allowed: {sorted(required | optional)}"
        )
    if rope_type == "default":
        return None

    def positive(name: str, *, allow_none: bool = False) -> None:
        value = params.get(name)
        if value is None and allow_none:
            return
        if not _is_real(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"scaling[{name!r}] must be a finite number > 0 for rope_type "
                f"{rope_type!r}, got {value!r}"
            )

    positive("factor")
    if rope_type in ("llama3", "yarn"):
        positive("original_max_position_embeddings")
    if rope_type == "llama3":
        positive("low_freq_factor")
        positive("high_freq_factor")
        if params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError(
                "llama3 scaling needs high_freq_factor > low_freq_factor, got "
                f"high_freq_factor={params['high_freq_factor']}, "
                f"low_freq_factor={params['low_freq_factor']}"
            )
    if rope_type == "yarn":
        positive("attention_factor", allow_none=True)
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            value = params.get(name)
            if value is not None and not (_is_real(value) and math.isfinite(value)):
                raise ValueError(
                    f"scaling[{name!r}] must be a finite number or None, got {value!r}"
                )
        truncate = params.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise ValueError(f"scaling['truncate'] must be a bool or None, got {truncate!r}")
    return _FrozenMapping({"rope_type": rope_type, **params})


# --------------------------------------------------------------------------------------------
# Inverse frequencies: HF formulas (modeling_rope_utils.py, transformers 5.x) in float64.
# Each returns (inv_freq [rotary_dim/2] float64 on CPU, attention_factor).
# --------------------------------------------------------------------------------------------


def _default_inv_freq(base: float, dim: int) -> Tensor:
    """``1 / base ** (arange(0, dim, 2) / dim)``: HF ``compute_default_rope_parameters``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return 1.0 / (base**exponents)


def _linear_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> tuple[Tensor, float]:
    """HF ``_compute_linear_scaling_rope_parameters``: every frequency divided by ``factor``."""
    return _default_inv_freq(base, dim) / p["factor"], 1.0


def _llama3_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> tuple[Tensor, float]:
    """HF ``_compute_llama3_parameters`` (Llama 3.1 frequency-dependent interpolation)."""
    inv_freq = _default_inv_freq(base, dim)
    factor = p["factor"]
    low_freq_factor = p["low_freq_factor"]
    high_freq_factor = p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: keep; wavelen > low_freq_wavelen: divide by factor.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # In between: interpolate with a smooth factor.
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


def _yarn_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> tuple[Tensor, float]:
    """HF ``_compute_yarn_parameters`` (YaRN; Peng et al. 2023, arXiv:2309.00071).

    Mirrors HF exactly, including its defaults: ``beta_fast or 32``, ``beta_slow or 1``,
    ``truncate`` defaulting to True (an explicit None disables truncation, as in HF), and the
    attention factor ``0.1 * mscale * ln(factor) + 1`` (ratio form when both ``mscale`` and
    ``mscale_all_dim`` are truthy) unless ``attention_factor`` is given.
    """
    factor = p["factor"]
    attention_factor = p.get("attention_factor")
    mscale = p.get("mscale")
    mscale_all_dim = p.get("mscale_all_dim")
    original_max_position_embeddings = p["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)

    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def find_correction_dim(num_rotations: float) -> float:
        # Inverse of the rotation count: the dimension whose wavelength completes
        # `num_rotations` turns over the original context.
        return (
            dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent singularity

    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


_INV_FREQ_FUNCTIONS = {
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}


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
        if not _is_int(self.head_dim) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        rotary_dim = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if not _is_int(rotary_dim) or not 0 < rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim must be an int with 0 < rotary_dim <= head_dim={self.head_dim}, "
                f"got {rotary_dim!r}"
            )
        if rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even (channels rotate in pairs), got {rotary_dim}"
            )
        if not _is_real(self.base) or not math.isfinite(self.base) or self.base <= 0:
            raise ValueError(f"base must be a finite number > 0, got {self.base!r}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {self.layout!r}")
        base = float(self.base)
        scaling = _normalize_scaling(
            self.scaling, base=base, head_dim=self.head_dim, rotary_dim=rotary_dim
        )
        if scaling is None:
            inv_freq, attention_scaling = _default_inv_freq(base, rotary_dim), 1.0
        else:
            inv_freq, attention_scaling = _INV_FREQ_FUNCTIONS[scaling["rope_type"]](
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
        if rope_type in _REQUIRED_KEYS:
            # HF ignores keys it does not know (with a warning); do the same.
            known = {"rope_type", "type"} | _REQUIRED_KEYS[rope_type] | _OPTIONAL_KEYS[rope_type]
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


# --------------------------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------------------------


def _as_positions(positions: Tensor | int | float, x: Tensor, name: str) -> Tensor:
    """Validate ``positions`` against ``x [..., D]``; return it as float64 on x's device."""
    if isinstance(positions, (int, float)) and not isinstance(positions, bool):
        return torch.tensor(float(positions), dtype=torch.float64, device=x.device)
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a tensor or a number, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(
            f"{name} must be an integer or real floating tensor, got {positions.dtype}"
        )
    if positions.device != x.device:
        raise ValueError(f"{name} is on {positions.device} but x is on {x.device}")
    lead = tuple(x.shape[:-1])
    try:
        broadcast = tuple(torch.broadcast_shapes(tuple(positions.shape), lead))
    except RuntimeError:
        broadcast = None
    if broadcast != lead:
        raise ValueError(
            f"{name} of shape {tuple(positions.shape)} does not broadcast to x.shape[:-1]={lead}"
        )
    return positions.to(torch.float64)


def _cos_sin(
    positions64: Tensor, cfg: RotaryConfig, dtype: torch.dtype, factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos/sin of ``positions * inv_freq`` formed in float64, cast to ``dtype``: ``[..., P]``.

    ``factor`` multiplies both (HF's attention_scaling); 1.0 is a pure rotation.
    """
    angles = positions64.unsqueeze(-1) * cfg._inv_freq_on(positions64.device)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _check_x(x: Tensor, cfg: RotaryConfig) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"x must have last dimension head_dim={cfg.head_dim}, got shape {tuple(x.shape)}"
        )


def _rotate(
    x: Tensor,
    positions64: Tensor,
    cfg: RotaryConfig,
    *,
    factor: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Rotate the rotary channels of ``x [..., D]`` by ``positions64 * inv_freq``.

    Rotation runs in float32 (float64 for float64 ``x``); the result is ``out_dtype`` (default
    x's dtype), the non-rotary tail is x's own channels (cast only if ``out_dtype`` differs).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute = torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32
    r, p = cfg.rotary_dim, cfg.num_pairs
    cos, sin = _cos_sin(positions64, cfg, compute, factor)
    rot = x[..., :r].to(compute)
    if cfg.layout == "half":
        x1, x2 = rot[..., :p], rot[..., p:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    if cfg.layout == "half":
        out = torch.cat((y1, y2), dim=-1)
    else:
        out = torch.stack((y1, y2), dim=-1).flatten(-2)
    out = out.to(out_dtype)
    if r < cfg.head_dim:
        out = torch.cat((out, x[..., r:].to(out_dtype)), dim=-1)
    return out


def apply_rotary(
    x: Tensor,
    positions: Tensor | int | float,
    cfg: RotaryConfig,
    *,
    attention_scaling: bool = False,
) -> Tensor:
    """Rotate raw queries or keys to their positions (RoPE; Su et al. 2021, eq. 34).

    Args:
        x: ``[..., S, D]`` (any leading dims, ``D == cfg.head_dim``), any floating dtype.
        positions: token positions (integer or floating tensor, or a number), broadcastable to
            ``x.shape[:-1]`` (e.g. ``[S]``, ``[B, 1, S]``, ``[B, H, S]``), on x's device.
        cfg: the rotary configuration.
        attention_scaling: multiply cos and sin by ``cfg.attention_scaling`` as HF's rotary
            embedding does (only yarn differs from 1.0). Off by default: then a pure rotation.

    Returns:
        Tensor of x's shape and dtype: rotary channels rotated (angles in float64, rotation in
        float32, or float64 for float64 x), channels ``rotary_dim..`` bit-identical. The input
        is not modified; the op is differentiable. Error bound: see ``ROTATION_ERROR_BOUND``.

    Raises:
        ValueError: x not floating or wrong last dimension; positions not a real tensor, on
            another device, or not broadcastable to ``x.shape[:-1]``.
    """
    _check_x(x, cfg)
    pos = _as_positions(positions, x, "positions")
    factor = cfg.attention_scaling if attention_scaling else 1.0
    return _rotate(x, pos, cfg, factor=factor)


def rotate_by_delta(x: Tensor, delta: Tensor | int | float, cfg: RotaryConfig) -> Tensor:
    """Relay already-rotated keys by a position delta: a pure rotation by ``delta * inv_freq``.

    ``rotate_by_delta(apply_rotary(k, p, cfg), p2 - p, cfg) == apply_rotary(k, p2, cfg)`` up to
    rounding (rotations compose additively). Never multiplies by an attention factor, so every
    rotary pair keeps its norm (up to rounding).

    Args:
        x: rotated keys ``[..., S, D]``, any floating dtype.
        delta: position deltas (integer or floating tensor, or a number) broadcastable to
            ``x.shape[:-1]``, on x's device.
        cfg: the rotary configuration the keys were rotated with.

    Returns:
        Tensor of x's shape and dtype; non-rotary channels bit-identical; input not modified.

    Raises:
        ValueError: as :func:`apply_rotary`.
    """
    _check_x(x, cfg)
    return _rotate(x, _as_positions(delta, x, "delta"), cfg)


def rotation_tables(
    delta: Tensor, cfg: RotaryConfig, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The cos and sin by which :func:`rotate_by_delta` rotates: ``[..., P]`` of ``delta *
    inv_freq`` (angles in float64), cast to ``dtype`` — the rotation's precision, float32 unless
    the keys are float64. For compiled code that must reproduce :func:`rotate_by_delta` bit for
    bit (``y1 = x1 cos - x2 sin``, ``y2 = x1 sin + x2 cos``, each product and sum rounded to
    ``dtype``; pairs of :meth:`RotaryConfig.pair_indices`, entry ``p`` for pair ``p``).

    Args:
        delta: position deltas ``[...]`` (integer or floating tensor; tokens).
        cfg: the rotary configuration.
        dtype: floating dtype of the tables.

    Returns:
        ``(cos, sin)``, each ``[..., P]`` in ``dtype`` on ``delta``'s device.

    Raises:
        ValueError: ``delta`` not a real tensor.
    """
    if not isinstance(delta, Tensor) or delta.dtype == torch.bool or delta.is_complex():
        raise ValueError("delta must be an integer or real floating tensor")
    return _cos_sin(delta.to(torch.float64), cfg, dtype)
