"""Attention over a PN-Mix cache that reads its packed buffers directly (docs/design.md,
"Attention").

The torch reference (:func:`packed_attention_reference`) takes the raw buffers of a
:class:`~kvlab.pnmix.store.PackedStore` plus the per-row counts and the codec description
(:class:`PackedKV`), which is what a compiled kernel reads too; :func:`pnmix_attention` is the
public entry point and dispatches to a backend: the reference, or a compiled kernel
(:mod:`kvlab.pnmix.kernels`) for the configurations that kernel supports (docs/design.md,
"Kernels").

Algorithm (split-K softmax, as FlashDecoding): the stream of every row — exact sinks, quantized
groups, exact residual — is cut into segments: the exact tokens (sinks and residual together)
and blocks of ``block_groups`` group slots. Per segment: logits ``q · (k - mu)`` in float32,
where a block's keys are first decoded to float32 (element for element what
:meth:`~kvlab.pnmix.cache.PNMixCache.dequantize` computes) in separable steps — the codec's
``unpack`` and ``decode`` (:func:`decode_key_block`), its payload (exact sparse entries,
:func:`apply_key_payload`), and for a position-aware codec the rotation of each decoded
key to its RoPE position (:func:`rotate_to_positions`) — and ``mu`` is one
stored key of the row: the softmax is unchanged, while float32 rounding becomes relative to the
spread of the row's keys rather than their magnitude (large zero points do not cancel); logits
are masked where a slot lies beyond the row's count or, causally, beyond what a query may see;
then the segment's maximum ``m``, ``l = Σ exp(logit - m)`` and ``Σ exp(logit - m) v``. Values
of a block are read from their codes in the per-token affine form ``Σ_t p_t z_t + Σ_t (p_t s_t)
c_t`` (the terms of ``Σ_t p_t (z_t + s_t c_t)`` regrouped; float32 rounding relative to the
values' scale); a value codec that codes values in a rotated frame (Hadamard) has the
attention-weighted sum of a query row's decoded values of all blocks mapped back once
(:func:`transform_values`). Segments are merged with weights ``exp(m - max m)``. A query row
that sees nothing (a padding query) returns zeros.

Memory: the largest temporaries are one block's decoded keys and unpacked value codes
(``B * H_kv * block_groups * group_tokens * (D + Dv)`` floats) and its logits; nothing grows
with the context beyond one block except the per-segment ``(m, l, acc)`` triples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.attention_logits import softcap_logits
from kvlab.pnmix.cache import PNMixCache
from kvlab.pnmix.codecs import KeyCodec, KeyLayout
from kvlab.pnmix.kernels.dispatch import BACKENDS, select_backend
from kvlab.pnmix.packing import unpack_codes
from kvlab.pnmix.values import ValueCodec
from kvlab.rope import RotaryConfig, rotate_by_delta

__all__ = [
    "BACKENDS",
    "PackedKV",
    "apply_key_payload",
    "decode_key_block",
    "packed_attention_reference",
    "packed_kv",
    "pnmix_attention",
    "pnmix_decode_step",
    "rotate_to_positions",
    "transform_values",
]

_DEFAULT_BLOCK_TOKENS = 4096


@dataclass(frozen=True, eq=False)
class PackedKV:
    """Everything packed attention reads: buffers, host counts and the codec description.

    Attributes:
        sink_keys, sink_values: storage dtype ``[B, H, S, D|Dv]``.
        key_codes: uint8 ``[B, H, G_cap, ceil(T * D * bits / 8)]`` (token-major ``[T, D]``
            codes per group, little-endian bitstream).
        key_scalars: storage dtype ``[B, H, G_cap, S_k]`` (the codec's layout).
        value_codes: uint8 ``[B, H, G_cap, ceil(T * Dv * bits / 8)]``.
        value_scalars: storage dtype ``[B, H, G_cap, 2 * T]`` (``[scale(T) | zero(T)]``).
        residual_keys, residual_values: storage dtype ``[B, H, R_cap, D|Dv]``.
        sink_lengths, group_counts, residual_lengths: host int64 ``[B, H]``.
        bits, group_tokens: code width and ``T``.
        codec, layout: the key codec and the head's rotary pairs.
        mask: the codec's per-pair table ``[B, H, P]``: a mix's bool mask, per-pair widths
            (uint8 bits); ``None`` for codecs without a table.
        active_pairs: int64 ``[U]`` pairs set in some row's mask (``None`` = all pairs).
        key_payload: uint8 ``[B, H, G_cap, E]`` per-group key side data (exact outliers), or
            ``None`` / ``E = 0``.
        position_offsets: host int64 ``[B, H]`` RoPE position offsets of the rows (a token at
            stream index ``i`` sits at ``offset + i``); read for position-aware codecs.
        sink_tokens: ``S``: group slot ``g`` starts at stream index ``S + g * T``.
        rotary: the layer's RoPE (position-aware codecs), or ``None``.
        value_codec: the value codec (``None``: per-token min-max of the values themselves).
    """

    sink_keys: Tensor
    sink_values: Tensor
    key_codes: Tensor
    key_scalars: Tensor
    value_codes: Tensor
    value_scalars: Tensor
    residual_keys: Tensor
    residual_values: Tensor
    sink_lengths: np.ndarray
    group_counts: np.ndarray
    residual_lengths: np.ndarray
    bits: int
    group_tokens: int
    codec: KeyCodec
    layout: KeyLayout
    mask: Tensor | None = None
    active_pairs: Tensor | None = None
    key_payload: Tensor | None = None
    position_offsets: np.ndarray | None = None
    sink_tokens: int = 0
    rotary: RotaryConfig | None = None
    value_codec: ValueCodec | None = None

    @property
    def seq_lengths(self) -> np.ndarray:
        """int64 ``[B, H]``: tokens per row."""
        return self.sink_lengths + self.group_counts * self.group_tokens + self.residual_lengths


def packed_kv(cache: PNMixCache) -> PackedKV:
    """The :class:`PackedKV` of ``cache`` (views of its buffers, copies of its counts)."""
    s = cache.store
    return PackedKV(
        sink_keys=s.sink_keys,
        sink_values=s.sink_values,
        key_codes=s.key_codes,
        key_scalars=s.key_scalars,
        value_codes=s.value_codes,
        value_scalars=s.value_scalars,
        residual_keys=s.residual_keys,
        residual_values=s.residual_values,
        sink_lengths=s.sink_lengths.copy(),
        group_counts=s.group_counts.copy(),
        residual_lengths=s.residual_lengths.copy(),
        bits=s.geometry.bits,
        group_tokens=s.geometry.group_tokens,
        codec=cache.codec,
        layout=cache.layout,
        mask=cache.codec_mask(),
        active_pairs=cache.active_pairs(),
        key_payload=s.key_payload if s.geometry.key_payload_bytes else None,
        position_offsets=s.position_offsets.copy(),
        sink_tokens=s.geometry.sink_tokens,
        rotary=cache.rotary,
        value_codec=cache.value_codec,
    )


_LUTS: dict[tuple[int, torch.device], Tensor] = {}


def _unpack_float(packed: Tensor, bits: int, n: int) -> Tensor:
    """Float32 codes ``[..., n]`` of packed rows ``[..., bytes]`` (the values
    :func:`~kvlab.pnmix.packing.unpack_codes` returns, as floats)."""
    if 8 % bits:
        return unpack_codes(packed, bits, n).float()
    per_byte = 8 // bits
    key = (bits, packed.device)
    lut = _LUTS.get(key)
    if lut is None:
        byte = torch.arange(256, device=packed.device)[:, None]
        shifts = torch.arange(per_byte, device=packed.device) * bits
        lut = ((byte >> shifts) & ((1 << bits) - 1)).float()
        _LUTS[key] = lut
    codes = F.embedding(packed.int(), lut).flatten(-2)
    return codes if codes.shape[-1] == n else codes[..., :n]


def _limits(kv: PackedKV, nq: int, rep: int, causal: bool, device: torch.device) -> Tensor | None:
    """Per (b, h, query row) how many slots of the sinks, the group region and the residual a
    query may see: int64 ``[3, B, H, M, 1]``; ``None`` when every query sees every stored
    token (equal rows, and one query or no causal mask)."""
    uniform = all(
        int(a.min()) == int(a.max(initial=0))
        for a in (kv.sink_lengths, kv.group_counts, kv.residual_lengths)
    )
    if uniform and (not causal or nq == 1):
        return None
    ns, ng, nr = kv.sink_lengths, kv.group_counts * kv.group_tokens, kv.residual_lengths
    n = ns + ng + nr
    j = np.tile(np.arange(nq), rep)  # query row m = r * Q + j
    visible = (
        n[..., None] - nq + j + 1 if causal else np.broadcast_to(n[..., None], (*n.shape, j.size))
    )
    sinks = np.clip(np.minimum(visible, ns[..., None]), 0, None)
    groups = np.clip(np.minimum(visible - ns[..., None], ng[..., None]), 0, None)
    res = np.clip(np.minimum(visible - (ns + ng)[..., None], nr[..., None]), 0, None)
    return torch.from_numpy(np.stack([sinks, groups, res])[..., None]).to(device)


def decode_key_block(kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 1 of a block's keys: group slots ``g0 .. g1 - 1`` of every row unpacked and decoded
    by the key codec, float32 ``[B, H, n * T, D]`` in the codec's frame (no payload, no
    rotation)."""
    b, h = kv.sink_keys.shape[:2]
    d, t, n = kv.sink_keys.shape[-1], kv.group_tokens, g1 - g0
    packed = kv.key_codes[:, :, g0:g1]
    mask = kv.mask
    if kv.codec.uniform_code_width:
        codes = _unpack_float(packed, kv.bits, t * d).reshape(b, h, n, t, d)
    else:  # per-pair widths: the codec's own layout
        table = None if mask is None else mask[:, :, None]
        codes = kv.codec.unpack(packed, t, kv.layout, table).float()
    if mask is not None:
        mask = mask.unsqueeze(2).expand(-1, -1, n, -1)
    keys = kv.codec.decode(codes, kv.key_scalars[:, :, g0:g1], kv.layout, mask, kv.active_pairs)
    return keys.reshape(b, h, n * t, d)


def apply_key_payload(keys: Tensor, kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 2 (codecs with a payload): the block's decoded keys ``[B, H, n * T, D]`` with the
    codec's per-group side data applied — exact sparse outliers written back."""
    if kv.key_payload is None or kv.key_payload.shape[-1] == 0:
        return keys
    b, h, _, d = keys.shape
    n, t = g1 - g0, kv.group_tokens
    grouped = keys.reshape(b, h, n, t, d)
    out = kv.codec.apply_payload(grouped, kv.key_payload[:, :, g0:g1], kv.sink_keys.dtype)
    return out.reshape(b, h, n * t, d)


def rotate_to_positions(keys: Tensor, kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Step 3 (position-aware codecs): the block's decoded pre-RoPE keys ``[B, H, n * T, D]``
    rotated to their RoPE positions ``offset + S + g * T + t`` (:func:`kvlab.rope.
    rotate_by_delta`: angles in float64, rotation in float32)."""
    if not kv.codec.position_aware:
        return keys
    assert kv.rotary is not None and kv.position_offsets is not None
    t = kv.group_tokens
    local = kv.sink_tokens + np.arange(g0 * t, g1 * t, dtype=np.int64)
    pos = torch.from_numpy(kv.position_offsets[..., None] + local).to(keys.device)
    return rotate_by_delta(keys, pos, kv.rotary)


def transform_values(acc: Tensor, kv: PackedKV) -> Tensor:
    """The value codec's output transform of an attention-weighted sum of decoded values
    ``[..., Dv]`` (Hadamard: ``@ H^T``; identity for per-token min-max)."""
    codec = kv.value_codec
    return acc if codec is None else codec.output_transform(acc)


def _key_block(kv: PackedKV, g0: int, g1: int) -> Tensor:
    """Decoded float32 keys of group slots ``g0 .. g1 - 1`` at their positions: the three
    steps above."""
    keys = decode_key_block(kv, g0, g1)
    keys = apply_key_payload(keys, kv, g0, g1)
    return rotate_to_positions(keys, kv, g0, g1)


def _reference_keys(kv: PackedKV) -> Tensor:
    """A stored key of every row, float32 ``[B, H, 1, D]``: the first sink slot, else the first
    residual slot, else the decoded first token of group slot 0. Logits are computed against
    keys minus this reference: softmax is invariant to the row's constant ``q · mu``, and the
    subtraction (exact when a key lies within a factor of 2 of ``mu``, Sterbenz) makes the
    float32 rounding of a logit relative to the spread of the row's keys, not their magnitude
    (large zero points: docs/design.md, "Attention")."""
    if kv.sink_keys.shape[2]:
        return kv.sink_keys[:, :, :1].float()
    if kv.residual_keys.shape[2]:
        return kv.residual_keys[:, :, :1].float()
    b, h = kv.sink_keys.shape[:2]
    d = kv.sink_keys.shape[-1]
    if kv.key_codes.shape[2] == 0:
        return kv.sink_keys.new_zeros((b, h, 1, d), dtype=torch.float32)
    return _key_block(kv, 0, 1)[:, :, :1]


class _Partials:
    """Per-segment softmax partials ``(m, l, acc)``, merged at the end."""

    def __init__(self) -> None:
        self.m: list[Tensor] = []
        self.l: list[Tensor] = []
        self.acc: list[Tensor] = []
        self.coded: list[bool] = []  # acc in the value codec's frame (a quantized block)

    def logits(self, s: Tensor, hidden: Tensor | None) -> Tensor:
        """Mask logits ``[B, H, M, w]`` where ``hidden`` (bool, broadcastable); return the
        unnormalized probabilities ``exp(s - m)`` and record ``m`` and ``l``."""
        if hidden is not None:
            s = s.masked_fill(hidden, -math.inf)
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
        p = torch.exp(s - m)
        self.m.append(m)
        self.l.append(p.sum(dim=-1, keepdim=True))
        return p

    def merge(self, transform: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """``Σ w acc / Σ w l``; ``transform`` maps the summed accumulators of the quantized
        blocks (in the value codec's frame) back, once per query row."""
        tiny = torch.finfo(torch.float32).tiny
        coded = self.coded + [False] * (len(self.acc) - len(self.coded))
        if transform is None or not any(coded):
            if len(self.m) == 1:
                return self.acc[0] / self.l[0].clamp_min(tiny)
            m = torch.stack(self.m)
            w = torch.exp(m - m.amax(dim=0))
            l_sum = (w * torch.stack(self.l)).sum(dim=0)
            acc = (w * torch.stack(self.acc)).sum(dim=0)
            return acc / l_sum.clamp_min(tiny)
        m = torch.stack(self.m)
        w = torch.exp(m - m.amax(dim=0))
        l_sum = (w * torch.stack(self.l)).sum(dim=0)
        parts = [wi * a for wi, a in zip(w, self.acc, strict=True)]
        exact = [p for p, c in zip(parts, coded, strict=True) if not c]
        quantized = torch.stack([p for p, c in zip(parts, coded, strict=True) if c]).sum(dim=0)
        acc = transform(quantized)
        if exact:
            acc = acc + torch.stack(exact).sum(dim=0)
        return acc / l_sum.clamp_min(tiny)


def packed_attention_reference(
    query: Tensor,
    kv: PackedKV,
    *,
    scale: float,
    causal: bool = True,
    block_groups: int = 32,
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Softmax attention of ``query`` over packed storage, in float32 (module docstring).

    Args:
        query: ``[B, H_q, Q, D]`` on the buffers' device, ``H_q`` a multiple of ``H``: query
            head ``i`` reads kv head ``i // (H_q / H)`` (GQA). Query ``j`` of row ``(b, h)``
            is that row's stream token ``n - Q + j`` (``n`` its length).
        kv: the packed storage.
        scale: softmax scale of the logits.
        causal: query ``j`` sees stream indices ``<= n - Q + j`` (bottom-right); ``False``: all
            of the row's ``n`` tokens.
        block_groups: group slots decoded at a time (>= 1).
        logit_softcap: Gemma 2 soft-cap of the scaled logits, applied before masking
            (:func:`kvlab.attention_logits.softcap_logits`), or ``None``. ``tanh`` is not
            shift-invariant, so with a cap the logits are ``q · (k - mu) + q · mu``.
        sink_logits: ``[H_q]`` learned sink logits (GPT-OSS ``s_aux``): one extra logit per
            query row in the softmax, with no value, or ``None``.

    Returns:
        float32 ``[B, H_q, Q, Dv]``; zeros for a query that sees no token (and no sink).
    """
    b, hq, nq, d = query.shape
    hkv = kv.sink_keys.shape[1]
    rep = hq // hkv
    t = kv.group_tokens
    dev = kv.sink_keys.device
    q = query.to(device=dev, dtype=torch.float32).reshape(b, hkv, rep * nq, d) * scale
    limits = _limits(kv, nq, rep, causal, dev)
    mu = _reference_keys(kv)
    # q . mu: what the centred logits lack, needed where the true logit value matters
    q_mu = q @ mu.mT if logit_softcap is not None or sink_logits is not None else None

    def transform(s: Tensor) -> Tensor:
        if logit_softcap is None:
            return s
        return softcap_logits(s + q_mu, logit_softcap)

    parts = _Partials()
    n_sink = int(kv.sink_lengths.max(initial=0))
    n_res = int(kv.residual_lengths.max(initial=0))
    if n_sink or n_res:  # the exact tokens, sinks then residual, as one segment
        keys = torch.cat([kv.sink_keys[:, :, :n_sink], kv.residual_keys[:, :, :n_res]], 2)
        values = torch.cat([kv.sink_values[:, :, :n_sink], kv.residual_values[:, :, :n_res]], 2)
        hidden = None
        if limits is not None:
            cols = torch.arange(n_sink + n_res, device=dev)
            hidden = torch.where(cols < n_sink, cols >= limits[0], (cols - n_sink) >= limits[2])
        p = parts.logits(transform(q @ keys.float().sub_(mu).mT), hidden)
        parts.acc.append(p @ values.float())
        parts.coded.append(False)
    n_groups = int(kv.group_counts.max(initial=0))
    dv = kv.sink_values.shape[-1]
    for g0 in range(0, n_groups, block_groups):
        g1 = min(g0 + block_groups, n_groups)
        n = g1 - g0
        keys = _key_block(kv, g0, g1).sub_(mu)
        hidden = None
        if limits is not None:
            hidden = torch.arange(g0 * t, g1 * t, device=dev) >= limits[1]
        p = parts.logits(transform(q @ keys.mT), hidden)
        vcodes = _unpack_float(kv.value_codes[:, :, g0:g1], kv.bits, t * dv).reshape(b, hkv, -1, dv)
        vs = kv.value_scalars[:, :, g0:g1].float()  # [B, H, n, 2T]: scale(T) | zero(T)
        v_scale = vs[..., :t].reshape(b, hkv, 1, n * t)
        v_zero = vs[..., t:].reshape(b, hkv, 1, n * t)
        parts.acc.append((p * v_scale) @ vcodes + (p * v_zero).sum(dim=-1, keepdim=True))
        parts.coded.append(True)
    if sink_logits is not None:  # row r * Q + j of kv head h is query head h * rep + r
        sinks = sink_logits.detach().to(device=dev, dtype=torch.float32).view(1, hkv, rep, 1)
        sinks = sinks.expand(b, hkv, rep, nq).reshape(b, hkv, rep * nq, 1)
        if logit_softcap is None:
            sinks = sinks - q_mu  # into the centred logits' frame
        parts.m.append(sinks)
        parts.l.append(torch.ones_like(sinks))
        parts.acc.append(sinks.new_zeros((b, hkv, rep * nq, kv.sink_values.shape[-1])))
        parts.coded.append(False)
    coded_frame = kv.value_codec is not None and kv.value_codec.transforms_output
    post = (lambda acc: transform_values(acc, kv)) if coded_frame else None
    return parts.merge(post).reshape(b, hq, nq, -1)


def pnmix_attention(
    query: Tensor,
    cache: PNMixCache,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_groups: int | None = None,
    backend: str = "auto",
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Softmax attention of ``query`` over a PN-Mix cache, consuming its packed codes.

    Args:
        query: ``[B, H_q, Q, D]``, any floating dtype, already RoPE-rotated at its positions.
            The ``Q`` queries of row ``b`` belong to the last ``Q`` tokens of its stream
            (``n_b - Q + j``); with left padding, queries before a row's first token see
            nothing and return zeros.
        cache: the layer's :class:`PNMixCache` (``H_q`` a multiple of its ``H_kv``; query head
            ``i`` reads kv head ``i // (H_q / H_kv)``, GQA).
        scale: softmax scale of the logits (default ``1 / sqrt(D)``).
        causal: query ``j`` sees stream positions ``<= n_b - Q + j`` (bottom-right aligned);
            ``False`` = every query sees its row's whole stream.
        block_groups: quantized groups decoded at a time (bounds temporary memory);
            default: as many as make 4,096 tokens (at least one).
        backend: ``"torch"`` (the reference, :func:`packed_attention_reference`), ``"cpu"``
            (the compiled C++ kernel), ``"triton"`` (CUDA), or ``"auto"``: the argument wins,
            then the environment variable ``KVLAB_PNMIX_BACKEND``, then the automatic rule
            (CUDA: ``"triton"`` when installed, else ``"torch"``; CPU: ``"cpu"``, compiled on
            first use, else ``"torch"``; :mod:`kvlab.pnmix.kernels.dispatch`). Compiled
            backends agree with the reference to float32 rounding (docs/design.md,
            "Kernels").
        logit_softcap: Gemma 2 attention-logit soft-cap applied to the scaled logits before
            the causal mask (:func:`kvlab.attention_logits.softcap_logits`), or ``None``.
        sink_logits: ``[H_q]`` learned sink logits (GPT-OSS ``s_aux``): one extra logit per
            query head in the softmax, with no value
            (:func:`kvlab.attention_logits.softmax_with_sinks`), or ``None``.

    Returns:
        ``[B, H_q, Q, Dv]`` in ``query``'s dtype and device, computed in float32. Agrees with
        ``cache.dequantize()`` followed by standard attention up to float32 rounding of the
        logits and outputs. Increments ``cache.attention_calls`` by one. Reads no device
        value back to the host.

    Raises:
        ValueError: wrong rank, dtype or shape; ``H_q`` not a multiple of ``H_kv``; ``Q``
            larger than the longest row; an empty cache; ``block_groups < 1``; an unknown
            backend; ``sink_logits`` not ``[H_q]``; ``logit_softcap`` not a positive number;
            an explicit compiled backend for a codec or device it does not handle.
        RuntimeError: an explicit backend that is unavailable here (not installed, not
            compiled).
    """
    if not isinstance(cache, PNMixCache):
        raise ValueError(f"cache must be a PNMixCache, got {type(cache).__name__}")
    if not isinstance(query, Tensor) or not query.is_floating_point() or query.dim() != 4:
        raise ValueError("query must be a 4-D floating tensor [B, H_q, Q, D]")
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if block_groups is None:
        block_groups = max(1, _DEFAULT_BLOCK_TOKENS // cache.config.group_tokens)
    if isinstance(block_groups, bool) or not isinstance(block_groups, int) or block_groups < 1:
        raise ValueError(f"block_groups must be an int >= 1, got {block_groups!r}")
    b, hq, nq, d = query.shape
    hkv = cache.num_key_value_heads
    longest = int(cache.seq_lengths.max(initial=0))
    if b != cache.batch_size:
        raise ValueError(f"query batch {b} != cache batch_size {cache.batch_size}")
    if d != cache.head_dim:
        raise ValueError(f"query head_dim {d} != cache head_dim {cache.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of num_key_value_heads {hkv}")
    if longest == 0:
        raise ValueError("cache is empty: append keys and values before attending")
    if not 1 <= nq <= longest:
        raise ValueError(f"query count {nq} must lie in 1..seq_length={longest}")
    if sink_logits is not None and tuple(sink_logits.shape) != (hq,):
        raise ValueError(f"sink_logits must be [H_q] = [{hq}], got {tuple(sink_logits.shape)}")
    if logit_softcap is not None:
        softcap_logits(query.new_zeros(()), logit_softcap)  # validates the cap
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    decode = cache.kernel_decode
    chosen = select_backend(backend, cache.device, decode)
    kv = packed_kv(cache)
    if chosen == "torch":
        out = packed_attention_reference(
            query,
            kv,
            scale=scale,
            causal=causal,
            block_groups=block_groups,
            logit_softcap=logit_softcap,
            sink_logits=sink_logits,
        )
    else:
        assert not isinstance(decode, str)
        if chosen == "cpu":
            from kvlab.pnmix.kernels.cpu import packed_attention_cpu as kernel
        else:
            from kvlab.pnmix.kernels.triton_decode import packed_attention_triton as kernel
        out = kernel(
            query,
            kv,
            decode,
            _reference_keys(kv),
            scale=scale,
            causal=causal,
            logit_softcap=logit_softcap,
            sink_logits=sink_logits,
        )
    cache._record_attention_call()
    return out.to(device=query.device, dtype=query.dtype)


def _valid_cap(cap: float | None) -> bool:
    return cap is None or (isinstance(cap, (int, float)) and 0.0 < float(cap) < math.inf)


def pnmix_decode_step(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    cache: PNMixCache,
    *,
    scale: float | None = None,
    backend: str = "auto",
    logit_softcap: float | None = None,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """One decode step of one layer: ``cache.append(keys, values, checks="deferred",
    queries=query)`` (the queries when they match the tokens' ``[B, ., T, .]``), then
    ``pnmix_attention(query, cache, causal=True, ...)`` over the rows including the new token.

    When the backend is ``"cpu"`` and the append only writes one residual slot per row
    (:meth:`PNMixCache.single_token_fits`: one token per row, sinks full, no flush — all but
    one step in ``group_tokens``), both run in ONE compiled call (docs/design.md, "Kernels"):
    the stored bytes and counts are exactly the append's; the output is the ``"cpu"`` backend's.
    Otherwise the two calls run as written.

    Args:
        query: ``[B, H_q, Q, D]`` (the fast path needs ``Q = 1``).
        keys, values: ``[B, H_kv, T, D|Dv]`` new tokens (the fast path needs ``T = 1``).
        cache, scale, backend, logit_softcap, sink_logits: as in :func:`pnmix_attention`.

    Returns:
        ``[B, H_q, Q, Dv]`` in ``query``'s dtype.

    Raises:
        ValueError: what :meth:`PNMixCache.append` or :func:`pnmix_attention` raise.
        RuntimeError: an explicit backend that is unavailable.
    """
    if (
        isinstance(cache, PNMixCache)
        and isinstance(query, Tensor)
        and query.dim() == 4
        and query.shape[2] == 1
        and query.is_floating_point()
        and query.shape[0] == cache.batch_size
        and query.shape[3] == cache.head_dim
        and query.shape[1] % cache.num_key_value_heads == 0
        and query.device == cache.device
        and isinstance(keys, Tensor)
        and isinstance(values, Tensor)
        and _valid_cap(logit_softcap)
        and (sink_logits is None or tuple(sink_logits.shape) == (query.shape[1],))
    ):
        decode = cache.kernel_decode
        if cache.single_token_fits(keys, values) and (
            select_backend(backend, cache.device, decode) == "cpu"
        ):
            from kvlab.pnmix.kernels.cpu import decode_step_cpu

            assert not isinstance(decode, str)
            out = decode_step_cpu(
                query,
                keys,
                values,
                cache,
                decode,
                cache.deferred_flag(),
                scale=1.0 / math.sqrt(query.shape[3]) if scale is None else scale,
                logit_softcap=logit_softcap,
                sink_logits=sink_logits,
            )
            cache.commit_single_token()
            cache._record_attention_call()
            return out if out.dtype == query.dtype else out.to(query.dtype)
    # the forward's queries feed a query-aware per-pair table computed by this append (a row's
    # first flush), exactly as the two-call path of the model integration passes them
    queries = (
        query
        if isinstance(query, Tensor)
        and isinstance(keys, Tensor)
        and query.dim() == 4
        and keys.dim() == 4
        and tuple(query.shape[::2]) == (keys.shape[0], keys.shape[2])
        else None
    )
    cache.append(keys, values, checks="deferred", queries=queries)
    return pnmix_attention(
        query,
        cache,
        scale=scale,
        causal=True,
        backend=backend,
        logit_softcap=logit_softcap,
        sink_logits=sink_logits,
    )
