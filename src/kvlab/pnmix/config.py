"""Configuration of a PN-Mix cache (docs/design.md, "PN-Mix")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.pnmix.codecs import KeyCodec, MixCodec, PairCodec, key_codec_from_name
from kvlab.pnmix.quantizers import STORAGE_DTYPES

__all__ = ["KeyCoding", "PNMixConfig", "check_int"]


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


KeyCoding = Literal["mix", "cartesian", "phase_norm", "per_token"]
_KEY_CODINGS = ("mix", "cartesian", "phase_norm", "per_token")


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
            bytes as ``"mix"`` minus its mask.
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
        return key_codec_from_name(self.key_coding, self.bits)

    @property
    def channelwise_keys(self) -> bool:
        """True when keys are coded per channel/pair over a group (every coding but per_token)."""
        return isinstance(self.key_codec, (PairCodec, MixCodec))
