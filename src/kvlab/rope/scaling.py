"""RoPE context-extension scaling: HF ``rope_parameters`` / ``rope_scaling`` dicts validated and
the inverse frequencies they give (see :mod:`kvlab.rope` for the conventions).

``"linear"``, ``"llama3"`` and ``"yarn"`` with exactly HF's parameter names and formulas,
transcribed from ``transformers/modeling_rope_utils.py`` (``_compute_linear_scaling_rope_
parameters``, ``_compute_llama3_parameters``, ``_compute_yarn_parameters``), evaluated in
float64. A new HF rope type changes this module only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "INV_FREQ_FUNCTIONS",
    "OPTIONAL_KEYS",
    "REQUIRED_KEYS",
    "default_inv_freq",
    "is_int",
    "is_real",
    "normalize_scaling",
]

# Scaling parameters per rope_type, with HF's names (transformers 5.x `RopeParameters`).
# "rope_theta" and "partial_rotary_factor" may also appear in an HF dict; they are accepted when
# they agree with `base` / `rotary_dim` and then dropped (the config carries them itself).
REQUIRED_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
}
OPTIONAL_KEYS: dict[str, frozenset[str]] = {
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


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool)."""
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
            return float(v) if is_real(v) else repr(v)

        return hash(tuple(sorted((k, key(v)) for k, v in self._data.items())))

    def __repr__(self) -> str:
        return repr(self._data)


def normalize_scaling(
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
            f"{sorted(REQUIRED_KEYS)} (a relay needs a position-independent frequency table)"
        )
    if rope_type not in REQUIRED_KEYS:
        raise ValueError(
            f"unknown RoPE scaling rope_type {rope_type!r}; expected one of {sorted(REQUIRED_KEYS)}"
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

    required, optional = REQUIRED_KEYS[rope_type], OPTIONAL_KEYS[rope_type]
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
        if not is_real(value) or not math.isfinite(value) or value <= 0:
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
            if value is not None and not (is_real(value) and math.isfinite(value)):
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


def default_inv_freq(base: float, dim: int) -> Tensor:
    """``1 / base ** (arange(0, dim, 2) / dim)``: HF ``compute_default_rope_parameters``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return 1.0 / (base**exponents)


def _linear_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> tuple[Tensor, float]:
    """HF ``_compute_linear_scaling_rope_parameters``: every frequency divided by ``factor``."""
    return default_inv_freq(base, dim) / p["factor"], 1.0


def _llama3_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> tuple[Tensor, float]:
    """HF ``_compute_llama3_parameters`` (Llama 3.1 frequency-dependent interpolation)."""
    inv_freq = default_inv_freq(base, dim)
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


#: The inverse-frequency function of each scaled ``rope_type``: ``(base, rotary_dim, params) ->
#: (inv_freq float64 [rotary_dim / 2], attention_factor)``.
INV_FREQ_FUNCTIONS: dict[str, Callable[[float, int, Mapping[str, Any]], tuple[Tensor, float]]] = {
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}
