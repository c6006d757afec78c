"""Configuration of a PN-Mix cache (docs/design.md, "PN-Mix")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.pnmix.codecs import (
    KEY_CODING_NAMES,
    KeyCodec,
    PerTokenCodec,
    key_codec_from_name,
)
from kvlab.pnmix.quantizers import STORAGE_DTYPES
from kvlab.pnmix.values import VALUE_CODING_NAMES, ValueCodec, value_codec_from_name

__all__ = ["KeyCoding", "PNMixConfig", "ValueCoding", "check_int"]


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


KeyCoding = Literal[
    "mix",
    "cartesian",
    "phase_norm",
    "per_token",
    "prerope_cartesian",
    "prerope_phase_norm",
    "prerope_mix",
    "qmix",
    "prerope_qmix",
    "bit_alloc",
]
_KEY_CODINGS = KEY_CODING_NAMES
ValueCoding = Literal["per_token", "hadamard", "hadamard_mse", "hadamard_auto"]


@dataclass(frozen=True)
class PNMixConfig:
    """Configuration of a PN-Mix cache (defaults: the seed configuration, docs/design.md "PN-Mix").

    Attributes:
        bits: code width of every quantized key/value element, 2, 3 or 4.
        sink_tokens: leading tokens kept exact (tokens, >= 0).
        residual_tokens: recent tokens kept exact after a flush (tokens, >= 0).
        group_tokens: tokens per quantized group (>= 2 for the channel-wise key codings,
            whose per-channel min-max needs a group; >= 1 for ``"per_token"``).
        storage_dtype: dtype of every exact value and every stored scalar,
            ``torch.float16`` (default) or ``torch.bfloat16`` (for activations beyond
            float16's range).
        key_coding: a name — ``"mix"`` (per-pair Cartesian or Phase–Norm by prefill saliency),
            ``"cartesian"`` (all channels per-channel min-max: KIVI keys), ``"phase_norm"``
            (every rotary pair Phase–Norm: ablation) or ``"per_token"`` (keys per token over
            the head's channels, like values) — or a :class:`~kvlab.pnmix.codecs.KeyCodec`
            whose ``bits`` equal ``bits``. ``"cartesian"`` and ``"phase_norm"`` store the same
            bytes as ``"mix"`` minus its mask. Position-aware (pre-RoPE) codings —
            ``"prerope_cartesian"``, ``"prerope_phase_norm"``, ``"prerope_mix"``,
            ``"prerope_qmix"``, ``"bit_alloc"`` (widths 0/2/3/4 per rotary pair, pre-RoPE) —
            need the layer's :class:`~kvlab.rope.RotaryConfig` (``PNMixCache(rotary=...)``);
            ``"qmix"`` / ``"prerope_qmix"`` choose Cartesian or Phase–Norm per pair by the
            query-weighted logit error (docs/design.md, "Key codecs").
        key_outlier_fraction: fraction of each group's key elements kept exact in a sparse
            side table (KVQuant dense-and-sparse), in ``[0, 1)``; only with ``"bit_alloc"``,
            ``"cartesian"`` or ``"prerope_cartesian"`` named codings (0: none).
        value_coding: ``"per_token"`` (default: per-token min-max), ``"hadamard_mse"`` (the
            Hadamard frame with the per-token range chosen by squared error) or ``"hadamard"``
            (per-token min-max of Hadamard-rotated values; the value head dim must be a power
            of two), ``"hadamard_auto"`` (one of the two Hadamard codings per kv head, chosen at
            its first flush by the attention-weighted output error), or a
            :class:`~kvlab.pnmix.values.ValueCodec` whose ``bits`` equal ``bits``.
        value_group_channels: channels of the value coding's frame that share one scale and
            zero per token (KIVI's value group size; a divisor of the value head_dim, checked by
            the cache, or at least the head_dim: one group); ``None`` (default): one pair per
            token over all channels, ``2 + 32 / head_dim`` bits per value channel in float16.
            Only with a named ``value_coding`` (a :class:`~kvlab.pnmix.values.ValueCodec`
            carries its own ``group_channels``).
            The compiled kernels (CPU and Triton) read grouped value scalars
            (docs/design.md, "Value codecs").
        rotary_dim: rotary channels of a key (even; ``None`` = the head_dim); channels
            ``rotary_dim .. head_dim - 1`` are always Cartesian.
        rotary_layout: ``"half"`` pairs ``(i, i + rotary_dim/2)``, ``"interleaved"`` pairs
            ``(2i, 2i + 1)`` (docs/design.md, "Rotary pairs"); must match the model's RoPE.

    Raises:
        ValueError: any field out of its domain (checked at construction).
    """

    bits: int = 2
    sink_tokens: int = 32
    residual_tokens: int = 32
    group_tokens: int = 128
    storage_dtype: torch.dtype = torch.float16
    key_coding: KeyCoding | KeyCodec = "mix"
    rotary_dim: int | None = None
    rotary_layout: Literal["half", "interleaved"] = "half"
    key_outlier_fraction: float = 0.0
    value_coding: ValueCoding | ValueCodec = "per_token"
    value_group_channels: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (2, 3, 4):
            raise ValueError(f"bits must be 2, 3 or 4, got {self.bits!r}")
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("residual_tokens", self.residual_tokens, 0)
        if isinstance(self.key_coding, KeyCodec):
            if self.key_coding.bits != self.bits:
                raise ValueError(
                    f"key codec bits {self.key_coding.bits} differ from config bits {self.bits}"
                )
        elif self.key_coding not in _KEY_CODINGS:
            raise ValueError(
                f"key_coding must be one of {_KEY_CODINGS} or a KeyCodec, got {self.key_coding!r}"
            )
        fraction = self.key_outlier_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"key_outlier_fraction must be a number, got {fraction!r}")
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"key_outlier_fraction must lie in [0, 1), got {fraction!r}")
        if fraction and isinstance(self.key_coding, KeyCodec):
            raise ValueError(
                "key_outlier_fraction applies to named key codings; a KeyCodec object carries "
                "its own outliers"
            )
        if isinstance(self.value_coding, ValueCodec):
            if self.value_coding.bits != self.bits:
                raise ValueError(
                    f"value codec bits {self.value_coding.bits} differ from config bits {self.bits}"
                )
        elif self.value_coding not in VALUE_CODING_NAMES:
            raise ValueError(
                f"value_coding must be one of {VALUE_CODING_NAMES} or a ValueCodec, got "
                f"{self.value_coding!r}"
            )
        if self.value_group_channels is not None:
            check_int("value_group_channels", self.value_group_channels, 1)
            if isinstance(self.value_coding, ValueCodec):
                raise ValueError(
                    "value_group_channels applies to named value codings; a ValueCodec object "
                    "carries its own group_channels"
                )
        check_int("group_tokens", self.group_tokens, 1)
        minimum = self.key_codec.min_group_tokens
        if self.group_tokens < minimum:
            raise ValueError(
                f"group_tokens must be >= {minimum} for key_coding={str(self.key_coding)!r} "
                f"(per-channel min-max over a group's tokens), got {self.group_tokens}"
            )
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"storage_dtype must be torch.float16 or torch.bfloat16, got {self.storage_dtype!r}"
            )
        if self.rotary_dim is not None:
            check_int("rotary_dim", self.rotary_dim, 2)
            if self.rotary_dim % 2:
                raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        if self.rotary_layout not in ("half", "interleaved"):
            raise ValueError(
                f"rotary_layout must be 'half' or 'interleaved', got {self.rotary_layout!r}"
            )

    @property
    def key_codec(self) -> KeyCodec:
        """The key codec: ``key_coding`` itself, or the codec its name stands for."""
        if isinstance(self.key_coding, KeyCodec):
            return self.key_coding
        return key_codec_from_name(self.key_coding, self.bits, float(self.key_outlier_fraction))

    @property
    def value_codec(self) -> ValueCodec:
        """The value codec: ``value_coding`` itself, or the codec its name stands for."""
        if isinstance(self.value_coding, ValueCodec):
            return self.value_coding
        return value_codec_from_name(self.value_coding, self.bits, self.value_group_channels)

    @property
    def channelwise_keys(self) -> bool:
        """True when keys are coded per channel/pair over a group (every coding but per_token)."""
        return not isinstance(self.key_codec, PerTokenCodec)
