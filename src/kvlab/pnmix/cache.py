"""The PN-Mix quantized KV cache of one attention layer (kvlab SPEC §3).

Per sequence of the batch the cache holds, in sequence order:

1. **Sinks** — the first ``sink_tokens`` tokens, exact in the storage dtype.
2. **Quantized groups** — blocks of ``group_tokens`` consecutive tokens with packed ``bits``-bit
   codes. Keys: per kv head, per channel over the group's tokens (Cartesian, KIVI-style), or
   Phase–Norm on the rotary pairs the mix mask selects (see :mod:`kvlab.pnmix.quantizers`
   for the pair-slot convention); values: per token over the head's channels (KIVI, Liu et
   al. 2024: per-channel keys, per-token values).
3. **Residual** — the most recent tokens, exact. When it reaches
   ``residual_tokens + group_tokens`` tokens the oldest ``group_tokens`` are quantized as one
   group. Which tokens form which group depends on the total length only, each group is
   quantized from its own tokens only, and stored codes are never rewritten, so one prefill or
   one token at a time gives byte-identical storage.

The mix mask (``key_coding="mix"``) holds one bit per (kv head, rotary pair) per sequence:
True = Phase–Norm. It is computed once, by saliency, from the keys of the **first quantized
group** (tokens ``sink_tokens .. sink_tokens + group_tokens - 1``) at the moment that group is
flushed: per pair, the coding with the smaller reconstruction error (sum of squared errors
over both channels and the group's tokens). Ties go to Cartesian. It is frozen afterwards.
Any prefill of at least ``sink_tokens + residual_tokens + group_tokens`` tokens flushes that
group, so the mask is computed at prefill, from prefill keys; and because the first group is
fixed by the total length alone, the mask — like every other stored byte — does not depend
on how the tokens arrived (SPEC §3). A shorter prefill leaves the mask to the first flush.

Storage is exactly what :meth:`PNMixCache.nbytes` counts: the exact buffers are tensors of
their logical size (re-allocated on append, no spare capacity), each group is a
:class:`PackedGroup` of packed uint8 codes plus storage-dtype scalars, and the mask is packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from kvlab.pnmix.packing import pack_codes, unpack_codes
from kvlab.pnmix.quantizers import (
    STORAGE_DTYPES,
    dequantize_keys_channelwise,
    key_pair_errors,
    minmax_dequantize,
    minmax_quantize,
    quantize_keys_channelwise,
    rotary_pair_indices,
    round_to_storage,
)

__all__ = ["KeyCoding", "PNMixCache", "PNMixConfig", "PackedGroup"]

KeyCoding = Literal["mix", "cartesian", "phase_norm", "per_token"]
_KEY_CODINGS = ("mix", "cartesian", "phase_norm", "per_token")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class PNMixConfig:
    """Configuration of a PN-Mix cache (defaults: the SPEC §3 / seed-004 configuration).

    Attributes:
        bits: code width of every quantized key/value element, 2, 3 or 4 (2 = SPEC).
        sink_tokens: leading tokens kept exact (tokens, >= 0).
        residual_tokens: recent tokens kept exact after a flush (tokens, >= 0).
        group_tokens: tokens per quantized group (>= 2 for the channel-wise key codings,
            whose per-channel min-max needs a group; >= 1 for ``"per_token"``).
        storage_dtype: dtype of every exact value and every stored scalar,
            ``torch.float16`` (default) or ``torch.bfloat16`` (for activations beyond
            float16's range).
        key_coding: ``"mix"`` (SPEC: per-pair Cartesian or Phase–Norm by prefill saliency),
            ``"cartesian"`` (all channels per-channel min-max: KIVI keys), ``"phase_norm"``
            (every rotary pair Phase–Norm: ablation) or ``"per_token"`` (keys per token over
            the head's channels, like values). ``"cartesian"`` and ``"phase_norm"`` store the
            same bytes as ``"mix"`` minus its mask.
        rotary_dim: rotary channels of a key (even; ``None`` = the head_dim); channels
            ``rotary_dim .. head_dim - 1`` are always Cartesian.
        rotary_layout: ``"half"`` pairs ``(i, i + rotary_dim/2)``, ``"interleaved"`` pairs
            ``(2i, 2i + 1)`` (SPEC §1); must match the model's RoPE.

    Raises:
        ValueError: any field out of its domain (checked at construction).
    """

    bits: int = 2
    sink_tokens: int = 32
    residual_tokens: int = 32
    group_tokens: int = 128
    storage_dtype: torch.dtype = torch.float16
    key_coding: KeyCoding = "mix"
    rotary_dim: int | None = None
    rotary_layout: Literal["half", "interleaved"] = "half"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (2, 3, 4):
            raise ValueError(f"bits must be 2, 3 or 4, got {self.bits!r}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("residual_tokens", self.residual_tokens, 0)
        if self.key_coding not in _KEY_CODINGS:
            raise ValueError(f"key_coding must be one of {_KEY_CODINGS}, got {self.key_coding!r}")
        _check_int("group_tokens", self.group_tokens, 1)
        if self.key_coding != "per_token" and self.group_tokens < 2:
            raise ValueError(
                f"group_tokens must be >= 2 for key_coding={self.key_coding!r} (per-channel "
                f"min-max over a group's tokens), got {self.group_tokens}"
            )
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"storage_dtype must be torch.float16 or torch.bfloat16, got {self.storage_dtype!r}"
            )
        if self.rotary_dim is not None:
            _check_int("rotary_dim", self.rotary_dim, 2)
            if self.rotary_dim % 2:
                raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        if self.rotary_layout not in ("half", "interleaved"):
            raise ValueError(
                f"rotary_layout must be 'half' or 'interleaved', got {self.rotary_layout!r}"
            )

    @property
    def channelwise_keys(self) -> bool:
        """True when keys are coded per channel/pair over a group (every coding but per_token)."""
        return self.key_coding != "per_token"


@dataclass(frozen=True, eq=False)
class PackedGroup:
    """One quantized group of ``num_tokens`` tokens, all sequences of the batch (read-only view).

    Attributes:
        start: sequence position of the group's first token.
        num_tokens: tokens in the group (= ``group_tokens``).
        bits: code width.
        head_dim, value_head_dim: channels of keys and values.
        key_codes: uint8 ``[B, H_kv, ceil(T * D * bits / 8)]``: per (sequence, kv head) the
            token-major codes ``[T, D]`` packed by :func:`~kvlab.pnmix.packing.pack_codes`.
            Channel-wise codings use the pair-slot convention of
            :mod:`kvlab.pnmix.quantizers`.
        key_scale, key_zero: storage dtype; ``[B, H_kv, D]`` for channel-wise codings (per
            channel / pair slot), ``[B, H_kv, T]`` for ``"per_token"``.
        value_codes: uint8 ``[B, H_kv, ceil(T * Dv * bits / 8)]``, token-major ``[T, Dv]``.
        value_scale, value_zero: storage dtype ``[B, H_kv, T]`` (per token).

    Tensors are shared with the cache: do not modify them in place.
    """

    start: int
    num_tokens: int
    bits: int
    head_dim: int
    value_head_dim: int
    key_codes: Tensor
    key_scale: Tensor
    key_zero: Tensor
    value_codes: Tensor
    value_scale: Tensor
    value_zero: Tensor

    def key_code_matrix(self) -> Tensor:
        """Unpacked key codes: uint8 ``[B, H_kv, T, D]``."""
        n = self.num_tokens * self.head_dim
        codes = unpack_codes(self.key_codes, self.bits, n)
        return codes.reshape(*codes.shape[:-1], self.num_tokens, self.head_dim)

    def value_code_matrix(self) -> Tensor:
        """Unpacked value codes: uint8 ``[B, H_kv, T, Dv]``."""
        n = self.num_tokens * self.value_head_dim
        codes = unpack_codes(self.value_codes, self.bits, n)
        return codes.reshape(*codes.shape[:-1], self.num_tokens, self.value_head_dim)

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by field name."""
        return {
            "key_codes": self.key_codes,
            "key_scale": self.key_scale,
            "key_zero": self.key_zero,
            "value_codes": self.value_codes,
            "value_scale": self.value_scale,
            "value_zero": self.value_zero,
        }

    def _select(self, index: Tensor) -> PackedGroup:
        picked = {name: t.index_select(0, index) for name, t in self.tensors().items()}
        return PackedGroup(
            start=self.start,
            num_tokens=self.num_tokens,
            bits=self.bits,
            head_dim=self.head_dim,
            value_head_dim=self.value_head_dim,
            **picked,
        )


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _State:
    sink_k: Tensor
    sink_v: Tensor
    res_k: Tensor
    res_v: Tensor
    groups: list[PackedGroup] = field(default_factory=list)
    mask_packed: Tensor | None = None


class PNMixCache:
    """PN-Mix quantized KV cache of ONE layer, for a batch of equally long sequences.

    Args:
        config: :class:`PNMixConfig`.
        batch_size: sequences ``B`` (>= 1).
        num_key_value_heads: kv heads ``H_kv`` (>= 1).
        head_dim: key channels ``D`` (>= 1, >= rotary_dim).
        value_head_dim: value channels ``Dv`` (default ``head_dim``).
        device: device of the storage; ``None`` = the device of the first appended keys.

    Raises:
        ValueError: bad sizes, or ``rotary_dim`` (``config.rotary_dim`` or ``head_dim``) not an
            even number ``<= head_dim``.
    """

    def __init__(
        self,
        config: PNMixConfig,
        *,
        batch_size: int,
        num_key_value_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(config, PNMixConfig):
            raise ValueError(f"config must be a PNMixConfig, got {type(config).__name__}")
        _check_int("batch_size", batch_size, 1)
        _check_int("num_key_value_heads", num_key_value_heads, 1)
        _check_int("head_dim", head_dim, 1)
        if value_head_dim is None:
            value_head_dim = head_dim
        _check_int("value_head_dim", value_head_dim, 1)
        rotary_dim = head_dim if config.rotary_dim is None else config.rotary_dim
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}"
                + (" (head_dim is odd: set config.rotary_dim)" if config.rotary_dim is None else "")
            )
        self._config = config
        self._batch_size = batch_size
        self._num_heads = num_key_value_heads
        self._head_dim = head_dim
        self._value_head_dim = value_head_dim
        self._rotary_dim = rotary_dim
        self._first, self._second = rotary_pair_indices(rotary_dim, config.rotary_layout)
        self._device = torch.device(device) if device is not None else None
        self._saliency_computations = 0
        self._attention_calls = 0
        self._state = self._empty_state(self._device or torch.device("cpu"))

    # ------------------------------------------------------------------ description
    @property
    def config(self) -> PNMixConfig:
        return self._config

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_key_value_heads(self) -> int:
        return self._num_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def value_head_dim(self) -> int:
        return self._value_head_dim

    @property
    def rotary_dim(self) -> int:
        return self._rotary_dim

    @property
    def num_pairs(self) -> int:
        """Rotary pairs per key head: ``rotary_dim // 2``."""
        return self._first.numel()

    @property
    def pair_indices(self) -> tuple[Tensor, Tensor]:
        """``(first, second)`` int64 ``[P]`` channel indices of the rotary pairs (CPU)."""
        return self._first.clone(), self._second.clone()

    @property
    def device(self) -> torch.device:
        return self._state.sink_k.device

    # ------------------------------------------------------------------ lengths
    @property
    def sink_length(self) -> int:
        """Tokens in the exact sink buffer (<= ``sink_tokens``)."""
        return self._state.sink_k.shape[2]

    @property
    def residual_length(self) -> int:
        """Tokens in the exact residual buffer."""
        return self._state.res_k.shape[2]

    @property
    def num_groups(self) -> int:
        return len(self._state.groups)

    @property
    def quantized_tokens(self) -> int:
        """Tokens stored as packed codes (``num_groups * group_tokens``)."""
        return sum(g.num_tokens for g in self._state.groups)

    @property
    def seq_length(self) -> int:
        """Tokens stored per sequence: sinks + quantized + residual."""
        return self.sink_length + self.quantized_tokens + self.residual_length

    @property
    def groups(self) -> tuple[PackedGroup, ...]:
        """The quantized groups in sequence order (read-only view of the packed storage)."""
        return tuple(self._state.groups)

    @property
    def sink_keys(self) -> Tensor:
        """Exact sink keys, storage dtype ``[B, H_kv, sink_length, D]`` (do not modify)."""
        return self._state.sink_k

    @property
    def sink_values(self) -> Tensor:
        """Exact sink values, storage dtype ``[B, H_kv, sink_length, Dv]`` (do not modify)."""
        return self._state.sink_v

    @property
    def residual_keys(self) -> Tensor:
        """Exact residual keys, storage dtype ``[B, H_kv, residual_length, D]``."""
        return self._state.res_k

    @property
    def residual_values(self) -> Tensor:
        """Exact residual values, storage dtype ``[B, H_kv, residual_length, Dv]``."""
        return self._state.res_v

    # ------------------------------------------------------------------ mask
    @property
    def mix_mask(self) -> Tensor | None:
        """The mix mask, bool ``[B, H_kv, P]`` (True = Phase–Norm), unpacked from its packed
        storage (``uint8 [B, ceil(H_kv * P / 8)]``, bit ``h * P + p`` of each sequence's
        little-endian bitstream). ``None`` before the first group is flushed and for codings
        other than ``"mix"``."""
        packed = self._state.mask_packed
        if packed is None:
            return None
        bits = unpack_codes(packed, 1, self._num_heads * self.num_pairs)
        return bits.reshape(packed.shape[0], self._num_heads, self.num_pairs).bool()

    @property
    def phase_norm_pairs(self) -> Tensor | None:
        """Bool ``[B, H_kv, P]``: which rotary pairs the quantized groups code in Phase–Norm
        (the mix mask; all False for ``"cartesian"``, all True for ``"phase_norm"``).
        ``None`` for ``"per_token"`` and for ``"mix"`` before the first flush."""
        coding = self._config.key_coding
        shape = (self._batch_size, self._num_heads, self.num_pairs)
        if coding == "mix":
            return self.mix_mask
        if coding == "cartesian":
            return torch.zeros(shape, dtype=torch.bool, device=self.device)
        if coding == "phase_norm":
            return torch.ones(shape, dtype=torch.bool, device=self.device)
        return None

    @property
    def saliency_computations(self) -> int:
        """How many times the mix mask was computed (0 or 1)."""
        return self._saliency_computations

    @property
    def attention_calls(self) -> int:
        """Calls of :func:`kvlab.pnmix.attention.pnmix_attention` on this cache."""
        return self._attention_calls

    def _record_attention_call(self) -> None:
        self._attention_calls += 1

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> dict[str, int]:
        """Persistent storage by component, in bytes, from the stored tensors' sizes
        (``numel * element_size``): ``key_sink``, ``key_residual``, ``key_codes``,
        ``key_scales`` (scales + zero points / phase spans + offsets), ``key_mask``,
        ``value_sink``, ``value_residual``, ``value_codes``, ``value_scales``."""
        s = self._state
        groups = s.groups
        return {
            "key_sink": _nbytes(s.sink_k),
            "key_residual": _nbytes(s.res_k),
            "key_codes": sum(_nbytes(g.key_codes) for g in groups),
            "key_scales": sum(_nbytes(g.key_scale) + _nbytes(g.key_zero) for g in groups),
            "key_mask": 0 if s.mask_packed is None else _nbytes(s.mask_packed),
            "value_sink": _nbytes(s.sink_v),
            "value_residual": _nbytes(s.res_v),
            "value_codes": sum(_nbytes(g.value_codes) for g in groups),
            "value_scales": sum(_nbytes(g.value_scale) + _nbytes(g.value_zero) for g in groups),
        }

    @property
    def key_bytes(self) -> int:
        """Bytes of key storage (sinks, residual, codes, scalars, mask)."""
        return sum(v for k, v in self.nbytes().items() if k.startswith("key_"))

    @property
    def value_bytes(self) -> int:
        """Bytes of value storage (sinks, residual, codes, scalars)."""
        return sum(v for k, v in self.nbytes().items() if k.startswith("value_"))

    @property
    def persistent_bytes(self) -> int:
        """``key_bytes + value_bytes``."""
        return self.key_bytes + self.value_bytes

    @property
    def key_bits_per_element(self) -> float:
        """Key storage bits per stored key element, sinks and residual included:
        ``key_bytes * 8 / (B * H_kv * seq_length * D)`` (``nan`` when empty)."""
        elements = self._batch_size * self._num_heads * self.seq_length * self._head_dim
        return self.key_bytes * 8 / elements if elements else math.nan

    # ------------------------------------------------------------------ writing
    def _empty_state(self, device: torch.device) -> _State:
        b, h, d, dv = self._batch_size, self._num_heads, self._head_dim, self._value_head_dim
        dt = self._config.storage_dtype
        return _State(
            sink_k=torch.empty((b, h, 0, d), dtype=dt, device=device),
            sink_v=torch.empty((b, h, 0, dv), dtype=dt, device=device),
            res_k=torch.empty((b, h, 0, d), dtype=dt, device=device),
            res_v=torch.empty((b, h, 0, dv), dtype=dt, device=device),
        )

    def _check_input(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [B, H_kv, T, D], got shape {tuple(t.shape)}")
        b, h, d, dv = self._batch_size, self._num_heads, self._head_dim, self._value_head_dim
        if keys.shape[0] != b or values.shape[0] != b:
            raise ValueError(
                f"batch size mismatch: cache has {b}, keys {keys.shape[0]}, "
                f"values {values.shape[0]}"
            )
        if keys.shape[1] != h or values.shape[1] != h:
            raise ValueError(
                f"num_key_value_heads mismatch: cache has {h}, keys {keys.shape[1]}, "
                f"values {values.shape[1]}"
            )
        if keys.shape[3] != d:
            raise ValueError(f"keys head_dim {keys.shape[3]} != cache head_dim {d}")
        if values.shape[3] != dv:
            raise ValueError(f"values head dim {values.shape[3]} != cache value_head_dim {dv}")
        if keys.shape[2] != values.shape[2]:
            raise ValueError(
                f"keys and values disagree on tokens: {keys.shape[2]} vs {values.shape[2]}"
            )
        if self._device is None:
            self._device = keys.device
            self._state = self._empty_state(keys.device)
        dt = self._config.storage_dtype
        k = round_to_storage(keys.to(self._device), dt, name="keys")
        v = round_to_storage(values.to(self._device), dt, name="values")
        return k, v

    def _phase_norm_pairs_of(self, mask_packed: Tensor | None) -> Tensor | None:
        coding = self._config.key_coding
        shape = (self._batch_size, self._num_heads, self.num_pairs)
        if coding == "mix":
            assert mask_packed is not None  # computed just above, at the first flush
            bits = unpack_codes(mask_packed, 1, self._num_heads * self.num_pairs)
            return bits.reshape(shape).bool()
        if coding == "per_token":
            return None
        return torch.full(shape, coding == "phase_norm", dtype=torch.bool, device=self.device)

    def _saliency(self, keys: Tensor) -> Tensor:
        """Bool ``[B, H_kv, P]``: Phase–Norm where its error on ``keys`` (the first group,
        ``[B, H_kv, group_tokens, D]``) is strictly smaller than Cartesian's."""
        cfg = self._config
        cart, pn = key_pair_errors(keys, cfg.bits, self._first, self._second, cfg.storage_dtype)
        return pn < cart

    def _quantize_group(
        self, keys: Tensor, values: Tensor, pn_pairs: Tensor | None, start: int
    ) -> PackedGroup:
        cfg = self._config
        b, h, t, d = keys.shape
        dv = values.shape[-1]
        if cfg.key_coding == "per_token":
            kc, ks, kz = minmax_quantize(keys, cfg.bits, -1, cfg.storage_dtype)
        else:
            assert pn_pairs is not None
            kc, ks, kz = quantize_keys_channelwise(
                keys, cfg.bits, self._first, self._second, pn_pairs, cfg.storage_dtype
            )
        vc, vs, vz = minmax_quantize(values, cfg.bits, -1, cfg.storage_dtype)
        return PackedGroup(
            start=start,
            num_tokens=t,
            bits=cfg.bits,
            head_dim=d,
            value_head_dim=dv,
            key_codes=pack_codes(kc.reshape(b, h, t * d), cfg.bits),
            key_scale=ks.contiguous(),
            key_zero=kz.contiguous(),
            value_codes=pack_codes(vc.reshape(b, h, t * dv), cfg.bits),
            value_scale=vs.contiguous(),
            value_zero=vz.contiguous(),
        )

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Append ``T`` tokens to every sequence.

        Args:
            keys: ``[B, H_kv, T, D]`` keys, already RoPE-rotated at their positions, any
                floating dtype (rounded to the storage dtype).
            values: ``[B, H_kv, T, Dv]``.

        The first ``sink_tokens`` tokens of the stream fill the sinks; the rest enter the
        residual, which flushes every full ``group_tokens`` beyond ``residual_tokens``. With
        ``key_coding="mix"`` the call that flushes the first group computes the mix mask from
        that group (see module docstring). ``T = 0`` is a no-op. The call is
        atomic: on an error nothing is stored.

        Raises:
            ValueError: wrong type, dtype, rank or shape; NaN/inf; a value beyond the storage
                dtype's range (the float16 message names bfloat16 storage); a Phase–Norm pair
                norm beyond it.
        """
        k, v = self._check_input(keys, values)
        t = k.shape[2]
        if t == 0:
            return
        cfg = self._config
        old = self._state
        n_sink = min(t, cfg.sink_tokens - self.sink_length)
        sink_k, sink_v = old.sink_k, old.sink_v
        if n_sink > 0:
            sink_k = torch.cat([sink_k, k[:, :, :n_sink]], dim=2)
            sink_v = torch.cat([sink_v, v[:, :, :n_sink]], dim=2)
        rest_k, rest_v = k[:, :, n_sink:], v[:, :, n_sink:]
        res_k, res_v = old.res_k, old.res_v
        if rest_k.shape[2] > 0:
            res_k = torch.cat([res_k, rest_k], dim=2)
            res_v = torch.cat([res_v, rest_v], dim=2)
        n_res, size = res_k.shape[2], cfg.group_tokens
        n_flush = (n_res - cfg.residual_tokens) // size if n_res >= cfg.residual_tokens else 0
        chunks = [
            (res_k[:, :, i * size : (i + 1) * size], res_v[:, :, i * size : (i + 1) * size])
            for i in range(n_flush)
        ]
        mask_packed = old.mask_packed
        saliency = 0
        if cfg.key_coding == "mix" and mask_packed is None and chunks:
            pn = self._saliency(chunks[0][0]).reshape(self._batch_size, -1)
            mask_packed = pack_codes(pn.to(torch.uint8), 1)
            saliency = 1
        new_groups = []
        if chunks:
            pn_pairs = self._phase_norm_pairs_of(mask_packed)
            first_start = cfg.sink_tokens + self.quantized_tokens
            new_groups = [
                self._quantize_group(ck, cv, pn_pairs, first_start + i * size)
                for i, (ck, cv) in enumerate(chunks)
            ]
            # clone: the kept residual must not pin the flushed tokens' memory
            res_k = res_k[:, :, n_flush * size :].clone()
            res_v = res_v[:, :, n_flush * size :].clone()
        self._state = _State(
            sink_k=sink_k,
            sink_v=sink_v,
            res_k=res_k,
            res_v=res_v,
            groups=old.groups + new_groups,
            mask_packed=mask_packed,
        )
        self._saliency_computations += saliency

    # ------------------------------------------------------------------ reading
    def dequantize(self) -> tuple[Tensor, Tensor]:
        """The whole cache in float32, in sequence order (sinks, groups, residual).

        Reference/testing only (attention never calls it).

        Returns:
            ``(keys [B, H_kv, seq_length, D], values [B, H_kv, seq_length, Dv])`` float32.
        """
        s = self._state
        cfg = self._config
        keys = [s.sink_k.float()]
        values = [s.sink_v.float()]
        pn_pairs = self._phase_norm_pairs_of(s.mask_packed) if s.groups else None
        for g in s.groups:
            codes = g.key_code_matrix()
            if cfg.key_coding == "per_token":
                keys.append(minmax_dequantize(codes, g.key_scale, g.key_zero, -1))
            else:
                assert pn_pairs is not None
                keys.append(
                    dequantize_keys_channelwise(
                        codes,
                        g.key_scale,
                        g.key_zero,
                        cfg.bits,
                        self._first,
                        self._second,
                        pn_pairs,
                    )
                )
            values.append(minmax_dequantize(g.value_code_matrix(), g.value_scale, g.value_zero, -1))
        keys.append(s.res_k.float())
        values.append(s.res_v.float())
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def select_batch(self, index: Tensor) -> None:
        """Keep/reorder sequences (beam search): sequence ``i`` becomes old ``index[i]``.

        Every buffer — exact tensors, packed codes, scalars and the packed mask — is
        row-selected; nothing is re-quantized. ``index`` may repeat entries and change the
        batch size.

        Args:
            index: 1-D integer tensor (or sequence of ints) of length >= 1, entries in
                ``0 .. B - 1``.

        Raises:
            ValueError: not 1-D, not integer, empty, or out of range.
        """
        idx = torch.as_tensor(index)
        if idx.dim() != 1 or idx.numel() == 0:
            raise ValueError(f"index must be a non-empty 1-D tensor, got shape {tuple(idx.shape)}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"index must have an integer dtype, got {idx.dtype}")
        if int(idx.min()) < 0 or int(idx.max()) >= self._batch_size:
            raise ValueError(
                f"index entries must lie in 0..{self._batch_size - 1}, got "
                f"{int(idx.min())}..{int(idx.max())}"
            )
        idx = idx.to(device=self.device, dtype=torch.long)
        s = self._state
        self._state = _State(
            sink_k=s.sink_k.index_select(0, idx),
            sink_v=s.sink_v.index_select(0, idx),
            res_k=s.res_k.index_select(0, idx),
            res_v=s.res_v.index_select(0, idx),
            groups=[g._select(idx) for g in s.groups],
            mask_packed=None if s.mask_packed is None else s.mask_packed.index_select(0, idx),
        )
        self._batch_size = idx.numel()

    def __repr__(self) -> str:
        c = self._config
        return (
            f"PNMixCache(B={self._batch_size}, H_kv={self._num_heads}, D={self._head_dim}, "
            f"Dv={self._value_head_dim}, bits={c.bits}, key_coding={c.key_coding!r}, "
            f"seq_length={self.seq_length}, sinks={self.sink_length}, "
            f"quantized={self.quantized_tokens}, residual={self.residual_length})"
        )
